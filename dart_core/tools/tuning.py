"""Tree settings chosen by exact replay (dart_core/tools/replay.py) and from logged runs: the size of DART's
tree (and a score floor) for this machine, and the pruner's score weights. Their command lines are
`dart-tune tree|scoring`.

Tree size (`log_steps`, `simulate`): at temperature 0 the target's next token does not depend on the
tree, so one run logged at a large size tells what a smaller tree cut from the same ranking (its
best N nodes, or those above a score floor) would have accepted: the prefix of the accepted path
that lies inside it. With the verify's time by size measured on this machine (`time_verify`), each
setting's tokens/s is estimated without running it. An estimate, not a measurement: it ignores that
smaller trees draft a little faster and that a step's tree depends on where the previous one ended.

Score weights (`search_weights`): coordinate ascent over GRID, every setting's τ an exact replay of
the recorded greedy decodes (seconds of drafting, not a bench run). τ at a fixed tree size is the
whole story only up to drafting and pruning time: confirm a choice with the bench.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..drafters.dart import DartDrafter
from ..generate import GenerationParams, StepEvent, Summary, generate
from ..tree import DraftTree
from .replay import GreedyRecord, replay

FLOORS = [-0.5 * i for i in range(1, 13)]  # score floors tried (scores are <= 0)
VERIFY_REPEATS = 7


@dataclass(frozen=True)
class LoggedStep:
    ranked: list[int]  # tree node indices (root excluded) in the pruner's order: score desc, depth asc, index asc
    scores: list[float]  # per tree node, root first
    path: list[int]  # accepted node indices, root excluded
    fixed_s: float  # draft + prune + other seconds of this step
    dataset: str = ""  # the bench set of the step's prompt
    cached: int = 0  # tokens in the cache before the step (prompt + committed output)


def rank_nodes(scores: list[float], parents: list[int]) -> list[int]:
    depth = [0] * len(scores)
    for i in range(1, len(scores)):
        depth[i] = depth[parents[i]] + 1
    return sorted(range(1, len(scores)), key=lambda i: (-scores[i], depth[i], i))


def kept_nodes(step: LoggedStep, max_nodes: int, min_score: float = float("-inf"), min_nodes: int = 0) -> int:
    """How many of the step's ranked nodes a tree with these settings keeps (a prefix of the ranking)."""
    n = min(max_nodes, len(step.ranked))
    for i in range(min(min_nodes, n), n):
        if step.scores[step.ranked[i]] < min_score:
            return i
    return n


def accepted(step: LoggedStep, keep: int) -> int:
    """Drafted tokens the step would accept with only the first `keep` ranked nodes."""
    kept = set(step.ranked[:keep])
    n = 0
    for node in step.path:
        if node not in kept:
            break
        n += 1
    return n


class VerifyTimes:
    """Seconds of a verify by tree size (root included), measured after a few cache lengths and
    interpolated linearly in between (clamped outside)."""

    def __init__(self, by_length: dict[int, dict[int, float]]):
        self.lengths = sorted(by_length)
        self.by_length = by_length

    def __call__(self, rows: int, cached: int) -> float:
        ls = self.lengths
        if cached <= ls[0] or len(ls) == 1:
            return self.by_length[ls[0]][rows]
        if cached >= ls[-1]:
            return self.by_length[ls[-1]][rows]
        hi = next(i for i, n in enumerate(ls) if n >= cached)
        a, b = ls[hi - 1], ls[hi]
        w = (cached - a) / (b - a)
        return (1 - w) * self.by_length[a][rows] + w * self.by_length[b][rows]


def simulate(steps: list[LoggedStep], verify: VerifyTimes, **setting) -> tuple[float, float]:
    """(tokens/s, τ) of the logged steps under a tree setting (kept_nodes' keywords); prefill excluded."""
    tokens = seconds = 0.0
    for s in steps:
        keep = kept_nodes(s, **setting)
        tokens += accepted(s, keep) + 1
        seconds += s.fixed_s + verify(keep + 1, s.cached)
    return tokens / seconds, tokens / len(steps)


