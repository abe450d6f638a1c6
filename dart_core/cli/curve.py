"""The training curve of the draft heads: validation hit@1 per row and bench τ against cumulative
training hours, kept under assets/training/ so it survives the machine.

    # a milestone of a run: copy its validation history, bench its current head on the six bench sets
    dart-curve point --run ~/.cache/dart-demo/runs/dart-v1 --label dart-v1 --method dart
    # a head saved earlier (its trained.json gives the step and hours), e.g. to compare at equal hours
    dart-curve point --head DIR --label eagle3-v1 --method eagle3 --threads 1
    # the tables (markdown), or rewritten in place between the curve markers of assets/README.md
    dart-curve table [--readme]

A run directory is a `dart-train dart|eagle3` --work directory: train/checkpoint.pt
(step, cumulative training seconds), train/history.json (the periodic validation) and train/head.
Bench points are appended to assets/training/points.jsonl, one JSON object per line, each with the
command that reproduces it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..drafters.config import default_max_nodes
from ..drafters.dart import UPSTREAM_WEIGHTS
from ..drafters.head import trained_record
from . import installed_command
from .options import add_threads_flag, weight_flag_args

ROOT = Path(__file__).resolve().parents[2]  # the repository: the curve's files live under its assets/
CURVE_DIR = ROOT / "assets" / "training"
POINTS = CURVE_DIR / "points.jsonl"
README = ROOT / "assets" / "README.md"
BENCH_SETS = ["mt_bench", "humaneval", "gsm8k", "alpaca", "qa", "sum"]
MARK_START, MARK_END = "<!-- curve:start -->", "<!-- curve:end -->"


def run_state(run: Path) -> tuple[int, float]:
    """(optimizer step, cumulative training hours) of the run's last checkpoint."""
    import torch

    ck = torch.load(run / "train" / "checkpoint.pt", weights_only=False, map_location="cpu")
    return int(ck["step"]), float(ck["elapsed_s"]) / 3600.0


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def snapshot_head(run: Path, dest: Path) -> tuple[int, float]:
    """Copy the run's head to `dest` while no checkpoint is written (a training run may be going on):
    the (step, hours) read before and after the copy agree, so they are the copied head's."""
    for _ in range(5):
        before = run_state(run)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(run / "train" / "head", dest)
        if run_state(run) == before:
            return before
        time.sleep(5)
    raise SystemExit(f"{run}: the head kept changing while it was copied")


def saved_head_state(head: Path, dest: Path) -> tuple[int, float]:
    """Copy a saved head (a milestone, a kept step-N head) to `dest`; its (step, hours) from its
    trained.json, without which the point has no place on the curve."""
    record = trained_record(head)
    if record is None or "elapsed_s" not in record:
        raise SystemExit(f"{head}: no trained.json with step and elapsed_s, so the point has no step or hours")
    shutil.copytree(head, dest)
    return record["step"], float(record["elapsed_s"]) / 3600.0


def point(args) -> int:
    CURVE_DIR.mkdir(parents=True, exist_ok=True)
    head_flag = "--dart-model" if args.method == "dart" else "--eagle3-model"
    with tempfile.TemporaryDirectory() as tmp:
        if args.head is not None:  # a saved head: its step and hours from its trained.json; the history stays
            step, hours = saved_head_state(args.head.expanduser(), Path(tmp) / "head")
        else:
            run = args.run.expanduser()
            step, hours = snapshot_head(run, Path(tmp) / "head")
            history = [h for h in json.loads((run / "train" / "history.json").read_text()) if h["step"] <= step]
            (CURVE_DIR / f"{args.label}.history.json").write_text(json.dumps(history, indent=1) + "\n")
        out = Path(tmp) / "bench.json"
        cmd = [
            *installed_command("dart-bench"),
            "--methods",
            args.method,
            head_flag,
            str(Path(tmp) / "head"),
            "--dataset",
            *[str(args.data / f"{s}.jsonl") for s in BENCH_SETS],
            "--max-nodes",
            str(args.max_nodes),
            "--limit",
            str(args.limit),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--dtype",
            args.dtype,
            "--out",
            str(out),
        ]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.method == "eagle3":
            cmd += ["--eagle3-max-nodes", str(args.max_nodes)]
        elif args.weights == "upstream":
            cmd += weight_flag_args(UPSTREAM_WEIGHTS)
        print("+", shlex.join(cmd), file=sys.stderr)
        subprocess.run(cmd, cwd=ROOT, check=True)
        result = json.loads(out.read_text())
    rec = {
        "label": args.label,
        "method": args.method,
        "step": step,
        "train_hours": round(hours, 3),
        "tau": result["methods"][args.method]["tau"],
        "tau_by_set": {d: r[args.method]["tau"] for d, r in result["datasets"].items()},
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "max_nodes": args.max_nodes,
        "dtype": args.dtype,
        **({"weights": args.weights} if args.method == "dart" else {}),
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "command": f"dart-curve point {'--head HEAD' if args.head is not None else '--run RUN'}"
        f" --label {args.label} --method {args.method} --limit {args.limit} --max-nodes {args.max_nodes}"
        + (f" --weights {args.weights}" if args.method == "dart" else ""),
    }
    with POINTS.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec, indent=1))
    return 0


