"""The profile stage: where the fixed-shape forward's time goes at the 8B shape: the graph replay alone
against a whole verify (inputs loaded, outputs copied), and the GPU time by kernel of one uncaptured
forward (torch.profiler) at 1 and 64 rows at each context."""

from __future__ import annotations

import random

import torch

from ...tools.toys import random_tree_under
from .common import Report, fill_cache, random_big_target, sync, timed_ms, use_path


def stage_profile(dev: torch.device, small: bool, rep: Report, opts) -> dict:
    from torch.profiler import ProfilerActivity, profile

    target = random_big_target(dev, small)
    model = target.model
    use_path(model, "fixed", opts)
    rng = random.Random(5)
    V = model.args.vocab_size
    r: dict = {}
    for P in opts.contexts:
        for rows in (1, 64):
            cache = fill_cache(target, P, P + 80)
            tree = random_tree_under(rng, rng.randrange(V), rows, V)
            entry = {"verify_ms": round(timed_ms(lambda: target.verify(tree, cache, capture=False), dev), 3)}
            runner = getattr(cache, "fixed_runner", None)
            if runner is not None and runner.graph is not None:
                entry["replay_ms"] = round(timed_ms(runner.graph.replay, dev), 3)
            if runner is not None:  # one forward uncaptured, kernel by kernel

                def body():
                    with torch.inference_mode():
                        model.fixed_body(runner.inputs, cache, runner.kernels, False, True)

                body()
                sync(dev)
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                with profile(activities=activities) as prof:
                    body()
                    sync(dev)
                key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
                events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))
                total = sum(getattr(e, key, 0) for e in events)
                entry["kernel_ms_total"] = round(total / 1e3, 3)
                entry["top"] = [{"name": e.key[:90], "calls": e.count, "ms": round(getattr(e, key, 0) / 1e3, 3)} for e in events[:12]]
            r[f"P{P}_rows{rows}"] = entry
            rep.log(f"profile: P={P} rows={rows} { ({k: v for k, v in entry.items() if k != 'top'}) }")
            rep.save("profile", r)
            cache = None
    return r
