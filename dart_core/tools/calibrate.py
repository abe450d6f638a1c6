"""The tree size (and, for the embedded default, the weights path) that makes a drafter fastest on
this machine, from measured costs.

Speculation pays only while a verify of n+1 rows costs little more than a one-row step, and that
ratio depends on the CPU, the kernel build, the weights (bf16, GGUF blocks) and the thread count:
on one Xeon a 6-row GGUF verify costs 1.8x a step, a bf16 one 1.4x, and the forced AVX2 build 2.8x
(docs/engine.md). So the CPU default is measured, not a constant:

    expected tokens/s at n drafted nodes = τ(n) / step(n)      plain decoding: 1 / step(0)

- step(n): the generation loop's own step at n drafted nodes (n = 0: plain decoding), timed in the
  loop itself on one prompt of about PREFIX tokens (loop_step_ms): drafting, pruning, the verify of
  n + 1 rows, acceptance and the loop's bookkeeping, each after the others as they run. Timed apart,
  the pieces added up to less than the loop spends (a 4-row verify cost 1.56x a step alone and 1.73x
  in the loop, the drafting and pruning 2-5x more right after a verify: caches hold the verify's data);
- forward(k): the target's forward of k new rows after PREFIX committed tokens, measured alone (median
  of a few runs, 1..MAX_CALIBRATED_ROWS rows): what a verify costs by rows, for the tables and the docs;
  both are cached per machine, kernel build, weights and threads under ~/.cache/dart-demo/calibration/
  (a second start reads them back);
- τ(n): the head's tokens per target forward at n nodes, measured offline by exact replay on held-out
  prompts and shipped beside the head as TAU_FILE (`dart-calibrate --write-tau HEAD`
  writes it, with the command and prompts). A head without one keeps the device default, and says so.

Where no size beats plain decoding the choice is still the fastest size (DART is what was asked
for), and its reason says that plain decoding is expected faster on this machine.

The same rule picks the weights path of the embedded default (`--dtype auto`, the default of the bench,
the app and this module's command line; choose_weights): each candidate path (its own GGUF blocks,
bf16) is loaded and measured, and the one whose DART is expected fastest at its best tree size runs.

The choice is a prediction; the bench CLI is the measurement (`--max-nodes N` and `--dtype` override).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..drafters.config import DartConfig, DrafterConfigs
from ..generate import Drafter, DraftSession, Proposal
from ..target import Target
from .replay import GreedyRecord, record_greedy, replay

TAU_FILE = "tree_sizes.json"  # beside a head's config.json: τ by tree size, by replay
CALIBRATION_VERSION = 5  # bump when what is measured changes, so old cached files are not read
MAX_CALIBRATED_ROWS = 17  # verify rows timed: trees of up to 16 drafted nodes
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


# ------------------------------------------------------------------------------ the measurements


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
    from .. import kernels

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
    root = Path(__file__).resolve().parent.parent  # dart_core/: the engine's files
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
    from .. import kernels

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
    """What a forward's cost depends on: the host (CPU, kernel build, threads), the model and its weights."""
    return {
        **host_key(threads),
        "model": target.name,
        "model_dir": str(target.model_dir),
        "weights": target.weights,
        "device": str(target.device),
    }


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
    from ..loading import cache_root

    return cache_root() / "calibration"


