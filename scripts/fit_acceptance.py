"""Fit the DART pruner's ranking: a calibrated model of P(node accepted) per tree level, by exact replay.

    python scripts/fit_acceptance.py --records ~/.cache/dart-demo/acceptance/train-val-gguf.pt \\
        --prompts 200 --dtype gguf --threads 1 --out assets/dart/acceptance.json

1. Decodes training prompts greedily once (`--records FILE` caches them; dart_core/replay.py): the
   first prompts of the self-distilled corpus's pool (dart_core.corpus.prompt_pool over `--data`,
   the bench sets excluded, seed 0), which are its validation split: no head was trained on them,
   and no bench prompt is among them. Prompts longer than `--max-prompt-tokens` are skipped.
2. Replays DART on every record (the embedded head and trie, the hand-weighted score at
   `--collect-nodes` nodes choosing the steps). At every step it walks the target's true
   continuation from the root: for each level, the candidates the pruner would give the true parent
   there (the head's top-k row, the context's candidates) with the features the C++ pruner computes
   (ngram_cpp/reference.py candidate_features, the executable copy of pruner.cpp's), labelled 1 for
   the target's next token. Where no candidate is the target's token the walk ends: deeper nodes
   could never be accepted.
3. Fits one logistic regression per level (the last row shared by the levels past the head's rows),
   level by level, since a row's parent features are the previous level's output: P(token is the
   target's next | its parent path is). A node's tree score is then the sum of ln P along its path,
   ln P(node accepted). Reports the log-loss and a reliability table on the last `--holdout` share
   of the prompts (fitted without them), then refits on all and writes the weights, the command and
   the fit's numbers to `--out`.

`--evaluate RECORDS` replays the score and the fitted ranking (and the adaptive tree, with this
machine's forward costs by rows from dart_core/calibrate.py) on other records, e.g. held-out prompts
11-20 of the bench sets (scripts/tune_scoring.py --records writes them), and prints τ by tree size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ngram_cpp  # noqa: E402
from ngram_cpp.reference import ACCEPTANCE_FEATURES, FEATURE_NAMES, candidate_features, log_sigmoid  # noqa: E402

TRAIN_DATA = ["code-alpaca-2k.json", "gpteacher-codegen.json", "gpteacher-roleplay.json", "gpteacher-toolformer.json",
              "sharegpt.jsonl", "t0-prompts.jsonl", "user-oriented-instructions.jsonl"]
BENCH_SETS = ["alpaca", "gsm8k", "humaneval", "mt_bench", "qa", "sum"]
PARENT_INC, PARENT_SCORE = FEATURE_NAMES.index("parent's increment"), FEATURE_NAMES.index("parent's score")


# ------------------------------------------------------------------------------ the data


def record_training_prompts(target, data: list[str], exclude: list[str], n: int, max_prompt_tokens: int, max_new: int, pool_size: int):
    """Greedy records of the first `n` pool prompts (of the first `pool_size`: the corpus's
    validation split) that fit `max_prompt_tokens`."""
    from dart_core.corpus import prompt_pool
    from dart_core.replay import record_greedy

    records = []
    for i, pp in enumerate(prompt_pool(data, exclude, seed=0)[:pool_size]):
        if len(target.encode(pp.messages)) > max_prompt_tokens:
            continue
        records.append((pp.source, record_greedy(target, pp.messages, max_new)))
        print(f"recorded {len(records)}: pool prompt {i} ({pp.source})", file=sys.stderr)
        if len(records) >= n:
            break
    return records


class _CollectingSession:
    """A DART session that, at each step, also collects the true path's candidate features."""

    def __init__(self, owner: "Collector", session):
        self.owner, self.s, self.pos = owner, session, None

    def extend(self, ids, hidden) -> None:
        self.pos = 0 if self.pos is None else self.pos + len(ids)  # the prompt first, then what each step commits
        self.s.extend(ids, hidden)

    def propose(self, root: int, max_nodes: int):
        prop = self.s.propose(root, max_nodes)
        self.owner.collect(prop.info, root, list(self.s.committed), self.s.index, self.owner.output[self.pos + 1:])
        return prop