def tables() -> str:
    """Markdown: per run label, validation hit@1 per row by training hours, then the bench points."""
    parts = []
    points = [json.loads(line) for line in POINTS.read_text().splitlines() if line.strip()] if POINTS.exists() else []
    for hist_file in sorted(CURVE_DIR.glob("*.history.json")):
        label = hist_file.name.removesuffix(".history.json")
        history = json.loads(hist_file.read_text())
        rows = max((len(h["val_hit1"]) for h in history), default=0)  # a resumed run may train fewer rows than before
        parts.append(f"**{label}**: validation (held-out self-distilled records), hit@1 per row (α-j = depth j)\n")
        parts.append("| step | train h | val KL | " + " | ".join(f"α-{j + 1}" for j in range(rows)) + " |")
        parts.append("|---" * (3 + rows) + "|")
        for h in history:
            hits = " | ".join([f"{100 * a:.1f}%" for a in h["val_hit1"]] + ["–"] * (rows - len(h["val_hit1"])))
            parts.append(f"| {h['step']} | {h['elapsed_s'] / 3600:.2f} | {h['val_kl']:.3f} | {hits} |")
        mine = [p for p in points if p["label"] == label]
        if mine:
            parts.append("\nBench τ (first turns, greedy; `limit` prompts per set):\n")
            parts.append(
                "| step | train h | tree nodes | score weights | τ (all) | " + " | ".join(BENCH_SETS) + " | prompts/set | tokens |"
            )
            parts.append("|---" * (7 + len(BENCH_SETS)) + "|")
            for p in mine:
                by_set = " | ".join(f"{p['tau_by_set'].get(s, float('nan')):.2f}" for s in BENCH_SETS)
                # points before the weights had presets (2026-11-24) were all taken with upstream's
                weights = p.get("weights", "upstream") if p["method"] == "dart" else "–"
                parts.append(
                    f"| {p['step']} | {p['train_hours']:.2f} | {p.get('max_nodes', '?')} | {weights} | {p['tau']:.2f} | {by_set} | "
                    f"{p['limit']} "
                    f"| {p['max_new_tokens']} |"  # each point's commit stays in points.jsonl
                )
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def table(args) -> int:
    text = tables()
    if not args.readme:
        print(text)
        return 0
    readme = README.read_text()
    if MARK_START not in readme or MARK_END not in readme:
        raise SystemExit(f"{README} has no {MARK_START} ... {MARK_END} block")
    head, rest = readme.split(MARK_START, 1)
    _, tail = rest.split(MARK_END, 1)
    README.write_text(f"{head}{MARK_START}\n{text}{MARK_END}{tail}")
    print(f"updated {README}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dart-curve",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    pt = sub.add_parser("point", help="copy a run's validation history and bench its head")
    source = pt.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=Path, help="the training --work directory: bench its current head, copy its history")
    source.add_argument(
        "--head", type=Path, help="a saved head directory with a trained.json (a milestone, a kept step-N head): bench it only"
    )
    pt.add_argument("--label", required=True, help="the run's name in the tables (e.g. dart-v1)")
    pt.add_argument("--method", choices=["dart", "eagle3"], required=True)
    pt.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "bench", help="directory of the bench .jsonl files")
    pt.add_argument("--limit", type=int, default=10, help="prompts per bench set")
    pt.add_argument("--max-new-tokens", type=int, default=128)
    pt.add_argument(
        "--max-nodes",
        type=int,
        default=default_max_nodes("cpu"),
        help="drafted tree nodes (both methods; default: the CPU default, so points compare)",
    )
    pt.add_argument("--dtype", default="bfloat16")
    add_threads_flag(
        pt, "the bench's torch CPU threads (default: torch's choice); τ does not depend on it, so 1 leaves a core to a training run"
    )
    pt.add_argument(
        "--weights",
        choices=["embedded", "upstream"],
        default="embedded",
        help="DART's tree score weights: the embedded target's preset (the bench's default) or upstream's "
        "(the points before 2026-11-24 used these)",
    )
    tb = sub.add_parser("table", help="print the curve tables")
    tb.add_argument("--readme", action="store_true", help=f"rewrite the block between {MARK_START} and {MARK_END} in assets/README.md")
    args = p.parse_args(argv)
    return point(args) if args.cmd == "point" else table(args)
