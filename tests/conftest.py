"""Shared fixtures: tiny random Llama / Qwen2 / Qwen3 targets built in the test, and the embedded model.
The helpers the test modules share are in support.py; this file holds fixtures only."""

from __future__ import annotations

import os

# OpenMP threads (torch's and the C++ kernels', one libgomp pool) wait for each other at every
# parallel region; with the default policy they spin, and on a machine whose cores something else
# also uses (a shared CI runner, a second job) a 2-thread forward then stalls at its barriers (docs/
# peers.md, "Threads on a busy machine": tiny ops of ~10 us took 5-20 ms here with another job running).
# Passive waiting changes timings only, never a result. Set before torch is imported (libgomp reads it
# when it loads); the subprocesses the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dart_core.target import Target  # noqa: E402

from support import build_tiny_checkpoint, tiny_target  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A command line run in process with --threads N calls torch.set_num_threads(N) for the whole
    process; every test starts with the session's thread count, whatever the one before it ran."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_ckpt(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, build_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Target:
    return tiny_target(build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.fixture(scope="session")
def embedded_on():
    """embedded_on(weights): load_target("default", "cpu", weights), loaded once per session and
    shared by the modules that read it (a GGUF path costs a parse of the file's metadata, seconds
    each). A load reads one thing of the kernel build in use: whether it multiplies bf16 in hardware
    (a bf16 model's linears are interleaved without it, a quantized GGUF path's prefill GEMMs are
    bf16 with it), so that is part of the key: a test that switches builds and then loads gets the
    model as a load on that build gives it. Loads read the session's cache (the embedded model's
    conversion), also from a test that points DART_CACHE_DIR elsewhere. Tests must leave the targets
    as they found them."""
    from dart_core import kernels, load_target
    from dart_core.loading import CACHE_ENV

    session_cache = os.environ.get(CACHE_ENV)
    loaded: dict[tuple, Target] = {}

    def get(weights: str) -> Target:
        key = (weights, kernels.bf16_arithmetic())
        if key not in loaded:
            with pytest.MonkeyPatch.context() as mp:
                if session_cache is None:
                    mp.delenv(CACHE_ENV, raising=False)
                else:
                    mp.setenv(CACHE_ENV, session_cache)
                loaded[key] = load_target("default", "cpu", weights)
        return loaded[key]

    return get


@pytest.fixture(scope="session")
def embedded_target(embedded_on) -> Target:
    return embedded_on("float32")


@pytest.fixture(scope="session")
def embedded_bf16(embedded_on) -> Target:
    return embedded_on("bfloat16")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    """DART_CACHE_DIR pointed at an empty directory for this test (calibration files, exports), with
    what `make setup` and the first trie load put in any cache linked in: the embedded model's
    safetensors conversion and the decompressed trie. Without them every such test converted the
    GGUF again (~30 s) and decompressed the trie again."""
    import ngram_cpp
    from dart_core.drafters import DEFAULT_NGRAM
    from dart_core.loading import ensure_embedded_model

    model = ensure_embedded_model()  # in the cache in use before this test
    trie = ngram_cpp.decompressed(DEFAULT_NGRAM)
    cache = tmp_path / "dart-cache"
    cache.mkdir()
    (cache / model.name).symlink_to(model, target_is_directory=True)
    (cache / "ngram" / trie.parent.name).mkdir(parents=True)
    (cache / "ngram" / trie.parent.name / trie.name).symlink_to(trie)
    monkeypatch.setenv("DART_CACHE_DIR", str(cache))
    return cache
