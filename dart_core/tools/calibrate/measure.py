"""The costs the calibration measures on this machine, cached per machine, kernel build, weights and
threads under ~/.cache/dart-demo/calibration/: the target's forward by rows (measure_forwards,
forward_costs), the generation loop's step by tree size (loop_step_ms) and drafting by replay
(drafting_ms); smaller trees are asked of one drafter (GenerationParams.max_nodes, replay's max_nodes)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ...drafters.config import DartConfig
from ...generate import Drafter
from ...target import Target
from ..replay import GreedyRecord, record_greedy, replay

CALIBRATION_VERSION = 5  # bump when what is measured changes, so old cached files are not read
MAX_CALIBRATED_ROWS = 17  # verify rows timed on the CPU kernels: trees of up to 16 drafted nodes
CUDA_CALIBRATED_ROWS = 61  # on a CUDA GPU's fixed-shape forward: trees of up to the paper's 60 nodes
PREFIX = 200  # committed tokens before the timed rows (a chat turn's prompt and some answer)
REPEATS = 9  # timed forwards per row count (median)
ROUNDS = 3  # passes over the row counts; each pass times about REPEATS / ROUNDS forwards of each
# Before a row count is timed, its own forward runs untimed for this long: a forward is slower for
# tens of ms after a bigger one (a one-row int8 step 7.8 ms right after a 17-row forward against 5.1
# after a 4-row one, and 4.6-5.6 in runs of its own, on the Xeon of docs/engine.md), and in the loop
# a step follows a step.
SETTLE_S = 0.05
OVERHEAD_PROMPT = "Write a short paragraph about why the sky is blue."  # the record drafting is timed on
OVERHEAD_TOKENS = 48
# The loop's steps are timed on this request (about PREFIX tokens with the chat template), LOOP_STEPS
# steps a size after untimed ones (LOOP_WARMUP, LOOP_SETTLE_S), in ROUNDS passes over the sizes (median of all).
LOOP_PROMPT = (
    "Summarise the following note for a colleague in three sentences, then list two questions it leaves open.\n\n"
    "The lighthouse on the north cape was automated in 1987, but the keeper's cottage stayed in use as a weather "
    "station until the storm of 2009 took part of its roof. Since then the council has debated three plans: "
    "restoring the cottage as a small museum, letting it to a sailing school, or pulling it down and leaving the "
    "tower alone on the rock. The museum plan has the most public support, yet nobody has costed the repairs to "
    "the sea wall that the access path depends on. The sailing school would pay rent from the first year, but it "
    "needs a slipway, and the harbour authority has not said whether one may be built on that side of the cape. "
    "Demolition is the cheapest option and the one the insurers prefer, although the heritage board has asked to "
    "be consulted first. A decision is due at the spring meeting, and the weather records kept in the cottage "
    "for sixty years still need a new home before then."
)
LOOP_STEPS = 12
# Untimed steps before a size's timed ones: at least LOOP_WARMUP steps and LOOP_SETTLE_S seconds. A
# run starts with its prompt's prefill, and the steps after it are slower for ~0.1 s (on the Xeon of
# docs/engine.md, gguf-int16: plain decoding's step 4.5 ms after 3 untimed steps, 3.7 after 10, 3.55
# after 30, against 3.8 ms in a bench run; DART's 3-node step 8.6 / 8.4 / 7.6 ms, 8.5 in the bench).
# Counted in steps alone, the short one-token step still carried that cost and speculation looked
# ~15% better against it than it was.
LOOP_WARMUP = 3
LOOP_SETTLE_S = 0.2
LOOP_MAX_TOKENS = 512  # a run's cap; LOOP_PROMPT's answer ends (EOS) well before it
# Only sizes whose τ per ms of verify alone is within this fraction of the best size's are timed in the
# loop: a loop step costs at least its verify, so the others cannot win (and timing all 16 sizes on
# three weights paths took 1.5 minutes of a first start).
LOOP_SHORTLIST = 0.7


def cpu_model() -> str:
    """/proc/cpuinfo's first "model name" (platform.processor() where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def kernel_build_digest() -> str | None:
    """A digest of the loaded kernel extension's file: a rebuilt build (new code under the same name,
    e.g. avx512bf16) costs otherwise, so the costs measured on the old one are not read back for it."""
    from ... import kernels

    path = getattr(getattr(kernels, "_ext", None), "__file__", None)
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return None


# The Python a decoding step runs (the loop, the target's forward around the kernels, the drafters)
# and the n-gram extension: a change there changes what a step costs as a kernel rebuild does.
STEP_SOURCES = (
    "generate.py",
    "tree.py",
    "model.py",
    "hf_checkpoint.py",
    "gguf_checkpoint.py",
    "kernels/*.py",
    "target.py",
    "sampling.py",
    "drafters/*.py",
)


