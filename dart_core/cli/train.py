"""Train a DART or EAGLE3 draft head for a target model: one data pipeline (self-distillation, the
target-state cache, the draft vocabulary), one training loop (dart_core/tools/training), two objectives.

    dart-train dart --data ../shared/data/train/*.json* --work runs/dart \\
        --self-distill 8000 --self-distill-minutes 30 --cache-tokens 700000 --train-minutes 30 --export assets/dart
    dart-train eagle3 --data ../shared/data/train/*.json* --work runs/eagle3 \\
        --cache runs/dart/cache --train-minutes 30 --export assets/eagle3

Two resumable phases: (1) run the frozen target over the data once and cache its captured hidden
states and final hidden state (`build_cache`); (2) train the head on the cache (`train_head`).
Re-running the same command resumes either phase. dart-train dart and dart-train eagle3
are this command with the objective fixed.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from ..target import load_target
from ..tools.training import CACHE_META, CacheConfig, TrainConfig, build_cache, train_head
from .options import add_device_flag, add_model_flag, add_threads_flag, apply_threads

OBJECTIVES = {
    "dart": "Train a DART draft head: one forward drafts D+1 depths; the loss is Σ_j γ^j·KL(target ‖ draft) over its rows.",
    "eagle3": "Train an EAGLE3 draft head (the baseline DART is compared with) with the training-time test: --ttt-steps "
    "unrolled steps in which the head is fed its own previous output state, as when it drafts.",
}


def main(objective: str, description: str, argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flag(p, help="target: 'default', a local dir or a hub id")
    p.add_argument("--data", nargs="+", required=True, help="training files (.json/.jsonl/.txt, see dart_core.tools.data)")
    p.add_argument("--work", type=Path, required=True, help="work dir: cache/, train/ (checkpoints, history)")
    p.add_argument(
        "--cache", type=Path, default=None, help="target-state cache dir (default WORK/cache); share one between DART and EAGLE3"
    )
    add_device_flag(p)
    p.add_argument("--cache-dtype", default="bfloat16", help="target dtype while caching states")
    p.add_argument("--cache-tokens", type=int, default=1_000_000, help="training tokens to cache")
    p.add_argument("--cache-minutes", type=float, default=None, help="stop caching after this long (0: train on the shards cached so far)")
    p.add_argument("--val-records", type=int, default=150)
    p.add_argument(
        "--self-distill",
        type=int,
        default=0,
        metavar="N",
        help="regenerate the answers of the first N conversations (validation first) with the target, greedy",
    )
    p.add_argument("--self-distill-max-new", type=int, default=256, help="token limit of a regenerated answer")
    p.add_argument("--self-distill-batch", type=int, default=32, help="conversations generated together")
    p.add_argument(
        "--self-distill-minutes", type=float, default=None, help="stop generating after this long (unfinished records are dropped)"
    )
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary: the most frequent target tokens")
    if objective == "dart":
        p.add_argument("--draft-length", type=int, default=7, help="mask slots D; the head predicts D+1 depths")
    else:
        p.add_argument(
            "--ttt-steps", type=int, default=7, help="unrolled steps of the training-time test; the head is trained on steps+1 depths"
        )
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps in all, overriding --epochs (the records of the cache grow as a corpus does: "
        "give the DART and EAGLE3 heads the same token budget with the same --steps, --batch-records and --anchors)",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--batch-records", type=int, default=4)
    p.add_argument("--anchors", type=int, default=32, help="prefix positions trained per record and step")
    p.add_argument("--gamma", type=float, default=0.6, help="loss weight decay over depths (DART paper: 0.6)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument(
        "--keep-heads-every",
        type=int,
        default=None,
        metavar="N",
        help="also keep the head of every N-th step (WORK/train/heads/step-N, with its training time), e.g. to bench two runs at equal "
        "steps",
    )
    p.add_argument(
        "--train-minutes", type=float, default=None, help="training time budget over all resumes; the cosine schedule ends with it"
    )
    p.add_argument(
        "--adopt-cache-vocab",
        action="store_true",
        help="on resuming, move the checkpoint's head to the cache's draft vocabulary if it differs (rows of shared ids and "
        "their optimizer moments carried over, new ids from the target's LM head rows); without it the checkpoint's stays",
    )
    p.add_argument(
        "--init-head",
        type=Path,
        default=None,
        metavar="DIR",
        help="a new run (WORK/train has no checkpoint yet) starts from this saved head instead of a fresh one, e.g. the committed "
        "assets/dart on a machine that lost the run directory: its weights, and the step and training time in its "
        "trained.json; the optimizer starts afresh with a new warm-up. Ignored once WORK/train has a checkpoint",
    )
    p.add_argument(
        "--init-history",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --init-head: the validation history of the run that made the head (e.g. assets/training/dart-v1.history.json)",
    )
    add_threads_flag(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export", type=Path, default=None, help="copy the final head (config.json + model.safetensors) here")
    args = p.parse_args(argv)
    if args.init_history is not None and args.init_head is None:
        p.error("--init-history goes with --init-head")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    apply_threads(args)

    cache_dir = args.cache or args.work / "cache"
    if args.cache is not None and (args.cache / CACHE_META).exists():
        print(f"reusing the cache {args.cache} as it is", file=sys.stderr)
    else:
        target = load_target(args.model, args.device, args.cache_dtype)
        build_cache(
            target,
            CacheConfig(
                data=[str(d) for d in args.data],
                out_dir=str(cache_dir),
                max_tokens=args.cache_tokens,
                max_minutes=args.cache_minutes,
                max_seq_len=args.max_seq_len,
                val_records=args.val_records,
                draft_vocab_size=args.draft_vocab,
                seed=args.seed,
                self_distill=args.self_distill,
                self_distill_max_new=args.self_distill_max_new,
                self_distill_batch=args.self_distill_batch,
                self_distill_minutes=args.self_distill_minutes,
            ),
        )
    target = load_target(args.model, args.device, "float32")  # fp32 master copy of the embedding and LM head
    rows = (args.draft_length if objective == "dart" else args.ttt_steps) + 1
    head_dir = train_head(
        target,
        TrainConfig(
            cache_dir=str(cache_dir),
            out_dir=str(args.work / "train"),
            epochs=args.epochs,
            steps=args.steps,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            batch_records=args.batch_records,
            anchors_per_record=args.anchors,
            gamma=args.gamma,
            eval_every=args.eval_every,
            keep_heads_every=args.keep_heads_every,
            max_minutes=args.train_minutes,
            seed=args.seed,
            adopt_cache_vocab=args.adopt_cache_vocab,
            init_head=None if args.init_head is None else str(args.init_head),
            init_history=None if args.init_history is None else str(args.init_history),
        ),
        objective,
        rows,
    )
    if args.export:
        args.export.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(head_dir / name, args.export / name)
        print(f"exported {args.export}", file=sys.stderr)
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`dart-train dart|eagle3 FLAGS...`"""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in OBJECTIVES:
        print(
            f"usage: dart-train {{{','.join(OBJECTIVES)}}} [flags] (-h after the objective for its flags)",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return main(argv[0], OBJECTIVES[argv[0]], argv[1:], prog=f"dart-train {argv[0]}")
