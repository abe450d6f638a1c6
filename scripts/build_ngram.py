"""Build an n-gram trie for DART's tree pruner from instruction data.

    python scripts/build_ngram.py ../shared/data/train/*.json* --out assets/ngram/smollm2-3gram.ngram

Every record is rendered as the target sees it (chat template applied, see dart_core.data) and
tokenized with the target's tokenizer; n-grams never cross records. Like upstream, a document ends
with the EOS id: plain-text documents get it appended, and chat-rendered records already end their
last turn with the template's end-of-turn token (the EOS of the embedded SmolLM2, `<|im_end|>`).
The output is deterministic for the same inputs and tokenizer. Writes our compact format (.ngram,
with the tokenizer's vocabulary size and fingerprint in its header) unless --format upstream.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

import ngram_cpp
from dart_core.data import iter_records, render
from dart_core.loading import DEFAULT_MODEL, load_tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="+", type=Path, help="data files (.json, .jsonl, .txt)")
    p.add_argument("--out", type=Path, required=True, help="output file")
    p.add_argument("--tokenizer", default=DEFAULT_MODEL, help="target model whose tokenizer to use (default: the embedded model)")
    p.add_argument("--order", type=int, default=ngram_cpp.DEFAULT_ORDER)
    p.add_argument("--format", choices=["compact", "upstream"], default="compact")
    p.add_argument("--limit", type=int, default=None, help="at most N records per file")
    p.add_argument("--slices-in-memory", type=int, default=ngram_cpp.DEFAULT_SLICES_IN_MEMORY, help="spill sorted runs to disk beyond this")
    p.add_argument("--spill-dir", type=Path, default=None, help="directory for the sorted runs (default: the system's temporary directory)")
    p.add_argument(
        "--vocab-size", type=int, default=None, help="vocabulary size for the header (default: len(tokenizer); use the model's if it is larger)"
    )
    args = p.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer)
    vocab_size = len(tokenizer) if args.vocab_size is None else args.vocab_size
    fingerprint = ngram_cpp.tokenizer_fingerprint(tokenizer)
    stats = {"records": 0, "tokens": 0}

    def sequences():
        for path in args.data:
            for i, record in enumerate(tqdm(iter_records(path), desc=path.name, unit=" rec", file=sys.stderr)):
                if args.limit is not None and i >= args.limit:
                    break
                ids = render(tokenizer, record)
                stats["records"] += 1
                stats["tokens"] += len(ids)
                yield ids

    t0 = time.perf_counter()
    model = ngram_cpp.build(sequences(), vocab_size, args.order, fingerprint, args.slices_in_memory, args.spill_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out, args.format)
    print(
        f"{args.out}: order {model.order}, {stats['records']} records, {stats['tokens']} tokens, {model.num_nodes} nodes, "
        f"{args.out.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
