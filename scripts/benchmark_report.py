"""Paper-style benchmark report: speed-up and τ per dataset, latency breakdown, per-position
acceptance and ablations, written to docs/benchmarks.md with figures (PNG + HTML) in docs/figures/.

    python scripts/benchmark_report.py                     # this machine's CPU, embedded default
    python scripts/benchmark_report.py --device cuda --limit 20 --max-new-tokens 256

Every cell (a dataset, a temperature, a set of methods and flags) is one run of the bench CLI
(`python -m dart_core.bench`), so the methods of a cell are measured interleaved, prompt by prompt,
on the same machine; speed-ups are ratios to the `ar` run of the same cell. Cells are stored as JSON
under --work (one directory per device, dtype, prompt count and token limit) and a finished cell is
never re-run: an interrupted report resumes, and re-running the command only rewrites the document.
The document keeps one section per device, so a GPU run adds its section next to the CPU one. With
--readme, the README's headline table (between its bench markers) is replaced by this run's means.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "bench"
DATASETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "qa", "sum")
METHODS = ("ar", "hf", "pld", "eagle3", "dart")
SPECULATIVE = ("eagle3", "dart")  # methods that report τ, steps and a time split
TEMPERATURES = (0.0, 1.0)
ABLATION_DATASET = "mt_bench"
TREE_SIZES = (8, 16, 24, 40, 60)
DRAFT_DEPTHS = (2, 4, 6, 8)
TREE_TOP_KS = (5, 10, 25)
THREADS = (1, 2)
README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


@dataclass(frozen=True)
class Cell:
    name: str  # file stem of the cell's JSON
    dataset: str
    methods: tuple[str, ...]
    temperature: float = 0.0
    flags: tuple[str, ...] = ()  # extra bench flags
    group: str = "main"  # "main" or the ablation's name
    setting: str = ""  # the ablated value, for the tables


def plan(args: argparse.Namespace) -> list[Cell]:
    cells = [
        Cell(f"{d}-t{t:g}", d, tuple(args.methods), t)
        for t in args.temperatures
        for d in args.datasets
    ]
    if args.no_ablations:
        return cells
    d = ABLATION_DATASET
    cells += [Cell(f"abl-ngram-{v}", d, ("ar", "dart"), 0.0, f, "n-gram", v) for v, f in (("on", ()), ("off", ("--no-ngram",)))]
    cells += [Cell(f"abl-nodes-{n}", d, ("ar", "dart", "eagle3"), 0.0, ("--max-nodes", str(n)), "tree size", str(n)) for n in TREE_SIZES]
    cells += [Cell(f"abl-depth-{n}", d, ("ar", "dart"), 0.0, ("--draft-depth", str(n)), "draft length d", str(n)) for n in DRAFT_DEPTHS]
    cells += [Cell(f"abl-topk-{k}", d, ("ar", "dart"), 0.0, ("--tree-top-k", str(k)), "top-k", str(k)) for k in TREE_TOP_KS]
    cells += [Cell(f"abl-threads-{n}", d, ("ar", "dart", "eagle3"), 0.0, ("--threads", str(n)), "CPU threads", str(n)) for n in THREADS if args.device == "cpu"]
    return cells


def run_cell(cell: Cell, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"{cell.name}.json"
    if out.exists():
        return json.loads(out.read_text())
    cmd = [
        sys.executable, "-m", "dart_core.bench", "--methods", ",".join(cell.methods), "--dataset", str(args.data / f"{cell.dataset}.jsonl"),
        "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--temperature", f"{cell.temperature:g}",
        "--dtype", args.dtype, "--device", args.device, "--model", args.model, "--out", str(out.with_suffix(".tmp")), *cell.flags,
    ]  # fmt: skip
    if args.threads and "--threads" not in cell.flags:
        cmd += ["--threads", str(args.threads)]
    print(f"[cell {cell.name}] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    out.with_suffix(".tmp").rename(out)
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------ tables


def fmt(v, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows])


def mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def main_tables(results: dict[Cell, dict], temperature: float, methods: list[str]) -> str:
    cells = [c for c in results if c.group == "main" and c.temperature == temperature]
    others = [m for m in methods if m != "ar"]
    spd_rows, tau_rows, size_rows = [], [], []
    for c in cells:
        r = results[c]["methods"]
        spd_rows.append([c.dataset] + [fmt(r[m]["speedup_vs_ar"]) + "x" if m in r else "–" for m in others] + [fmt(r["ar"]["tokens_per_s"], ".1f")])
        tau_rows.append([c.dataset] + [fmt(r[m]["tau"]) for m in methods if m in SPECULATIVE])
        env = results[c]["env"]
        size_rows.append([c.dataset, str(len({s["question_id"] for s in results[c]["samples"]})), str(env["max_new_tokens"])]
                         + [str(r[m]["new_tokens"]) for m in methods])  # fmt: skip
    spd_rows.append(["**mean**"] + [fmt(mean([results[c]["methods"][m]["speedup_vs_ar"] for c in cells])) + "x" for m in others]
                    + [fmt(mean([results[c]["methods"]["ar"]["tokens_per_s"] for c in cells]), ".1f")])  # fmt: skip
    tau_rows.append(["**mean**"] + [fmt(mean([results[c]["methods"][m]["tau"] for c in cells])) for m in methods if m in SPECULATIVE])
    return "\n\n".join([
        "Speed-up over plain decoding (`ar`, our loop) in the same run; last column: `ar` tokens/s.\n\n"
        + table(["dataset", *others, "ar tok/s"], spd_rows),
        "τ, mean accepted length (tokens per target forward, the bonus token included):\n\n"
        + table(["dataset", *[m for m in methods if m in SPECULATIVE]], tau_rows),
        "What each cell averages (prompts, token limit per prompt, new tokens generated per method):\n\n"
        + table(["dataset", "prompts", "max new", *[f"{m} tokens" for m in methods]], size_rows),
    ])  # fmt: skip


def latency_table(results: dict[Cell, dict], methods: list[str]) -> str:
    """ms per step of each stage, averaged over the temperature-0 main cells weighted by steps."""
    rows = []
    for m in methods:
        if m not in SPECULATIVE and m != "ar":
            continue
        tot = {"draft": 0.0, "prune": 0.0, "verify": 0.0, "other": 0.0}
        steps = 0
        for c, res in results.items():
            r = res["methods"].get(m)
            if c.group != "main" or c.temperature != 0.0 or r is None or not r.get("accept_hist"):
                continue
            n = sum(r["accept_hist"])
            steps += n
            for k in tot:
                tot[k] += (r[f"{k}_ms"] or 0.0) * n
        if not steps:
            continue
        per = {k: v / steps for k, v in tot.items()}
        total = sum(per.values())
        rows.append([m] + [f"{per[k]:.2f} ({100 * per[k] / total:.0f}%)" for k in tot] + [f"{total:.2f}", str(steps)])
    return table(["method", "draft ms", "prune ms", "verify ms", "other ms", "total ms/step", "steps"], rows)


def acceptance_by_depth(results: dict[Cell, dict], method: str) -> list[float]:
    """P(a step accepts >= k drafts), pooled over the temperature-0 main cells."""
    hist: list[int] = []
    for c, res in results.items():
        r = res["methods"].get(method)
        if c.group == "main" and c.temperature == 0.0 and r and r.get("accept_hist"):
            for a, n in enumerate(r["accept_hist"]):
                hist.extend([0] * (a + 1 - len(hist)))
                hist[a] += n
    total = sum(hist)
    return [sum(hist[k:]) / total for k in range(1, len(hist))] if total else []


def ablation_tables(results: dict[Cell, dict]) -> str:
    groups: dict[str, list[Cell]] = {}
    for c in results:
        if c.group != "main":
            groups.setdefault(c.group, []).append(c)
    parts = []
    for group, cells in groups.items():
        methods = [m for m in cells[0].methods if m != "ar"]
        header = [group] + [h for m in methods for h in (f"{m} speed-up", f"{m} τ", f"{m} draft+prune ms", f"{m} verify ms")] + ["ar tok/s"]
        rows = []
        for c in cells:
            r = results[c]["methods"]
            row = [c.setting]
            for m in methods:
                x = r[m]
                row += [fmt(x["speedup_vs_ar"]) + "x", fmt(x["tau"]), fmt((x["draft_ms"] or 0) + (x["prune_ms"] or 0)), fmt(x["verify_ms"])]
            rows.append(row + [fmt(r["ar"]["tokens_per_s"], ".1f")])
        parts.append(f"**{group}** ({ABLATION_DATASET}, temperature 0):\n\n" + table(header, rows))
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------------- figures


def figures(results: dict[Cell, dict], methods: list[str], fig_dir: Path, tag: str) -> list[str]:
    """Speed-up bars, τ against drafting latency, per-position acceptance; PNG (if kaleido and a
    Chromium are available) and HTML. Returns markdown lines embedding them."""
    import plotly.graph_objects as go

    fig_dir.mkdir(parents=True, exist_ok=True)
    main0 = [c for c in results if c.group == "main" and c.temperature == 0.0]
    figs = {}
    bars = go.Figure()
    for m in methods:
        if m == "ar":
            continue
        bars.add_bar(name=m, x=[c.dataset for c in main0], y=[results[c]["methods"][m]["speedup_vs_ar"] for c in main0])
    bars.add_hline(y=1.0, line_dash="dot", annotation_text="plain decoding")
    bars.update_layout(title="Speed-up over plain decoding (temperature 0)", yaxis_title="speed-up", barmode="group")
    figs["speedup"] = bars
    scatter = go.Figure()
    for m in methods:
        if m not in SPECULATIVE:
            continue
        pts = [results[c]["methods"][m] for c in main0]
        scatter.add_scatter(
            name=m, mode="markers+text", text=[c.dataset for c in main0], textposition="top center",
            x=[(p["draft_ms"] or 0) + (p["prune_ms"] or 0) for p in pts], y=[p["tau"] for p in pts],
        )  # fmt: skip
    scatter.update_layout(title="τ against drafting latency (draft + prune, ms per step)", xaxis_title="ms per step", yaxis_title="τ")
    figs["tau-vs-latency"] = scatter
    acc = go.Figure()
    for m in methods:
        if m in SPECULATIVE:
            a = acceptance_by_depth(results, m)
            acc.add_scatter(name=m, x=list(range(1, len(a) + 1)), y=a, mode="lines+markers")
    acc.update_layout(title="Per-position acceptance: P(a step accepts at least k drafts)", xaxis_title="k", yaxis_title="rate", yaxis_range=[0, 1])
    figs["acceptance"] = acc
    lines = []
    png_ok = _can_write_png()
    for name, fig in figs.items():
        fig.update_layout(width=900, height=450, template="plotly_white")
        stem = f"{tag}-{name}"
        fig.write_html(fig_dir / f"{stem}.html", include_plotlyjs="cdn")
        if png_ok:
            fig.write_image(fig_dir / f"{stem}.png")
            lines.append(f"![{name}](figures/{stem}.png) ([interactive](figures/{stem}.html))")
        else:
            lines.append(f"[{name} (interactive)](figures/{stem}.html)")
    return lines


def _can_write_png() -> bool:
    try:
        import kaleido  # noqa: F401
    except ImportError:
        print("kaleido is not installed (pip install kaleido): figures as HTML only", file=sys.stderr)
        return False
    browser = os.environ.get("BROWSER_PATH") or shutil.which("chromium") or shutil.which("google-chrome")
    if not browser:
        print("no Chromium found for kaleido: figures as HTML only", file=sys.stderr)
        return False
    os.environ.setdefault("BROWSER_PATH", browser)
    return True


# ---------------------------------------------------------------------------------------- document


def section(results: dict[Cell, dict], args: argparse.Namespace, tag: str, figure_lines: list[str]) -> str:
    env = next(iter(results.values()))["env"]
    where = env["gpu"] or env["cpu"]
    cmd = f"python scripts/benchmark_report.py --device {args.device} --dtype {args.dtype} --limit {args.limit} --max-new-tokens {args.max_new_tokens}"
    parts = [
        f"## {args.device.upper()}: {where} ({datetime.date.today().isoformat()})",
        f"Reproduce: `{cmd}` (cells cached under `{_rel(args.work)}`).\n\n"
        + table(["", ""], [
            ["device", f"{env['device']}, {env['threads']} threads" + (f", {env['gpu']}" if env["gpu"] else "")],
            ["CPU", env["cpu"]], ["target", env["model"]], ["dtype", env["dtype"]],
            ["torch / transformers / python", f"{env['torch']} / {env['transformers']} / {env['python']}"],
            ["git commit", str(env["git_commit"])], ["prompts per cell", str(args.limit)], ["max new tokens", str(args.max_new_tokens)],
            ["draft tree", f"{args.tree_nodes} nodes besides the root (the device default; EAGLE3 gets the same budget) unless a table varies it"],
        ]),  # fmt: skip
    ]
    for t in args.temperatures:
        parts.append(f"### Temperature {t:g}" + (" (greedy)" if t == 0 else " (sampling; lossless: tests/test_acceptance.py)"))
        parts.append(main_tables(results, t, args.methods))
    parts.append("### Latency breakdown (temperature 0, all datasets, per target forward)")
    parts.append(latency_table(results, args.methods))
    acc_rows = [[m] + [f"{a:.2f}" for a in acceptance_by_depth(results, m)] for m in args.methods if m in SPECULATIVE]
    width = max((len(r) for r in acc_rows), default=1)
    parts.append("### Per-position acceptance (temperature 0, all datasets): P(a step accepts at least k drafts)")
    parts.append(table(["method", *[f"k={k}" for k in range(1, width)]], [r + ["–"] * (width - len(r)) for r in acc_rows]))
    ablations = ablation_tables(results)
    if ablations:
        parts.append("### Ablations")
        parts.append(ablations)
    if figure_lines:
        parts.append("### Figures")
        parts.append("\n\n".join(figure_lines))
    return "\n\n".join(parts) + "\n"


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


HEADER = """# Benchmarks

