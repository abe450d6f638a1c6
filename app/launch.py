"""Start the demo:  dart-app   (the embedded default model at http://127.0.0.1:7860).

Flag names follow the upstream DART app where it has them (docs/upstream.md); --dtype, --threads, the
tree parameters and the llama.cpp row's flags are ours. Models load here, once, before the server
starts; importing the package loads nothing.

The llama.cpp row (--compare-llamacpp): compare mode ends with llama.cpp's own binary (`make peers`)
on the GGUF the target came from, with the engine's thread count. By default it is on where it can
run (the binaries are built, and the target is the embedded GGUF model or --gguf names one); the
header says what runs or why nothing does. Asked for with the flag and unable to run, the app starts
anyway and says why in its notes, never silently. The vLLM rows (--compare-vllm vllm,vllm-dart@2):
vLLM's engine in the venv `make vllm` builds, on the target's converted checkpoint, after llama.cpp's
row; off unless asked for, reported the same way.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # the demo phones nowhere

import torch  # noqa: E402

from dart_core import load_target  # noqa: E402
from dart_core.cli.options import (
    AUTO_HELP,
    WEIGHTS_HELP,
    add_drafter_flags,
    add_dtype_flag,
    add_llamacpp_flags,
    add_model_flag,
    add_threads_flag,  # noqa: E402
    drafter_configs,
    unset_sizes,
)
from dart_core.drafters import DEFAULT_DART_HEAD as DEFAULT_DART  # noqa: E402
from dart_core.drafters import DEFAULT_EAGLE3_HEAD as DEFAULT_EAGLE3  # noqa: E402
from dart_core.drafters.config import DartConfig, DrafterConfigs, Eagle3Config  # noqa: E402
from dart_core.drafters.head import trained_record  # noqa: E402
from dart_core.drafters.registry import DEFAULT_HEADS, build_drafter, embedded_head_exists, ngram_choice  # noqa: E402
from dart_core.loading import AUTO, DEFAULT_MODEL, EMBEDDED_NAME, TARGET_DTYPE_CHOICES  # noqa: E402
from dart_core.prefix_cache import DEFAULT_PREFIX_CACHE_MB, PrefixStore  # noqa: E402
from dart_core.tools import calibrate, peers, vllm_peer  # noqa: E402
from dart_core.tools.bench import vllm_dtype  # noqa: E402
from dart_core.tools.methods import METHODS  # noqa: E402

from .engine import (  # noqa: E402
    MIN_REFERENCE_TOKENS,
    PEER_TIMEOUT_S,
    ComputeThread,
    Engine,
    Peer,
    available_cores,
    engine_threads,
    peer_label,
    vllm_label,
)
from .render import CostPath, CostView  # noqa: E402
from .ui import CSS_PATH, Settings, build_demo  # noqa: E402

log = logging.getLogger("app")
DEFAULT_PORT = 7860
DEFAULT_NEW_TOKENS = 128  # the slider's start value (the flag sets its maximum)
WARMUP_PROMPT = "Say hi in one short sentence."
WARMUP_TOKENS = 8
QUEUE_SIZE = 64  # requests waiting beyond this are refused (the queue tells the user)
# The largest tree a visitor may ask for, by device: each drafter is built at this size (or at its
# default, if larger) and serves any smaller tree per request. On a CPU a verified row costs arithmetic,
# so 32 shows what a wide tree costs without stalling the one engine; on a GPU the paper's 60.
APP_MAX_NODES = {"cpu": 32, "cuda": 60}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dart-app", description="DART speculative decoding demo (Gradio).")
    add_model_flag(p, "--base-model-name-or-path")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    add_dtype_flag(
        p,
        AUTO,
        TARGET_DTYPE_CHOICES,
        f"{WEIGHTS_HELP}. {AUTO_HELP} The header says which and why. On a CPU with the C++ kernels every choice gives "
        "greedy texts identical to AR's on that path, bit for bit",
    )
    add_threads_flag(
        p, "torch CPU threads of the engine (default on the CPU: all cores but one, which serves the web page: see app/engine.py)"
    )
    p.add_argument("--template-name", default=None, help="accepted for upstream compatibility; the tokenizer's own chat template is used")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the most a request may ask for")
    p.add_argument("--max-length", type=int, default=2048, help="prompt + output limit in tokens (the conversation must fit)")
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for conversations' KV caches kept between turns, all visitors together (0: every turn prefills "
        "the whole conversation); reuse is exact, and on the CPU kernels turns prompts into kernel forwards",
    )
    add_drafter_flags(p)
    g = p.add_argument_group("compare")
    g.add_argument(
        "--compare-eagle3", action="store_true", help="start in compare mode: each prompt runs through DART, EAGLE3 and AR in turn"
    )
    g.add_argument(
        "--compare-llamacpp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare mode ends with llama.cpp on the same prompt (its own binary, the same GGUF, the engine's thread count); "
        "the flag also starts in compare mode. Default: on where it can run (binaries built by `make peers`, and the "
        "embedded target or --gguf); --no-compare-llamacpp: off. Given but unable to run, the app starts anyway and its header says why",
    )
    add_llamacpp_flags(g)
    g.add_argument(
        "--llamacpp-methods",
        default="llamacpp",
        help=f"comma-separated llama.cpp methods for the compare rows, run in this order (default: llamacpp, plain decoding; "
        f"choices as in the bench: {', '.join(peers.PEER_METHODS)})",
    )
    g.add_argument(
        "--compare-vllm",
        default="",
        metavar="METHODS",
        help="comma-separated vLLM methods compare mode runs after llama.cpp's (e.g. vllm,vllm-eagle3@1,vllm-dart@2: vLLM's plain "
        "decoding, our EAGLE3 head through vLLM's eagle3, our DART head through this project's plugin; @N draft tokens a step). "
        "Each is one vLLM engine on the target's converted checkpoint, in the venv `make vllm` builds (docs/vllm.md), started "
        "with the app (tens of seconds each) and given the engine's thread count. Default: none. Unable to run, the app starts "
        "anyway and its header says why",
    )
    g = p.add_argument_group("server")
    g.add_argument("--listen", action="store_true", help="bind 0.0.0.0 instead of 127.0.0.1")
    g.add_argument("--share", action="store_true", help="ask Gradio for a public link")
    g.add_argument("--server-port", type=int, default=DEFAULT_PORT)
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up generations (faster start, first request slower)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.max_length < 2:
        p.error("--max-new-tokens must be >= 1 and --max-length >= 2")
    args.llamacpp_methods = method_list(p, "--llamacpp-methods", args.llamacpp_methods, peers.split_peer_method)
    args.compare_vllm = method_list(p, "--compare-vllm", args.compare_vllm, vllm_peer.split_vllm_method)
    try:
        drafter_configs(args, args.base_model_name_or_path == DEFAULT_MODEL)  # every drafter flag in range, before anything loads
    except ValueError as e:
        p.error(str(e))
    return args


def method_list(p: argparse.ArgumentParser, flag: str, text: str, split) -> list[str]:
    """A flag's comma-separated peer methods, each checked by `split` (ValueError for a bad one) and none twice."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    try:
        for m in methods:
            split(m)
    except ValueError as e:
        p.error(f"{flag}: {e}")
    if len(set(methods)) != len(methods):
        p.error(f"{flag}: a method is named twice")
    return methods


