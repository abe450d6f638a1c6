"""Convert an n-gram file between our compact format and the upstream `.trie` layout.

    dart-ngram-convert IN OUT [--format compact|upstream]

The input format is detected; the output format defaults to the other one.
"""

from __future__ import annotations

import argparse
import sys

import ngram_cpp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dart-ngram-convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--format", choices=["compact", "upstream"], default=None, help="output format (default: the other one)")
    p.add_argument("--vocab-size", type=int, default=None, help="the tokenizer's vocabulary size (an upstream .trie does not record it)")
    p.add_argument("--fingerprint", default=None, help="the tokenizer's fingerprint (ngram_cpp.tokenizer_fingerprint)")
    args = p.parse_args(argv)
    model = ngram_cpp.convert(args.src, args.dst, args.format, args.vocab_size, args.fingerprint)
    vocab = f"vocab {model.vocab_size}" + ("" if model.vocab_known else " (max id + 1)")
    print(f"{args.dst}: order {model.order}, {model.num_nodes} nodes, {vocab}", file=sys.stderr)
    return 0
