"""Choose DART's tree size (and score floor) for this machine and head from one logged run.

    python scripts/tune_tree.py --dataset ../shared/data/bench/*.jsonl --skip 10 --limit 5 --cap 16 [--dart-model DIR]

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

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dart_core.bench import held_out_questions  # noqa: E402
from dart_core.drafters import default_max_nodes
from dart_core.drafters.registry import add_drafter_flags, build_drafter, check_drafter_flags  # noqa: E402
from dart_core.generate import GenerationParams, StepEvent, Summary, generate  # noqa: E402
from dart_core.loading import DEFAULT_MODEL  # noqa: E402
from dart_core.target import load_target  # noqa: E402
from dart_core.tree import DraftTree  # noqa: E402

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
                steps.append(LoggedStep(rank_nodes(scores, parents), scores, list(ev.path[1:]), t.draft + t.prune + t.other,
                                        name, cached))
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--dataset", type=Path, nargs="+", required=True, help="question.jsonl files (first turns)")
    p.add_argument("--skip", type=int, default=10, help="prompts skipped at the start of each file (the bench's)")
    p.add_argument("--limit", type=int, default=5, help="prompts used from each file after --skip")
    p.add_argument("--cap", type=int, default=16, help="drafted nodes of the logged trees (the largest size considered)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the logged steps' summary and every setting's estimate as JSON")
    add_drafter_flags(p)
    args = p.parse_args(argv)
    try:
        check_drafter_flags(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.cap < 1 or args.limit < 1 or args.skip < 0:
        raise SystemExit("--cap and --limit must be >= 1, --skip >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    default_nodes = default_max_nodes(args.device)
    args.max_nodes, args.tree_min_score = args.cap, None  # log full trees; the settings are simulated
    target = load_target(args.model, args.device, args.dtype)
    drafter = build_drafter("dart", target, args, default_target=args.model == DEFAULT_MODEL)
    try:
        questions = held_out_questions(args.dataset, args.skip, args.limit)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    prompts = [(name, target.encode([{"role": "user", "content": q["turns"][0]}])) for name, q in questions]
    print(f"logging {len(prompts)} prompts at {args.cap} nodes", file=sys.stderr)
    steps = log_steps(target, drafter, prompts, args.max_new_tokens)
    by_len = sorted((ids for _, ids in prompts), key=len)
    timed = {len(ids): ids for ids in (by_len[0], by_len[len(by_len) // 2], by_len[-1])}
    verify_s = VerifyTimes({n: time_verify(target, ids, range(1, args.cap + 2)) for n, ids in timed.items()})
    results = []
    for n in range(1, args.cap + 1):
        results.append(({"max_nodes": n}, *simulate(steps, verify_s, max_nodes=n)))
        for floor in FLOORS:
            for m in range(1, n):
                setting = {"max_nodes": n, "min_score": floor, "min_nodes": m}
                results.append((setting, *simulate(steps, verify_s, **setting)))
    results.sort(key=lambda r: -r[1])
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
        args.out.write_text(json.dumps({
            "steps": len(steps), "cap": args.cap,
            "verify_ms": {n: {k: 1e3 * v for k, v in t.items()} for n, t in verify_s.by_length.items()},
            "fixed_ms_per_step": 1e3 * statistics.mean(s.fixed_s for s in steps) if steps else None,
            "settings": [{"setting": s, "tokens_per_s": tps, "tau": tau,
                          "tau_per_set": {n: simulate([x for x in steps if x.dataset == n], verify_s, **s)[1] for n in names}}
                         for s, tps, tau in results],
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