def head_named(name: str, args) -> bool:
    """Whether the command line named this drafter's head (else the embedded one is used)."""
    return {"dart": args.dart_model, "eagle3": args.eagle3_model}[name] is not None


@dataclass
class Loaded:
    engine: Engine
    notes: list[str]
    pruner: str | None
    progress: Progress
    threads: int | None  # torch CPU threads of the engine (None: left to torch, on a GPU)
    configs: DrafterConfigs  # what the drafters were built from (their tree sizes calibrated where unset)
    peers_line: str | None = None  # the header's line on the llama.cpp row
    tree_line: str | None = None  # the header's line on the tree sizes: calibrated on this machine, or why not
    weights_line: str | None = None  # the header's line on the weights path: chosen here, or given
    costs: CostView | None = None  # the "why" view's forward costs by rows
    costs_note: str = ""
    heads_line: str | None = None  # the header's line on the heads' training (trained.json)


class Progress:
    """Timed start-up messages on stderr, so a slow load is visibly progressing."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, what: str) -> None:
        log.warning("[%5.1fs] %s…", time.perf_counter() - self.t0, what)


def largest_tree(target, default: int) -> int:
    """The largest tree size a visitor may ask for (APP_MAX_NODES), never below `default`; where a
    tree of `default` nodes verifies exactly, cut to the sizes that do too, so no slider position
    leaves the exact path (the CPU kernels are exact at any size, the fixed-shape forward up to its rows)."""
    top = max(default, APP_MAX_NODES.get(target.device.type, APP_MAX_NODES["cpu"]))
    if target.exact_verify(default + 1):
        while top > default and not target.exact_verify(top + 1):
            top -= 1
    return top


def sizes_for_requests(configs: DrafterConfigs, target) -> tuple[DrafterConfigs, dict[str, int]]:
    """The configs the drafters are built with, each at the largest size a request may ask for
    (largest_tree), and each method's default size: the one calibrated or given (--max-nodes,
    --eagle3-max-nodes). A drafter built large and asked for a smaller tree drafts the same trees as one
    built at that size (tests/test_calibrate.py, tests/test_app.py), so the default costs nothing."""
    device = target.device.type
    defaults = {"dart": configs.dart.tree_size(device), "eagle3": configs.eagle3.tree_size(device)}
    built = replace(
        configs,
        dart=replace(configs.dart, max_nodes=largest_tree(target, defaults["dart"])),
        eagle3=replace(configs.eagle3, max_nodes=largest_tree(target, defaults["eagle3"])),
    )
    return built, defaults


def load_dart(config: DartConfig, target, notes: list[str], progress: Progress):
    """The DART drafter, or None with a note when the embedded head is absent or unusable. A head
    named on the command line must load: failing to is an error, not a silent fallback."""
    import ngram_cpp

    explicit = config.head is not None
    if not explicit and not embedded_head_exists("dart"):
        notes.append(f"No trained DART head at {DEFAULT_DART}: only plain decoding (AR) is available.")
        return None
    try:
        ngram = ngram_choice(config, target)  # made once (a hub look-up, maybe a download), for the note too
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    progress(f"loading the DART head {config.head or DEFAULT_DART} and n-gram {ngram.path}")
    try:
        resolved = replace(config, ngram=None if ngram.path is None else str(ngram.path), use_ngram=ngram.path is not None)
        drafter = calibrate.build_measured("dart", target, resolved)
    except (OSError, ValueError) as e:
        if explicit:
            raise SystemExit(f"cannot load the DART head {config.head}: {e}") from None
        notes.append(f"The embedded DART head did not load ({e}): only plain decoding (AR) is available.")
        return None
    if ngram.note:
        notes.append(ngram.note)
    if not ngram_cpp.HAVE_CPP:
        notes.append("The C++ tree pruner is not built here: the pure-Python pruner runs (same trees, slower drafting).")
    return drafter


def load_eagle3(config: Eagle3Config, compare: bool, target, notes: list[str], progress: Progress):
    """The EAGLE3 drafter, or None (with a note in compare mode) when there is no usable head. Like
    DART's: a head named on the command line must load; the embedded one may not fit another target."""
    explicit = config.head is not None
    if not explicit and not embedded_head_exists("eagle3"):
        if compare:
            notes.append(
                "--compare-eagle3: no EAGLE3 head is available for this target (pass --eagle3-model-name-or-path); comparing DART with "
                "plain decoding."
            )
        return None
    progress(f"loading the EAGLE3 head {config.head or DEFAULT_EAGLE3}")
    try:
        return build_drafter("eagle3", target, config)
    except (OSError, ValueError) as e:
        if explicit:
            raise SystemExit(f"cannot load the EAGLE3 head {config.head}: {e}") from None
        if compare:
            notes.append(f"The embedded EAGLE3 head does not fit this target ({e}): comparing DART with plain decoding.")
        return None


