"""τ by tree size: a head's tokens per target forward at each tree size, measured offline by exact
replay on held-out prompts and shipped beside the head as TAU_FILE (`dart-calibrate --write-tau`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...generate import Drafter
from ..replay import GreedyRecord, replay

TAU_FILE = "tree_sizes.json"  # beside a head's config.json: τ by tree size, by replay


def read_tau_table(head_dir: str | os.PathLike | None) -> dict[int, float] | None:
    """τ by drafted nodes from the head's TAU_FILE, or None where the head has none. A file that is
    there but unreadable is an error (it would silently change the tree size otherwise)."""
    if head_dir is None:
        return None
    path = Path(head_dir) / TAU_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        table = {int(n): float(t) for n, t in data["tau"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a τ-by-tree-size table ({e}); rewrite it with dart-calibrate --write-tau") from None
    if not table or any(n < 1 or t < 1.0 for n, t in table.items()):
        raise ValueError(f"{path}: τ must be >= 1 at sizes >= 1")
    return table


def tau_by_size(drafter: Drafter, records: list[GreedyRecord], sizes: list[int]) -> dict[int, float]:
    """τ (tokens per target forward, the prefill counted) of `drafter` at each size, summed over the
    records, by exact replay."""
    out = {}
    for n in sizes:
        runs = [replay(drafter, rec, n) for rec in records]
        out[n] = sum(r.new_tokens for r in runs) / sum(r.steps for r in runs)
    return out
