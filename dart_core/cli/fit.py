"""Fit the DART pruner's ranking: a calibrated model of P(node accepted) per tree level, by exact replay.

    dart-fit --records ~/.cache/dart-demo/acceptance/train-val-gguf.pt \\
        --prompts 200 --dtype gguf --threads 1 --out assets/dart/acceptance.json

1. Decodes training prompts greedily once (`--records FILE` caches them; dart_core/tools/replay.py): the
   first prompts of the self-distilled corpus's pool (dart_core.tools.training.corpus.prompt_pool over `--data`,
   the bench sets excluded, seed 0), which are its validation split: no head was trained on them,
   and no bench prompt is among them. Prompts longer than `--max-prompt-tokens` are skipped.
2. Replays DART on every record (the embedded head and trie, the hand-weighted score at
   `--collect-nodes` nodes choosing the steps). At every step it runs the pruner's search again in
   the Python reference (ngram_cpp/reference.py pool_features, the executable copy of pruner.cpp,
   checked against it) and keeps its `--keep` best nodes by score (a set closed under taking
   parents) with the features the fitted ranking scores them with, each labelled 1 if its whole
   path is the target's recorded continuation (the node would be accepted).
3. Fits one logistic regression per level (the last row shared by the levels past the head's rows),
   level by level, since a node's features include its parent's fitted value: P(node accepted),
   capped by the parent's, which is what the pruner's final cut ranks by (ngram_cpp/src/pruner.h).
   Reports the log-loss and a reliability table on the last `--holdout` share of the prompts
   (fitted without them), then refits on all and writes the weights, the command and the fit's
   numbers to `--out`.

`--method eagle3` does the same for EAGLE3's pool (dart_core/drafters/eagle3.py has its features).
`--evaluate RECORDS` replays the score and the fitted ranking (and the adaptive tree, with this
machine's forward costs by rows from dart_core/tools/calibrate/) on other records, e.g. held-out prompts
11-20 of the bench sets (dart-tune scoring --records writes them), and prints τ by tree size.

The fit is dart_core/tools/fitting.py; dart-fit is this command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import ngram_cpp
from ngram_cpp.reference import ACCEPTANCE_FEATURES, FEATURE_NAMES

from ..drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD
from ..drafters.dart import CONTEXT_ORDER, load_fitted_ranking
from ..drafters.registry import resolve_ngram
from ..loading import DEFAULT_MODEL
from ..target import load_target
from ..tools import calibrate
from ..tools.fitting import (
    BENCH_SETS,
    PARENT_FIT,
    TRAIN_DATA,
    collect,
    evaluate,
    evaluate_eagle3,
    fit,
    record_training_prompts,
    report,
    stack,
)
from ..tools.replay import record_greedy
from ..tools.tuning import save_records
from .options import add_drafter_flags, add_dtype_flag, add_model_flag, add_threads_flag, apply_threads, drafter_configs
from .tune import read_records


def log(msg: str) -> None:
    print(msg, file=sys.stderr)


def training_records(args: argparse.Namespace, target):
    """--records when it exists, else the training prompts recorded now (and saved there)."""
    if args.records is not None and args.records.exists():
        records = read_records(args.records)
        print(f"{len(records)} records from {args.records}", file=sys.stderr)
        return records
    records = record_training_prompts(
        target, args.data, args.exclude, args.prompts, args.max_prompt_tokens, args.max_new_tokens, args.pool, log
    )
    if args.records is not None:
        save_records(records, args.records)
    return records


def collect_and_fit(drafter, feature_params, records, args: argparse.Namespace, parent_col: int):
    """Replay the records collecting each step's nodes, report a fit without the last --holdout share
    of the prompts, then fit on all: (data, table, the held-out report, W)."""
    t0 = time.perf_counter()
    data = collect(drafter, feature_params, records, args.keep)
    table = stack([st for _, rs in data for st in rs])
    print(
        f"collected {sum(len(rs) for _, rs in data)} steps, {len(table[0])} nodes ({int(table[3].sum())} accepted) in "
        f"{time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )
    cut = int(round(len(data) * (1 - args.holdout)))
    held = None
    if cut < len(data):
        W_fit = fit(stack([st for _, rs in data[:cut] for st in rs]), args.rows, args.l2, parent_col=parent_col)
        held = report(stack([st for _, rs in data[cut:] for st in rs]), W_fit, parent_col=parent_col)
        print(json.dumps(held, indent=1), file=sys.stderr)
    holdout = {"prompts_left_out": len(data) - cut, **(held or {})}
    return data, table, holdout, fit(table, args.rows, args.l2, parent_col=parent_col)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dart-fit",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--data", nargs="+", default=[f"../shared/data/train/{f}" for f in TRAIN_DATA], help="training files (the corpus's)")
    p.add_argument(
        "--exclude", nargs="+", default=[f"../shared/data/bench/{b}.jsonl" for b in BENCH_SETS], help="question files never used"
    )
    p.add_argument("--prompts", type=int, default=200, help="training prompts to record")
    p.add_argument("--pool", type=int, default=300, help="take prompts from the pool's first N (the corpus's validation split)")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--records", type=Path, default=None, help="cache of the training records (written if absent, read if present)")
    p.add_argument("--collect-nodes", type=int, default=16, help="tree size of the replay whose steps are collected")
    p.add_argument("--rows", type=int, default=6, help="weight rows: one per level, the last shared by deeper levels")
    p.add_argument("--keep", type=int, default=128, help="nodes per step fitted on: the search's best by score (and their ancestors)")
    p.add_argument("--l2", type=float, default=1.0)
    p.add_argument("--holdout", type=float, default=0.2, help="share of the prompts (the last ones) the reported fit leaves out")
    p.add_argument("--out", type=Path, default=None, help="the fitted ranking (JSON), e.g. assets/dart/acceptance.json")
    p.add_argument("--evaluate", type=Path, default=None, help="records to replay the score and the fitted ranking on (no fit)")
    p.add_argument("--ranking", type=Path, default=None, help="--evaluate: the fitted ranking's directory (default: the head's)")
    p.add_argument("--sizes", default="5,8,16,60", help="--evaluate: tree sizes")
    p.add_argument(
        "--costs",
        type=Path,
        default=None,
        help="--evaluate: a forward-cost file of the calibration's cache (~/.cache/dart-demo/calibration/forwards-*.json) "
        "to estimate tokens/s and size adaptive trees with (default: this process's forward_costs at --threads)",
    )
    p.add_argument(
        "--draft-ms", type=float, default=None, help="--evaluate: drafting ms per step added to every step's cost (default: timed here)"
    )
    p.add_argument("--eval-out", type=Path, default=None, help="--evaluate: write the table as JSON")
    p.add_argument("--method", choices=["dart", "eagle3"], default="dart", help="the drafter whose ranking is fitted or evaluated")
    add_model_flag(p)
    add_dtype_flag(p, "gguf")
    add_threads_flag(p)
    add_drafter_flags(p)
    args = p.parse_args(argv)
    try:
        configs = drafter_configs(args, args.model == DEFAULT_MODEL)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    apply_threads(args)
    target = load_target(args.model, "cpu", args.dtype)
    # the replays that collect and the baseline rank by the score
    config = dataclasses.replace(configs.dart, ranking="score")
    if args.method == "eagle3":
        return eagle3_main(args, dataclasses.replace(configs.eagle3, ranking="score"), target, argv)

    if args.evaluate is not None:
        sizes = [int(x) for x in args.sizes.split(",")]
        drafter = calibrate.build_measured("dart", target, dataclasses.replace(config, max_nodes=max(sizes)))
        ranking = load_fitted_ranking(args.ranking or config.head or DEFAULT_DART_HEAD)
        if ranking is None:
            raise SystemExit("no fitted ranking to evaluate (--ranking DIR with an acceptance.json)")
        records = read_records(args.evaluate)
        if args.costs is not None:
            data = json.loads(args.costs.read_text())
            costs_ms, costs_from = (
                {int(k): float(v) for k, v in data["ms"].items()},
                {"file": str(args.costs), **data["key"], "measured_at": data["measured_at"]},
            )
        else:
            c = calibrate.forward_costs(target, args.threads)
            costs_ms, costs_from = c.ms, {**c.key, "measured_at": c.measured_at}
        draft = args.draft_ms
        if draft is None:
            rec = record_greedy(target, [{"role": "user", "content": calibrate.OVERHEAD_PROMPT}], calibrate.OVERHEAD_TOKENS)
            draft = calibrate.drafting_ms(drafter, rec, [8])[8]
        print(
            f"{len(records)} records; forward ms by rows {', '.join(f'{k}: {v:.1f}' for k, v in costs_ms.items())}; drafting {draft:.2f} "
            "ms",
            file=sys.stderr,
        )
        rows = evaluate(drafter, records, sizes, ranking, costs_ms, draft, log)
        names = list(rows[0]["per_set"])
        print(
            "\n| ranking | max nodes | mean nodes | τ | "
            + " | ".join(names)
            + " | est. tok/s |\n|---|---|---|---|"
            + "---|" * len(names)
            + "---|"
        )
        for r in rows:
            print(
                f"| {r['ranking']} | {r['max_nodes']} | {r['mean_nodes']:.1f} | {r['tau']:.3f} | "
                + " | ".join(f"{r['per_set'][k]:.2f}" for k in names)
                + f" | {r.get('est_tokens_per_s', float('nan')):.1f} |"
            )
        if args.eval_out:
            args.eval_out.write_text(
                json.dumps(
                    {"records": str(args.evaluate), "forward_ms": costs_ms, "costs": costs_from, "draft_ms": draft, "rows": rows}, indent=1
                )
                + "\n"
            )
        return 0

    drafter = calibrate.build_measured("dart", target, dataclasses.replace(config, max_nodes=args.collect_nodes))
    records = training_records(args, target)
    prune = drafter.params.prune
    trie = resolve_ngram(config, target)
    if trie is None:
        raise SystemExit("the fitted ranking's features include the trie's probability: fit it with the n-gram model in use")
    feature_params = dataclasses.replace(prune, acceptance=(0.0,) * ACCEPTANCE_FEATURES)  # the fitted ranking's features
    data, table, holdout, W = collect_and_fit(drafter, feature_params, records, args, PARENT_FIT)
    if args.out:
        command = "dart-fit " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(
            json.dumps(
                {
                    "format": "dart-acceptance/1",
                    "command": command,
                    "what": "P(a tree node is accepted), a logistic regression per level (row r scores level r, "
                    "the last row every deeper one) "
                    "on the features below, capped by the parent's; the pruner's final cut ranks the search's nodes by it "
                    "(ngram_cpp/src/pruner.h)",
                    "trie": trie.name.removesuffix(ngram_cpp.XZ) if trie is not None else None,
                    "features": list(FEATURE_NAMES),
                    "weights": [[round(float(w), 6) for w in row] for row in W],
                    "tree": {
                        "top_k": prune.top_k,
                        "context_max_candidates": prune.context_max_candidates,
                        "context_extend": prune.context_extend,
                        "context_order": drafter.params.context_order if drafter.params.context_order else CONTEXT_ORDER,
                        "collected_at_nodes": args.collect_nodes,
                        "beam_width": prune.beam_width,
                    },
                    "data": {
                        "records": len(records),
                        "sets": sorted({n for n, _ in records}),
                        "steps": sum(len(rs) for _, rs in data),
                        "nodes": len(table[0]),
                        "nodes_per_step": args.keep,
                        "prompts": f"the first {args.prompts} prompts of at most {args.max_prompt_tokens} tokens "
                        "among the corpus pool's first "
                        f"{args.pool} (its validation split), {args.max_new_tokens} new tokens, {target.weights} weights",
                    },
                    "holdout_fit": holdout,
                    "fit": report(table, W),
                },
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def eagle3_main(args, config, target, argv) -> int:
    """--method eagle3: fit (or with --evaluate, evaluate) EAGLE3's ranking."""
    from ..drafters.eagle3 import ACCEPTANCE_FORMAT, FEATURES, load_fitted_ranking
    from ..drafters.eagle3 import PARENT_FIT as E3_PARENT

    if args.evaluate is not None:
        sizes = [int(x) for x in args.sizes.split(",")]
        drafter = calibrate.build_measured("eagle3", target, dataclasses.replace(config, max_nodes=max(sizes)))
        weights = load_fitted_ranking(args.ranking or config.head or DEFAULT_EAGLE3_HEAD)
        if weights is None:
            raise SystemExit("no fitted EAGLE3 ranking to evaluate (--ranking DIR with an acceptance.json)")
        records = read_records(args.evaluate)
        rows = evaluate_eagle3(drafter, records, sizes, weights, log)
        names = list(rows[0]["per_set"])
        print("\n| ranking | nodes | τ | " + " | ".join(names) + " | drafting ms/step |\n|---|---|---|" + "---|" * len(names) + "---|")
        for r in rows:
            print(
                f"| {r['ranking']} | {r['max_nodes']} | {r['tau']:.3f} | "
                + " | ".join(f"{r['per_set'][k]:.2f}" for k in names)
                + f" | {r['drafting_ms_per_step']:.2f} |"
            )
        if args.eval_out:
            args.eval_out.write_text(json.dumps({"records": str(args.evaluate), "rows": rows}, indent=1) + "\n")
        return 0
    drafter = calibrate.build_measured("eagle3", target, dataclasses.replace(config, max_nodes=args.collect_nodes))
    records = training_records(args, target)
    data, table, holdout, W = collect_and_fit(drafter, None, records, args, E3_PARENT)
    if args.out:
        command = "dart-fit " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(
            json.dumps(
                {
                    "format": ACCEPTANCE_FORMAT,
                    "command": command,
                    "what": "P(a tree node is accepted), a logistic regression per depth (row r scores depth r + 1, "
                    "the last row every deeper one) "
                    "on the features below, capped by the parent's; EAGLE3's tree keeps the best of its pool by it "
                    "(dart_core/drafters/eagle3.py)",
                    "features": list(FEATURES),
                    "weights": [[round(float(w), 6) for w in row] for row in W],
                    "data": {
                        "records": len(records),
                        "steps": sum(len(rs) for _, rs in data),
                        "nodes": len(table[0]),
                        "nodes_per_step": args.keep,
                        "collected_at_nodes": args.collect_nodes,
                        "prompts": f"the first {args.prompts} prompts of at most {args.max_prompt_tokens} tokens "
                        "among the corpus pool's first "
                        f"{args.pool} (its validation split), {args.max_new_tokens} new tokens, {target.weights} weights",
                    },
                    "holdout_fit": holdout,
                    "fit": report(table, W, parent_col=E3_PARENT),
                },
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