def load_weights(args, config: DartConfig, device, notes: list[str], progress: Progress):
    """The target on the weights path --dtype names, or (auto) the one calibrated on this machine for
    DART's `config` (dart_core/tools/calibrate/weights.py: each candidate measured on the first start,
    cached after); returns (target, the choice, DART's tree size timed while choosing or None, the header's line)."""
    if args.dtype != AUTO:
        progress(f"loading the target {args.base_model_name_or_path} ({device}, {args.dtype})")
        target = load_target(args.base_model_name_or_path, device, args.dtype)
        choice = calibrate.WeightsChoice(args.dtype, f"{target.weights} (given: --dtype {args.dtype})")
        return target, choice, None, f"Weights {choice.reason}."
    progress(f"loading the target {args.base_model_name_or_path} ({device}) on the weights path chosen for this machine (--dtype auto)")
    try:
        target, choice, dart = calibrate.choose_weights(
            args.base_model_name_or_path, device, True, config, log=lambda m: log.warning("%s", m), enabled=not args.no_calibration
        )
    except (ValueError, OSError, RuntimeError) as e:  # e.g. a damaged τ table: start on the old default, and say so
        notes.append(f"The weights path was not calibrated ({e}); {calibrate.AUTO_FALLBACK} is used.")
        target = load_target(args.base_model_name_or_path, device, calibrate.AUTO_FALLBACK)
        return target, calibrate.WeightsChoice(calibrate.AUTO_FALLBACK, f"{calibrate.AUTO_FALLBACK} (not calibrated: {e})"), None, None
    if not choice.calibrated:
        return target, choice, None, f"Weights {choice.reason} (--dtype auto; --dtype overrides)."
    when = f"cached from {choice.measured_at}" if choice.from_cache else "measured at this start"
    return target, choice, dart, f"Weights chosen on this machine (--dtype auto, {when}): {choice.reason}. --dtype overrides."


