"""The embedded stage: the embedded model (its converted checkpoint or GGUF on the machine, or --model):
ids, τ and tokens/s of ar, dart and eagle3 interleaved prompt by prompt, the tree sizes calibrated on
the device, each drafter's generation profiled, a prompt's prefill in chunks against one eager
forward, then its own sweep of forward paths."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import torch

from ... import ARDrafter, GenerationParams, generate
from ...generate import Summary
from ...target import Target
from ..config import CudaForward
from .big import prefill_costs, sweep_paths
from .common import Report, recorded_failure, sync


def traced(target: Target, prompt, drafter, params: GenerationParams) -> tuple[Summary, list[float]]:
    """complete(), with each decoding step's draft time (ms) in order."""
    draft_ms, summary = [], None
    for event in generate(target, prompt, drafter, params):
        if isinstance(event, Summary):
            summary = event
        elif event.step > 0:
            draft_ms.append(round(event.times.draft * 1e3, 3))
    assert summary is not None
    return summary, draft_ms


def draft_trace(draft_ms: list[float]) -> dict:
    """One generation's draft times: its first steps' each, and the median and largest of the rest."""
    rest = draft_ms[3:]
    return {
        "first_ms": draft_ms[:3],
        "rest_median_ms": round(statistics.median(rest), 3) if rest else None,
        "rest_max_ms": max(rest, default=None),
        "steps": len(draft_ms),
    }


def with_suffix(prompt, suffix: str):
    """A prompt (a string, or chat messages) with `suffix` added to its text (the last message's)."""
    if isinstance(prompt, str):
        return prompt + suffix
    return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + suffix}]