Generated by `scripts/benchmark_report.py` from runs of the bench CLI (`python -m dart_core.bench`);
every number below was measured, in the run this section describes, on the machine it names.
Speed-ups are ratios to plain decoding (`ar`: our loop drafting nothing) measured in the same run,
prompt by prompt interleaved. `hf` is transformers' `generate`, `pld` its prompt-lookup decoding.
Prompts are the first N of each file of `../shared/data/bench` (first turn only).
"""


def write_document(path: Path, tag: str, body: str) -> None:
    start, end = f"<!-- report:{tag}:start -->", f"<!-- report:{tag}:end -->"
    text = path.read_text() if path.exists() else HEADER
    block = f"{start}\n{body}{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def readme_block(results: dict[Cell, dict], args: argparse.Namespace) -> str:
    env = next(iter(results.values()))["env"]
    main0 = [c for c in results if c.group == "main" and c.temperature == 0.0]
    rows = []
    for m in args.methods:
        if m == "ar":
            continue
        rows.append([m, fmt(mean([results[c]["methods"][m]["speedup_vs_ar"] for c in main0])) + "x",
                     fmt(mean([results[c]["methods"][m]["tau"] for c in main0]))])  # fmt: skip
    return (
        f"Greedy, mean over {len(main0)} datasets x {args.limit} prompts x ≤{args.max_new_tokens} tokens, "
        f"{env['gpu'] or env['cpu']}, {env['threads']} threads, {env['dtype']}, {datetime.date.today().isoformat()} "
        f"(full report: [docs/benchmarks.md](docs/benchmarks.md); reproduce: `python scripts/benchmark_report.py --readme`):\n\n"
        + table(["method", "speed-up vs plain decoding", "τ"], rows)
        + "\n"
    )


def update_readme(block: str) -> None:
    path = ROOT / "README.md"
    text = path.read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"README.md lacks the markers {README_START} ... {README_END}")
    text = re.sub(re.escape(README_START) + ".*?" + re.escape(README_END), lambda _: f"{README_START}\n{block}{README_END}", text, flags=re.S)
    path.write_text(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--model", default="default")
    p.add_argument("--limit", type=int, default=4, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for every cell except the threads ablation")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--temperatures", nargs="+", type=float, default=list(TEMPERATURES))
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--data", type=Path, default=DATA, help="directory of the benchmark .jsonl files")
    p.add_argument("--work", type=Path, default=None, help="cell cache (default runs/report/<device>-<dtype>-n<limit>-t<tokens>-nodes<default tree size>)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--readme", action="store_true", help="also replace the README's headline table")
    args = p.parse_args(argv)
    if "ar" not in args.methods:
        args.methods = ["ar", *args.methods]  # speed-ups are ratios to it
    args.methods = [m for m in METHODS if m in args.methods]
    # the default tree size is part of every cell's setting: a new default must not reuse old cells
    from dart_core.drafters import default_max_nodes

    nodes = args.tree_nodes = default_max_nodes(args.device.split(":")[0])
    args.work = args.work or ROOT / "runs" / "report" / f"{args.device}-{args.dtype}-n{args.limit}-t{args.max_new_tokens}-nodes{nodes}"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    results = {cell: run_cell(cell, args, args.work) for cell in plan(args)}
    tag = args.device.split(":")[0]
    figure_lines = figures(results, args.methods, args.out.parent / "figures", tag)
    write_document(args.out, tag, section(results, args, tag, figure_lines))
    print(f"wrote {args.out}", file=sys.stderr)
    if args.readme:
        update_readme(readme_block(results, args))
        print("updated README.md's headline table", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