class Collector:
    """Wraps a DartDrafter for replay(); `steps` gets, per step, per level: (features [n, F], the
    target's token's row or -1)."""

    def __init__(self, drafter, feature_params):
        self.d, self.params = drafter, feature_params
        self.name, self.needs_hidden, self.max_nodes = drafter.name, drafter.needs_hidden, drafter.max_nodes
        self.steps: list[list[tuple[np.ndarray, int]]] = []
        self.output: list[int] = []
        self.trie = drafter.ngram._impl if drafter.ngram is not None else None

    def new_session(self, capacity: int):
        return _CollectingSession(self, self.d.new_session(capacity))

    def collect(self, info, root, committed, index, truth) -> None:
        tokens, probs = np.asarray(info["topk_tokens"], dtype=np.int64), np.asarray(info["topk_probs"], dtype=np.float32)
        levels, path = [], []
        for want in truth:
            toks, _, xs = candidate_features(tokens, probs, root, committed, self.trie, self.params, index, path)
            if not toks:
                break
            hit = toks.index(want) if want in toks else -1
            levels.append((np.asarray(xs, dtype=np.float64), hit))
            if hit < 0:
                break  # no deeper node of this step can be accepted
            path.append(want)
        self.steps.append(levels)


def collect(drafter, feature_params, records) -> list[tuple[str, list]]:
    """(set, its steps' levels) per record."""
    from dart_core.replay import replay

    out = []
    for name, rec in records:
        c = Collector(drafter, feature_params)
        c.output = rec.output_ids
        replay(c, rec)
        out.append((name, c.steps))
    return out


# ------------------------------------------------------------------------------ the fit


def logistic(X: np.ndarray, y: np.ndarray, l2: float, iters: int = 50) -> np.ndarray:
    """Ridge-penalised logistic regression by Newton's method (the bias unpenalised)."""
    w = np.zeros(X.shape[1])
    pen = np.full(X.shape[1], l2)
    pen[0] = 0.0
    for _ in range(iters):
        z = X @ w
        p = 1.0 / (1.0 + np.exp(-z))
        g = X.T @ (p - y) + pen * w
        H = (X * (p * (1 - p))[:, None]).T @ X + np.diag(pen + 1e-9)
        step = np.linalg.solve(H, g)
        w -= step
        if np.max(np.abs(step)) < 1e-8:
            break
    return w


def level_rows(steps: list[list], weights: np.ndarray | None, n_rows: int):
    """Per weight row r: (X, y) of every collected level it scores, with the parent features filled
    from `weights` (the true parent's increment and score; rows not yet fitted give 0)."""
    X = [[] for _ in range(n_rows)]
    y = [[] for _ in range(n_rows)]
    for levels in steps:
        inc = score = 0.0
        for lvl, (xs, hit) in enumerate(levels):
            r = min(lvl, n_rows - 1)
            xs = xs.copy()
            xs[:, PARENT_INC], xs[:, PARENT_SCORE] = inc, score
            X[r].append(xs)
            lab = np.zeros(len(xs))
            if hit >= 0:
                lab[hit] = 1.0
            y[r].append(lab)
            if hit < 0:
                break
            z = float(xs[hit] @ weights[r]) if weights is not None else 0.0
            inc = log_sigmoid(z)
            score += inc
    return [(np.concatenate(a) if a else np.zeros((0, ACCEPTANCE_FEATURES)), np.concatenate(b) if b else np.zeros(0)) for a, b in zip(X, y)]


def fit(steps: list[list], n_rows: int, l2: float, passes: int = 3) -> np.ndarray:
    """Weights [n_rows, F], fitted row by row (a row's parent features come from the rows before it;
    the last row, shared by the deeper levels, feeds itself, hence a few passes)."""
    W = np.zeros((n_rows, ACCEPTANCE_FEATURES))
    for _ in range(passes):
        for r in range(n_rows):
            X, y = level_rows(steps, W, n_rows)[r]
            if len(y) and 0 < y.sum() < len(y):
                W[r] = logistic(X, y, l2)
    return W


