"""Build an n-gram trie for DART's tree pruner from instruction data and the target's own answers.

    dart-ngram ../shared/data/train/*.json* --corpus assets/corpus --out assets/ngram/smollm2-3gram.ngram

Every record is rendered as the target sees it (chat template applied, see dart_core.tools.data) and
tokenized with the target's tokenizer; n-grams never cross records. Like upstream, a document ends
with the EOS id: plain-text documents get it appended, and chat-rendered records already end their
last turn with the template's end-of-turn token (the EOS of the embedded SmolLM2, `<|im_end|>`).
With --corpus, the training records of a self-distilled corpus (dart_core.tools.training.corpus: prompt and the
target's answer, already token ids, ending with EOS unless the answer hit its token limit) are added;
its validation records are left out, as they are for the heads. The output is deterministic for the
same inputs and tokenizer. Writes our compact format (.ngram,
with the tokenizer's vocabulary size and fingerprint in its header) unless --format upstream.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

import ngram_cpp

from ..loading import DEFAULT_MODEL, load_tokenizer
from ..tools.data import iter_records, render


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dart-ngram", description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="*", type=Path, help="data files (.json, .jsonl, .txt)")
    p.add_argument(
        "--corpus", type=Path, default=None, help="an exported self-distilled corpus (assets/corpus) whose training records to add"
    )
    p.add_argument("--out", type=Path, required=True, help="output file")
    p.add_argument("--tokenizer", default=DEFAULT_MODEL, help="target model whose tokenizer to use (default: the embedded model)")
    p.add_argument("--order", type=int, default=ngram_cpp.DEFAULT_ORDER)
    p.add_argument("--format", choices=["compact", "upstream"], default="compact")
    p.add_argument("--limit", type=int, default=None, help="at most N records per file")
    p.add_argument("--slices-in-memory", type=int, default=ngram_cpp.DEFAULT_SLICES_IN_MEMORY, help="spill sorted runs to disk beyond this")
    p.add_argument("--spill-dir", type=Path, default=None, help="directory for the sorted runs (default: the system's temporary directory)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size for the header (default: len(tokenizer); use the model's if it is larger)",
    )
    args = p.parse_args(argv)
    if not args.data and args.corpus is None:
        p.error("give data files, --corpus, or both")
    if args.corpus is not None:
        from ..tools.training.corpus import CORPUS_META

        corpus_target = json.loads((args.corpus / CORPUS_META).read_text())["target"]
        if corpus_target != args.tokenizer:
            p.error(f"{args.corpus} holds token ids of {corpus_target!r}, not of --tokenizer {args.tokenizer!r}")

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
        if args.corpus is not None:
            from ..tools.training.corpus import read_corpus

            for record in tqdm(read_corpus(args.corpus), desc=args.corpus.name, unit=" rec", file=sys.stderr):
                if record["split"] != "train":
                    continue
                stats["records"] += 1
                stats["tokens"] += len(record["ids"])
                yield record["ids"]

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