def cost_view(target, weights, dart_nodes: int | None, dart_size) -> tuple[CostView | None, str]:
    """The "why" view: the forward cost by rows the tree size (and, with --dtype auto, the weights path)
    was chosen from, read from the calibration's cache (never timed here), with a note saying what it
    shows or why there is none. `dart_nodes`: DART's tree size in use; `dart_size`: its SizeChoice."""
    from dart_core import kernels

    def expected(table: list[dict], nodes: int | None) -> float | None:
        return next((r["tokens_per_s"] for r in table if r["nodes"] == nodes), None)

    paths = []
    if weights.paths:  # --dtype auto measured every candidate path
        for e in weights.paths:
            ms = {int(k): float(v) for k, v in e["forward_ms"].items()}
            chosen = e["dtype"] == weights.dtype
            table = (e.get("dart") or {}).get("table", [])
            nodes = dart_nodes if chosen else (e["dart"]["max_nodes"] if e.get("dart") else None)
            paths.append(CostPath(e["weights"], ms, nodes, expected(table, nodes), chosen))
        why = f"Weights path (--dtype auto): {weights.reason}."
    else:
        rows = calibrate.calibrated_rows(target)
        costs = calibrate.cached_forward_costs(target, rows=rows) if rows else None
        if costs is None:
            why = (
                "No forward-cost table: the tree sizes were given or not calibrated here, and so was the weights path "
                "(dart-calibrate measures it)."
                if rows
                else "No forward-cost table: the target is neither on the CPU kernels nor on a GPU's fixed-shape forward, "
                "where the tree size is calibrated."
            )
            return None, why
        table = dart_size.table if dart_size is not None else []
        paths.append(CostPath(target.weights, costs.ms, dart_nodes, expected(table, dart_nodes), True))
        why = f"Weights {weights.reason}: the one path measured."
    key = calibrate.host_key(torch.get_num_threads())
    caption = (
        f"Median ms of one forward after {calibrate.PREFIX} cached tokens, measured by the calibration on {key['cpu']} "
        f"({kernels.describe()}, {key['threads']} thread{'s' if key['threads'] != 1 else ''}) and cached in "
        f"{calibrate.calibration_dir()}. DART's expected tokens/s = τ(n) / its loop step at n nodes (drafting, verify of n + 1 "
        "rows and the rest, timed in the generation loop). The tree size sliders run any other size: a tree of n nodes "
        "verifies n + 1 rows."
    )
    return CostView(tuple(paths), caption), why


