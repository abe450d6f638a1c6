"""Generate the self-distilled corpus: the target's own answers to a pool of chat prompts, with its
hidden states captured in the generating forward (a training cache), resumably.

    dart-corpus --data ../shared/data/train/*.json* \\
        --exclude ../shared/data/bench/*.jsonl --out ~/.cache/dart-demo/runs/corpus-v1

Re-running the same command resumes. `--export DIR` writes the compact corpus (token ids, offsets,
provenance) that is committed under assets/corpus/; see dart_core/tools/training/corpus.py. dart-corpus
is this command.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ..target import load_target
from ..tools.training.corpus import CACHE_META, CorpusConfig, choose_draft_vocab, corpus_to_cache, export_corpus, generate_corpus
from .options import add_device_flag, add_model_flag, add_threads_flag, apply_threads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate the self-distilled corpus (see dart_core/tools/training/corpus.py).")
    add_model_flag(p, help="target: 'default', a local dir or a hub id")
    p.add_argument("--data", nargs="+", required=True, help="prompt files (.json/.jsonl, see dart_core.tools.data)")
    p.add_argument("--exclude", nargs="*", default=[], help="question.jsonl files whose prompts are held out (the bench sets)")
    p.add_argument("--out", type=Path, required=True, help="run directory (resumable; a training cache when states are captured)")
    add_device_flag(p)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=48, help="sequences decoding together")
    p.add_argument("--sample-share", type=float, default=0.25, help="share of prompts answered by sampling")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled answers")
    p.add_argument("--val-prompts", type=int, default=300)
    p.add_argument("--no-capture", action="store_true", help="token ids only (no hidden states)")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long (resumable)")
    p.add_argument("--max-prompts", type=int, default=None, help="stop after this many pool prompts")
    add_threads_flag(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--export",
        type=Path,
        default=None,
        metavar="DIR",
        help="after generating, write the compact corpus (token ids, offsets, provenance) of the finished parts to DIR",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="after generating, choose the N-token draft vocabulary of the corpus (or keep the one chosen before) "
        "and report its coverage of the target's argmax",
    )
    p.add_argument(
        "--rechoose-draft-vocab",
        action="store_true",
        help="with --draft-vocab: choose anew even if a vocabulary was chosen before (heads trained on it no longer match)",
    )
    p.add_argument(
        "--rebuild-from",
        type=Path,
        default=None,
        metavar="CORPUS",
        help="instead of generating, rebuild the states of an exported corpus with one teacher-forced pass into --out",
    )
    p.add_argument("--no-generate", action="store_true", help="only --export / --draft-vocab what --out holds")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    apply_threads(args)
    if args.rebuild_from is not None:
        corpus_to_cache(load_target(args.model, args.device, args.dtype), args.rebuild_from, args.out, args.minutes)
        return 0
    cfg = CorpusConfig(
        data=[str(d) for d in args.data],
        out_dir=str(args.out),
        exclude=[str(e) for e in args.exclude],
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        sample_share=args.sample_share,
        temperature=args.temperature,
        val_prompts=args.val_prompts,
        seed=args.seed,
        capture=not args.no_capture,
        max_minutes=args.minutes,
        max_prompts=args.max_prompts,
    )
    if not args.no_generate:
        generate_corpus(load_target(args.model, args.device, args.dtype), cfg)
    if args.export is not None:
        command = "dart-corpus " + " ".join(argv if argv is not None else sys.argv[1:])
        m = export_corpus(args.out, args.export, command)
        print(f"{args.export}: {len(m['parts'])} parts, {m['records']} records, {m['answer_tokens']} answer tokens", file=sys.stderr)
    if args.draft_vocab is not None:
        info = choose_draft_vocab(
            args.out, args.draft_vocab, json.loads((args.out / CACHE_META).read_text())["vocab_size"], rechoose=args.rechoose_draft_vocab
        )
        print(
            f"draft vocabulary {info['size']} ({'kept' if info['kept'] else 'chosen'}): covers {info['coverage_greedy_argmax']:.2%} of "
            "greedy answer tokens "
            f"(the target's argmax), {info['coverage_answer_tokens']:.2%} of all answer tokens",
            file=sys.stderr,
        )
    return 0
