"""Export an EAGLE3 head as a GGUF draft model for llama.cpp (`--spec-type draft-eagle3 -md FILE`).

    dart-export-gguf --head assets/eagle3 --out eagle3.gguf

What the file holds, and why, is in dart_core/tools/export_gguf.py (`dart-export-gguf` is this command too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..loading import DEFAULT_MODEL
from ..tools.export_gguf import OUTTYPES, export_eagle3_gguf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dart-export-gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="EAGLE3 head: a local dir or hub id (e.g. assets/eagle3)")
    p.add_argument("--out", required=True, type=Path, help="the .gguf file to write")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the head's target: 'default' (the embedded GGUF), a target .gguf, or an HF dir / hub id with --tokenizer-gguf",
    )
    p.add_argument("--outtype", default="bf16", choices=sorted(OUTTYPES), help="type of the 2-D weights (norms are always f32)")
    p.add_argument(
        "--tokenizer-gguf", type=Path, default=None, help="for an HF target: a GGUF of the same model to copy the tokenizer from"
    )
    a = p.parse_args(argv)
    try:
        out = export_eagle3_gguf(a.head, a.model, a.out, a.outtype, a.tokenizer_gguf)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): llama-speculative-simple -m TARGET.gguf -md {out} --spec-type draft-eagle3")
    return 0
