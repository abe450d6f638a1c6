"""Export a DART head trained here so that upstream's loader (fvliang/DART) runs it right.

    dart-export-upstream --head assets/dart --out dart-upstream [--dtype float32]

Why and how (the final norm folded into the LM head) is in dart_core/tools/export_upstream.py
(`dart-export-upstream` is this command too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..tools.export_upstream import export_upstream


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dart-export-upstream", description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="DART head directory (or hub id) to export")
    p.add_argument("--out", type=Path, required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="tensor dtype written (default float32)")
    args = p.parse_args(argv)
    try:
        folded = export_upstream(args.head, args.out, args.dtype)
    except (OSError, ValueError) as e:
        p.exit(1, f"error: {e}\n")
    what = "final norm folded into lm_head" if folded else "already twice-normed, written unchanged"
    print(f"exported {args.head} -> {args.out} ({what})", file=sys.stderr)
    return 0
