"""Fit the DART pruner's ranking: a calibrated model of P(node accepted) per tree level, by exact replay.

    python scripts/fit_acceptance.py --records ~/.cache/dart-demo/acceptance/train-val-gguf.pt \\
        --prompts 200 --dtype gguf --threads 1 --out assets/dart/acceptance.json

1. Decodes training prompts greedily once (`--records FILE` caches them; dart_core/replay.py): the
   first prompts of the self-distilled corpus's pool (dart_core.corpus.prompt_pool over `--data`,
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
from ngram_cpp.reference import ACCEPTANCE_FEATURES, FEATURE_NAMES, pool_features  # noqa: E402

TRAIN_DATA = ["code-alpaca-2k.json", "gpteacher-codegen.json", "gpteacher-roleplay.json", "gpteacher-toolformer.json",
              "sharegpt.jsonl", "t0-prompts.jsonl", "user-oriented-instructions.jsonl"]
BENCH_SETS = ["alpaca", "gsm8k", "humaneval", "mt_bench", "qa", "sum"]
PARENT_FIT = FEATURE_NAMES.index("parent's fitted ln P")


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
    """A DART session that, at each step, also collects the search's nodes with their features."""

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
    """Wraps a DartDrafter for replay(); `steps` gets, per step, the search's `keep` best nodes by
    score (a set closed under taking parents) as (depth [n], parent row or -1 [n], features [n, F],
    accepted [n])."""

    def __init__(self, drafter, feature_params, keep: int):
        self.d, self.params, self.keep = drafter, feature_params, keep
        self.name, self.needs_hidden, self.max_nodes = drafter.name, drafter.needs_hidden, drafter.max_nodes
        self.steps: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.output: list[int] = []
        self.trie = drafter.ngram._impl if drafter.ngram is not None else None

    def new_session(self, capacity: int):
        return _CollectingSession(self, self.d.new_session(capacity))

    def collect(self, info, root, committed, index, truth) -> None:
        tokens, probs = np.asarray(info["topk_tokens"], dtype=np.int64), np.asarray(info["topk_probs"], dtype=np.float32)
        pool = pool_features(tokens, probs, root, committed, self.trie, self.params, index, self.d.eos_id)
        score = np.array([x[FEATURE_NAMES.index("score")] for _, _, _, x in pool])
        depth = np.array([dep for _, _, dep, _ in pool])
        # the best `keep` by (score, depth, expansion order): the nodes a cut at up to `keep` can hold
        order = np.lexsort((np.arange(len(pool)), depth, -score))[: self.keep]
        row = {int(n): r for r, n in enumerate(sorted(order.tolist()))}
        kept = sorted(row)
        acc = np.zeros(len(pool), dtype=bool)
        for n, (tok, parent, dep, _) in enumerate(pool):  # parents come before their children
            acc[n] = dep - 1 < len(truth) and tok == truth[dep - 1] and (parent < 0 or acc[parent])
        self.steps.append((depth[kept], np.array([row[pool[n][1]] if pool[n][1] >= 0 else -1 for n in kept]),
                           np.array([pool[n][3] for n in kept], dtype=np.float64), acc[kept].astype(np.float64)))


class _Eagle3CollectingSession(_CollectingSession):
    def propose(self, root: int, max_nodes: int):
        self.s.collect = True
        prop = self.s.propose(root, max_nodes)
        self.owner.collect_pool(self.s.last_pool, self.owner.output[self.pos + 1:])
        return prop


class Eagle3Collector:
    """As Collector, for an Eagle3Drafter: its search's pool (the `keep` best by cumulative
    log-probability, a set closed under taking parents) with the fitted ranking's features."""

    def __init__(self, drafter, keep: int):
        self.d, self.keep = drafter, keep
        self.name, self.needs_hidden, self.max_nodes = drafter.name, drafter.needs_hidden, drafter.max_nodes
        self.steps: list = []
        self.output: list[int] = []

    def new_session(self, capacity: int):
        return _Eagle3CollectingSession(self, self.d.new_session(capacity))

    def collect_pool(self, pool, truth) -> None:
        tokens, parents, depth, feats = pool
        score = np.array([x[1] for x in feats])
        depth = np.array(depth)
        order = np.lexsort((np.arange(len(tokens)), depth, -score))[: self.keep]
        kept = sorted(order.tolist())
        row = {n: r for r, n in enumerate(kept)}
        acc = np.zeros(len(tokens), dtype=bool)
        for n in range(len(tokens)):
            acc[n] = depth[n] - 1 < len(truth) and tokens[n] == truth[depth[n] - 1] and (parents[n] < 0 or acc[parents[n]])
        self.steps.append((depth[kept], np.array([row[parents[n]] if parents[n] >= 0 else -1 for n in kept]),
                           np.array([feats[n] for n in kept], dtype=np.float64), acc[kept].astype(np.float64)))


