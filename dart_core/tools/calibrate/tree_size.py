"""The tree size a drafter runs at on this machine: the size whose expected tokens/s, τ(n) / the
loop's step at n drafted nodes, is the highest (choose_max_nodes), for one drafter
(calibrate_drafter) or every drafter the flags left unsized (calibrate_unset_sizes)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from ...drafters.config import DrafterConfigs
from ...generate import Drafter
from ...target import Target
from . import measure
from .tau import TAU_FILE, read_tau_table


@dataclass(frozen=True)
class SizeChoice:
    max_nodes: int
    reason: str  # one line for logs and the app's header
    table: list[dict] = field(default_factory=list)  # per size: nodes, tau, verify_ms, step_ms, tokens_per_s
    calibrated: bool = False  # False: a default, for the reason given
    plain_tokens_per_s: float | None = None  # plain decoding's, from its loop step (calibrated choices)

    def as_dict(self) -> dict:
        return asdict(self)


def choose_max_nodes(forward_ms: dict[int, float], tau: dict[int, float], step_ms: dict[int, float]) -> SizeChoice:
    """The size with the most expected tokens per second, τ(n) / step(n), over the sizes with a τ and
    a loop step (step_ms: measure.loop_step_ms, 0 = plain decoding's step, which the reason compares with);
    forward(n + 1), the verify alone, goes into the table beside it."""
    sizes = sorted(n for n in tau if n > 0 and n in step_ms)
    if not sizes or 0 not in step_ms:
        raise ValueError("no tree size has both a τ and a loop step, or plain decoding's step is missing")
    table = []
    for n in sizes:
        table.append(
            {
                "nodes": n,
                "tau": tau[n],
                "verify_ms": forward_ms.get(n + 1),
                "step_ms": step_ms[n],
                "tokens_per_s": 1e3 * tau[n] / step_ms[n],
            }
        )
    best = max(table, key=lambda r: r["tokens_per_s"])
    plain = 1e3 / step_ms[0]
    verdict = "against" if best["tokens_per_s"] > plain else "below"
    reason = (
        f"{best['nodes']} drafted nodes: expected {best['tokens_per_s']:.0f} tok/s (τ {best['tau']:.2f}, "
        f"a loop step {best['step_ms']:.1f} ms) {verdict} plain decoding's {plain:.0f} (a loop step {step_ms[0]:.1f} ms)"
    )
    if verdict == "below":
        reason += ": on this machine plain decoding is expected faster at every tree size"
    return SizeChoice(best["nodes"], reason, table, calibrated=True, plain_tokens_per_s=plain)


def calibrate_drafter(
    target: Target, drafter: Drafter, head_dir: str | os.PathLike | None, fallback: int, threads: int | None = None
) -> SizeChoice:
    """The tree size for `drafter` (built at its largest size) on this machine: its loop steps by size
    (cached like the forward costs, keyed by the drafter's head and parameters too) against the head's
    τ table. Without a table, `fallback`, with the reason."""
    tau = read_tau_table(head_dir)
    if tau is None:
        return SizeChoice(fallback, f"{fallback} drafted nodes (the device default: the head has no {TAU_FILE} to calibrate with)")
    costs = measure.forward_costs(target, threads)
    sizes = sorted(n for n in tau if n + 1 in costs.ms and n <= drafter.max_nodes)
    if not sizes:
        return SizeChoice(
            fallback, f"{fallback} drafted nodes (the device default: the head's {TAU_FILE} has no size up to {drafter.max_nodes})"
        )
    key = {
        **measure.machine_key(target, threads or torch.get_num_threads()),
        "kind": "loop",
        "drafter": drafter.name,
        "head": str(head_dir),
        # the head's kernel weights (Q8_0 or its own dtype) change what drafting costs
        "head_int8": bool(getattr(getattr(drafter, "fast", None), "int8", False)),
        "params": repr(getattr(drafter, "params", None)),
        "sizes": sizes,
    }
    path = measure.cache_path("loop", key)
    step_ms, data = None, measure.read_cache(path, key)
    if data is not None:
        try:
            step_ms = {int(n): float(v) for n, v in data["step_ms"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged file: measured again and rewritten
    if step_ms is None:
        step_ms = measure.loop_step_ms(target, drafter, [0, *measure.loop_sizes(costs.ms, tau, sizes)])
        measure.write_cache(path, {"key": key, "step_ms": step_ms, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})
    return choose_max_nodes(costs.ms, tau, step_ms)


def calibrate_unset_sizes(
    target: Target, configs: DrafterConfigs, unset, log=None, known: dict[str, SizeChoice] | None = None, enabled: bool = True
) -> tuple[DrafterConfigs, dict[str, SizeChoice]]:
    """For each drafter in `unset` (whose tree size the user left unset), the size calibrated on this
    machine: returns the configs with those sizes and the choices (with their reasons) by drafter.
    An EAGLE3 without a τ table follows DART's size, so both verify trees of one size. Only on the CPU
    kernel path or a CUDA GPU's fixed-shape forward (measure.calibrated_rows) and when `enabled`
    (--no-calibration turns it off): elsewhere the configs come back as
    they were. `known`: choices already made on this target with these configs (choose_weights makes
    DART's), used instead of timing the drafter again."""
    from ...drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD
    from ...drafters.config import default_max_nodes
    from ...drafters.head import resolve_head_dir

    rows = measure.calibrated_rows(target)
    if not enabled or not rows:
        return configs, {}
    defaults = {"dart": DEFAULT_DART_HEAD, "eagle3": DEFAULT_EAGLE3_HEAD}
    fallback = default_max_nodes(target.device.type)
    choices = {}
    for method in [m for m in ("dart", "eagle3") if m in unset]:  # DART first: an uncalibrated EAGLE3 follows it
        config = configs[method]
        if known and method in known:
            choice = known[method]
        else:
            head_dir = resolve_head_dir(config.head) if config.head is not None else defaults[method]
            drafter = measure.build_measured(method, target, replace(config, max_nodes=rows - 1))
            choice = calibrate_drafter(target, drafter, head_dir, fallback)
        if choice.calibrated or method == "dart":
            configs = replace(configs, **{method: replace(config, max_nodes=choice.max_nodes)})
        else:
            configs = replace(configs, eagle3=replace(config, max_nodes=configs.dart.max_nodes))
        choices[method] = choice
        if log is not None:
            log(f"{method} tree size: {choice.reason}")
    return configs, choices