def _cache_path(kind: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return calibration_dir() / f"{kind}-{digest}.json"


def _read_cache(path: Path, key: dict) -> dict | None:
    """A cache file's data if it is there, parses and was written for `key`, else None: a damaged or
    stale file is measured again (and rewritten) rather than trusted. Callers read its fields."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def _write_cache(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: a reader never sees half a file
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def cached_forward_costs(target: Target, threads: int | None = None, rows: int | None = None) -> ForwardCosts | None:
    """The forward costs cached for this machine, build, weights and threads, or None: never measures
    (the app's "why" view shows what the calibration measured, and adds no timing to a start)."""
    threads, rows = threads or torch.get_num_threads(), rows or MAX_CALIBRATED_ROWS
    key = machine_key(target, threads)
    data = _read_cache(_cache_path("forwards", key), key)
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
    threads, rows = threads or torch.get_num_threads(), rows or MAX_CALIBRATED_ROWS
    if not refresh:
        cached = cached_forward_costs(target, threads, rows)
        if cached is not None:
            return cached
    key = machine_key(target, threads)
    ms = measure_forwards(target, range(1, rows + 1))
    costs = ForwardCosts(key, ms, time.strftime("%Y-%m-%d %H:%M:%S"))
    _write_cache(_cache_path("forwards", key), {"key": key, "ms": ms, "measured_at": costs.measured_at})
    return costs


class _CappedSession:
    def __init__(self, session: DraftSession, max_nodes: int):
        self.session, self.max_nodes = session, max_nodes

    def extend(self, ids, hidden) -> None:
        self.session.extend(ids, hidden)

    def propose(self, root: int, max_nodes: int) -> Proposal:
        return self.session.propose(root, min(self.max_nodes, max_nodes))


class SizeCapped:
    """`drafter` with trees of at most `max_nodes` drafted nodes: the same trees as the drafter built
    at that size (both drafters cut their pool to the size the loop allows), without rebuilding it."""

    def __init__(self, drafter: Drafter, max_nodes: int):
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        self.drafter, self.max_nodes = drafter, max_nodes
        self.name, self.needs_hidden = drafter.name, drafter.needs_hidden

    def new_session(self, capacity: int) -> _CappedSession:
        return _CappedSession(self.drafter.new_session(capacity), self.max_nodes)


def drafting_ms(drafter: Drafter, record: GreedyRecord, sizes: list[int]) -> dict[int, float]:
    """Wall ms per step that `drafter` spends drafting and pruning at each tree size, timed by exact
    replay of one greedy record (the head forward and the pruner are real; nothing else runs)."""
    out = {}
    for n in sizes:
        capped = SizeCapped(drafter, n)
        replay(capped, record)  # warm-up: first-use allocations, the pruner's tables
        t0 = time.perf_counter()
        r = replay(capped, record)
        out[n] = (time.perf_counter() - t0) * 1e3 / max(1, len(r.accepted))
    return out


def with_row_costs(target: Target, config: DartConfig, threads: int | None = None) -> DartConfig:
    """`config` with the step cost by rows an adaptive tree is sized against (DartConfig.row_costs):
    the target's forward cost by rows on this machine (forward_costs: measured once per machine, build,
    weights and threads, then cached) plus the drafter's own drafting time, timed here by replay of one
    short greedy decode. Unchanged when the config is not adaptive or already has its costs."""
    from ..drafters.registry import build_drafter

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
    from ..drafters.registry import build_drafter

    if method == "dart":
        config = with_row_costs(target, config, threads)
    return build_drafter(method, target, config)


def loop_step_ms(target: Target, drafter: Drafter | None, sizes: list[int], steps: int | None = None) -> dict[int, float]:
    """Median wall ms of one generation-loop step at each size in `sizes` (0: plain decoding; others:
    `drafter` capped at that many drafted nodes), greedy on LOOP_PROMPT: the loop's own StepEvent times
    (drafting, pruning, verify and the rest). The sizes are timed in ROUNDS passes so that a busy spell
    of the machine falls on all of them; each run's first LOOP_WARMUP steps and LOOP_SETTLE_S seconds
    are not timed (its first steps follow its prefill and another size's verifies)."""
    from ..generate import ARDrafter, GenerationParams, StepEvent, generate

    steps = steps or LOOP_STEPS
    per_round = max(1, -(-steps // ROUNDS))
    ids = target.encode([{"role": "user", "content": LOOP_PROMPT}])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(ROUNDS):
        for n in sizes:
            if n > 0 and drafter is None:
                raise ValueError("loop_step_ms: sizes above 0 need a drafter")
            d = ARDrafter() if n == 0 else SizeCapped(drafter, n)
            got: list[float] = []
            warm, settled = 0, 0.0
            # stops at EOS too: a size whose run ends early is timed again in the next pass
            for ev in generate(target, ids, d, GenerationParams(max_new_tokens=LOOP_MAX_TOKENS)):
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


# ------------------------------------------------------------------------------ τ by tree size


def read_tau_table(head_dir: str | os.PathLike | None) -> dict[int, float] | None:
    """τ by drafted nodes from the head's TAU_FILE, or None where the head has none. A file that is
    there but unreadable is an error (it would silently change the tree size otherwise)."""
    if head_dir is None:
        return None
    path = Path(head_dir) / TAU_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        table = {int(n): float(t) for n, t in data["tau"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a τ-by-tree-size table ({e}); rewrite it with dart-calibrate --write-tau") from None
    if not table or any(n < 1 or t < 1.0 for n, t in table.items()):
        raise ValueError(f"{path}: τ must be >= 1 at sizes >= 1")
    return table


def tau_by_size(drafter: Drafter, records: list[GreedyRecord], sizes: list[int]) -> dict[int, float]:
    """τ (tokens per target forward, the prefill counted) of `drafter` at each size, summed over the
    records, by exact replay."""
    out = {}
    for n in sizes:
        capped = SizeCapped(drafter, n)
        runs = [replay(capped, rec) for rec in records]
        out[n] = sum(r.new_tokens for r in runs) / sum(r.steps for r in runs)
    return out


# ------------------------------------------------------------------------------ the choice


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
    a loop step (step_ms: loop_step_ms, 0 = plain decoding's step, which the reason compares with);
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
    costs = forward_costs(target, threads)
    sizes = sorted(n for n in tau if n + 1 in costs.ms and n <= drafter.max_nodes)
    if not sizes:
        return SizeChoice(
            fallback, f"{fallback} drafted nodes (the device default: the head's {TAU_FILE} has no size up to {drafter.max_nodes})"
        )
    key = {
        **machine_key(target, threads or torch.get_num_threads()),
        "kind": "loop",
        "drafter": drafter.name,
        "head": str(head_dir),
        # the head's kernel weights (Q8_0 or its own dtype) change what drafting costs
        "head_int8": bool(getattr(getattr(drafter, "fast", None), "int8", False)),
        "params": repr(getattr(drafter, "params", None)),
        "sizes": sizes,
    }
    path = _cache_path("loop", key)
    step_ms, data = None, _read_cache(path, key)
    if data is not None:
        try:
            step_ms = {int(n): float(v) for n, v in data["step_ms"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged file: measured again and rewritten
    if step_ms is None:
        step_ms = loop_step_ms(target, drafter, [0, *loop_sizes(costs.ms, tau, sizes)])
        _write_cache(path, {"key": key, "step_ms": step_ms, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})
    return choose_max_nodes(costs.ms, tau, step_ms)


def calibrate_unset_sizes(
    target: Target, configs: DrafterConfigs, unset, log=None, known: dict[str, SizeChoice] | None = None, enabled: bool = True
) -> tuple[DrafterConfigs, dict[str, SizeChoice]]:
    """For each drafter in `unset` (whose tree size the user left unset), the size calibrated on this
    machine: returns the configs with those sizes and the choices (with their reasons) by drafter.
    An EAGLE3 without a τ table follows DART's size, so both verify trees of one size. Only on the CPU
    kernel path and when `enabled` (--no-calibration turns it off): elsewhere the configs come back as
    they were. `known`: choices already made on this target with these configs (choose_weights makes
    DART's), used instead of timing the drafter again."""
    from ..drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD
    from ..drafters.config import default_max_nodes
    from ..drafters.head import resolve_head_dir

    if not enabled or not target.model.kernel_path(MAX_CALIBRATED_ROWS, target.device):
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
            drafter = build_measured(method, target, replace(config, max_nodes=MAX_CALIBRATED_ROWS - 1))
            choice = calibrate_drafter(target, drafter, head_dir, fallback)
        if choice.calibrated or method == "dart":
            configs = replace(configs, **{method: replace(config, max_nodes=choice.max_nodes)})
        else:
            configs = replace(configs, eagle3=replace(config, max_nodes=configs.dart.max_nodes))
        choices[method] = choice
        if log is not None:
            log(f"{method} tree size: {choice.reason}")
    return configs, choices


# ------------------------------------------------------------------------------ the weights path

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
    # dart (SizeChoice.as_dict() at its best size, or None), tokens_per_s (what the paths are ranked by)
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
    from .. import kernels
    from ..loading import DEFAULT_MODEL

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
) -> tuple[Target, WeightsChoice, SizeChoice | None]:
    """--dtype auto: the target loaded on the weights path that makes DART fastest on this machine,
    the choice (with every candidate's costs), and DART's tree size on that path (None where it was not
    calibrated: the bench and the app pass it to calibrate_unset_sizes, which then does not time DART again).

    For the embedded default on the CPU kernels each WEIGHTS_CANDIDATES path is loaded and its forward
    costs measured (forward_costs: cached as before), then the generation loop's steps on it, plain and
    with DART at each tree size (loop_step_ms), and the head's τ table is the one it ships. Each path
    is ranked by DART's
    expected tokens/s at its best tree size (config.max_nodes N: at N); without a τ table, by the
    one-token step. The choice is cached beside the forward costs, keyed by the host, the τ table and
    DART's config; a later start loads only the chosen path. Elsewhere, or not `enabled`: fixed_weights."""
    from ..drafters import DEFAULT_DART_HEAD
    from ..drafters.head import resolve_head_dir
    from ..loading import DEFAULT_MODEL, resolve_model_dir
    from ..target import load_target

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
    sizes = sorted(n for n in (tau or {}) if n + 1 <= MAX_CALIBRATED_ROWS)
    if config.max_nodes is not None and tau is not None:
        sizes = [config.max_nodes] if config.max_nodes in sizes else []
        if not sizes:
            why_plain = f"--max-nodes {config.max_nodes} is not a calibrated size (1-{MAX_CALIBRATED_ROWS - 1} with a τ)"
    key = {
        **host_key(threads),
        "kind": "weights",
        "model_dir": str(resolve_model_dir(model)),
        "candidates": list(WEIGHTS_CANDIDATES),
        "tau": {str(n): tau[n] for n in sizes} if sizes else None,
        "dart_config": _config_key(config),
        "max_nodes": config.max_nodes,
    }
    path = _cache_path("weights", key)
    data = None if refresh else _read_cache(path, key)
    if data is not None:
        try:
            paths = [{**e, "forward_ms": {int(k): float(v) for k, v in e["forward_ms"].items()}} for e in data["choice"]["paths"]]
            choice = WeightsChoice(**{**data["choice"], "paths": paths, "from_cache": True})
            say(f"weights: {choice.reason} (cached {choice.measured_at})")
            entry = choice.path(choice.dtype)
            dart = SizeChoice(**entry["dart"]) if entry and entry.get("dart") else None
            return load_target(model, device, choice.dtype, kernels=use_kernels), choice, dart
        except (ValueError, KeyError, TypeError):
            pass  # a damaged file: measured again and rewritten
    entries, kept = [], None
    for dtype in WEIGHTS_CANDIDATES:
        say(f"weights path {dtype}: loading and measuring its forward cost by rows")
        target = load_target(model, device, dtype, kernels=use_kernels)
        costs = forward_costs(target, threads, refresh=refresh)
        entry = {
            "dtype": dtype,
            "weights": target.weights,
            "forward_ms": costs.ms,
            "measured_at": costs.measured_at,
            "plain_tokens_per_s": 1e3 / costs.ms[1],
            "dart": None,
        }
        if sizes and why_plain is None:
            timed = loop_sizes(costs.ms, tau, sizes)
            say(f"timing the generation loop's steps beside {dtype}: plain decoding and DART at {len(timed)} tree sizes")
            try:
                drafter = build_measured("dart", target, replace(config, max_nodes=max(timed)))
                step_ms = loop_step_ms(target, drafter, [0, *timed])
                del drafter  # it holds this path's target: let it go if another path wins
            except (OSError, ValueError) as e:  # a head that does not load: rank by the step, and say why
                why_plain = f"the DART head did not load: {e}"
            else:
                dart = choose_max_nodes(costs.ms, {n: tau[n] for n in sizes}, step_ms)
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
    _write_cache(path, {"key": key, "choice": choice.as_dict()})
    say(f"weights: {choice.reason}")
    entry = choice.path(choice.dtype)
    return target, choice, (SizeChoice(**entry["dart"]) if entry["dart"] else None)


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
