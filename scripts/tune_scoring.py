"""Tune the DART pruner's score (weights of the head, the trie and the context n-gram) by exact replay.

    python scripts/tune_scoring.py --dataset ../shared/data/bench/*.jsonl --skip 10 --limit 10 [--max-nodes 5]

1. Decodes the prompts greedily once (by default prompts 11-20 of each file: the bench reports on the
   first 10), keeping what a drafter is given (dart_core/replay.py; `--records FILE` caches them).
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

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dart_core.bench import held_out_questions  # noqa: E402
from dart_core.drafters.dart import DartDrafter  # noqa: E402
from dart_core.drafters.registry import add_drafter_flags, build_drafter, check_drafter_flags  # noqa: E402
from dart_core.loading import DEFAULT_MODEL, DTYPE_CHOICES  # noqa: E402
from dart_core.replay import GreedyRecord, record_greedy, replay  # noqa: E402
from dart_core.target import load_target  # noqa: E402

# Values tried per PruneParams field (ngram_cpp/src/pruner.h has the score they enter)
GRID: dict[str, list] = {
    "level_exponent": [-1.0, -0.7, -0.4, 0.0, 0.4],
    "logit_decay": [0.6, 0.75, 0.9, 1.0, 1.15],
    "ngram_weight": [0.0, 0.25, 0.5, 0.75, 1.0],
    "context_weight": [0.5, 0.65, 0.8, 0.9, 1.0],
    "context_extend": [0, 2, 4, 6],
    "context_max_candidates": [1, 2, 4, 8],
    "ngram_on_first_level": [False, True],
    "beam_width": [10, 20, 40],
    "top_k": [10, 25, 50],
}


def load_records(path: Path) -> list[tuple[str, GreedyRecord]]:
    data = torch.load(path, weights_only=False)
    if not isinstance(data, list) or not all(isinstance(r, tuple) and isinstance(r[1], GreedyRecord) for r in data):
        raise SystemExit(f"{path}: not a list of (set, GreedyRecord) written by this script")
    return data


def evaluate(drafter: DartDrafter, records: list[tuple[str, GreedyRecord]], prune) -> dict:
    """τ overall and per set (tokens / target forwards, summed over the records), prune ms per step."""
    d = drafter.with_params(dataclasses.replace(drafter.params, prune=prune))
    tokens: dict[str, int] = {}
    steps: dict[str, int] = {}
    t0, n_steps = time.perf_counter(), 0
    for name, rec in records:
        r = replay(d, rec)
        tokens[name] = tokens.get(name, 0) + r.new_tokens
        steps[name] = steps.get(name, 0) + r.steps
        n_steps += len(r.accepted)
    return {
        "tau": sum(tokens.values()) / sum(steps.values()),
        "per_set": {n: tokens[n] / steps[n] for n in tokens},
        "ms_per_step": 1e3 * (time.perf_counter() - t0) / max(n_steps, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--dataset", type=Path, nargs="+", required=True, help="question.jsonl files (first turns)")
    p.add_argument("--skip", type=int, default=10, help="prompts skipped at the start of each file (the bench's)")
    p.add_argument("--limit", type=int, default=10, help="prompts used from each file after --skip")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--params", nargs="*", default=list(GRID), choices=list(GRID), metavar="FIELD",
                   help=f"PruneParams fields to search (default all: {', '.join(GRID)})")
    p.add_argument("--rounds", type=int, default=2, help="passes of coordinate ascent over --params (0: no search)")
    p.add_argument("--sizes", type=str, default="", help="after the search, τ of the flags' and the best weights at these tree sizes (e.g. 5,8,16,60)")
    p.add_argument("--records", type=Path, default=None, help="cache of the greedy records (written if absent, read if present)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES, help="the target's weights (gguf: the embedded default's own blocks)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="write every setting tried as JSON")
    add_drafter_flags(p)
    args = p.parse_args(argv)
    try:
        check_drafter_flags(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--sizes takes tree sizes separated by commas, got {args.sizes!r}") from None
    if args.limit < 1 or args.skip < 0 or args.rounds < 0 or any(n < 1 for n in sizes):
        raise SystemExit("--limit and --sizes must be >= 1, --rounds and --skip >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dart_ranking is None:
        args.dart_ranking = "score"  # the weights searched here are the score's (the fitted ranking ignores them)
    target = load_target(args.model, args.device, args.dtype)
    drafter = build_drafter("dart", target, args, default_target=args.model == DEFAULT_MODEL)
    if args.records is not None and args.records.exists():
        records = load_records(args.records)
        print(f"{len(records)} records from {args.records}", file=sys.stderr)
    else:
        try:
            questions = held_out_questions(args.dataset, args.skip, args.limit)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        records = []
        for name, q in questions:
            records.append((name, record_greedy(target, [{"role": "user", "content": q["turns"][0]}], args.max_new_tokens)))
            print(f"recorded {len(records)}: {name} {q['question_id']}", file=sys.stderr)
        if args.records is not None:
            args.records.parent.mkdir(parents=True, exist_ok=True)
            torch.save(records, args.records)

    tried: dict[str, dict] = {}

    def run(prune) -> float:
        key = json.dumps({f: getattr(prune, f) for f in GRID})
        if key not in tried:
            tried[key] = {"setting": json.loads(key), **evaluate(drafter, records, prune)}
            print(f"  τ {tried[key]['tau']:.3f}  {key}", file=sys.stderr)
        return tried[key]["tau"]

    start = drafter.params.prune
    best, best_tau = start, run(start)
    start_tau = best_tau
    for _ in range(args.rounds):
        improved = False
        for field in args.params:
            if field == "context_weight" and best.context_weight == 0:
                continue  # the context n-gram is off (--no-context-ngram): nothing to weigh
            for value in GRID[field]:
                cand = dataclasses.replace(best, **{field: value})
                tau = run(cand)
                if tau > best_tau + 1e-9:
                    best, best_tau, improved = cand, tau, True
        if not improved:
            break

    rows = sorted(tried.values(), key=lambda r: -r["tau"])
    names = list(rows[0]["per_set"])
    changed = lambda s: ", ".join(f"{f}={v}" for f, v in s.items() if getattr(start, f) != v) or "(the flags' values)"  # noqa: E731
    print(f"\n{len(records)} records, {drafter.max_nodes} drafted nodes, {len(tried)} settings\n")
    print("| setting | τ | " + " | ".join(names) + " | prune+draft ms/step |\n|---|---|" + "---|" * len(names) + "---|")
    for r in rows[:15]:
        print(f"| {changed(r['setting'])} | {r['tau']:.3f} | " + " | ".join(f"{r['per_set'][n]:.2f}" for n in names)
              + f" | {r['ms_per_step']:.2f} |")
    print(f"\nbest: {changed(rows[0]['setting'])} (τ {rows[0]['tau']:.3f} against {start_tau:.3f})")
    by_size = []
    if sizes:
        print("\nτ by tree size (drafted nodes):\n\n| weights | nodes | τ | " + " | ".join(names) + " |\n|---|---|---|" + "---|" * len(names))
        for label, prune in (("the flags'", start), ("best", best)) if best != start else (("the flags'", start),):
            for n in sizes:
                r = evaluate(drafter, records, dataclasses.replace(prune, max_nodes=n))
                by_size.append({"weights": label, "max_nodes": n, **r})
                print(f"| {label} | {n} | {r['tau']:.3f} | " + " | ".join(f"{r['per_set'][k]:.2f}" for k in names) + " |")
    if args.out:
        args.out.write_text(json.dumps({"records": len(records), "max_nodes": drafter.max_nodes,
                                        "start": {f: getattr(start, f) for f in GRID}, "settings": rows, "by_size": by_size}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
