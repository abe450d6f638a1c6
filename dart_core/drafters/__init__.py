"""Draft heads that plug into the generation loop, and the embedded assets the bench and the app
share (the per-device tree size default is in config.py)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
DEFAULT_DART_HEAD = ASSETS / "dart"
DEFAULT_NGRAM = ASSETS / "ngram" / "smollm2-3gram.ngram.xz"  # xz-compressed: ngram_cpp.load decompresses it once into the cache
DEFAULT_EAGLE3_HEAD = ASSETS / "eagle3"
