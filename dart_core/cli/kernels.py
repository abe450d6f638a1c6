"""dart-kernels: the CPU kernel builds this machine has and runs, the one in use, and
optionally the embedded target's forward cost by rows."""

from __future__ import annotations

import argparse
import time

import torch

from .. import kernels
from ..kernels import bound
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
    p.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="N",
        help="also time the prefill of an N-token prompt (Target.prefill into an empty cache, the fastest of 3) "
        "for each --time dtype, a prompt token against its bound",
    )
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.split and not args.time:
        p.error("--split splits the one-token step of the --time dtypes: give --time DTYPE [DTYPE ...] too")
    if args.prefill is not None and (not args.time or args.prefill < 1):
        p.error("--prefill N times an N-token prompt (N >= 1) of the --time dtypes: give --time DTYPE [DTYPE ...] too")
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
    bandwidth = kernels.read_bandwidth() if specs else None
    rates = bound.issue_rates() if specs else None
    if bandwidth is not None:
        print(f"read bandwidth: {bandwidth:.1f} GB/s (kernels.read_bandwidth: torch's sum over 256 MiB)")
    if rates is not None:
        print(f"issue rates (kernels.bound, measured on one core): {rates.describe()}")
    for name, (dtype, float_inputs) in specs.items():
        target = load_target("default", "cpu", dtype, float_inputs=float_inputs)
        ms = calibrate.measure_forwards(target, rows, repeats=TIMED, prefix=args.prefix)
        cells = "  ".join(f"{m} rows {v:.2f} ms ({v / ms[rows[0]]:.2f}x)" for m, v in ms.items())
        print(f"{name:9s} after {args.prefix} tokens: {cells}")
        if rates is not None and target.model.kernel_path(1, target.device):
            for line in bound_lines(name, target.model, ms, args.prefix, rates, bandwidth):
                print(line)
        if args.split:
            print(split_line(name, calibrate.forward_split(target, prefix=args.prefix), bandwidth))
        if args.prefill is not None:
            print(prefill_line(name, target, args.prefill, rates))
    return 0


PREFILL_RUNS = 3


def prefill_ms(target, n: int, runs: int = PREFILL_RUNS) -> float:
    """The fastest of `runs` prefills of an n-token prompt into an empty cache, in ms."""
    vocab = target.model.args.vocab_size
    ids = [(1000 + 7 * i) % vocab for i in range(n)]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(runs):
            cache = target.new_cache(n + 8)
            t0 = time.perf_counter()
            target.prefill(ids, cache, capture=False)
            best = min(best, (time.perf_counter() - t0) * 1e3)
            target.return_cache(cache)
    return best


def prefill_bound_ms(model, n: int, rates: bound.IssueRates) -> float:
    """The arithmetic of an n-token prompt: row i's layers over its i + 1 keys, and the LM head once
    (the last row's logits)."""
    threads = torch.get_num_threads()
    total = sum(bound.ms(row_work(model, i + 1, rates, head=False), rates, threads) for i in range(n))
    head = bound.ms(bound.linear_work(model.output.weight, rates), rates, threads)
    return total + head


def prefill_line(name: str, target, n: int, rates: bound.IssueRates | None) -> str:
    t = prefill_ms(target, n)
    line = f"{name:9s} prefill of {n} tokens: {t:.0f} ms, {t / n:.3f} ms a token"
    if rates is not None and target.model.kernel_path(1, target.device):
        b = prefill_bound_ms(target.model, n, rates)
        line += f" / its arithmetic {b / n:.3f} ms a token ({t / b:.2f}x)"
    return line


def row_work(model, keys: float, rates: bound.IssueRates, head: bool = True) -> bound.Work:
    """One row of the target's forward on the kernels: every layer's linears and attention over `keys`
    keys, and the LM head."""
    a = model.args
    work = bound.Work()
    for layer in model.layers:
        for lin in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2):
            work = work + bound.linear_work(lin.weight, rates)
        work = work + bound.attention_work(a.n_heads, a.head_dim, round(keys), rates)
    return work + bound.linear_work(model.output.weight, rates) if head else work


def bound_lines(name: str, model, ms: dict[int, float], prefix: int, rates: bound.IssueRates, bandwidth: float) -> list[str]:
    """Each timed row count against its bound: k rows' arithmetic (kernels.bound) or the step's weights
    at the read bandwidth, whichever is larger; an extra row's measured cost against one row's arithmetic."""
    threads = torch.get_num_threads()
    weights = model.step_weight_bytes()
    memory = weights / bandwidth / 1e6
    one = bound.ms(row_work(model, prefix + 1, rates), rates, threads)
    fill = bound.ms(row_work(model, prefix + 32, rates, head=False), rates, threads)
    lines = [
        f"{name:9s} bound ({threads} threads): a row's arithmetic {one:.2f} ms (a prefill row without the LM head, "
        f"32 keys on: {fill:.2f} ms); the step's weights ({weights / 1e6:.1f} MB) at {bandwidth:.1f} GB/s: {memory:.2f} ms"
    ]
    cells = []
    first = min(ms)
    for k, t in ms.items():
        rows_bound = sum(bound.ms(row_work(model, prefix + i + 1, rates), rates, threads) for i in range(k))
        b = max(rows_bound, memory)
        cell = f"{k} rows {t:.2f} / {b:.2f} ms ({t / b:.2f}x)"
        if k > first:
            extra = (t - ms[first]) / (k - first)
            cell += f", an extra row {extra:.2f} ms ({extra / one:.2f}x a row's bound)"
        cells.append(cell)
    lines.append(f"{name:9s} measured / bound: " + "; ".join(cells))
    return lines


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