def report(steps: list[list], W: np.ndarray) -> dict:
    """Log-loss per weight row and a reliability table (predicted against observed acceptance rate)."""
    rows = level_rows(steps, W, len(W))
    out = {"per_row": [], "reliability": []}
    allp, ally = [], []
    for r, (X, y) in enumerate(rows):
        if not len(y):
            continue
        p = np.clip(1.0 / (1.0 + np.exp(-(X @ W[r]))), 1e-12, 1 - 1e-12)
        base = np.clip(y.mean(), 1e-12, 1 - 1e-12)
        out["per_row"].append({"row": r, "candidates": int(len(y)), "accepted": int(y.sum()),
                               "log_loss": float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))),
                               "log_loss_constant": float(-np.mean(y * np.log(base) + (1 - y) * np.log(1 - base)))})
        allp.append(p)
        ally.append(y)
    p, y = np.concatenate(allp), np.concatenate(ally)
    for lo, hi in [(0, 0.01), (0.01, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 0.95), (0.95, 1.0001)]:
        m = (p >= lo) & (p < hi)
        if m.any():
            out["reliability"].append({"predicted": [lo, min(hi, 1.0)], "candidates": int(m.sum()), "mean_predicted": float(p[m].mean()),
                                       "observed": float(y[m].mean())})
    return out


# ------------------------------------------------------------------------------ evaluation


def evaluate(drafter, records, sizes: list[int], ranking, costs_ms: dict[int, float] | None, draft_ms: float) -> list[dict]:
    """τ (and the expected tokens/s from this machine's forward cost by rows, where given) of the
    score, the fitted ranking and the adaptive fitted tree at each size, by exact replay."""
    from dart_core.drafters.dart import DartParams, with_fitted_ranking
    from dart_core.replay import replay

    base = drafter.params
    fitted_params = DartParams(with_fitted_ranking(base.prune, ranking), base.depth, ranking.context_order)
    variants = [("score", base), ("fitted", fitted_params)]
    if costs_ms:
        top = max(costs_ms)
        row_costs = tuple(costs_ms[r] + draft_ms for r in range(1, top + 1))
        variants.append(("fitted+adaptive", dataclasses.replace(fitted_params, prune=dataclasses.replace(fitted_params.prune, row_costs=row_costs))))
    out = []
    for label, params in variants:
        for n in sizes:
            if label == "fitted+adaptive" and n + 1 > max(costs_ms):
                continue
            d = drafter.with_params(dataclasses.replace(params, prune=dataclasses.replace(params.prune, max_nodes=n)))
            tokens: dict[str, int] = {}
            steps: dict[str, int] = {}
            ms, nodes, n_steps = 0.0, 0, 0
            for name, rec in records:
                r = replay(d, rec)
                tokens[name] = tokens.get(name, 0) + r.new_tokens
                steps[name] = steps.get(name, 0) + r.steps
                nodes += sum(r.tree_sizes)
                n_steps += len(r.tree_sizes)
                if costs_ms:
                    ms += sum(costs_ms.get(k + 1, math.nan) + draft_ms for k in r.tree_sizes) + costs_ms[1]  # the prefill as a step
            row = {"ranking": label, "max_nodes": n, "tau": sum(tokens.values()) / sum(steps.values()),
                   "per_set": {k: tokens[k] / steps[k] for k in tokens}, "mean_nodes": nodes / max(n_steps, 1)}
            if costs_ms:
                row["est_tokens_per_s"] = 1e3 * sum(tokens.values()) / ms
            out.append(row)
            print(f"  {label:16s} {n:3d} nodes: τ {row['tau']:.3f}  mean tree {row['mean_nodes']:.1f}"
                  + (f"  est. {row['est_tokens_per_s']:.1f} tok/s" if costs_ms else ""), file=sys.stderr)
    return out


