"""Convert an n-gram file between our compact format and the upstream `.trie` layout.

    python -m ngram_cpp.convert IN OUT [--format compact|upstream]

The input format is detected; the output format defaults to the other one.
"""

from __future__ import annotations

import argparse
import sys

import ngram_cpp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ngram_cpp.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--format", choices=["compact", "upstream"], default=None, help="output format (default: the other one)")
    args = p.parse_args(argv)
    ngram_cpp.convert(args.src, args.dst, args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