def profiled_generation(target: Target, prompt, drafter, params: GenerationParams, dev: torch.device) -> dict:
    """One generation under torch's profiler: the ops that took the most host time and device time, to
    name what a drafter pays in a generation beyond its steady steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        summary, draft_ms = traced(target, prompt, drafter, params)
        sync(dev)
    out = {"wall_ms": round((time.perf_counter() - t0) * 1e3, 1), "draft": draft_trace(draft_ms), "steps": summary.steps}
    events = prof.key_averages()
    for key, name in (
        ("cpu_time_total", "top_host_total"),
        ("self_cpu_time_total", "top_host_self"),
        ("self_device_time_total", "top_device_self"),
    ):
        ranked = sorted(events, key=lambda e: -getattr(e, key, 0))[:15]
        out[name] = [{"name": e.key[:90], "calls": e.count, "ms": round(getattr(e, key, 0) / 1e3, 3)} for e in ranked if getattr(e, key, 0)]
    return out


def stage_embedded(dev: torch.device, small: bool, rep: Report, opts) -> dict:
    from dart_core import load_target
    from dart_core.drafters.config import DartConfig, DrafterConfigs, Eagle3Config
    from dart_core.drafters.registry import build_drafter
    from dart_core.tools import calibrate

    r = {}
    texts = [json.loads(line) for line in opts.prompts.read_text().splitlines() if line.strip()] if opts.prompts else []
    texts = texts or ["Write a haiku about the sea.", "Explain what a hash table is in two sentences."]
    heads = opts.heads
    for dname in opts.embedded_dtypes.split(","):
        target = load_target(opts.model, dev, dname)
        target.model.cuda_forward = CudaForward(split=opts.fixed_split or None)
        configs = DrafterConfigs(
            DartConfig.embedded(head=str(heads / "dart"), ngram=str(heads / "ngram" / "smollm2-3gram.ngram.xz")),
            Eagle3Config(head=str(heads / "eagle3")),
        )
        sizes = {m: opts.nodes for m in ("dart", "eagle3")}
        calibration = {}
        if opts.calibrate and calibrate.calibrated_rows(target):
            # the tree sizes the bench and the app would pick on this device (its costs timed to a
            # synchronize, τ from the heads' tables), run beside the fixed --nodes
            t0 = time.perf_counter()
            calibrated, choices = calibrate.calibrate_unset_sizes(target, configs, {"dart", "eagle3"}, log=rep.log)
            calibration = {
                m: {"max_nodes": c.max_nodes, "reason": c.reason, "calibrated": c.calibrated, "table": c.table} for m, c in choices.items()
            }
            calibration["seconds"] = round(time.perf_counter() - t0, 1)
            for m in ("dart", "eagle3"):
                sizes[f"{m}-calibrated"] = calibrated[m].max_nodes
        methods = {"ar": ARDrafter()}
        for m, n in sizes.items():
            method = m.removesuffix("-calibrated")
            label = f"{method}@{n}"
            if label not in methods:
                methods[label] = build_drafter(method, target, dataclasses.replace(configs[method], max_nodes=n))
        params = GenerationParams(opts.max_new_tokens)
        res = {m: {"ids": [], "tokens": 0, "steps": 0, "wall": 0.0, "decode": 0.0, "prefill": 0.0, "stages": {}} for m in methods}
        traces = {m: [] for m in methods}  # each generation's draft times, the warm-up's first
        for m, drafter in methods.items():  # warm-up: the longest prompt at the measured length, so the caches
            # (and the graphs captured on them) the measured generations lease are already there
            traces[m].append(draft_trace(traced(target, max(texts, key=lambda t: len(target.encode(t))), drafter, params)[1]))
        for text in texts:
            for m, drafter in methods.items():  # interleaved prompt by prompt
                s, draft_ms = traced(target, text, drafter, params)
                traces[m].append(draft_trace(draft_ms))
                v = res[m]
                v["ids"].append(s.output_ids)
                v["tokens"] += s.new_tokens
                v["steps"] += s.steps
                v["wall"] += s.wall_s
                v["decode"] += s.wall_s - s.prefill_s
                v["prefill"] += s.prefill_s
                for k in ("draft", "prune", "verify", "other"):
                    v["stages"][k] = v["stages"].get(k, 0.0) + getattr(s.times, k)
        rows = {}
        ar_rate = res["ar"]["tokens"] / res["ar"]["wall"]
        for m, v in res.items():
            rows[m] = {
                "tokens_per_s": round(v["tokens"] / v["wall"], 1),
                "decode_tokens_per_s": round((v["tokens"] - len(texts)) / v["decode"], 1),
                "vs_ar": round(v["tokens"] / v["wall"] / ar_rate, 3),
                "tau": round(v["tokens"] / v["steps"], 3),
                "ids_equal_ar": sum(a == b for a, b in zip(v["ids"], res["ar"]["ids"])),
                "prompts": len(texts),
                # where a decoding step's time goes (ms; the steps after the prompt's), and the prompts'
                "ms_a_step": {k: round(t / max(1, v["steps"] - len(texts)) * 1e3, 3) for k, t in v["stages"].items()},
                "prefill_ms": round(v["prefill"] / len(texts) * 1e3, 2),
                "draft_by_generation": traces[m],  # the warm-up, then the measured prompts in turn
            }
        R = target.model.fixed_row_count(dev)
        prefill: dict = {}
        if target.model.fixed_path(R, dev):  # (on the CPU kernels a prompt runs on them, not in chunks)
            with recorded_failure(rep, f"embedded {dname}: prefill", prefill, dev):
                prefill.update(prefill_costs(target, [R + 1, 2 * R, 4 * R, 8 * R], dev))
        profiles = {}
        if opts.profile_drafters:  # each drafter once more on a prompt none of its generations had (a new length)
            fresh = with_suffix(texts[0], " Answer in one short paragraph, then stop.")
            for m, drafter in methods.items():
                if m != "ar":
                    with recorded_failure(rep, f"embedded {dname}: profile {m}", profiles.setdefault(m, {}), dev):
                        profiles[m].update(profiled_generation(target, fresh, drafter, params, dev))
        rep.log(f"embedded {dname} ({target.weights}): {rows}, prefill {prefill}")
        # the prompt's forward: one eager forward against fixed-shape chunks
        r[dname] = {
            **rows,
            "prefill": prefill,
            **({"calibration": calibration} if calibration else {}),
            **({"profiles": profiles} if profiles else {}),
        }
        rep.save("embedded", r)
        sweep = [p for p in opts.embedded_sweep.split(",") if p]
        if sweep and target.model.fixed_path(R, dev):  # last: it leaves the model on the sweep's last path
            r[dname]["sweep"] = {}
            sweep_paths(target, sweep, r[dname]["sweep"], "embedded", r, rep, opts)
        elif sweep:
            r[dname]["sweep"] = {"skipped": f"no fixed-shape forward on {dev} for {target.weights} (another path runs every forward)"}
            rep.save("embedded", r)
    return r
