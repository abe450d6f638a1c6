"""Choose tree settings by replay: `tree`, DART's tree size (and score floor) for this machine from one
logged run; `scoring`, the pruner's score weights by exact replay. The logic is dart_core/tools/tuning.py.

    dart-tune tree --dataset ../shared/data/bench/*.jsonl --skip 10 --limit 5 --cap 16
    dart-tune scoring --dataset ../shared/data/bench/*.jsonl --skip 10 --limit 10 [--max-nodes 5]

(dart-tune tree and dart-tune scoring are these two commands.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from ..drafters.config import default_max_nodes
from ..loading import DEFAULT_MODEL, DTYPES
from ..target import load_target
from ..tools import calibrate
from ..tools.bench import held_out_questions
from ..tools.replay import record_greedy
from ..tools.tuning import (
    GRID,
    VerifyTimes,
    evaluate,
    load_records,
    log_steps,
    save_records,
    search_weights,
    simulate,
    time_verify,
    tree_settings,
)
from .options import add_drafter_flags, add_target_flags, apply_threads, drafter_configs

TREE_DOC = """Choose DART's tree size (and score floor) for this machine and head from one logged run.

    dart-tune tree --dataset ../shared/data/bench/*.jsonl --skip 10 --limit 5 --cap 16 [--dart-model DIR]

1. Generates greedily with DART at `--cap` drafted nodes on held-out prompts (by default prompts 11-15
   of each file: the bench reports on the first 10) and logs every step's tree scores and accepted path.
   At temperature 0 the target's next token does not depend on the tree, so what a smaller tree cut
   from the same ranking (the best N nodes, or those above a score floor) would have accepted is
   known: the prefix of the accepted path that lies inside it.
2. Times the target's verify at every tree size 1..cap+1 on this machine (chains after the shortest,
   the median and the longest prompt, median of repeats) and charges each logged step the time
   interpolated at its own cache length (attention over a 1,400-token summary prompt costs more than
   over a 40-token question); drafting and the rest of a step cost what the logged run measured.
3. Prints the expected tokens/s and τ of every fixed size and of score floors
   (`--tree-min-score S --tree-min-nodes M --max-nodes N`), best first.

An estimate, not a measurement: it ignores that smaller trees draft a little faster (fewer head
rows) and that a step's tree depends on where the previous step ended. Confirm the choice with the
bench CLI in one interleaved run, e.g. `--methods ar,dart@5,dart@8`.
"""

SCORING_DOC = """Tune the DART pruner's score (weights of the head, the trie and the context n-gram) by exact replay.

    dart-tune scoring --dataset ../shared/data/bench/*.jsonl --skip 10 --limit 10 [--max-nodes 5]

1. Decodes the prompts greedily once (by default prompts 11-20 of each file: the bench reports on the
   first 10), keeping what a drafter is given (dart_core/tools/replay.py; `--records FILE` caches them).
2. Replays DART on every record for each setting: the real head forward and pruner at every step,
   the recorded continuation as the target's verdict. At temperature 0 on the CPU kernels this is
   the loop's own τ, step for step (tests/test_replay.py), in seconds of drafting per setting.
3. Searches one parameter at a time (coordinate ascent from the flags' values, `--rounds` passes)
   over the grid below, at the fixed tree size `--max-nodes`, and prints every setting tried with
   its τ, overall and per set, best first; `--sizes 5,8,16,60` then replays the flags' and the
   best weights at those tree sizes.

τ at a fixed tree size is the whole story only up to drafting and pruning time (a larger beam or
top-k prunes slower; the table shows the mean prune ms): confirm a choice with the bench CLI in one
interleaved run (tokens/s), on the bench's own prompts.
"""


HELD_OUT = 10  # prompts the bench reports on at the start of each file: the tuning skips them


def add_held_out_flags(p: argparse.ArgumentParser, limit: int) -> None:
    p.add_argument("--dataset", type=Path, nargs="+", required=True, help="question.jsonl files (first turns)")
    p.add_argument("--skip", type=int, default=HELD_OUT, help="prompts skipped at the start of each file (the bench's)")
    p.add_argument("--limit", type=int, default=limit, help="prompts used from each file after --skip")


def held_out_or_exit(args: argparse.Namespace) -> list[tuple[str, dict]]:
    try:
        return held_out_questions(args.dataset, args.skip, args.limit)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def dart_config_or_exit(args: argparse.Namespace):
    """DART's config from the flags, or exit naming the flag out of range."""
    try:
        return drafter_configs(args, args.model == DEFAULT_MODEL).dart
    except ValueError as e:
        raise SystemExit(str(e)) from None


def read_records(path: Path):
    """The cached greedy records (--records), or exit naming the file."""
    try:
        return load_records(path)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def tree_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dart-tune tree",
        description=TREE_DOC.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=TREE_DOC.split("\n\n", 1)[1],
    )
    add_held_out_flags(p, limit=5)
    p.add_argument("--cap", type=int, default=16, help="drafted nodes of the logged trees (the largest size considered)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_target_flags(p, dtype_choices=list(DTYPES), device="cpu")
    p.add_argument("--out", type=Path, default=None, help="write the logged steps' summary and every setting's estimate as JSON")
    add_drafter_flags(p)
    args = p.parse_args(argv)
    config = dart_config_or_exit(args)
    if args.cap < 1 or args.limit < 1 or args.skip < 0:
        raise SystemExit("--cap and --limit must be >= 1, --skip >= 0")
    apply_threads(args)
    default_nodes = default_max_nodes(args.device)
    target = load_target(args.model, args.device, args.dtype)
    drafter = calibrate.build_measured(
        "dart", target, dataclasses.replace(config, max_nodes=args.cap, min_score=None)
    )  # full trees; the settings are simulated
    questions = held_out_or_exit(args)
    prompts = [(name, target.encode([{"role": "user", "content": q["turns"][0]}])) for name, q in questions]
    print(f"logging {len(prompts)} prompts at {args.cap} nodes", file=sys.stderr)
    steps = log_steps(target, drafter, prompts, args.max_new_tokens)
    by_len = sorted((ids for _, ids in prompts), key=len)
    timed = {len(ids): ids for ids in (by_len[0], by_len[len(by_len) // 2], by_len[-1])}
    verify_s = VerifyTimes({n: time_verify(target, ids, range(1, args.cap + 2)) for n, ids in timed.items()})
    results = tree_settings(steps, verify_s, args.cap)
    fixed = [r for r in results if len(r[0]) == 1]

    def row(setting, tps, tau):
        flags = f"--max-nodes {setting['max_nodes']}"
        if "min_score" in setting:
            flags += f" --tree-min-score {setting['min_score']} --tree-min-nodes {setting['min_nodes']}"
        return f"| `{flags}` | {tps:.1f} | {tau:.2f} |"

    print(f"{len(steps)} steps logged; verify ms by tree size (root included), after")
    for n in verify_s.lengths:
        print(f"  {n} cached tokens: " + ", ".join(f"{k}: {1e3 * v:.1f}" for k, v in verify_s.by_length[n].items()))
    print("\n| setting | est. tokens/s | τ |\n|---|---|---|")
    for r in results[:10]:
        print(row(*r))
    names = list(dict.fromkeys(s.dataset for s in steps))
    print("\nper set (τ):\n\n| setting | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for setting, _, _ in results[:3] + [r for r in fixed if r[0]["max_nodes"] == default_nodes]:
        taus = [simulate([s for s in steps if s.dataset == n], verify_s, **setting)[1] for n in names]
        print(row(setting, 0, 0).split(" |")[0] + " | " + " | ".join(f"{t:.2f}" for t in taus) + " |")
    print("\nfixed sizes:\n\n| setting | est. tokens/s | τ |\n|---|---|---|")
    for r in sorted(fixed, key=lambda r: r[0]["max_nodes"]):
        print(row(*r))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "steps": len(steps),
                    "cap": args.cap,
                    "verify_ms": {n: {k: 1e3 * v for k, v in t.items()} for n, t in verify_s.by_length.items()},
                    "fixed_ms_per_step": 1e3 * statistics.mean(s.fixed_s for s in steps) if steps else None,
                    "settings": [
                        {
                            "setting": s,
                            "tokens_per_s": tps,
                            "tau": tau,
                            "tau_per_set": {n: simulate([x for x in steps if x.dataset == n], verify_s, **s)[1] for n in names},
                        }
                        for s, tps, tau in results
                    ],
                },
                indent=1,
            )
            + "\n"
        )
    return 0


def scoring_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dart-tune scoring",
        description=SCORING_DOC.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SCORING_DOC.split("\n\n", 1)[1],
    )
    add_held_out_flags(p, limit=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--params",
        nargs="*",
        default=list(GRID),
        choices=list(GRID),
        metavar="FIELD",
        help=f"PruneParams fields to search (default all: {', '.join(GRID)})",
    )
    p.add_argument("--rounds", type=int, default=2, help="passes of coordinate ascent over --params (0: no search)")
    p.add_argument(
        "--sizes", type=str, default="", help="after the search, τ of the flags' and the best weights at these tree sizes (e.g. 5,8,16,60)"
    )
    p.add_argument("--records", type=Path, default=None, help="cache of the greedy records (written if absent, read if present)")
    add_target_flags(p, device="cpu")
    p.add_argument("--out", type=Path, default=None, help="write every setting tried as JSON")
    add_drafter_flags(p)
    args = p.parse_args(argv)
    config = dart_config_or_exit(args)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--sizes takes tree sizes separated by commas, got {args.sizes!r}") from None
    if args.limit < 1 or args.skip < 0 or args.rounds < 0 or any(n < 1 for n in sizes):
        raise SystemExit("--limit and --sizes must be >= 1, --rounds and --skip >= 0")
    apply_threads(args)
    if config.ranking is None:
        config = dataclasses.replace(config, ranking="score")  # the weights searched here are the score's (the fitted ranking ignores them)
    target = load_target(args.model, args.device, args.dtype)
    drafter = calibrate.build_measured("dart", target, config)
    if args.records is not None and args.records.exists():
        records = read_records(args.records)
        print(f"{len(records)} records from {args.records}", file=sys.stderr)
    else:
        questions = held_out_or_exit(args)
        records = []
        for name, q in questions:
            records.append((name, record_greedy(target, [{"role": "user", "content": q["turns"][0]}], args.max_new_tokens)))
            print(f"recorded {len(records)}: {name} {q['question_id']}", file=sys.stderr)
        if args.records is not None:
            save_records(records, args.records)

    start = drafter.params.prune
    tried, best = search_weights(drafter, records, args.params, args.rounds, lambda m: print(m, file=sys.stderr))
    start_tau = tried[json.dumps({f: getattr(start, f) for f in GRID})]["tau"]

    rows = sorted(tried.values(), key=lambda r: -r["tau"])
    names = list(rows[0]["per_set"])
    changed = lambda s: ", ".join(f"{f}={v}" for f, v in s.items() if getattr(start, f) != v) or "(the flags' values)"  # noqa: E731
    print(f"\n{len(records)} records, {drafter.max_nodes} drafted nodes, {len(tried)} settings\n")
    print("| setting | τ | " + " | ".join(names) + " | prune+draft ms/step |\n|---|---|" + "---|" * len(names) + "---|")
    for r in rows[:15]:
        print(
            f"| {changed(r['setting'])} | {r['tau']:.3f} | "
            + " | ".join(f"{r['per_set'][n]:.2f}" for n in names)
            + f" | {r['ms_per_step']:.2f} |"
        )
    print(f"\nbest: {changed(rows[0]['setting'])} (τ {rows[0]['tau']:.3f} against {start_tau:.3f})")
    by_size = []
    if sizes:
        print(
            "\nτ by tree size (drafted nodes):\n\n| weights | nodes | τ | " + " | ".join(names) + " |\n|---|---|---|" + "---|" * len(names)
        )
        for label, prune in (("the flags'", start), ("best", best)) if best != start else (("the flags'", start),):
            for n in sizes:
                r = evaluate(drafter, records, dataclasses.replace(prune, max_nodes=n))
                by_size.append({"weights": label, "max_nodes": n, **r})
                print(f"| {label} | {n} | {r['tau']:.3f} | " + " | ".join(f"{r['per_set'][k]:.2f}" for k in names) + " |")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "records": len(records),
                    "max_nodes": drafter.max_nodes,
                    "start": {f: getattr(start, f) for f in GRID},
                    "settings": rows,
                    "by_size": by_size,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


COMMANDS = {"tree": tree_main, "scoring": scoring_main}


def main(argv: list[str] | None = None) -> int:
    """`dart-tune tree|scoring FLAGS...`"""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])