def step_code_digest() -> str:
    """A digest of the code a decoding step runs besides the kernel build (STEP_SOURCES and the
    ngram_cpp extension), so costs timed with other drafting code are measured again, not read back."""
    import ngram_cpp

    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]  # dart_core/: the engine's files
    missing = [p for p in STEP_SOURCES if not any(root.glob(p))]
    if missing:  # a renamed file would drop out of the digest unseen
        raise RuntimeError(f"STEP_SOURCES names files that are not in {root}: {missing}")
    files = sorted(f for pattern in STEP_SOURCES for f in root.glob(pattern))
    ext = getattr(getattr(ngram_cpp, "_ngram", None), "__file__", None)
    for f in [*files, *([Path(ext)] if ext else [])]:
        try:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        except OSError:
            h.update(f.name.encode() + b"\0?")
    return h.hexdigest()[:16]


def host_key(threads: int) -> dict:
    """What any cost measured here depends on besides the model: the CPU model and flags, the kernel
    build (its name and its file), the step's other code (step_code_digest), threads and torch."""
    from ... import kernels

    cpu, flags = cpu_model(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "flags":
                flags = " ".join(sorted(f for f in value.split() if f.startswith(("avx", "amx", "fma"))))
                break
    except OSError:
        pass
    return {
        "version": CALIBRATION_VERSION,
        "cpu": cpu,
        "cpu_flags": flags,
        "kernels": kernels.describe(),
        "kernel_build": kernel_build_digest(),
        "step_code": step_code_digest(),
        "threads": threads,
        "torch": torch.__version__,
    }


def machine_key(target: Target, threads: int) -> dict:
    """What a forward's cost depends on: the host (CPU, kernel build, threads), the GPU where the
    target runs on one, the model and its weights."""
    gpu = {"gpu": torch.cuda.get_device_name(target.device), "cuda": torch.version.cuda} if target.device.type == "cuda" else {}
    return {
        **host_key(threads),
        **gpu,
        "model": target.name,
        "model_dir": str(target.model_dir),
        "weights": target.weights,
        "device": str(target.device),
    }


def calibrated_rows(target: Target) -> int:
    """Verify rows the calibration times on the target's path, 0 where it does not calibrate:
    MAX_CALIBRATED_ROWS on the CPU kernels; CUDA_CALIBRATED_ROWS on a CUDA GPU's fixed-shape forward
    (exact up to its 64 rows, where a wide tree verifies for about the price of one token). Not on the
    eager paths: beyond the fixed rows they are not exact, and on a CPU the fixed forward pads every
    step to its 16 rows, so its cost does not depend on the tree."""
    if target.device.type == "cuda":
        return CUDA_CALIBRATED_ROWS if target.model.fixed_path(CUDA_CALIBRATED_ROWS, target.device) else 0
    return MAX_CALIBRATED_ROWS if target.model.kernel_path(MAX_CALIBRATED_ROWS, target.device) else 0


def _prefilled_cache(target: Target, prefix: int, rows: int):
    """A cache holding `prefix` committed tokens, with room for forwards of up to `rows` new ones
    after them (the timed forwards write there and never commit)."""
    cache = target.new_cache(prefix + rows + 8)
    target.prefill(list(range(100, 100 + prefix)), cache, capture=False)
    cache.commit(prefix)
    return cache


def measure_forwards(target: Target, rows: range | list[int], repeats: int | None = None, prefix: int = PREFIX) -> dict[int, float]:
    """Median wall ms of one target forward of k new rows (a chain after `prefix` committed tokens)
    for each k in `rows`: the one-token step (k = 1) against the verify of a tree of k - 1 nodes.
    The row counts are timed in ROUNDS passes (1, 2, ..., 1, 2, ...), so a busy spell of the machine
    falls on every size alike instead of on a few: it is their ratios that choose the tree size. In
    a pass each count first runs untimed for SETTLE_S, then a few timed forwards back to back, as
    the loop runs them (a forward timed right after another size's was up to 1.7x dearer)."""
    rows, repeats = list(rows), repeats or REPEATS
    per_round = max(1, -(-repeats // ROUNDS))
    times: dict[int, list[float]] = {k: [] for k in rows}
    device = target.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        cache = _prefilled_cache(target, prefix, max(rows))
        inputs = {k: (torch.arange(k, device=target.device) + 500, torch.arange(k, device=target.device) + cache.length) for k in rows}
        for _ in range(ROUNDS):
            for k in rows:
                settle_end, settled = time.perf_counter() + SETTLE_S, 0
                while settled < 2 or time.perf_counter() < settle_end:
                    target.model(*inputs[k], cache)  # writes the rows' keys past the committed length: never committed
                    settled += 1
                for _ in range(per_round):
                    sync()
                    t0 = time.perf_counter()
                    target.model(*inputs[k], cache)
                    sync()  # a GPU forward is timed when its work is done, not when it is queued
                    times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


SPLIT_FORWARDS = 200  # one-token forwards forward_split times, after SPLIT_SETTLE_S of untimed ones
SPLIT_SETTLE_S = 0.5


@dataclass(frozen=True)
class ForwardSplit:
    """Where a one-token step's time goes on the kernels (forward_split): mean ms of one forward and
    of its two parts that read weights, with the bytes each reads."""

    ms: float  # the whole forward, as the generation loop calls it
    layers_ms: float  # the decoder layers (one LayerStack call: linears, norms, attention)
    head_ms: float  # the LM head's linear
    layers_bytes: int  # every layer's linears and norms
    head_bytes: int

    @property
    def rest_ms(self) -> float:
        """The embedding lookup, the attention plan, the final norm and the Python around them."""
        return self.ms - self.layers_ms - self.head_ms


def forward_split(target: Target, forwards: int = SPLIT_FORWARDS, prefix: int = PREFIX) -> ForwardSplit:
    """Time `forwards` one-token forwards back to back after `prefix` committed tokens, as a plain
    decoding step runs them, and the decoder layers and the LM head inside them (the model's
    stage_seconds); the rest is what is left of the forward's wall time."""
    model = target.model
    if not model.kernel_path(1, target.device):
        raise ValueError("forward_split times the kernel path, and this target's one-token forward runs eager torch")
    with torch.inference_mode():
        cache = _prefilled_cache(target, prefix, 1)
        token, position = torch.tensor([500], device=target.device), torch.tensor([cache.length], device=target.device)
        settle_end = time.perf_counter() + SPLIT_SETTLE_S
        while time.perf_counter() < settle_end:
            model(token, position, cache)  # writes past the committed length: never committed
        model.stage_seconds = {}
        try:
            t0 = time.perf_counter()
            for _ in range(forwards):
                model(token, position, cache)
            wall = time.perf_counter() - t0
            stages = model.stage_seconds
        finally:
            model.stage_seconds = None
    head_bytes = model.output.weight.nbytes
    return ForwardSplit(
        ms=wall / forwards * 1e3,
        layers_ms=stages["layers"] / forwards * 1e3,
        head_ms=stages["head"] / forwards * 1e3,
        layers_bytes=model.step_weight_bytes() - head_bytes - model.norm.weight.nbytes,
        head_bytes=head_bytes,
    )


@dataclass(frozen=True)
class ForwardCosts:
    key: dict  # machine_key(): what the costs were measured on
    ms: dict[int, float]  # rows -> median ms of one forward
    measured_at: str
    from_cache: bool = False

    def ratio(self, rows: int) -> float:
        return self.ms[rows] / self.ms[1]


def calibration_dir() -> Path:
    from ...loading import cache_root

    return cache_root() / "calibration"


def cache_path(kind: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return calibration_dir() / f"{kind}-{digest}.json"


def read_cache(path: Path, key: dict) -> dict | None:
    """A cache file's data if it is there, parses and was written for `key`, else None: a damaged or
    stale file is measured again (and rewritten) rather than trusted. Callers read its fields."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def write_cache(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: a reader never sees half a file
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def cached_forward_costs(target: Target, threads: int | None = None, rows: int | None = None) -> ForwardCosts | None:
    """The forward costs cached for this machine, build, weights and threads, or None: never measures
    (the app's "why" view shows what the calibration measured, and adds no timing to a start)."""
    threads, rows = threads or torch.get_num_threads(), rows or calibrated_rows(target) or MAX_CALIBRATED_ROWS
    key = machine_key(target, threads)
    data = read_cache(cache_path("forwards", key), key)
    if data is None:
        return None
    try:
        ms = {int(k): float(v) for k, v in data["ms"].items()}
        if all(k in ms for k in range(1, rows + 1)):
            return ForwardCosts(key, ms, data["measured_at"], from_cache=True)
    except (ValueError, KeyError, TypeError):
        pass  # a damaged cache file is measured again (and rewritten) rather than trusted
    return None


def forward_costs(target: Target, threads: int | None = None, refresh: bool = False, rows: int | None = None) -> ForwardCosts:
    """The target's forward cost by rows on this machine: read back from the calibration cache when
    this machine, build, weights and thread count were measured before (unless `refresh`), else
    measured (~3-10 s) and saved."""
    threads, rows = threads or torch.get_num_threads(), rows or calibrated_rows(target) or MAX_CALIBRATED_ROWS
    if not refresh:
        cached = cached_forward_costs(target, threads, rows)
        if cached is not None:
            return cached
    key = machine_key(target, threads)
    ms = measure_forwards(target, range(1, rows + 1))
    costs = ForwardCosts(key, ms, time.strftime("%Y-%m-%d %H:%M:%S"))
    write_cache(cache_path("forwards", key), {"key": key, "ms": ms, "measured_at": costs.measured_at})
    return costs


def drafting_ms(drafter: Drafter, record: GreedyRecord, sizes: list[int]) -> dict[int, float]:
    """Wall ms per step that `drafter` spends drafting and pruning at each tree size, timed by exact
    replay of one greedy record (the head forward and the pruner are real; nothing else runs)."""
    out = {}
    for n in sizes:
        replay(drafter, record, n)  # warm-up: first-use allocations, the pruner's tables
        t0 = time.perf_counter()
        r = replay(drafter, record, n)
        out[n] = (time.perf_counter() - t0) * 1e3 / max(1, len(r.accepted))
    return out


def with_row_costs(target: Target, config: DartConfig, threads: int | None = None) -> DartConfig:
    """`config` with the step cost by rows an adaptive tree is sized against (DartConfig.row_costs):
    the target's forward cost by rows on this machine (forward_costs: measured once per machine, build,
    weights and threads, then cached) plus the drafter's own drafting time, timed here by replay of one
    short greedy decode. Unchanged when the config is not adaptive or already has its costs."""
    from ...drafters.registry import build_drafter

    if not config.adaptive or config.row_costs:
        return config
    drafter = build_drafter("dart", target, replace(config, adaptive=False, ranking="fitted"))
    costs = forward_costs(target, threads)
    record = record_greedy(target, [{"role": "user", "content": OVERHEAD_PROMPT}], OVERHEAD_TOKENS)
    n = min(drafter.max_nodes, max(costs.ms) - 1)
    draft_ms = drafting_ms(drafter, record, [n])[n]
    return replace(config, row_costs=tuple(costs.ms[r] + draft_ms for r in range(1, max(costs.ms) + 1)))


def build_measured(method: str, target: Target, config, threads: int | None = None):
    """build_drafter, with what the config leaves to this machine measured first (an adaptive DART
    tree's row costs: with_row_costs): the way command lines and the app build drafters."""
    from ...drafters.registry import build_drafter

    if method == "dart":
        config = with_row_costs(target, config, threads)
    return build_drafter(method, target, config)


def loop_step_ms(target: Target, drafter: Drafter | None, sizes: list[int], steps: int | None = None) -> dict[int, float]:
    """Median wall ms of one generation-loop step at each size in `sizes` (0: plain decoding; others:
    `drafter` capped at that many drafted nodes), greedy on LOOP_PROMPT: the loop's own StepEvent times
    (drafting, pruning, verify and the rest). The sizes are timed in ROUNDS passes so that a busy spell
    of the machine falls on all of them; each run's first LOOP_WARMUP steps and LOOP_SETTLE_S seconds
    are not timed (its first steps follow its prefill and another size's verifies)."""
    from ...generate import ARDrafter, GenerationParams, StepEvent, generate

    steps = steps or LOOP_STEPS
    per_round = max(1, -(-steps // ROUNDS))
    ids = target.encode([{"role": "user", "content": LOOP_PROMPT}])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(ROUNDS):
        for n in sizes:
            if n > 0 and drafter is None:
                raise ValueError("loop_step_ms: sizes above 0 need a drafter")
            # the drafter asked for n-node trees the way the app asks it (GenerationParams.max_nodes)
            d, cap = (ARDrafter(), None) if n == 0 else (drafter, n)
            got: list[float] = []
            warm, settled = 0, 0.0
            # stops at EOS too: a size whose run ends early is timed again in the next pass
            for ev in generate(target, ids, d, GenerationParams(max_new_tokens=LOOP_MAX_TOKENS, max_nodes=cap)):
                if not (isinstance(ev, StepEvent) and ev.tree is not None):
                    continue
                step = ev.times.draft + ev.times.prune + ev.times.verify + ev.times.other
                if warm < LOOP_WARMUP or settled < LOOP_SETTLE_S:
                    warm, settled = warm + 1, settled + step
                    continue
                got.append(step)
                if len(got) == per_round:
                    break
            times[n] += got
    missing = [n for n, v in times.items() if not v]
    if missing:
        raise ValueError(f"loop_step_ms: no step timed at sizes {missing} (the prompt's answer ended first)")
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def loop_sizes(forward_ms: dict[int, float], tau: dict[int, float], sizes: list[int]) -> list[int]:
    """The sizes worth timing in the loop: τ(n) / forward(n + 1) within LOOP_SHORTLIST of the best."""
    rate = {n: tau[n] / forward_ms[n + 1] for n in sizes if n + 1 in forward_ms}
    if not rate:
        return []
    top = max(rate.values())
    return [n for n in sizes if n in rate and rate[n] >= LOOP_SHORTLIST * top]
