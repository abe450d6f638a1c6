"""Fitting a drafter's ranking of tree nodes by exact replay: a calibrated model of P(node accepted),
per tree level for DART's pruner (ngram_cpp/src/pruner.h), per depth for EAGLE3's pool
(dart_core/drafters/eagle3.py). Its command line is `dart-fit`.

1. Greedy records (dart_core/tools/replay.py) of training prompts: the first prompts of the self-distilled
   corpus's pool (dart_core.training.corpus.prompt_pool, the bench sets excluded, seed 0), which are its
   validation split: no head was trained on them, and no bench prompt is among them.
2. Replay of the drafter on every record (`collect`): at every step DART's search is run again in the
   Python reference (ngram_cpp/reference.py pool_features, the executable copy of pruner.cpp,
   checked against it), and its `keep` best nodes by score (a set closed under taking parents) are
   kept with the features the fitted ranking scores them with, each labelled 1 if its whole path is
   the target's recorded continuation (the node would be accepted).
3. One logistic regression per level (`fit`; the last row shared by the levels past the head's rows),
   level by level, since a node's features include its parent's fitted value: P(node accepted),
   capped by the parent's, which is what the pruner's final cut ranks by. `report` gives the
   log-loss and a reliability table; `evaluate` replays the score, the fitted ranking and the
   adaptive tree on other records and gives τ by tree size.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np

from ngram_cpp.reference import FEATURE_NAMES, pool_features

from .replay import record_greedy, replay


def _quiet(_: str) -> None:
    pass


TRAIN_DATA = [
    "code-alpaca-2k.json",
    "gpteacher-codegen.json",
    "gpteacher-roleplay.json",
    "gpteacher-toolformer.json",
    "sharegpt.jsonl",
    "t0-prompts.jsonl",
    "user-oriented-instructions.jsonl",
]
BENCH_SETS = ["alpaca", "gsm8k", "humaneval", "mt_bench", "qa", "sum"]
PARENT_FIT = FEATURE_NAMES.index("parent's fitted ln P")


# ------------------------------------------------------------------------------ the data


def record_training_prompts(
    target,
    data: list[str],
    exclude: list[str],
    n: int,
    max_prompt_tokens: int,
    max_new: int,
    pool_size: int,
    log: Callable[[str], None] = _quiet,
):
    """Greedy records of the first `n` pool prompts (of the first `pool_size`: the corpus's
    validation split) that fit `max_prompt_tokens`."""
    from .training.corpus import prompt_pool

    records = []
    for i, pp in enumerate(prompt_pool(data, exclude, seed=0)[:pool_size]):
        if len(target.encode(pp.messages)) > max_prompt_tokens:
            continue
        records.append((pp.source, record_greedy(target, pp.messages, max_new)))
        log(f"recorded {len(records)}: pool prompt {i} ({pp.source})")
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
        self.owner.collect(prop.info, root, list(self.s.committed), self.s.index, self.owner.output[self.pos + 1 :])
        return prop

    def close(self) -> None:
        close = getattr(self.s, "close", None)
        if close is not None:
            close()


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
        self.steps.append(
            (
                depth[kept],
                np.array([row[pool[n][1]] if pool[n][1] >= 0 else -1 for n in kept]),
                np.array([pool[n][3] for n in kept], dtype=np.float64),
                acc[kept].astype(np.float64),
            )
        )


class _Eagle3CollectingSession(_CollectingSession):
    def propose(self, root: int, max_nodes: int):
        self.s.collect = True
        prop = self.s.propose(root, max_nodes)
        self.owner.collect_pool(self.s.last_pool, self.owner.output[self.pos + 1 :])
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
        self.steps.append(
            (
                depth[kept],
                np.array([row[parents[n]] if parents[n] >= 0 else -1 for n in kept]),
                np.array([feats[n] for n in kept], dtype=np.float64),
                acc[kept].astype(np.float64),
            )
        )


def collect(drafter, feature_params, records, keep: int) -> list[tuple[str, list]]:
    """(set, its steps) per record; feature_params None: an EAGLE3 drafter's pool."""
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
        out["per_row"].append(
            {
                "row": r,
                "nodes": int(m.sum()),
                "accepted": int(y[m].sum()),
                "log_loss": float(-np.mean(y[m] * np.log(p[m]) + (1 - y[m]) * np.log(1 - p[m]))),
                "log_loss_constant": float(-np.mean(y[m] * np.log(base) + (1 - y[m]) * np.log(1 - base))),
            }
        )
    for lo, hi in [(0, 0.01), (0.01, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 0.95), (0.95, 1.0001)]:
        m = (p >= lo) & (p < hi)
        if m.any():
            out["reliability"].append(
                {
                    "predicted": [lo, min(hi, 1.0)],
                    "nodes": int(m.sum()),
                    "mean_predicted": round(float(p[m].mean()), 4),
                    "observed": round(float(y[m].mean()), 4),
                }
            )
    return out


# ------------------------------------------------------------------------------ evaluation


def evaluate_eagle3(drafter, records, sizes: list[int], weights: tuple, log: Callable[[str], None] = _quiet) -> list[dict]:
    """τ of EAGLE3's cumulative log-probability and of its fitted ranking at each size, by exact replay."""
    from ..drafters.eagle3 import Eagle3Drafter

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
            row = {
                "ranking": label,
                "max_nodes": n,
                "tau": sum(tokens.values()) / sum(steps.values()),
                "per_set": {k: tokens[k] / steps[k] for k in tokens},
                "mean_nodes": float(n),
                "drafting_ms_per_step": 1e3 * (time.perf_counter() - t0) / sum(len(r.accepted) for _, r in runs),
            }
            out.append(row)
            log(f"  {label:16s} {n:3d} nodes: τ {row['tau']:.3f}")
    return out


def evaluate(
    drafter, records, sizes: list[int], ranking, costs_ms: dict[int, float] | None, draft_ms: float, log: Callable[[str], None] = _quiet
) -> list[dict]:
    """τ (and the expected tokens/s from this machine's forward cost by rows, where given) of the
    score, the fitted ranking and the adaptive fitted tree at each size, by exact replay."""
    from ..drafters.dart import DartParams, with_fitted_ranking

    base = drafter.params
    fitted_params = DartParams(with_fitted_ranking(base.prune, ranking), base.depth, ranking.context_order)
    variants = [("score", base), ("fitted", fitted_params)]
    if costs_ms:
        top = max(costs_ms)
        row_costs = tuple(costs_ms[r] + draft_ms for r in range(1, top + 1))
        variants.append(
            ("fitted+adaptive", dataclasses.replace(fitted_params, prune=dataclasses.replace(fitted_params.prune, row_costs=row_costs)))
        )
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
            row = {
                "ranking": label,
                "max_nodes": n,
                "tau": sum(tokens.values()) / sum(steps.values()),
                "per_set": {k: tokens[k] / steps[k] for k in tokens},
                "mean_nodes": nodes / max(n_steps, 1),
            }
            if costs_ms:
                row["est_tokens_per_s"] = 1e3 * sum(tokens.values()) / ms
            out.append(row)
            log(
                f"  {label:16s} {n:3d} nodes: τ {row['tau']:.3f}  mean tree {row['mean_nodes']:.1f}"
                + (f"  est. {row['est_tokens_per_s']:.1f} tok/s" if costs_ms else "")
            )
    return out
