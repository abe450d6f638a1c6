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
# pass; each row also attends over the whole cache, which costs more on long prompts. In the one-run
# sweep of the default heads (docs/benchmarks.md, "Default heads from the self-distilled corpus", six
# bench sets, AMD EPYC) a verify of 6 / 7 / 8 / 13 / 17 rows cost 16.3 / 17.3 / 19.2 / 25.4 / 31.0 ms
# against a 14.2 ms one-token step, and DART ran at 1.57x / 1.55x / 1.48x / 1.28x / 1.14x plain
# decoding with 5 / 6 / 7 / 12 / 16 nodes (τ 2.24 / 2.31 / 2.37 / 2.58 / 2.68): τ grows more slowly
# than the verify. On a GPU a 60-node verify costs about one token (paper).
DEFAULT_MAX_NODES = {"cpu": 5, "cuda": 60}
FALLBACK_MAX_NODES = 60  # other devices


def default_max_nodes(device_type: str) -> int:
    return DEFAULT_MAX_NODES.get(device_type, FALLBACK_MAX_NODES)