def log_steps(target, drafter, prompts: list[tuple[str, list[int]]], max_new: int) -> list[LoggedStep]:
    steps = []
    for name, ids in prompts:
        cached = len(ids)
        for ev in generate(target, ids, drafter, GenerationParams(max_new)):
            if isinstance(ev, StepEvent) and ev.tree is not None:
                scores, parents = ev.tree.scores.tolist(), ev.tree.parents.tolist()
                t = ev.times
                steps.append(LoggedStep(rank_nodes(scores, parents), scores, list(ev.path[1:]), t.draft + t.prune + t.other, name, cached))
            elif isinstance(ev, Summary):
                break
            if isinstance(ev, StepEvent):
                cached += len(ev.new_tokens) if ev.tree is not None else 0
    return steps


def time_verify(target, prompt: list[int], sizes: range) -> dict[int, float]:
    """Median seconds of a verify of a chain of each size, after `prompt` is cached (sizes interleaved)."""
    times: dict[int, list[float]] = {n: [] for n in sizes}
    cache = target.new_cache(len(prompt) + max(sizes) + 1)
    target.prefill(prompt, cache, capture=True)
    cache.commit(len(prompt))
    for _ in range(VERIFY_REPEATS):
        for n in sizes:
            tree = DraftTree.from_parents([prompt[-1]] * n, [-1] + list(range(n - 1)))
            t0 = time.perf_counter()
            target.verify(tree, cache, capture=True)
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    for n in sorted(med)[1:]:  # a bigger tree never costs less: smooth timing noise upwards
        med[n] = max(med[n], med[n - 1])
    return med


def tree_settings(steps: list[LoggedStep], verify: VerifyTimes, cap: int) -> list[tuple[dict, float, float]]:
    """(setting, estimated tokens/s, τ) of every fixed size 1..cap and every score floor (FLOORS)
    with each smaller count of nodes kept whatever their score, best tokens/s first."""
    results = []
    for n in range(1, cap + 1):
        results.append(({"max_nodes": n}, *simulate(steps, verify, max_nodes=n)))
        for floor in FLOORS:
            for m in range(1, n):
                setting = {"max_nodes": n, "min_score": floor, "min_nodes": m}
                results.append((setting, *simulate(steps, verify, **setting)))
    results.sort(key=lambda r: -r[1])
    return results


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
    """(set name, record) pairs saved by save_records; ValueError for anything else."""
    data = torch.load(path, weights_only=False)
    if not isinstance(data, list) or not all(isinstance(r, tuple) and isinstance(r[1], GreedyRecord) for r in data):
        raise ValueError(f"{path}: not a list of (set, GreedyRecord) written by the tuning tools")
    return data


def save_records(records: list[tuple[str, GreedyRecord]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(records, path)


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


def search_weights(
    drafter: DartDrafter,
    records: list[tuple[str, GreedyRecord]],
    fields: list[str],
    rounds: int,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[dict[str, dict], object]:
    """Coordinate ascent from the drafter's pruning parameters over `fields` of GRID, `rounds`
    passes (stopping early when a pass improves nothing). Returns every setting tried (by its GRID
    values, as JSON: {"setting", "tau", "per_set", "ms_per_step"}) and the best PruneParams."""
    tried: dict[str, dict] = {}

    def run(prune) -> float:
        key = json.dumps({f: getattr(prune, f) for f in GRID})
        if key not in tried:
            tried[key] = {"setting": json.loads(key), **evaluate(drafter, records, prune)}
            log(f"  τ {tried[key]['tau']:.3f}  {key}")
        return tried[key]["tau"]

    best = drafter.params.prune
    best_tau = run(best)
    for _ in range(rounds):
        improved = False
        for field in fields:
            if field == "context_weight" and best.context_weight == 0:
                continue  # the context n-gram is off: nothing to weigh
            for value in GRID[field]:
                cand = dataclasses.replace(best, **{field: value})
                tau = run(cand)
                if tau > best_tau + 1e-9:
                    best, best_tau, improved = cand, tau, True
        if not improved:
            break
    return tried, best