def calibrate_sizes(
    args, target, configs: DrafterConfigs, notes: list[str], progress: Progress, known=None
) -> tuple[DrafterConfigs, str | None, dict]:
    """The configs with the tree sizes the command line left unset calibrated on this machine
    (dart_core/tools/calibrate/; a few seconds on first start, the forward costs cached after), the
    header's line saying what was chosen and why, and the choices by drafter. `known`: DART's size
    timed already while choosing the weights path (not timed again). A head that cannot be read here is left to its
    loader below, which reports it; the calibration then notes that it did not run."""
    wanted = {m for m in ("dart", "eagle3") if head_named(m, args) or embedded_head_exists(m)} & unset_sizes(args)
    if not wanted:
        return configs, None, {}
    progress("calibrating the tree sizes on this machine")
    try:
        configs, choices = calibrate.calibrate_unset_sizes(
            target, configs, wanted, log=lambda m: log.warning("%s", m), known=known, enabled=not args.no_calibration
        )
    except (ValueError, OSError, RuntimeError) as e:
        notes.append(f"Tree sizes not calibrated ({e}); the device default is used.")
        return configs, None, {}
    if not choices:
        return configs, None, {}
    line = "Tree size " + "; ".join(f"{METHODS[m].label}: {c.reason}" for m, c in choices.items()) + " (--max-nodes N overrides)."
    return configs, line, choices


def llamacpp_gguf(args, default_target: bool) -> tuple[Path | None, str]:
    """The GGUF llama.cpp runs, and how its row names it: "same GGUF" when it is the file the
    embedded target came from, else the file's name (a GGUF the user vouches for). None: no GGUF."""
    embedded = None
    if default_target:
        from dart_core.loading import embedded_gguf_path

        try:
            embedded = embedded_gguf_path()
        except (FileNotFoundError, ImportError):
            pass
    if args.gguf is not None:
        same = embedded is not None and args.gguf.expanduser().resolve() == embedded.resolve()
        return args.gguf.expanduser(), "same GGUF" if same else args.gguf.name
    return embedded, "same GGUF"


