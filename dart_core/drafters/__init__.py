"""Draft heads that plug into the generation loop, and the defaults the bench and the app share:
the embedded assets and the per-device tree size (`max_nodes`: drafted nodes besides the root)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
DEFAULT_DART_HEAD = ASSETS / "dart"
DEFAULT_NGRAM = ASSETS / "ngram" / "smollm2-3gram.ngram"
DEFAULT_EAGLE3_HEAD = ASSETS / "eagle3"
# Draft tree size (drafted nodes besides the root) per device, where nothing better is known: on the
# CPU kernels a head with a tree_sizes.json gets the size calibrated on the machine instead
# (dart_core/tools/calibrate.py). CPU 5: in one interleaved bf16 sweep on a 2-core AMD EPYC (the changelog of
# docs/benchmarks.md, "Heads trained on the self-distilled corpus") DART ran at 1.57x plain decoding
# with 5 nodes against 1.55x / 1.48x / 1.28x / 1.14x with 6 / 7 / 12 / 16, its verify costing 16.3 ms
# at 6 rows and 31.0 at 17 against a 14.2 ms step: τ grew more slowly than the verify's cost.
# CUDA 60: on a GPU a 60-node verify costs about one token (the paper).
DEFAULT_MAX_NODES = {"cpu": 5, "cuda": 60}
FALLBACK_MAX_NODES = 60  # other devices


def default_max_nodes(device_type: str) -> int:
    return DEFAULT_MAX_NODES.get(device_type, FALLBACK_MAX_NODES)
