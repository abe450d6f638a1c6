"""The embedded default's weights path (`--dtype auto`): each candidate is loaded and measured, and the
one whose DART is expected fastest at its best tree size runs (choose_weights)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ...drafters.config import DartConfig
from ...target import Target
from . import measure, tree_size
from .tau import TAU_FILE, read_tau_table

# The paths --dtype auto chooses between for the embedded default: those that give the model's own
# answers, i.e. teacher-forced top-1 agreement with its fp32 copy of at least 99.5% on held-out prompts
# (`dart-fidelity`, docs/engine.md): its GGUF blocks against fp32 activations
# (exactly the fp32 copy: fp32 FMAs a verify row) and against 16-bit activations (integer dot products:
# nearly int8's step, twice its cost a verify row). Left to be asked for by name: gguf-int8 (llama.cpp's
# arithmetic, the cheapest step and verify rows, ~98% agreement) and bfloat16 (2.8x the bytes a step,
# ~98.5%); float32 streams twice bf16's bytes and computes what gguf computes.
WEIGHTS_CANDIDATES = ("gguf", "gguf-int16")
AUTO_FALLBACK = "bfloat16"  # --dtype auto where nothing is measured: the default before auto existed


@dataclass(frozen=True)
class WeightsChoice:
    dtype: str  # the --dtype auto stands for here
    reason: str  # one line for logs, the bench's environment and the app's header
    # per candidate measured: dtype, weights, forward_ms {rows: ms}, measured_at, plain_tokens_per_s,
    # dart (tree_size.SizeChoice.as_dict() at its best size, or None), tokens_per_s (what the paths are ranked by)
    paths: list[dict] = field(default_factory=list)
    calibrated: bool = False  # False: not measured (another target, no kernels, --no-calibration): the reason says why
    rule: str = ""  # "dart": expected DART tokens/s; "plain": one-token steps (no τ table to rank DART by)
    measured_at: str = ""  # when the choice was made (its forward costs may be older: paths[i]["measured_at"])
    from_cache: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    def path(self, dtype: str) -> dict | None:
        return next((p for p in self.paths if p["dtype"] == dtype), None)


def fixed_weights(model, device, use_kernels: bool, no_calibration: bool = False) -> WeightsChoice | None:
    """What --dtype auto is where there is nothing to measure between (None: measure). An HF
    checkpoint has no GGUF beside it and keeps bfloat16, the default before auto; so do the eager and
    CUDA paths (GGUF blocks run on the CPU kernels only) and --no-calibration (no measurement)."""
    from ... import kernels
    from ...loading import DEFAULT_MODEL

    if str(model or DEFAULT_MODEL) != DEFAULT_MODEL:
        why = "the target is not the embedded default, so it has no GGUF to compare with"
    elif torch.device(device).type != "cpu":
        why = f"GGUF blocks run on the CPU kernels, and the target is on {device}"
    elif not use_kernels:
        why = "GGUF blocks run on the CPU kernels, and --eager turns them off"
    elif not kernels.AVAILABLE:
        why = "the CPU kernels are not built here (pip install -e . builds them), and GGUF blocks need them"
    elif no_calibration:
        why = "--no-calibration: nothing measured"
    else:
        return None
    return WeightsChoice(AUTO_FALLBACK, f"{AUTO_FALLBACK} ({why})")


def _config_key(config: DartConfig) -> dict:
    """DART's settings but its tree size (keyed apart): the drafting cost and τ depend on them, so
    they key the cached weights choice."""
    return {k: str(v) for k, v in asdict(config).items() if k != "max_nodes"}


def rank_weights(entries: list[dict], rule: str, why_plain: str | None = None) -> WeightsChoice:
    """The measured path with the most expected tokens/s (entries as WeightsChoice.paths), with the reason."""
    if not entries:
        raise ValueError("no weights path was measured")
    best = max(entries, key=lambda e: e["tokens_per_s"])
    others = [e for e in entries if e is not best]

    def says(e: dict) -> str:
        if rule == "dart":
            return f"{e['tokens_per_s']:.0f} tok/s at {e['dart']['max_nodes']} drafted nodes"
        return f"{1e3 / e['plain_tokens_per_s']:.1f} ms"

    if rule == "dart":
        reason = (
            f"{best['weights']}: DART expected {says(best)}"
            + "".join(f", against {e['dtype']}'s {says(e)}" for e in others)
            + " (τ / the generation loop's step at that size, timed on this machine)"
        )
    else:
        reason = (
            f"{best['weights']}: the cheapest one-token step, {says(best)}"
            + "".join(f", against {e['dtype']}'s {says(e)}" for e in others)
            + f" (DART's speed cannot rank the paths: {why_plain or 'no τ table'})"
        )
    paths = [{**e, "chosen": e is best} for e in entries]
    return WeightsChoice(best["dtype"], reason, paths, calibrated=True, rule=rule, measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))


def choose_weights(
    model=None,
    device="cpu",
    use_kernels: bool = True,
    config: DartConfig | None = None,
    threads: int | None = None,
    refresh: bool = False,
    log=None,
    enabled: bool = True,
) -> tuple[Target, WeightsChoice, tree_size.SizeChoice | None]:
    """--dtype auto: the target loaded on the weights path that makes DART fastest on this machine,
    the choice (with every candidate's costs), and DART's tree size on that path (None where it was not
    calibrated: the bench and the app pass it to calibrate_unset_sizes, which then does not time DART again).

    For the embedded default on the CPU kernels each WEIGHTS_CANDIDATES path is loaded and its forward
    costs measured (measure.forward_costs: cached as before), then the generation loop's steps on it, plain and
    with DART at each tree size (measure.loop_step_ms), and the head's τ table is the one it ships. Each path
    is ranked by DART's
    expected tokens/s at its best tree size (config.max_nodes N: at N); without a τ table, by the
    one-token step. The choice is cached beside the forward costs, keyed by the host, the τ table and
    DART's config; a later start loads only the chosen path. Elsewhere, or not `enabled`: fixed_weights."""
    from ...drafters import DEFAULT_DART_HEAD
    from ...drafters.head import resolve_head_dir
    from ...loading import DEFAULT_MODEL, resolve_model_dir
    from ...target import load_target

    model = model or DEFAULT_MODEL
    config = config if config is not None else DartConfig()
    say = log or (lambda msg: None)
    fixed = fixed_weights(model, device, use_kernels, not enabled)
    if fixed is not None:
        return load_target(model, device, fixed.dtype, kernels=use_kernels), fixed, None
    threads = threads or torch.get_num_threads()
    head_dir = resolve_head_dir(config.head) if config.head is not None else DEFAULT_DART_HEAD
    tau, why_plain = None, None
    if not (Path(head_dir) / "config.json").is_file():
        why_plain = f"no DART head at {head_dir}"
    else:
        tau = read_tau_table(head_dir)
        if tau is None:
            why_plain = f"the DART head has no {TAU_FILE}"
    sizes = sorted(n for n in (tau or {}) if n + 1 <= measure.MAX_CALIBRATED_ROWS)
    if config.max_nodes is not None and tau is not None:
        sizes = [config.max_nodes] if config.max_nodes in sizes else []
        if not sizes:
            why_plain = f"--max-nodes {config.max_nodes} is not a calibrated size (1-{measure.MAX_CALIBRATED_ROWS - 1} with a τ)"
    key = {
        **measure.host_key(threads),
        "kind": "weights",
        "model_dir": str(resolve_model_dir(model)),
        "candidates": list(WEIGHTS_CANDIDATES),
        "tau": {str(n): tau[n] for n in sizes} if sizes else None,
        "dart_config": _config_key(config),
        "max_nodes": config.max_nodes,
    }
    path = measure.cache_path("weights", key)
    data = None if refresh else measure.read_cache(path, key)
    if data is not None:
        try:
            paths = [{**e, "forward_ms": {int(k): float(v) for k, v in e["forward_ms"].items()}} for e in data["choice"]["paths"]]
            choice = WeightsChoice(**{**data["choice"], "paths": paths, "from_cache": True})
            say(f"weights: {choice.reason} (cached {choice.measured_at})")
            entry = choice.path(choice.dtype)
            dart = tree_size.SizeChoice(**entry["dart"]) if entry and entry.get("dart") else None
            return load_target(model, device, choice.dtype, kernels=use_kernels), choice, dart
        except (ValueError, KeyError, TypeError):
            pass  # a damaged file: measured again and rewritten
    entries, kept = [], None
    for dtype in WEIGHTS_CANDIDATES:
        say(f"weights path {dtype}: loading and measuring its forward cost by rows")
        target = load_target(model, device, dtype, kernels=use_kernels)
        costs = measure.forward_costs(target, threads, refresh=refresh)
        entry = {
            "dtype": dtype,
            "weights": target.weights,
            "forward_ms": costs.ms,
            "measured_at": costs.measured_at,
            "plain_tokens_per_s": 1e3 / costs.ms[1],
            "dart": None,
        }
        if sizes and why_plain is None:
            timed = measure.loop_sizes(costs.ms, tau, sizes)
            say(f"timing the generation loop's steps beside {dtype}: plain decoding and DART at {len(timed)} tree sizes")
            try:
                drafter = measure.build_measured("dart", target, replace(config, max_nodes=max(timed)))
                step_ms = measure.loop_step_ms(target, drafter, [0, *timed])
                del drafter  # it holds this path's target: let it go if another path wins
            except (OSError, ValueError) as e:  # a head that does not load: rank by the step, and say why
                why_plain = f"the DART head did not load: {e}"
            else:
                dart = tree_size.choose_max_nodes(costs.ms, {n: tau[n] for n in sizes}, step_ms)
                entry.update(dart=dart.as_dict(), tokens_per_s=max(r["tokens_per_s"] for r in dart.table))
                entry["plain_tokens_per_s"] = dart.plain_tokens_per_s  # the loop's plain step, as DART's is
        if entry["dart"] is None:
            entry["tokens_per_s"] = entry["plain_tokens_per_s"]
        entries.append(entry)
        if kept is None or entry["tokens_per_s"] > kept[1]["tokens_per_s"]:
            kept = (target, entry)  # the loser is dropped here: only one target stays in memory for long
        del target
    # every path is ranked by the same rule: DART's speed where drafting was timed for all, else the step
    rule = "dart" if why_plain is None and all(e["dart"] for e in entries) else "plain"
    if rule == "plain":
        for e in entries:
            e.update(dart=None, tokens_per_s=e["plain_tokens_per_s"])
    choice = rank_weights(entries, rule, why_plain)
    target = kept[0] if kept[1]["dtype"] == choice.dtype else load_target(model, device, choice.dtype, kernels=use_kernels)
    measure.write_cache(path, {"key": key, "choice": choice.as_dict()})
    say(f"weights: {choice.reason}")
    entry = choice.path(choice.dtype)
    return target, choice, (tree_size.SizeChoice(**entry["dart"]) if entry["dart"] else None)


def weights_table(choice: WeightsChoice) -> str:
    """The per-path table of a measured choice, as text (the command line's, the bench's log)."""
    lines = []
    for e in choice.paths:
        ms = {int(k): v for k, v in e["forward_ms"].items()}
        line = f"  {'*' if e.get('chosen') else ' '} {e['dtype']:<9} step {ms[1]:6.2f} ms (plain {e['plain_tokens_per_s']:5.0f} tok/s)"
        if e.get("dart"):
            n = e["dart"]["max_nodes"]
            row = next(r for r in e["dart"]["table"] if r["nodes"] == n)
            line += (
                f"; DART at {n} nodes: verify {ms[n + 1]:.2f} ms ({ms[n + 1] / ms[1]:.2f}x) alone, a loop step "
                f"{row['step_ms']:.2f} ms, expected {e['tokens_per_s']:.0f} tok/s"
            )
        lines.append(line)
    return "\n".join(lines)
