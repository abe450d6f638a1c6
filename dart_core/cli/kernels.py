"""dart-kernels: the CPU kernel builds this machine has and runs, the one in use, and
optionally the embedded target's forward cost by rows."""

from __future__ import annotations

import argparse

import torch

from .. import kernels
from ..loading import DTYPE_CHOICES
from ..target import load_target, weights_spec
from ..tools import calibrate

TIMED = 15  # timed forwards per row count (median)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="The CPU kernel builds this machine has, and optionally the embedded target's forward cost by rows."
    )
    p.add_argument(
        "--time",
        nargs="*",
        metavar="DTYPE",
        help=f"time forwards of the embedded target in these weight dtypes (from {', '.join(DTYPE_CHOICES)}; e.g. gguf "
        "bfloat16, or gguf-int8+fp32:w2+head for gguf-int8 with those linears on fp32 inputs) on the build in use, "
        "as the calibration times them (each row count settled by its own forwards first)",
    )
    p.add_argument("--rows", default="1,2,4,6,9,16", help="row counts to time (default 1,2,4,6,9,16)")
    p.add_argument(
        "--split",
        action="store_true",
        help="also split each --time dtype's one-token step into the decoder layers, the LM head and the rest, "
        "with the GB/s each part reads its weights at, beside this machine's read bandwidth",
    )
    p.add_argument("--prefix", type=int, default=200, help="committed tokens before the timed rows (default 200)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.split and not args.time:
        p.error("--split splits the one-token step of the --time dtypes: give --time DTYPE [DTYPE ...] too")
    try:
        specs = {name: weights_spec(name) for name in args.time or []}
    except ValueError as e:
        p.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    feats = kernels.cpu_features()
    print("CPU features:", ", ".join(f for f, on in sorted(feats.items()) if on) or "unknown (no generic build)")
    print("builds present:", ", ".join(kernels.built_paths()) or "none")
    print("builds this CPU runs:", ", ".join(kernels.runnable_paths()) or "none")
    print("in use:", kernels.describe(), f"({torch.get_num_threads()} threads)")
    rows = [int(r) for r in args.rows.split(",")]
    bandwidth = kernels.read_bandwidth() if args.split and specs else None
    if bandwidth is not None:
        print(f"read bandwidth: {bandwidth:.1f} GB/s (kernels.read_bandwidth: torch's sum over 256 MiB)")
    for name, (dtype, float_inputs) in specs.items():
        target = load_target("default", "cpu", dtype, float_inputs=float_inputs)
        ms = calibrate.measure_forwards(target, rows, repeats=TIMED, prefix=args.prefix)
        cells = "  ".join(f"{m} rows {v:.2f} ms ({v / ms[rows[0]]:.2f}x)" for m, v in ms.items())
        print(f"{name:9s} after {args.prefix} tokens: {cells}")
        if bandwidth is not None:
            print(split_line(name, calibrate.forward_split(target, prefix=args.prefix), bandwidth))
    return 0


def split_line(name: str, s: calibrate.ForwardSplit, bandwidth: float) -> str:
    """One --split result as text: each part's ms, the bytes it reads and their rate, and the limit
    the read bandwidth sets for the bytes of the whole step."""

    def part(label: str, ms: float, nbytes: int) -> str:
        return f"{label} {ms:.2f} ms ({nbytes / 1e6:.1f} MB at {nbytes / ms / 1e6:.1f} GB/s)"

    limit = (s.layers_bytes + s.head_bytes) / bandwidth / 1e6
    return (
        f"{name:9s} one-token step {s.ms:.2f} ms = {part('layers', s.layers_ms, s.layers_bytes)} + "
        f"{part('LM head', s.head_ms, s.head_bytes)} + the rest {s.rest_ms:.2f} ms; "
        f"the weights at {bandwidth:.1f} GB/s: {limit:.2f} ms"
    )
