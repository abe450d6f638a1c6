"""Benchmark CLI: every method on the same prompts, interleaved prompt by prompt.

    dart-bench --methods ar,hf --dataset ../shared/data/bench/mt_bench.jsonl \\
        --limit 5 --max-new-tokens 64 --out results.json

Methods run on the same target weights. `ar` (and every drafter) go through our one generation
loop; `hf` is transformers' own `generate` and `pld` its prompt-lookup decoding, i.e. what a user
would run instead. `llamacpp*` run llama.cpp's binaries on the GGUF the target came from (the peers:
see dart_core/tools/peers.py and docs/peers.md; skipped with a message where they are not built);
`vllm*` run vLLM's engine on the target's safetensors in the venv `make vllm` builds, `vllm-dart` with
this project's vLLM plugin (dart_core/tools/vllm_peer.py, docs/vllm.md).
Interleaving methods per prompt cancels slow machine drift; a warm-up run of each method precedes
the timed ones. Progress goes to stderr, the markdown table to stdout. The bench itself is
dart_core/tools/bench.py; `dart-bench` is this command too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from .. import kernels
from ..drafters import DEFAULT_EAGLE3_HEAD
from ..drafters.config import DrafterConfigs
from ..drafters.head import trained_record
from ..drafters.registry import DEFAULT_HEADS
from ..loading import AUTO, DEFAULT_MODEL, TARGET_DTYPE_CHOICES
from ..prefix_cache import DEFAULT_PREFIX_CACHE_MB
from ..sampling import SamplingParams
from ..target import Target, load_target
from ..tools import calibrate, peers, vllm_peer
from ..tools.bench import (
    PeerSetup,
    build_runner,
    dataset_names,
    dataset_table,
    embedded_gguf_or_none,
    fidelity_lines,
    loop_methods,
    markdown_table,
    method_drafter,
    multi_turn_table,
    read_questions,
    run_interleaved,
    run_multi_turn,
    vllm_dtype,
    vllm_fidelity,
)
from ..tools.methods import METHODS, SIZED_METHODS, is_llamacpp, is_vllm, split_method
from .options import (
    AUTO_HELP,
    WEIGHTS_HELP,
    add_device_flag,
    add_drafter_flags,
    add_dtype_flag,
    add_llamacpp_flags,
    add_model_flag,
    add_threads_flag,
    apply_threads,
    drafter_configs,
    unset_sizes,
)


def target_path(target) -> str:
    """Which forward path the target's decode steps take: the CPU kernels, the fixed-shape forward
    (with its rows), or plain eager torch."""
    model = target.model
    if model.kernel_path(1, target.device):
        return "kernels"
    rows = model.fixed_row_count(target.device)
    return f"fixed ({rows} rows)" if rows else "eager"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dart-bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--methods",
        default="ar,hf",
        help=f"comma-separated, from: {', '.join(METHODS)} (default: ar,hf); "
        f"{', '.join(SIZED_METHODS)} take a tree size as method@N (e.g. dart@8,dart@16: a sweep in one run); "
        "llama.cpp's and vLLM's speculative methods a draft length (vllm-dart@4)",
    )
    p.add_argument(
        "--dataset",
        type=Path,
        nargs="+",
        required=True,
        help="question.jsonl file(s) (first turn of each row is used); with several, the report has a section per file",
    )
    p.add_argument("--limit", type=int, default=None, help="use the first N questions of each file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: seed + question index)")
    add_dtype_flag(
        p,
        AUTO,
        TARGET_DTYPE_CHOICES,
        f"{WEIGHTS_HELP}. {AUTO_HELP} Every method runs on the one path chosen; env.weights_choice records it and why",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="run the target on the torch path instead of the batch-invariant CPU kernels (dart_core/kernels/): the "
        "fixed-shape forward (dart_core/fixed_shape.py, exact up to its rows), plain eager torch beyond",
    )
    add_device_flag(p)
    add_model_flag(p)
    add_threads_flag(p)
    p.add_argument("--out", type=Path, default=None, help="write results JSON here")
    p.add_argument(
        "--multi-turn",
        action="store_true",
        help="play the questions with several turns as chats, each of the loop's methods with and without the prefix "
        "cache (dart_core/prefix_cache.py): time to first token and tokens/s of the later turns, same ids required",
    )
    p.add_argument("--prefix-cache-mb", type=int, default=DEFAULT_PREFIX_CACHE_MB, help="the prefix cache's bound in --multi-turn")
    g = p.add_argument_group("llama.cpp peers (the llamacpp* methods; see docs/peers.md)")
    add_llamacpp_flags(g)
    add_drafter_flags(p)
    return p.parse_args(argv)


def peer_setup(args: argparse.Namespace) -> PeerSetup:
    """--llamacpp-bin, --gguf (else the GGUF the embedded target came from; none for another target)
    and the EAGLE3 head (--eagle3-model, else the embedded one) for llamacpp-eagle3."""
    gguf = args.gguf or (embedded_gguf_or_none() if args.model == DEFAULT_MODEL else None)
    return PeerSetup(peers.resolve_bin_dir(args.llamacpp_bin), gguf, args.eagle3_model or DEFAULT_EAGLE3_HEAD)


def environment(args: argparse.Namespace, target: Target) -> dict:
    cpu = calibrate.cpu_model()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    import transformers

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "device": str(target.device),
        "gpu": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else None,
        "dtype": str(target.dtype).removeprefix("torch."),
        "weights": target.weights,
        "kernels": kernels.describe(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": target.name,
        "dataset": [str(d) for d in args.dataset],
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "git_commit": commit,
        "target_path": target_path(target),
        "cpu_kind": peers.cpu_kind(),
    }


def heads_trained(methods: list[str], configs: DrafterConfigs, peer: PeerSetup) -> dict[str, dict]:
    """Each head the run drafted with (llama.cpp's EAGLE3 draft included): its directory and what its
    trained.json says of its run, step and training seconds, so a comparison of heads says whether
    their training budgets were equal. Hub heads and heads without the file: the directory only."""
    used = {}
    for m in methods:
        base, _ = split_method(m)
        name = METHODS[base].drafter
        if name is not None:
            used[name] = getattr(configs, name).head or DEFAULT_HEADS[name]
        elif peers.needs_draft(m):
            used["eagle3"] = peer.eagle3_head
    return {name: {"head": shown_path(head), **(trained_record(head) or {})} for name, head in used.items()}


def shown_path(head: str | Path) -> str:
    """A head as the result file records it: relative to the repository when inside it (assets/dart,
    the same on every machine), else as given (a hub id, a directory elsewhere)."""
    path = Path(head).expanduser()
    try:
        return str(path.resolve().relative_to(DEFAULT_HEADS["dart"].parent.parent))
    except (ValueError, OSError):
        return str(head)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise SystemExit(f"no method given: choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise SystemExit(f"a method is named twice in {args.methods!r}")
    default_target = args.model == DEFAULT_MODEL
    try:
        for m in methods:
            split_method(m)
        drafter_configs(args, default_target)  # every drafter flag in range, before anything loads
    except ValueError as e:
        raise SystemExit(str(e)) from None
    apply_threads(args)
    names = dataset_names(args.dataset)
    questions = [(name, q) for name, path in zip(names, args.dataset) for q in read_questions(path, args.limit)]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    skipped = {}
    peer = peer_setup(args)
    vllm_missing = vllm_peer.unavailable() if any(is_vllm(m) for m in methods) else None
    for m in methods:  # a peer that cannot run here is skipped with the reason; the other methods still run
        if is_vllm(m) and vllm_missing:
            skipped[m] = f"{m}: {vllm_missing}"
            log(f"skipping {skipped[m]}")
        if is_llamacpp(m):
            draft = None
            if peers.needs_draft(m) and (peer.bin_dir / peers.binary_for(m)).is_file():  # no export where llama.cpp is absent
                try:  # llamacpp-eagle3 drafts with the bench's EAGLE3 head, exported for llama.cpp once (cached)
                    draft = peer.draft(m)
                except (ValueError, FileNotFoundError) as e:  # a head that cannot be exported is the user's error
                    raise SystemExit(f"{m}: cannot export the EAGLE3 head for llama.cpp: {e}") from None
            reason = peers.unavailable(m, peer.bin_dir, peer.gguf, draft)
            if reason:
                skipped[m] = reason
                log(f"skipping {reason}")
    methods = [m for m in methods if m not in skipped]
    if not methods:
        raise SystemExit("no method left to run: " + "; ".join(skipped.values()))

    log(f"loading target {args.model!r} ({args.dtype}, {args.device})")
    known = {}
    configs = drafter_configs(args, default_target)
    try:  # read before the run: a malformed trained.json stops the bench here, not after an hour
        heads = heads_trained(methods, configs, peer)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.dtype == AUTO:  # one weights path for every method: losslessness is per path (ids equal plain decoding's on it)
        target, weights, dart_size = calibrate.choose_weights(
            args.model, args.device, not args.eager, configs.dart, log=log, enabled=not args.no_calibration
        )
        if weights.paths:
            log(calibrate.weights_table(weights))
        if dart_size is not None:
            known["dart"] = dart_size  # timed on this target with these flags while choosing: not timed again
    else:
        target = load_target(args.model, args.device, args.dtype, kernels=not args.eager)
        weights = calibrate.WeightsChoice(args.dtype, f"{args.dtype} (given: --dtype {args.dtype})")
    # the tree sizes of the drafters run at the flags' size (not method@N) and left unset: this machine's
    unsized = {d for base, size in map(split_method, methods) if size is None and (d := METHODS[base].drafter)}
    configs, sizes = calibrate.calibrate_unset_sizes(
        target, configs, unsized & unset_sizes(args), log, known, enabled=not args.no_calibration
    )
    if args.multi_turn:  # the loop's methods only: fresh against reuse on each chat
        ours, others = loop_methods(methods)
        for m in others:
            log(f"--multi-turn runs the generation loop's methods: {m} left out")
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, seed=args.seed)
        drafters = {m: method_drafter(m, target, configs) for m in ours}
        try:
            turns = run_multi_turn(target, drafters, questions, args.max_new_tokens, sampling, log, args.prefix_cache_mb << 20)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        print(multi_turn_table(turns) + "\n\n" + turns["prefix_cache"])
        if args.out:
            args.out.write_text(json.dumps({"env": environment(args, target), "multi_turn": turns}, indent=1))
        return 0
    runners = {m: build_runner(m, target, configs, peer) for m in methods}
    prompts = [target.encode([{"role": "user", "content": q["turns"][0]}]) for _, q in questions]
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, seed=args.seed)
    run = run_interleaved(runners, questions, prompts, args.max_new_tokens, sampling, log)
    report, datasets = run.reports()

    result = {"env": environment(args, target), "methods": report, "datasets": datasets, "samples": run.samples}
    if target.device.type == "cpu":  # a step's memory limit: the bytes it streams over the bandwidth measured now
        step_bytes, gb_s = target.model.step_weight_bytes(), kernels.read_bandwidth()
        result["env"]["memory"] = {
            "step_weight_bytes": step_bytes,
            "read_gb_s": round(gb_s, 2),
            "streaming_limit_ms": round(step_bytes / gb_s / 1e6, 3),
        }
        log(
            f"a step streams {step_bytes / 1e6:.1f} MB of weights; read bandwidth {gb_s:.1f} GB/s: "
            f"memory limit {step_bytes / gb_s / 1e6:.2f} ms a step"
        )
    result["env"]["weights_choice"] = weights.as_dict()  # the --dtype the run used, why, and (auto) each path's measured costs
    result["env"]["heads"] = heads
    if sizes:
        result["env"]["tree_sizes"] = {m: c.as_dict() for m, c in sizes.items()}
    fidelity = vllm_fidelity(run.samples)
    if fidelity is not None:  # vLLM's drafting methods against vLLM's plain decoding, computed once for both places
        result["vllm_fidelity"] = fidelity
        for m, count in fidelity["same_as_vllm"].items():
            report[m]["same_as_vllm"] = count
    if any(is_vllm(m) for m in methods):
        result["env"]["vllm"] = {
            "venv": str(vllm_peer.venv_python()),
            "version": vllm_peer.VLLM_VERSION,
            "model": str(target.model_dir),
            "dtype": vllm_dtype(target),
        }
    if any(is_llamacpp(m) for m in methods):
        result["env"]["llamacpp"] = peers.describe(peer.bin_dir, peer.gguf)
        drafted_by_head = [m for m in methods if peers.needs_draft(m)]
        if drafted_by_head:  # which head llama.cpp drafted with, as the file it read
            result["env"]["llamacpp"]["draft_gguf"] = str(peer.draft(drafted_by_head[0]))
    if skipped:
        result["skipped"] = skipped
    if run.peer_errors:
        result["peer_errors"] = run.peer_errors
    if len(names) > 1:
        print(dataset_table(datasets) + "\n\nAll prompts:\n")
    print(markdown_table(report))
    for reason in skipped.values():
        print(f"\nskipped {reason}")
    if fidelity is not None and fidelity["same_as_vllm"]:
        print("\n" + "\n".join(fidelity_lines(fidelity)))
    for m, errs in run.peer_errors.items():
        print(f"\n{m}: {len(errs)} of {len(prompts)} prompts not run (its totals leave them out), e.g. {errs[0]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        log(f"wrote {args.out}")
    return 0