def collect(drafter, feature_params, records, keep: int) -> list[tuple[str, list]]:
    """(set, its steps) per record."""
    from dart_core.replay import replay

    out = []
    for name, rec in records:
        c = Collector(drafter, feature_params, keep) if feature_params is not None else Eagle3Collector(drafter, keep)
        c.output = rec.output_ids
        replay(c, rec)
        out.append((name, c.steps))
    return out


def stack(steps) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The steps' nodes as one table, parents as global row indices."""
    depth, parent, X, y, off = [], [], [], [], 0
    for d, par, x, acc in steps:
        depth.append(d)
        parent.append(np.where(par >= 0, par + off, -1))
        X.append(x)
        y.append(acc)
        off += len(d)
    return np.concatenate(depth), np.concatenate(parent), np.concatenate(X), np.concatenate(y)


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


def log_sigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


def fitted_values(table, W: np.ndarray, parent_col: int = PARENT_FIT) -> tuple[np.ndarray, np.ndarray]:
    """(features with the parent's fitted value filled in, fitted ln P) of every node under W, depth
    by depth (parents first), as the pruner computes them."""
    depth, parent, X, _ = table
    X = X.copy()
    fit = np.zeros(len(depth))
    for dep in range(1, int(depth.max()) + 1):
        m = depth == dep
        X[m, parent_col] = np.where(parent[m] >= 0, fit[np.maximum(parent[m], 0)], 0.0)
        r = min(dep - 1, len(W) - 1)
        own = log_sigmoid(X[m] @ W[r])
        fit[m] = np.minimum(own, np.where(parent[m] >= 0, X[m, parent_col], 0.0))
    return X, fit


def fit(table, n_rows: int, l2: float, passes: int = 3, parent_col: int = PARENT_FIT) -> np.ndarray:
    """Weights [n_rows, F], fitted row by row (a row's parent feature comes from the rows before it;
    the last row, shared by the deeper levels, feeds itself, hence a few passes)."""
    depth, _, X0, y = table
    W = np.zeros((n_rows, X0.shape[1]))
    for _ in range(passes):
        for r in range(n_rows):
            X, _ = fitted_values(table, W, parent_col)
            m = (depth - 1 == r) if r < n_rows - 1 else (depth - 1 >= r)
            if m.any() and 0 < y[m].sum() < m.sum():
                W[r] = logistic(X[m], y[m], l2)
    return W


def report(table, W: np.ndarray, parent_col: int = PARENT_FIT) -> dict:
    """Log-loss per weight row (against a constant rate) and a reliability table of the fitted
    P(accepted) (its mean against the observed rate, in bins)."""
    depth, _, X, y = table
    X, fit = fitted_values(table, W, parent_col)
    p = np.clip(np.exp(fit), 1e-12, 1 - 1e-12)
    out = {"per_row": [], "reliability": []}
    for r in range(len(W)):
        m = (depth - 1 == r) if r < len(W) - 1 else (depth - 1 >= r)
        if not m.any():
            continue
        base = np.clip(y[m].mean(), 1e-12, 1 - 1e-12)
        out["per_row"].append({"row": r, "nodes": int(m.sum()), "accepted": int(y[m].sum()),
                               "log_loss": float(-np.mean(y[m] * np.log(p[m]) + (1 - y[m]) * np.log(1 - p[m]))),
                               "log_loss_constant": float(-np.mean(y[m] * np.log(base) + (1 - y[m]) * np.log(1 - base)))})
    for lo, hi in [(0, 0.01), (0.01, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 0.95), (0.95, 1.0001)]:
        m = (p >= lo) & (p < hi)
        if m.any():
            out["reliability"].append({"predicted": [lo, min(hi, 1.0)], "nodes": int(m.sum()), "mean_predicted": round(float(p[m].mean()), 4),
                                       "observed": round(float(y[m].mean()), 4)})
    return out


