"""The committed assets as the code reads them: the compressed trie gives exactly the bytes of the trie
it was made from (so no result changes), and the tracked tree fits what a device check can carry."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import ngram_cpp
from dart_core.drafters import DEFAULT_NGRAM

ROOT = Path(__file__).resolve().parent.parent
TRIE_SHA256 = "c3ca982b7e7dd8464462f2a4b523ebd315617b49921ad15fd5d51a4c94b3b69d"  # the plain smollm2-3gram.ngram (assets/ngram/README.md)
DEVICE_TREE_LIMIT = 64 * 2**20  # bytes a device check carries, the working tree included


def test_the_compressed_trie_is_the_trie(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))
    assert DEFAULT_NGRAM.name.endswith(ngram_cpp.XZ) and DEFAULT_NGRAM.is_file()
    plain = ngram_cpp.decompressed(DEFAULT_NGRAM)
    assert plain.parent.parent == tmp_path / "ngram" and plain.name == "smollm2-3gram.ngram"
    assert hashlib.sha256(plain.read_bytes()).hexdigest() == TRIE_SHA256
    assert ngram_cpp.decompressed(DEFAULT_NGRAM) == plain  # decompressed once, then read back
    model = ngram_cpp.load(DEFAULT_NGRAM)
    assert model.vocab_size == 49152 and model.order == 3


def test_a_damaged_compressed_file_is_an_error(tmp_path, monkeypatch):
    import lzma

    import pytest

    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.ngram.xz"
    bad.write_bytes(DEFAULT_NGRAM.read_bytes()[:4096])  # cut short
    with pytest.raises((lzma.LZMAError, EOFError)):
        ngram_cpp.load(bad)
    assert not any((tmp_path / "cache").rglob("*.ngram"))  # nothing half-written is left to be read later


def test_the_tracked_tree_fits_a_device_check():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    total = sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())
    assert total <= DEVICE_TREE_LIMIT, (
        f"the tracked files take {total / 2**20:.1f} MiB, over the {DEVICE_TREE_LIMIT >> 20} MiB a device check carries"
    )
