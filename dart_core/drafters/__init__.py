"""Draft heads that plug into the generation loop, and the defaults the bench and the app share:
the embedded assets and the per-device tree size (`max_nodes`: drafted nodes besides the root)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
DEFAULT_DART_HEAD = ASSETS / "dart"
DEFAULT_NGRAM = ASSETS / "ngram" / "smollm2-3gram.ngram.xz"  # xz-compressed: ngram_cpp.load decompresses it once into the cache
DEFAULT_EAGLE3_HEAD = ASSETS / "eagle3"
# Draft tree size (drafted nodes besides the root) per device, where nothing better is known: on the
# CPU kernels a head with a tree_sizes.json gets the size calibrated on the machine instead
# (dart_core/tools/calibrate.py). CPU 5: the size that gave the best end-to-end speed in an interleaved
# bf16 sweep of sizes (docs/changelog.md, "Heads trained on the self-distilled corpus"), past which τ
# grew more slowly than the verify's cost. CUDA 60: on a GPU a 60-node verify is meant to cost about
# one token (the paper; docs/gpu.md says what the eager path measures today).
DEFAULT_MAX_NODES = {"cpu": 5, "cuda": 60}
FALLBACK_MAX_NODES = 60  # other devices


def default_max_nodes(device_type: str) -> int:
    return DEFAULT_MAX_NODES.get(device_type, FALLBACK_MAX_NODES)