def load_peers(args, target, default_target: bool, notes: list[str], progress: Progress) -> tuple[list[Peer], str | None]:
    """The llama.cpp peers compare mode runs after the engine's methods, and the header's line on them
    (what runs, or why nothing does). Called on the compute thread after torch's thread count is set:
    llama.cpp gets the engine's. Asked for (--compare-llamacpp) and unable to run: a note, not an error."""
    if args.compare_llamacpp is False:
        return [], "No llama.cpp row in compare mode (--no-compare-llamacpp)."
    asked = args.compare_llamacpp is True
    gguf, gguf_note = llamacpp_gguf(args, default_target)
    bin_dir = peers.resolve_bin_dir(args.llamacpp_bin)
    threads = torch.get_num_threads()
    loaded, reasons = [], []
    for method in args.llamacpp_methods:
        reason, draft = peers.unavailable(method, bin_dir, gguf), None
        if reason is not None and peers.needs_draft(method) and peers.unavailable("llamacpp", bin_dir, gguf) is None:
            try:  # llamacpp-eagle3 drafts with this app's EAGLE3 head, exported for llama.cpp once (cached)
                from dart_core.tools.export_gguf import cached_eagle3_gguf

                draft = cached_eagle3_gguf(args.eagle3_model or DEFAULT_EAGLE3, gguf)
                reason = peers.unavailable(method, bin_dir, gguf, draft)
            except (ValueError, FileNotFoundError) as e:
                reason = f"{method}: the EAGLE3 head cannot be exported for llama.cpp: {e}"
        if reason is None:
            try:
                runner = peers.LlamaCppPeer(
                    method, bin_dir, gguf, threads, target.tokenizer, target.eos_ids, timeout_s=PEER_TIMEOUT_S, draft=draft
                )
            except Exception as e:  # noqa: BLE001 (a peer that cannot be set up is reported, the app still starts)
                reason = f"{method}: {e}"
        if reason is not None:
            reasons.append(reason)
            continue
        progress(f"llama.cpp peer {method}: {runner.exe} on {gguf}")
        loaded.append(Peer(method, peer_label(method, gguf_note), runner, threads))
    parts = []
    if loaded:
        what = ", ".join(f"{p.label} ({p.runner.exe.name})" for p in loaded)
        parts.append(
            f"Compare mode ends with {what}: llama.cpp's own binary on {gguf.name}, the same prompt ids, "
            f"{threads} thread{'s' if threads != 1 else ''} as the engine, run after the engine's methods, never beside them"
            + ("." if asked else "; on because its binaries are built (--no-compare-llamacpp turns it off).")
        )
    if reasons:
        why = "; ".join(reasons)
        if asked:
            notes.append(f"--compare-llamacpp was given, but llama.cpp cannot run here, so compare mode has no llama.cpp row. {why}")
        else:
            parts.append(f"No llama.cpp row in compare mode: llama.cpp cannot run here. {why}")
    return loaded, " ".join(parts) or None


