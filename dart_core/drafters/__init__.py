"""Draft heads that plug into the generation loop, and the defaults the bench and the app share:
the embedded assets and the per-device tree size (`max_nodes`: drafted nodes besides the root)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
DEFAULT_DART_HEAD = ASSETS / "dart"
DEFAULT_NGRAM = ASSETS / "ngram" / "smollm2-3gram.ngram"
DEFAULT_EAGLE3_HEAD = ASSETS / "eagle3"
# Draft tree size (drafted nodes besides the root) per device. On a 2-core CPU with the batch-invariant
# kernels a one-token step costs ~16 ms and a verify of n nodes ~16 + ~1.3 n ms (bf16, AMD EPYC), so
# small trees win: the tree-size sweep in docs/benchmarks.md measured DART at 1.16x / 1.14x / 1.12x /
# 1.05x / 0.84x plain decoding with 4 / 6 / 8 / 12 / 16 nodes (8 has the highest τ of the near-ties).
# On a GPU a 60-node verify costs about one token (paper).
DEFAULT_MAX_NODES = {"cpu": 8, "cuda": 60}
FALLBACK_MAX_NODES = 60  # other devices


def default_max_nodes(device_type: str) -> int:
    return DEFAULT_MAX_NODES.get(device_type, FALLBACK_MAX_NODES)
