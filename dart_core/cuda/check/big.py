"""The big stage: a random-weight target of Qwen3-8B's shape in bf16: the one-row step against the HBM
limit, the verify's cost by rows at each context, verify == steps at that size, a sweep of forward paths
ranked in one process, DART draft + prune against EAGLE3's rollout at 60 nodes, and the loop a step
(its stage costs, its host-device synchronizations, a prompt's prefill in chunks against one eager
forward). The GEMMs by backend are gemm.py's."""

from __future__ import annotations

import json
import random
import statistics
import time

import torch

import ngram_cpp

from ... import ARDrafter, GenerationParams, complete, generate
from ...drafters.dart import DartDrafter, DartParams
from ...drafters.eagle3 import Eagle3Drafter, Eagle3Params
from ...generate import Summary
from ...target import Target
from ...tools.toys import random_tree_under
from .common import (
    Report,
    count_syncs,
    fault,
    fill_cache,
    forward_engine,
    random_big_target,
    random_head,
    recorded_failure,
    sync,
    timed_ms,
    use_path,
    verify_against_steps,
)
from .gemm import big_gemm


def stage_big(dev: torch.device, small: bool, rep: Report, opts) -> dict:
    """opts.big_parts: "verify" (each path's cost by rows, verify == steps), "sweep" (the same for the
    engine's default and opts.sweep's paths in this one process, under r["sweep"], ranked), "gemm"
    (each linear's GEMM timed by backend at the fixed rows, big_gemm) and "drafting" (drafting at 60
    nodes and the loop a step, on the first path asked for that verified without failing)."""
    r: dict = {}
    t0 = time.perf_counter()
    target = random_big_target(dev, small)
    a = target.model.args
    r["shape"] = {
        k: getattr(a, k) for k in ("n_layers", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads", "head_dim", "vocab_size")
    }
    r["weight_bytes_a_step"] = target.model.step_weight_bytes()
    rep.log(f"big: built {r['shape']} in {time.perf_counter() - t0:.1f} s, {r['weight_bytes_a_step'] / 1e9:.2f} GB a step")
    paths = opts.paths.split(",")
    parts = opts.big_parts.split(",")
    if "verify" in parts:
        r["verify"], r["verify_vs_steps"] = {}, {}
        for fpath in paths:
            entry: dict = {}
            with recorded_failure(rep, f"big ({fpath})", entry, dev):
                big_verify(target, fpath, r, rep, opts)
            if "error" in entry:
                r.setdefault("errors", {})[fpath] = entry["error"]
            rep.save("big", r)
    sweep = [p for p in opts.sweep.split(",") if p]
    if "sweep" in parts and sweep:
        r["sweep"] = {}
        sweep_paths(target, sweep, r["sweep"], "big", r, rep, opts)
    if "gemm" in parts:
        big_gemm(target, r, rep, opts)
    if "drafting" in parts:
        ok = [p for p in paths if p not in r.get("errors", {})]
        if not ok:
            raise RuntimeError(f"no forward path verified without failing ({r.get('errors')}): no drafting or loop to run")
        use_path(target.model, ok[0], opts)
        r["loop_path"] = ok[0]
        big_drafting(target, r, rep, small, dev)
    return r


def sweep_paths(target: Target, paths: list[str], sw: dict, stage: str, saved: dict, rep: Report, opts) -> None:
    """big_verify for the engine's default ("fixed") and then `paths`, all in this one process (a
    ranking of like with like), into sw (its verify, verify_vs_steps, errors) with sweep_summary's
    ranking; `saved` (the stage's result, which holds sw) saved after each path. It leaves the model
    on the last path."""
    dev = torch.device(target.device)
    sw.update(verify={}, verify_vs_steps={}, weight_bytes_a_step=target.model.step_weight_bytes())
    for fpath in ["fixed", *paths]:
        entry: dict = {}
        with recorded_failure(rep, f"{stage}: sweep ({fpath})", entry, dev):
            big_verify(target, fpath, sw, rep, opts, save=lambda: rep.save(stage, saved))
        if "error" in entry:
            sw.setdefault("errors", {})[fpath] = entry["error"]
        sw.update(sweep_summary(sw))
        rep.save(stage, saved)
    rep.log(f"{stage}: sweep { ({k: v for k, v in sw.items() if k in ('ranked', 'not_bitwise')}) }")


def sweep_summary(sw: dict) -> dict:
    """The sweep's paths ranked at each context by the one-row step and by the 64-row verify (ms), and
    those whose verify was not bitwise its steps: what the engine's default split should be."""
    verify = json.loads(json.dumps(sw["verify"]))  # one kind of key (the contexts and rows as strings)
    ranked = {}
    for P in sorted({c for v in verify.values() for c in v}, key=int):
        for rows, label in (("1", "step"), ("64", "verify64")):
            ms = {p: v[P]["ms_by_rows"][rows] for p, v in verify.items() if rows in v.get(P, {}).get("ms_by_rows", {})}
            ranked[f"P{P}_{label}"] = sorted(([p, t] for p, t in ms.items()), key=lambda pt: pt[1])
    checks = sw["verify_vs_steps"]
    return {"ranked": ranked, "not_bitwise": sorted(p for p, c in checks.items() if c["bitwise_equal"] != c["nodes"])}


def big_verify(target: Target, fpath: str, r: dict, rep: Report, opts, save=None) -> None:
    """One forward path at the big shape (or `target`'s): the verify's cost by rows at each context, then
    verify == steps, into r's verify and verify_vs_steps; save() after each context (default: r as the
    big stage's result)."""
    save = save or (lambda: rep.save("big", r))
    dev = torch.device(target.device)
    a = target.model.args
    env = rep.data["stages"].get("env", {})
    bw = opts.read_gb_s or env.get("read_gb_s") or env.get("copy_gb_s")
    rng = random.Random(3)
    V = a.vocab_size
    rows_list = [1, 2, 4, 8, 16, 32, 48, 64]
    fault(fpath)
    use_path(target.model, fpath, opts)
    by_context = {}
    for P in opts.contexts:
        cache = fill_cache(target, P, P + 80)
        kv_bytes = 2 * a.n_layers * a.n_kv_heads * a.head_dim * P * cache.k.element_size()
        costs = {}
        for rows in rows_list:
            tree = random_tree_under(rng, rng.randrange(V), rows, V)
            costs[rows] = round(timed_ms(lambda: target.verify(tree, cache, capture=False), dev), 3)
        entry = {"engine": forward_engine(target.model, dev), "ms_by_rows": costs, "ratio_64_to_1": round(costs[64] / costs[1], 3)}
        if bw:
            limit_ms = (r["weight_bytes_a_step"] + kv_bytes) / (bw * 1e6)
            entry["hbm_limit_ms"] = round(limit_ms, 3)
            entry["step_over_hbm_limit"] = round(costs[1] / limit_ms, 3)
        by_context[P] = entry
        r["verify"][fpath] = by_context
        rep.log(f"big ({fpath}): P={P} {entry}")
        save()
        cache = None

    # verify == steps at this size: the eager path's GEMMs and SDPA change with the rows and the mask
    prefix = [rng.randrange(V) for _ in range(300)]
    tree = random_tree_under(rng, prefix[-1], 24, V)
    r["verify_vs_steps"][fpath] = verify_against_steps(target, prefix, tree)
    rep.log(f"big ({fpath}): verify vs steps {r['verify_vs_steps'][fpath]}")


def big_drafting(target: Target, r: dict, rep: Report, small: bool, dev: torch.device) -> None:
    """Drafting at 60 nodes (DART's one head forward + the C++ pruner, EAGLE3's 7-deep rollout) and the
    loop a step, each drafter on its own (one failing leaves the others' rows)."""
    rng = random.Random(3)
    V = target.model.args.vocab_size
    vd = 2048 if small else 32000
    dart_head = random_head(target, 11, 4, vd)
    eagle_head = random_head(target, 12, None, vd)
    trie = ngram_cpp.build([[rng.randrange(V) for _ in range(64)] for _ in range(200)], V)
    dart_params = DartParams(ngram_cpp.PruneParams(max_nodes=60, context_weight=0.5))
    eager_head = DartDrafter(dart_head, target, trie, dart_params)
    eager_head.head_graph = False  # the head's forward as eager torch ops, for comparison
    eagle_params = Eagle3Params(depth=7, top_k=10, max_nodes=60)
    eager_eagle = Eagle3Drafter(eagle_head, target, eagle_params)
    eager_eagle.head_graph = eager_eagle.expand_graph = False  # its forwards as eager torch ops, a read-back a level, for comparison
    drafters = {
        "dart": DartDrafter(dart_head, target, trie, dart_params),  # on CUDA: the head's forward captured (cuda/head_graph.py)
        "dart-eager-head": eager_head,
        "eagle3": Eagle3Drafter(eagle_head, target, eagle_params),  # on CUDA: its first forward and expansion captured
        "eagle3-eager": eager_eagle,
    }
    prompt = [rng.randrange(V) for _ in range(512)]
    cache = target.new_cache(700)
    out = target.prefill(prompt, cache, capture=True)
    drafting: dict = {}
    r["drafting_60"] = drafting
    for name, drafter in drafters.items():
        entry: dict = {}
        with recorded_failure(rep, f"big: drafting {name}", entry, dev):
            fault(name)
            session = drafter.new_session(700)
            session.extend(prompt, out.hidden)
            draft, prune, wall = [], [], []
            for i in range(12):
                sync(dev)
                t_start = time.perf_counter()
                prop = session.propose(rng.randrange(V), 60)
                sync(dev)
                wall.append((time.perf_counter() - t_start) * 1e3)
                draft.append(prop.draft_s * 1e3)
                prune.append(prop.prune_s * 1e3)
                session.extend([int(prop.tree.tokens[0])], out.hidden[-1:])
            graph = getattr(session, "graph", None)
            first = getattr(session, "head_graph", None)  # EAGLE3's captured first forward (its `graph`: the expansion)
            if isinstance(drafter, Eagle3Drafter):
                entry["first_forward_graph_calls"] = first.calls if first is not None else 0
            entry.update(
                graph_calls=graph.calls if graph is not None else 0,  # proposals through the captured forward
                nodes=len(prop.tree) - 1,
                draft_ms=round(statistics.median(draft[2:]), 3),
                prune_ms=round(statistics.median(prune[2:]), 3),
                propose_ms=round(statistics.median(wall[2:]), 3),
            )
            rep.log(f"big: drafting {name} {entry}")
        drafting[name] = entry
        rep.save("big", r)
    cache = out = None

    # the loop, a step: stage times and synchronizations (greedy; random weights accept little)
    loop: dict = {}
    r["loop"] = loop
    for name, drafter in (("ar", ARDrafter()), *drafters.items()):
        entry = {}
        with recorded_failure(rep, f"big: loop {name}", entry, dev):
            fault(name)
            params = GenerationParams(12 if small else 24)
            complete(target, prompt, drafter, params)  # warm-up
            with count_syncs(dev) as syncs:
                summary = None
                for ev in generate(target, prompt, drafter, params):
                    summary = ev
            assert isinstance(summary, Summary)
            steps = summary.steps - 1
            t = summary.times
            entry.update(
                steps=steps,
                tau=round(summary.tau, 3),
                ms_a_step={k: round(getattr(t, k) / steps * 1e3, 3) for k in ("draft", "prune", "verify", "other")},
                tokens_per_s=round(summary.tokens_per_s, 1),
                prefill_ms=round(summary.prefill_s * 1e3, 2),
                syncs_a_step=round(syncs["n"] / summary.steps, 1),
                sync_sites=dict(sorted(syncs["sites"].items(), key=lambda kv: -kv[1])[:8]),
            )
            rep.log(f"big: loop {name} {entry}")
        loop[name] = entry
        rep.save("big", r)
    R = target.model.fixed_row_count(dev)
    if target.model.fixed_path(R, dev):  # (the loop's path may be the plain eager one: no chunks there)
        entry = {}
        with recorded_failure(rep, "big: prefill", entry, dev):
            entry.update(prefill_costs(target, [R + 1] if small else [2 * R, 8 * R], dev, 1 if small else 7))
            rep.log(f"big: prefill {entry}")
        r["prefill"] = entry
        rep.save("big", r)


def prefill_costs(target: Target, lengths: list[int], dev: torch.device, reps: int = 7) -> dict:
    """A prompt's prefill (ms, capturing the drafters' states) as one eager forward and as fixed-shape
    forwards of the fixed rows in turn (Target.prefill with model.fixed_prefill_chunks): which is
    faster depends on the model's size and the device, so the device says. `MODE_first_ms`: the first
    call at that length, before the warm-up (what a library pays the first time it sees a shape, which
    every new prompt length of an eager prefill would pay again)."""
    model = target.model
    R = model.fixed_row_count(dev)
    rng = random.Random(5)
    saved, out = model.fixed_prefill_chunks, {}
    try:
        for n in lengths:
            ids = [rng.randrange(model.args.vocab_size) for _ in range(n)]
            cache = target.new_cache(n + 8)
            row = {"chunks": -(-n // R)}
            for mode, chunks in (("eager", 0), ("chunked", row["chunks"])):
                model.fixed_prefill_chunks = chunks
                row[f"{mode}_first_ms"] = round(timed_ms(lambda: target.prefill(ids, cache, capture=True), dev, 0, 1), 3)
                row[f"{mode}_ms"] = round(timed_ms(lambda: target.prefill(ids, cache, capture=True), dev, min(2, reps), reps), 3)
            out[str(n)] = row
    finally:
        model.fixed_prefill_chunks = saved
    return out