def load_vllm_peers(args, target, configs: DrafterConfigs, notes: list[str], progress: Progress) -> tuple[list[Peer], str | None]:
    """The vLLM peers of --compare-vllm (none by default): one vLLM engine each, started here on the
    target's converted checkpoint with the engine's thread count, drafting with this app's heads. Unable
    to run (no `make vllm` venv, an engine that does not start): a note and the header's line, not an error."""
    if not args.compare_vllm:
        return [], None
    threads = torch.get_num_threads()
    why = vllm_peer.unavailable()
    loaded, reasons = [], [] if why is None else [why]
    for method in args.compare_vllm if why is None else []:
        progress(f"vLLM peer {method}: starting its engine")
        try:
            runner = vllm_peer.VllmPeer(
                method, target.model_dir, target.eos_ids, threads, dtype=vllm_dtype(target),
                dart_head=configs.dart.head, eagle3_head=configs.eagle3.head, timeout_s=PEER_TIMEOUT_S,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 (a peer that cannot start is reported, the app still starts)
            reasons.append(f"{method}: {e}")
            continue
        atexit.register(runner.close)
        loaded.append(Peer(method, vllm_label(method, runner.dtype), runner, threads))
    parts = []
    if loaded:
        parts.append(
            f"Compare mode ends with {', '.join(p.label for p in loaded)}: vLLM {loaded[0].runner.version} on the target's converted "
            f"checkpoint, the same prompt ids, {threads} thread{'s' if threads != 1 else ''} as the engine, run after the engine's "
            "methods, never beside them."
        )
    if reasons:  # asked for and unable to run: the header's notes say why
        notes.append(f"--compare-vllm was given, but not every vLLM row can run: {'; '.join(reasons)}")
    return loaded, " ".join(parts) or None


def load_models(args, compute: ComputeThread) -> Loaded:
    """Target, then the heads; each step logged. Nothing is loaded at import time. Runs on `compute`,
    the thread every later step runs on (app/engine.py, ComputeThread)."""
    progress = Progress()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = args.threads or (engine_threads(available_cores()) if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    notes: list[str] = []
    default_target = args.base_model_name_or_path == DEFAULT_MODEL
    configs = drafter_configs(args, default_target)  # the flags, once
    target, weights, dart_size, weights_line = load_weights(args, configs.dart, device, notes, progress)
    if args.template_name:
        notes.append(f"--template-name {args.template_name} ignored: the tokenizer's own chat template is used.")
    configs, tree_line, sizes = calibrate_sizes(args, target, configs, notes, progress, known={"dart": dart_size} if dart_size else None)
    dart_nodes = configs.dart.tree_size(device.type) if embedded_head_exists("dart") or head_named("dart", args) else None
    costs, costs_note = cost_view(target, weights, dart_nodes, sizes.get("dart", dart_size))
    configs, default_sizes = sizes_for_requests(configs, target)
    drafters = {}
    dart = load_dart(configs.dart, target, notes, progress)
    if dart is not None:
        drafters["dart"] = dart
    eagle3 = load_eagle3(configs.eagle3, args.compare_eagle3, target, notes, progress)
    if eagle3 is not None:
        drafters["eagle3"] = eagle3
    peer_list, peers_line = load_peers(args, target, default_target, notes, progress)
    vllm_list, vllm_line = load_vllm_peers(args, target, configs, notes, progress)
    peer_list += vllm_list
    peers_line = " ".join(x for x in (peers_line, vllm_line) if x) or None
    for n in notes:
        log.warning("note: %s", n)
    pruner = None
    if dart is not None:
        import ngram_cpp

        pruner = "C++" if getattr(ngram_cpp, "HAVE_CPP", False) else "pure Python"
    heads = heads_line({name: getattr(configs, name).head or DEFAULT_HEADS[name] for name in drafters}, notes)
    prefix = PrefixStore(args.prefix_cache_mb << 20) if args.prefix_cache_mb > 0 else None
    engine = Engine(
        target, drafters, args.max_new_tokens, args.max_length, compute, peer_list, {m: default_sizes[m] for m in drafters}, prefix
    )
    return Loaded(engine, notes, pruner, progress, threads, configs, peers_line, tree_line, weights_line, costs, costs_note, heads)


def heads_line(heads: dict[str, str | Path], notes: list[str]) -> str | None:
    """The header's line on how long each loaded head trained (its trained.json), and whether DART and
    EAGLE3 had the same number of training steps: compare mode is a fair comparison only then. A head
    without the file says so; a malformed file is a note, not a failed start."""
    said, steps = [], {}
    for name, head in heads.items():
        label = METHODS[name].label
        try:
            record = trained_record(head)
        except ValueError as e:
            notes.append(f"The {label} head's training record is unreadable: {e}")
            continue
        if record is None:
            said.append(f"{label} {head} (no trained.json: its training is unknown)")
            continue
        steps[name] = record["step"]
        hours = f", {record['elapsed_s'] / 3600:.1f} training hours" if "elapsed_s" in record else ""
        said.append(f"{label} {record.get('run', Path(head).name)} at step {record['step']:,}{hours}")
    if not said:
        return None
    line = "Heads: " + "; ".join(said)
    if len(steps) == 2:
        line += (
            ": the same number of training steps, on the same corpus"
            if steps["dart"] == steps["eagle3"]
            else ": unequal training, so compare mode does not show an equal-budget comparison"
        )
    return line + "."


def warm_up(engine: Engine) -> None:
    """The first calls pay for lazy initialisation; make them before users arrive. The last AR run is
    long enough to give the speed that speed-ups are quoted against until a user runs AR."""
    for method in engine.methods:
        engine.complete(
            engine.request([{"role": "user", "content": WARMUP_PROMPT}], method, min(WARMUP_TOKENS, engine.max_new_tokens), 0.0, 1.0, 0)
        )
    n = min(2 * MIN_REFERENCE_TOKENS, engine.max_new_tokens)
    ar = engine.complete(engine.request([{"role": "user", "content": "Tell me about the moon."}], "ar", n, 0.0, 1.0, 0))
    log.warning("warm-up done: AR %.1f tok/s over %d tokens", ar.tokens_per_s, ar.new_tokens)


def warm_up_peers(engine: Engine, notes: list[str]) -> list[str]:
    """One short run of each peer (it also brings llama.cpp's GGUF into the page cache; vLLM's first
    request is its slowest). A peer that fails it is dropped, with a note saying why; returns the
    methods dropped."""
    req = engine.request([{"role": "user", "content": WARMUP_PROMPT}], "ar", min(WARMUP_TOKENS, engine.max_new_tokens), 0.0, 1.0, 0)
    dropped = []
    for method in list(engine.peers):
        r = engine.run_peer(req, method)
        if r.error is not None:
            first = r.error.strip().splitlines()[0] if r.error.strip() else "no reason given"
            notes.append(f"{r.label} failed its warm-up run, so compare mode has no {r.engine_name} row for it: {first}")
            log.warning("%s peer %s failed its warm-up run:\n%s", r.engine_name, method, r.error)
            del engine.peers[method]
            dropped.append(method)
        else:
            log.warning("warm-up done: %s %.1f tok/s over %d tokens", r.label, r.tokens_per_s, r.new_tokens)
    return dropped


def target_label(args, engine: Engine) -> str:
    return f"{EMBEDDED_NAME} (embedded)" if args.base_model_name_or_path == DEFAULT_MODEL else engine.target.name


def exact_texts(configs: DrafterConfigs, target) -> bool:
    """Whether greedy texts must equal AR's: the verified trees run on the batch-invariant kernel
    path, or the target is float32 (where rounding has not parted them in our tests)."""
    nodes = max(configs.dart.tree_size(target.device.type), configs.eagle3.tree_size(target.device.type))
    return target.exact_verify(nodes + 1) or target.dtype == torch.float32


def build_app(args: argparse.Namespace):
    """Load the models, warm up (unless --no-warmup) and build the page: (demo, loaded, settings),
    everything but serving it."""
    compute = ComputeThread()
    loaded = compute.run(load_models, args, compute)
    engine = loaded.engine
    if not args.no_warmup:
        loaded.progress(f"warming up {', '.join(engine.methods)}")
        warm_up(engine)
        if engine.peers and warm_up_peers(engine, loaded.notes) and not engine.peers:
            loaded.peers_line = None  # the note says why
    settings = Settings(
        target_label=target_label(args, engine),
        default_new_tokens=min(DEFAULT_NEW_TOKENS, args.max_new_tokens),
        compare=(args.compare_eagle3 or args.compare_llamacpp is True or bool(args.compare_vllm))
        and len(engine.methods) + len(engine.peers) > 1,
        pruner=loaded.pruner,
        exact=exact_texts(loaded.configs, engine.target),
        notes=tuple(loaded.notes),
        threads=loaded.threads,
        peers_line=loaded.peers_line,
        tree_line=loaded.tree_line,
        weights_line=loaded.weights_line,
        costs=loaded.costs,
        costs_note=loaded.costs_note,
        heads_line=loaded.heads_line,
    )
    return build_demo(engine, settings), loaded, settings


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    demo, _, _ = build_app(args)
    demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)
    demo.launch(
        server_name="0.0.0.0" if args.listen else "127.0.0.1",
        server_port=args.server_port,
        share=args.share,
        css_paths=[CSS_PATH],
        show_error=True,
    )
    return 0