# ------------------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    from dart_core.drafters.dart import CONTEXT_ORDER, load_fitted_ranking
    from dart_core.drafters.registry import add_drafter_flags, build_drafter, check_drafter_flags, resolve_ngram
    from dart_core.loading import DEFAULT_MODEL, DTYPE_CHOICES
    from dart_core.target import load_target
    from tune_scoring import load_records

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--data", nargs="+", default=[f"../shared/data/train/{f}" for f in TRAIN_DATA], help="training files (the corpus's)")
    p.add_argument("--exclude", nargs="+", default=[f"../shared/data/bench/{b}.jsonl" for b in BENCH_SETS], help="question files never used")
    p.add_argument("--prompts", type=int, default=200, help="training prompts to record")
    p.add_argument("--pool", type=int, default=300, help="take prompts from the pool's first N (the corpus's validation split)")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--records", type=Path, default=None, help="cache of the training records (written if absent, read if present)")
    p.add_argument("--collect-nodes", type=int, default=16, help="tree size of the replay whose steps are collected")
    p.add_argument("--rows", type=int, default=6, help="weight rows: one per level, the last shared by deeper levels")
    p.add_argument("--l2", type=float, default=1.0)
    p.add_argument("--holdout", type=float, default=0.2, help="share of the prompts (the last ones) the reported fit leaves out")
    p.add_argument("--out", type=Path, default=None, help="the fitted ranking (JSON), e.g. assets/dart/acceptance.json")
    p.add_argument("--evaluate", type=Path, default=None, help="records to replay the score and the fitted ranking on (no fit)")
    p.add_argument("--ranking", type=Path, default=None, help="--evaluate: the fitted ranking's directory (default: the head's)")
    p.add_argument("--sizes", default="5,8,16,60", help="--evaluate: tree sizes")
    p.add_argument("--costs", type=Path, default=None,
                   help="--evaluate: a forward-cost file of dart_core/calibrate.py's cache (~/.cache/dart-demo/calibration/forwards-*.json) "
                        "to estimate tokens/s and size adaptive trees with (default: this process's forward_costs at --threads)")
    p.add_argument("--draft-ms", type=float, default=None, help="--evaluate: drafting ms per step added to every step's cost (default: timed here)")
    p.add_argument("--eval-out", type=Path, default=None, help="--evaluate: write the table as JSON")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="gguf", choices=DTYPE_CHOICES)
    p.add_argument("--threads", type=int, default=None)
    add_drafter_flags(p)
    args = p.parse_args(argv)
    try:
        check_drafter_flags(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, "cpu", args.dtype)
    default_target = args.model == DEFAULT_MODEL
    args.dart_ranking = "score"  # the replays that collect and the baseline rank by the hand-weighted score

    if args.evaluate is not None:
        from dart_core import calibrate
        from dart_core.drafters import DEFAULT_DART_HEAD

        sizes = [int(x) for x in args.sizes.split(",")]
        args.max_nodes = max(sizes)
        drafter = build_drafter("dart", target, args, default_target=default_target)
        ranking = load_fitted_ranking(args.ranking or args.dart_model or DEFAULT_DART_HEAD)
        if ranking is None:
            raise SystemExit("no fitted ranking to evaluate (--ranking DIR with an acceptance.json)")
        records = load_records(args.evaluate)
        if args.costs is not None:
            data = json.loads(args.costs.read_text())
            costs_ms, costs_from = {int(k): float(v) for k, v in data["ms"].items()}, {"file": str(args.costs), **data["key"],
                                                                                         "measured_at": data["measured_at"]}
        else:
            c = calibrate.forward_costs(target, args.threads)
            costs_ms, costs_from = c.ms, {**c.key, "measured_at": c.measured_at}
        draft = args.draft_ms
        if draft is None:
            from dart_core.replay import record_greedy

            rec = record_greedy(target, [{"role": "user", "content": calibrate.OVERHEAD_PROMPT}], calibrate.OVERHEAD_TOKENS)
            draft = calibrate.drafting_ms(drafter, rec, [8])[8]
        print(f"{len(records)} records; forward ms by rows {', '.join(f'{k}: {v:.1f}' for k, v in costs_ms.items())}; drafting {draft:.2f} ms",
              file=sys.stderr)
        rows = evaluate(drafter, records, sizes, ranking, costs_ms, draft)
        names = list(rows[0]["per_set"])
        print("\n| ranking | max nodes | mean nodes | τ | " + " | ".join(names) + " | est. tok/s |\n|---|---|---|---|" + "---|" * len(names) + "---|")
        for r in rows:
            print(f"| {r['ranking']} | {r['max_nodes']} | {r['mean_nodes']:.1f} | {r['tau']:.3f} | " + " | ".join(f"{r['per_set'][k]:.2f}" for k in names)
                  + f" | {r.get('est_tokens_per_s', float('nan')):.1f} |")
        if args.eval_out:
            args.eval_out.write_text(json.dumps({"records": str(args.evaluate), "forward_ms": costs_ms, "costs": costs_from, "draft_ms": draft, "rows": rows}, indent=1) + "\n")
        return 0

    args.max_nodes = args.collect_nodes
    drafter = build_drafter("dart", target, args, default_target=default_target)
    if args.records is not None and args.records.exists():
        records = load_records(args.records)
        print(f"{len(records)} records from {args.records}", file=sys.stderr)
    else:
        records = record_training_prompts(target, args.data, args.exclude, args.prompts, args.max_prompt_tokens, args.max_new_tokens, args.pool)
        if args.records is not None:
            args.records.parent.mkdir(parents=True, exist_ok=True)
            torch.save(records, args.records)
    prune = drafter.params.prune
    trie = resolve_ngram(args, default_target, target)
    if trie is None:
        raise SystemExit("the fitted ranking's features include the trie's probability: fit it with the n-gram model in use")
    feature_params = dataclasses.replace(prune, acceptance=(0.0,) * ACCEPTANCE_FEATURES)  # the fitted ranking's features
    t0 = time.perf_counter()
    data = collect(drafter, feature_params, records)
    steps = [s for _, rec_steps in data for s in rec_steps]
    print(f"collected {len(steps)} steps, {sum(len(lv) for s in steps for lv, _ in s)} candidates in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    cut = int(round(len(data) * (1 - args.holdout)))
    fit_steps = [s for _, rs in data[:cut] for s in rs]
    held_steps = [s for _, rs in data[cut:] for s in rs]
    W_fit = fit(fit_steps, args.rows, args.l2)
    held = report(held_steps, W_fit) if held_steps else None
    if held:
        print(json.dumps(held, indent=1), file=sys.stderr)
    W = fit(steps, args.rows, args.l2)
    if args.out:
        command = "python scripts/fit_acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(json.dumps({
            "format": "dart-acceptance/1",
            "command": command,
            "what": "P(a tree node's token is the target's next | its parent's path is), a logistic regression per level (row r scores "
                    "level r, the last row every deeper one) on the features below; read by ngram_cpp's pruner (ngram_cpp/src/pruner.h)",
            "trie": trie.name if trie is not None else None,
            "features": list(FEATURE_NAMES),
            "weights": [[round(float(w), 6) for w in row] for row in W],
            "tree": {"top_k": prune.top_k, "context_max_candidates": prune.context_max_candidates, "context_extend": prune.context_extend,
                     "context_order": drafter.params.context_order if drafter.params.context_order else CONTEXT_ORDER,
                     "collected_at_nodes": args.collect_nodes, "beam_width": prune.beam_width},
            "data": {"records": len(records), "sets": sorted({n for n, _ in records}), "steps": len(steps),
                     "prompts": f"the first {args.prompts} prompts of at most {args.max_prompt_tokens} tokens among the corpus pool's first "
                                f"{args.pool} (its validation split), {args.max_new_tokens} new tokens, {target.weights} weights"},
            "holdout_fit": {"prompts_left_out": len(data) - cut, **(held or {})},
            "fit": report(steps, W),
        }, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
