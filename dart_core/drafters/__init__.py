"""Draft heads that plug into the generation loop, and the defaults the bench and the app share:
the embedded assets and the per-device tree size (`max_nodes`: drafted nodes besides the root)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
DEFAULT_DART_HEAD = ASSETS / "dart"
DEFAULT_NGRAM = ASSETS / "ngram" / "smollm2-3gram.ngram"
DEFAULT_EAGLE3_HEAD = ASSETS / "eagle3"
# Draft tree size (drafted nodes besides the root) per device. On a 2-core CPU a verify of n nodes costs
# ~31 ms + ~1 ms per node (bf16, AMD EPYC), so with the embedded heads (τ ≈ 1.5-1.8, nearly flat in n)
# small trees win: the tree-size ablation in docs/benchmarks.md measured DART at 1.20x / 1.07x / 0.87x /
# 0.81x plain decoding with 8 / 16 / 24 / 40 nodes. On a GPU a 60-node verify costs about one token (paper).
DEFAULT_MAX_NODES = {"cpu": 8, "cuda": 60}
FALLBACK_MAX_NODES = 60  # other devices


def default_max_nodes(device_type: str) -> int:
    return DEFAULT_MAX_NODES.get(device_type, FALLBACK_MAX_NODES)
