"""Draft heads that plug into the generation loop, and the defaults the bench and the app share:
the embedded assets and the per-device tree size (`max_nodes`: drafted nodes besides the root)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
DEFAULT_DART_HEAD = ASSETS / "dart"
DEFAULT_NGRAM = ASSETS / "ngram" / "smollm2-3gram.ngram"
DEFAULT_EAGLE3_HEAD = ASSETS / "eagle3"
# Draft tree size (drafted nodes besides the root) per device. On a 2-core CPU with the batch-invariant
# kernels the bf16 linear runs up to 5 rows in one pass over the weights and 6-9 rows in one wider
# pass: a verify of 5-6 rows cost 15.3 ms against a 13.8 ms one-token step, 7 rows 16.1, 9 rows 18.7 (AMD EPYC);
# the one-run tree sweep in docs/benchmarks.md measured DART at 1.33x / 1.38x / 1.36x / 1.27x plain
# decoding with 4 / 5 / 6 / 8 nodes (embedded head), 1.41x / 1.45x / 1.43x / 1.34x / 1.18x with 4 / 5 /
# 6 / 8 / 12 (the self-distilled dart-v1 head). On a GPU a 60-node verify costs about one token (paper).
DEFAULT_MAX_NODES = {"cpu": 5, "cuda": 60}
FALLBACK_MAX_NODES = 60  # other devices


def default_max_nodes(device_type: str) -> int:
    return DEFAULT_MAX_NODES.get(device_type, FALLBACK_MAX_NODES)
