"""dart-calibrate (also dart-calibrate): this machine's forward
costs by rows, the weights path and each default head's tree size (dart_core/tools/calibrate/), and
--write-tau, which measures a head's τ by tree size by exact replay and ships it beside the head."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD
from ..drafters.config import DrafterConfigs, default_max_nodes
from ..loading import AUTO, DEFAULT_MODEL, TARGET_DTYPE_CHOICES
from ..target import load_target
from ..tools import calibrate
from ..tools.bench import held_out_questions
from ..tools.replay import record_greedy


def parse_sizes(text: str) -> list[int]:
    """Tree sizes from "1-16", "2,5,8" or "1-16,20,24": ascending, each once, every one >= 1."""
    sizes: set[int] = set()
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            sizes.update(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes are numbers and ranges, e.g. 1-16,20,24") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes of at least 1 drafted node")
    return sorted(sizes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dart-calibrate", description=calibrate.__doc__.split("\n\n")[0])
    p.add_argument(
        "--dtype",
        choices=TARGET_DTYPE_CHOICES,
        default=AUTO,
        help="the target's weights, as the bench's --dtype (default auto: measure each path, "
        f"{', '.join(calibrate.WEIGHTS_CANDIDATES)}, and print which one makes DART fastest here)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--write-tau",
        nargs="*",
        choices=["dart", "eagle3"],
        default=None,
        metavar="METHOD",
        help=f"measure τ by tree size for the default heads of these methods by exact replay and write {calibrate.TAU_FILE} beside each",
    )
    defaults = {"dart": DEFAULT_DART_HEAD, "eagle3": DEFAULT_EAGLE3_HEAD}
    for method, default in defaults.items():
        p.add_argument(
            f"--{method}-model",
            type=Path,
            default=default,
            metavar="DIR",
            help=f"--write-tau: the {method.upper()} head to measure, the directory the table goes into (default assets/{default.name})",
        )
    p.add_argument("--dataset", type=Path, nargs="+", default=None, help="--write-tau: question files (first turns)")
    p.add_argument("--skip", type=int, default=10, help="--write-tau: prompts skipped per file (the bench reports on the first 10)")
    p.add_argument("--limit", type=int, default=10, help="--write-tau: prompts per file after --skip")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sizes", default="1-16", type=parse_sizes, help="--write-tau: tree sizes, e.g. 1-16, 2,5,8 or 1-16,20,24")
    p.add_argument(
        "--refresh",
        action="store_true",
        help="measure the forward costs (and, with --dtype auto, the weights choice) again and save them, instead of reading the "
        "calibration cache",
    )
    args = p.parse_args(argv)
    if args.write_tau is not None and args.dtype == AUTO:
        p.error("--write-tau measures τ on one weights path, which the file records: give --dtype (the shipped tables used gguf)")
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = {"dart": args.dart_model, "eagle3": args.eagle3_model}
    tau_methods = (args.write_tau or ["dart", "eagle3"]) if args.write_tau is not None else []
    for method in tau_methods:
        if not heads[method].is_dir():
            p.error(f"--{method}-model {heads[method]}: not a directory (--write-tau writes {calibrate.TAU_FILE} into it)")
    configs = DrafterConfigs()  # the embedded heads' presets
    known = {}
    if args.dtype == AUTO:
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
        target, weights, dart = calibrate.choose_weights(DEFAULT_MODEL, "cpu", True, None, args.threads, args.refresh, log)
        when = (
            f" (cached {weights.measured_at}; --refresh measures again)"
            if weights.from_cache
            else " (measured now)"
            if weights.calibrated
            else ""
        )
        print(f"weights (--dtype auto): {weights.reason}{when}")
        if weights.paths:
            print(calibrate.weights_table(weights))
        if dart is not None:
            known["dart"] = dart
    else:
        target = load_target(DEFAULT_MODEL, "cpu", args.dtype)
    if args.write_tau is not None:
        if not args.dataset:
            raise SystemExit("--write-tau needs --dataset (held-out prompts: not the ones the bench reports on)")
        sizes = args.sizes
        questions = held_out_questions(args.dataset, args.skip, args.limit)
        t0 = time.perf_counter()
        records = [record_greedy(target, [{"role": "user", "content": q["turns"][0]}], args.max_new_tokens) for _, q in questions]
        print(f"recorded {len(records)} greedy decodes in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for method in tau_methods:
            # None: the embedded head's presets, however its directory was spelled
            head = None if heads[method].resolve() == defaults[method].resolve() else str(heads[method])
            drafter = calibrate.build_measured(method, target, replace(configs[method], head=head, max_nodes=max(sizes)))
            tau = calibrate.tau_by_size(drafter, records, sizes)
            out = heads[method] / calibrate.TAU_FILE
            out.write_text(
                json.dumps(
                    {
                        "method": method,
                        "tau": {str(n): round(t, 4) for n, t in tau.items()},
                        "prompts": f"{len(records)}: prompts {args.skip + 1}-{args.skip + args.limit} of "
                        + ", ".join(d.name for d in args.dataset),
                        "max_new_tokens": args.max_new_tokens,
                        "weights": target.weights,
                        "command": "dart-calibrate " + " ".join(argv if argv is not None else sys.argv[1:]),
                    },
                    indent=1,
                )
                + "\n"
            )
            print(f"{method}: " + "  ".join(f"{n}:{t:.3f}" for n, t in tau.items()) + f"  -> {out}")
        return 0
    costs = calibrate.forward_costs(target, args.threads, refresh=args.refresh and args.dtype != AUTO)  # auto measured them just now
    print(
        f"{target.weights}, {costs.key['kernels']}, {costs.key['threads']} threads, {costs.key['cpu']}"
        f" ({'cached ' + costs.measured_at if costs.from_cache else 'measured now'})"
    )
    print("forward ms by rows: " + "  ".join(f"{k}:{v:.2f} ({costs.ratio(k):.2f}x)" for k, v in costs.ms.items()))
    for method, head in heads.items():
        if method in known:  # timed while choosing the weights, on this very target and flags
            choice = known[method]
        else:
            drafter = calibrate.build_measured(method, target, replace(configs[method], max_nodes=calibrate.MAX_CALIBRATED_ROWS - 1))
            choice = calibrate.calibrate_drafter(
                target, drafter, head, fallback=default_max_nodes(target.device.type), threads=args.threads
            )
        print(f"{method}: {choice.reason}")
    return 0