# ------------------------------------------------------------------------------ evaluation


def evaluate_eagle3(drafter, records, sizes: list[int], weights: tuple) -> list[dict]:
    """τ of EAGLE3's cumulative log-probability and of its fitted ranking at each size, by exact replay."""
    from dart_core.drafters.eagle3 import Eagle3Drafter
    from dart_core.replay import replay

    out = []
    for label, w in (("score", ()), ("fitted", weights)):
        for n in sizes:
            d = Eagle3Drafter.__new__(Eagle3Drafter)
            d.__dict__.update(drafter.__dict__)  # the same loaded head and kernel weights
            d.params = dataclasses.replace(drafter.params, max_nodes=n, ranking=w)
            d.max_nodes = n
            t0 = time.perf_counter()
            runs = [(name, replay(d, rec)) for name, rec in records]
            tokens: dict[str, int] = {}
            steps: dict[str, int] = {}
            for name, r in runs:
                tokens[name] = tokens.get(name, 0) + r.new_tokens
                steps[name] = steps.get(name, 0) + r.steps
            row = {"ranking": label, "max_nodes": n, "tau": sum(tokens.values()) / sum(steps.values()),
                   "per_set": {k: tokens[k] / steps[k] for k in tokens}, "mean_nodes": float(n),
                   "drafting_ms_per_step": 1e3 * (time.perf_counter() - t0) / sum(len(r.accepted) for _, r in runs)}
            out.append(row)
            print(f"  {label:16s} {n:3d} nodes: τ {row['tau']:.3f}", file=sys.stderr)
    return out


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
    p.add_argument("--keep", type=int, default=128, help="nodes per step fitted on: the search's best by score (and their ancestors)")
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
    p.add_argument("--method", choices=["dart", "eagle3"], default="dart", help="the drafter whose ranking is fitted or evaluated")
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
    args.dart_ranking = args.eagle3_ranking = "score"  # the replays that collect and the baseline rank by the score
    if args.method == "eagle3":
        return eagle3_main(args, target, default_target, argv)

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
    data = collect(drafter, feature_params, records, args.keep)
    table = stack([st for _, rs in data for st in rs])
    print(f"collected {sum(len(rs) for _, rs in data)} steps, {len(table[0])} nodes ({int(table[3].sum())} accepted) in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    cut = int(round(len(data) * (1 - args.holdout)))
    held = None
    if cut < len(data):
        W_fit = fit(stack([st for _, rs in data[:cut] for st in rs]), args.rows, args.l2)
        held = report(stack([st for _, rs in data[cut:] for st in rs]), W_fit)
        print(json.dumps(held, indent=1), file=sys.stderr)
    W = fit(table, args.rows, args.l2)
    if args.out:
        command = "python scripts/fit_acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(json.dumps({
            "format": "dart-acceptance/1",
            "command": command,
            "what": "P(a tree node is accepted), a logistic regression per level (row r scores level r, the last row every deeper one) "
                    "on the features below, capped by the parent's; the pruner's final cut ranks the search's nodes by it "
                    "(ngram_cpp/src/pruner.h)",
            "trie": trie.name if trie is not None else None,
            "features": list(FEATURE_NAMES),
            "weights": [[round(float(w), 6) for w in row] for row in W],
            "tree": {"top_k": prune.top_k, "context_max_candidates": prune.context_max_candidates, "context_extend": prune.context_extend,
                     "context_order": drafter.params.context_order if drafter.params.context_order else CONTEXT_ORDER,
                     "collected_at_nodes": args.collect_nodes, "beam_width": prune.beam_width},
            "data": {"records": len(records), "sets": sorted({n for n, _ in records}), "steps": sum(len(rs) for _, rs in data),
                     "nodes": len(table[0]), "nodes_per_step": args.keep,
                     "prompts": f"the first {args.prompts} prompts of at most {args.max_prompt_tokens} tokens among the corpus pool's first "
                                f"{args.pool} (its validation split), {args.max_new_tokens} new tokens, {target.weights} weights"},
            "holdout_fit": {"prompts_left_out": len(data) - cut, **(held or {})},
            "fit": report(table, W),
        }, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def eagle3_main(args, target, default_target: bool, argv) -> int:
    """--method eagle3: fit (or with --evaluate, evaluate) EAGLE3's ranking."""
    from dart_core.drafters import DEFAULT_EAGLE3_HEAD
    from dart_core.drafters.eagle3 import ACCEPTANCE_FORMAT, FEATURES, PARENT_FIT as E3_PARENT, load_fitted_ranking
    from dart_core.drafters.registry import build_drafter
    from tune_scoring import load_records

    if args.evaluate is not None:
        sizes = [int(x) for x in args.sizes.split(",")]
        args.eagle3_max_nodes = max(sizes)
        drafter = build_drafter("eagle3", target, args, default_target=default_target)
        weights = load_fitted_ranking(args.ranking or args.eagle3_model or DEFAULT_EAGLE3_HEAD)
        if weights is None:
            raise SystemExit("no fitted EAGLE3 ranking to evaluate (--ranking DIR with an acceptance.json)")
        records = load_records(args.evaluate)
        rows = evaluate_eagle3(drafter, records, sizes, weights)
        names = list(rows[0]["per_set"])
        print("\n| ranking | nodes | τ | " + " | ".join(names) + " | drafting ms/step |\n|---|---|---|" + "---|" * len(names) + "---|")
        for r in rows:
            print(f"| {r['ranking']} | {r['max_nodes']} | {r['tau']:.3f} | " + " | ".join(f"{r['per_set'][k]:.2f}" for k in names)
                  + f" | {r['drafting_ms_per_step']:.2f} |")
        if args.eval_out:
            args.eval_out.write_text(json.dumps({"records": str(args.evaluate), "rows": rows}, indent=1) + "\n")
        return 0
    args.eagle3_max_nodes = args.collect_nodes
    drafter = build_drafter("eagle3", target, args, default_target=default_target)
    if args.records is not None and args.records.exists():
        records = load_records(args.records)
    else:
        records = record_training_prompts(target, args.data, args.exclude, args.prompts, args.max_prompt_tokens, args.max_new_tokens, args.pool)
        if args.records is not None:
            args.records.parent.mkdir(parents=True, exist_ok=True)
            torch.save(records, args.records)
    t0 = time.perf_counter()
    data = collect(drafter, None, records, args.keep)
    table = stack([st for _, rs in data for st in rs])
    print(f"collected {sum(len(rs) for _, rs in data)} steps, {len(table[0])} nodes ({int(table[3].sum())} accepted) in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    cut = int(round(len(data) * (1 - args.holdout)))
    held = None
    if cut < len(data):
        W_fit = fit(stack([st for _, rs in data[:cut] for st in rs]), args.rows, args.l2, parent_col=E3_PARENT)
        held = report(stack([st for _, rs in data[cut:] for st in rs]), W_fit, parent_col=E3_PARENT)
        print(json.dumps(held, indent=1), file=sys.stderr)
    W = fit(table, args.rows, args.l2, parent_col=E3_PARENT)
    if args.out:
        command = "python scripts/fit_acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(json.dumps({
            "format": ACCEPTANCE_FORMAT,
            "command": command,
            "what": "P(a tree node is accepted), a logistic regression per depth (row r scores depth r + 1, the last row every deeper one) "
                    "on the features below, capped by the parent's; EAGLE3's tree keeps the best of its pool by it "
                    "(dart_core/drafters/eagle3.py)",
            "features": list(FEATURES),
            "weights": [[round(float(w), 6) for w in row] for row in W],
            "data": {"records": len(records), "steps": sum(len(rs) for _, rs in data), "nodes": len(table[0]), "nodes_per_step": args.keep,
                     "collected_at_nodes": args.collect_nodes,
                     "prompts": f"the first {args.prompts} prompts of at most {args.max_prompt_tokens} tokens among the corpus pool's first "
                                f"{args.pool} (its validation split), {args.max_new_tokens} new tokens, {target.weights} weights"},
            "holdout_fit": {"prompts_left_out": len(data) - cut, **(held or {})},
            "fit": report(table, W, parent_col=E3_PARENT),
        }, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
