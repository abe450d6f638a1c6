"""The benchmark report: docs/benchmarks.md and the README's results tables, written from the bench
result files the repository keeps (docs/results/NAME.json, listed with their commands in
docs/results/runs.json).

    dart-report                   # rewrite both from docs/results/
    dart-report --check           # exit 1 if either is not what the results give
    dart-report --measure NAME    # run NAME's bench command again, then rewrite

Each result file is one run of the bench CLI (`dart-bench ... --out FILE`): every
method on the same prompts, interleaved prompt by prompt, so a run's speed-ups are ratios to its own
plain decoding (`ar`). The report writes, between its markers, the README's results (a short table per
CPU kind from the runs marked "readme": plain, EAGLE3, DART and llama.cpp, a row per weights path; the
GPU's row from the kept GPU check's embedded stage) and docs/benchmarks.md's report: every row of
those runs, then per run the command that made it, its environment, totals, per-set speed-ups,
acceptance by depth and the forward costs its calibration measured. Text outside the markers is kept
(the history of the runs is docs/changelog.md). To add a run: an entry in runs.json (its bench
arguments without --out, environment variables, a note), then `--measure NAME`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..tools.methods import METHODS, is_llamacpp, is_vllm
from . import installed_command

ROOT = Path(__file__).resolve().parents[2]  # the repository: the report reads and writes files named from it
RESULTS = Path("docs") / "results"  # relative to ROOT, as the commands name it
README = Path("README.md")
DOC = Path("docs") / "benchmarks.md"
README_MARKS = ("<!-- bench:start -->", "<!-- bench:end -->")
DOC_MARKS = ("<!-- report:start -->", "<!-- report:end -->")
# How the generated documents name this command and the bench's. They are the old names (thin aliases,
# dart-report and dart_core/tools/bench.py) until the documents are regenerated with the new ones.
COMMAND = "dart-report"
BENCH_COMMAND = "dart-bench"
# the kept GPU check whose embedded stage gives the README's GPU row
GPU_RESULT = RESULTS / "gpu-h200-2026-11-29.json"

# how the tables name the bench's methods (method@N adds its size)
LABELS = {
    "ar": "plain", "hf": "transformers generate", "pld": "transformers prompt lookup", "eagle3": "EAGLE3", "dart": "DART",
    "dart-noctx": "DART, no context n-gram", "dart-adaptive": "DART, adaptive tree",
    "llamacpp": "plain", "llamacpp-lookup": "lookup", "llamacpp-eagle3": "EAGLE3 chain",
    "llamacpp-ngram-simple": "ngram-simple", "llamacpp-ngram-map-k": "ngram-map-k", "llamacpp-ngram-mod": "ngram-mod",
    "vllm": "plain", "vllm-eagle3": "EAGLE3 chain", "vllm-dart": "DART chain, our plugin",
}  # fmt: skip


@dataclass
class Run:
    name: str
    entry: dict  # the runs.json entry
    data: dict  # the bench's result JSON

    @property
    def env(self) -> dict:
        return self.data["env"]

    def command(self) -> str:
        """The shell command that writes this run's file, as the documents show it."""
        env = [f"{k}={v}" for k, v in self.entry.get("env", {}).items()]
        words = [
            *env,
            BENCH_COMMAND,
            *shell_args([*self.entry["args"], "--out", str(RESULTS / f"{self.name}.json")]),
        ]
        chunks: list[str] = []  # an option with its values, or a word before the first option
        for w in words:
            if chunks and not w.startswith("--") and chunks[-1].startswith("--"):
                chunks[-1] += " " + w
            else:
                chunks.append(w)
        lines = [""]
        for c in chunks:  # lines of at most ~100 characters, broken before an option
            if lines[-1].strip() and len(lines[-1]) + len(c) > 100 and c.startswith("--"):
                lines.append("    ")
            lines[-1] += (" " if lines[-1].strip() else "") + c
        return " \\\n".join(lines)


def load_runs(root: Path) -> list[Run]:
    manifest = json.loads((root / RESULTS / "runs.json").read_text())
    runs = []
    for entry in manifest["runs"]:
        path = root / RESULTS / f"{entry['name']}.json"
        if not path.is_file():
            raise SystemExit(f"{path} is listed in runs.json but missing (measure it: {COMMAND} --measure {entry['name']})")
        runs.append(Run(entry["name"], entry, json.loads(path.read_text())))
    return runs


def shell_args(args: list[str]) -> list[str]:
    """Arguments as shell words; files of one directory and suffix in a row become dir/{a,b}.suffix."""
    out, i = [], 0
    while i < len(args):
        j = i
        while (
            j < len(args)
            and not args[j].startswith("-")
            and Path(args[j]).parent == Path(args[i]).parent
            and Path(args[j]).suffix == Path(args[i]).suffix
            and Path(args[i]).suffix
        ):
            j += 1
        if j - i >= 2:
            d, suffix = Path(args[i]).parent, Path(args[i]).suffix
            out.append(f"{d}/{{{','.join(Path(a).stem for a in args[i:j])}}}{suffix}")
            i = j
            continue
        a = args[i]
        out.append(a if re.fullmatch(r"[\w@%+=:,./~-]+", a) else shlex.quote(a))
        i += 1
    return out


# ------------------------------------------------------------------------------------------ labels


def fmt(v, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows])


def engine_prefix(method: str) -> str:
    """How a table that mixes engines prefixes a peer's method: "llama.cpp ", "vLLM " or nothing (ours)."""
    return "llama.cpp " if is_llamacpp(method) else "vLLM " if is_vllm(method) else ""


def method_head(method: str) -> str | None:
    """The head a method (method@N too) drafts with, whose trained.json the bench's env["heads"]
    records: "dart", "eagle3" (our loop's drafter, or llama.cpp's EAGLE3 on ours), or None."""
    base = method.partition("@")[0]
    if base in ("llamacpp-eagle3", "vllm-eagle3"):
        return "eagle3"
    if base == "vllm-dart":
        return "dart"
    known = METHODS.get(base)
    return None if known is None else known.drafter


def head_steps(env: dict, method: str) -> str | None:
    """ "12,188 steps" for a method whose head's training step the run recorded, else None."""
    head = (env.get("heads") or {}).get(method_head(method), {})
    return f"{head['step']:,} steps" if "step" in head else None


def method_label(run: Run, method: str) -> str:
    base, _, at = method.partition("@")
    label = LABELS.get(base, base)
    steps = head_steps(run.env, method)
    if is_llamacpp(method):
        parts = [f"draft length {at}"] if at else []
        parts += [f"head at {steps}"] if steps else []
        return f"{label}, {', '.join(parts)}" if parts else label
    if is_vllm(method):  # as ours: draft tokens a step and the head's training steps in brackets
        parts = [f"{at} draft{'s' if at != '1' else ''}"] if at else []
        parts += [steps] if steps else []
        return f"{label} ({', '.join(parts)})" if parts else label
    nodes = int(at) if at else (run.env.get("tree_sizes") or {}).get(base, {}).get("max_nodes")
    parts = [f"{nodes} node{'s' if nodes != 1 else ''}"] if nodes is not None and base != "ar" else []
    parts += [steps] if steps else []
    return f"{label} ({', '.join(parts)})" if parts else label


def heads_text(env: dict) -> str | None:
    """The heads a run compared, for its environment table: directory, run, step and training hours."""
    heads = env.get("heads") or {}
    parts = []
    for name, h in heads.items():
        trained = [h["run"]] if "run" in h else []
        trained += [f"step {h['step']:,}"] if "step" in h else []
        trained += [f"{h['elapsed_s'] / 3600:.2f} training hours"] if "elapsed_s" in h else []
        parts.append(f"{LABELS.get(name, name)} `{h['head']}`" + (f" ({', '.join(trained)})" if trained else " (no trained.json)"))
    return "; ".join(parts) or None


def kernel_label(env: dict) -> str:
    """The kernel build a run used and the CPU it ran on (its kind too when the build was forced below
    it): runs on different CPUs share the README's table."""
    if env.get("device", "cpu") != "cpu":
        return env.get("gpu") or env["device"]
    build = (env.get("kernels") or "eager").split()[0]
    forced = "forced" in (env.get("kernels") or "")
    cpu = env.get("cpu")
    if forced and env.get("cpu_kind"):
        return f"`{build}` (forced on an `{env['cpu_kind']}` CPU{', ' + cpu if cpu else ''})"
    return f"`{build}`" + (f" ({cpu})" if cpu else "")


def weights_label(env: dict) -> str:
    weights = (env.get("weights") or env["dtype"]).split(" (")[0]
    name = {"gguf": "GGUF", "bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(weights, weights)
    choice = env.get("weights_choice") or {}
    return f"{name} (auto)" if choice.get("calibrated") else name


def peer_label(env: dict) -> str:
    bin_dir = Path((env.get("llamacpp") or {}).get("bin_dir", ""))
    kind = bin_dir.parent.name if bin_dir.name == "bin" else ""
    return f"llama.cpp (`{kind}` build)" if kind else "llama.cpp"


def vllm_label(env: dict) -> str:
    v = env.get("vllm") or {}
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(v.get("dtype", "float32"), v.get("dtype"))
    return f"vLLM {v.get('version', '?')} (CPU build), {dtype} safetensors"


def engine_label(env: dict, method: str) -> str:
    """The engine and weights a method of a run ran on, as the README's table names them."""
    if is_llamacpp(method):
        return peer_label(env)
    if is_vllm(method):
        return vllm_label(env)
    return f"ours, {weights_label(env)}"


def same_ids(r: dict) -> str:
    """The ids column: prompts with our plain decoding's ids, and for vLLM's methods with vLLM plain's."""
    cell = str(r.get("same_as_ar", "–"))
    return cell + (f" (vLLM plain's: {r['same_as_vllm']})" if "same_as_vllm" in r else "")


# ------------------------------------------------------------------------------------------ tables


def unequal_heads(env: dict) -> bool:
    """Whether the run's DART and EAGLE3 heads were trained for different numbers of steps."""
    heads = env.get("heads") or {}
    steps = {heads.get(name, {}).get("step") for name in ("dart", "eagle3")}
    return None not in steps and len(steps) == 2


def slower_draft_length(run: Run, method: str) -> bool:
    """Whether a peer's method@N ran at another draft length that was faster in the same run (the
    README shows each peer method at its fastest; every length stays in docs/benchmarks.md)."""
    if "@" not in method or not (is_llamacpp(method) or is_vllm(method)):
        return False
    m, base = run.data["methods"], method.partition("@")[0]
    return any(k.partition("@")[0] == base and r["tokens_per_s"] > m[method]["tokens_per_s"] for k, r in m.items())


def summary_table(runs: list[Run]) -> str:
    """One row per method of each run, a peer's method at its fastest draft length; the CPU kind and
    the engine are named where they change. EAGLE3 rows of a run whose heads had unequal training are
    left out: the README compares equal budgets only (the rows stay in each run's section of
    docs/benchmarks.md)."""
    rows, last_kind, last_engine = [], None, None
    for run in runs:
        for method, r in run.data["methods"].items():
            if (method_head(method) == "eagle3" and unequal_heads(run.env)) or slower_draft_length(run, method):
                continue
            kind = kernel_label(run.env)
            engine = engine_label(run.env, method)
            rows.append([
                kind if kind != last_kind else "", engine if (kind, engine) != last_engine else "", method_label(run, method),
                fmt(r["tokens_per_s"], ".1f"), fmt(r.get("decode_tokens_per_s"), ".1f"), fmt(r["speedup_vs_ar"]) + "x",
                fmt(r["tau"]), same_ids(r),
            ])  # fmt: skip
            last_kind, last_engine = kind, (kind, engine)
    header = ["CPU kind (kernels)", "engine, weights", "method", "tokens/s", "decode tokens/s", "vs our plain", "τ", "ids = plain's"]
    return table(header, rows)


def peer_ratios(run: Run) -> str | None:
    """Our DART and plain decoding against llama.cpp's plain decoding in the same run."""
    m = run.data["methods"]
    if "dart" not in m or "llamacpp" not in m:
        return None
    peer = m["llamacpp"]

    def ratios(r: dict) -> str:
        text = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x"
        if r.get("decode_tokens_per_s") and peer.get("decode_tokens_per_s"):
            text += f" / {r['decode_tokens_per_s'] / peer['decode_tokens_per_s']:.2f}x"
        return text

    return (f"{kernel_label(run.env)}, ours on {weights_label(run.env)}, against the plain decoding of "
            f"{peer_label(run.env)} on the GGUF (end to end / "
            f"decode-only): our DART {ratios(m['dart'])}, our plain decoding {ratios(m['ar'])}.")  # fmt: skip


def vllm_ratios(run: Run) -> str | None:
    """vLLM's drafting methods against vLLM's plain decoding in the same run, each at its fastest draft
    length in the run, and vLLM's DART chain against its EAGLE3 chain."""
    m = run.data["methods"]
    plain = m.get("vllm")
    if plain is None:
        return None

    def best(base: str) -> str | None:
        names = [k for k in m if k.partition("@")[0] == base]
        return max(names, key=lambda k: m[k]["tokens_per_s"]) if names else None

    def vs(a: dict, b: dict) -> str:
        text = f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x"
        if a.get("decode_tokens_per_s") and b.get("decode_tokens_per_s"):
            text += f" / {a['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x"
        return text

    parts = []
    for base in ("vllm-eagle3", "vllm-dart"):
        k = best(base)
        if k is None:
            continue
        r = m[k]
        drafts = f", accepted/drafted {r['accepted_drafts']}/{r['drafted']}" if r.get("drafted") else ""
        parts.append(f"{method_label(run, k)} {r['tokens_per_s']:.1f} tokens/s, {vs(r, plain)} vLLM plain's (τ {fmt(r['tau'])}{drafts})")
    if not parts:
        return None
    text = f"{vllm_label(run.env)}, in the same run (end to end / decode-only), plain {plain['tokens_per_s']:.1f} tokens/s: " + "; ".join(
        parts
    )
    e, d = best("vllm-eagle3"), best("vllm-dart")
    if e and d:
        text += f"; vLLM's DART chain against its EAGLE3 chain: {vs(m[d], m[e])}"
    return text + "."


def fidelity_text(run: Run) -> str | None:
    """vLLM's drafting methods against vLLM's own plain decoding, id for id, and where they part."""
    f = run.data.get("vllm_fidelity")
    if not f or not f.get("same_as_vllm"):
        return None
    counts = ", ".join(f"{engine_prefix(k)}{method_label(run, k)} {c}" for k, c in f["same_as_vllm"].items())
    text = f"vLLM's drafting methods against vLLM's own plain decoding (prompts with exactly its ids): {counts}."
    parts = f.get("parts") or []
    if not parts:
        return text
    rows = []
    for p in parts:
        eagle = ", ".join(("same" if ok else "parts too") for ok in p["eagle3_same"].values()) or "–"
        rows.append([f"{p['dataset']} {p['question_id']}", p["method"], str(p["index"]), f"{p['token']} / {p['vllm_token']}",
                     "–" if p["top2_gap"] is None else f"{p['top2_gap']:.3g}", eagle])  # fmt: skip
    header = [
        "prompt",
        "method",
        "first differing new token",
        "its id / vLLM plain's",
        "vLLM plain's top-2 logit gap there",
        "vLLM EAGLE3 there",
    ]
    return (
        text + " Where they part (vLLM verifies with other matrix shapes than it decodes with, so a near-tie can round "
        "either way):\n\n" + table(header, rows)
    )


def setting(runs: list[Run]) -> str:
    """The prompts, tokens and threads the runs share, in words."""
    envs = [r.env for r in runs]
    sets = {tuple(Path(d).stem for d in e.get("dataset") or []) for e in envs}
    parts = []
    if len(sets) == 1:
        names = next(iter(sets))
        where = f"`{Path(envs[0]['dataset'][0]).parent}`"
        parts.append(f"the bench sets of {where} ({', '.join(names)})")
    for key, say in (("limit", "first {} prompts each (first turn)"), ("max_new_tokens", "{} new tokens"), ("threads", "{} threads")):
        values = {e.get(key) for e in envs}
        if len(values) == 1 and None not in values:
            parts.append(say.format(values.pop()))
    temps = {e.get("temperature") for e in envs}
    if temps == {0.0}:
        parts.append("greedy")
    cpus = {e.get("cpu") for e in envs}
    if len(cpus) == 1:
        parts.append(f"CPU: {cpus.pop()}")
    return ", ".join(parts)


def full_summary(runs: list[Run], details: str = "below") -> str:
    """docs/benchmarks.md's summary: every row of the runs marked "readme", one group per CPU kind and
    engine, and the ratios against the peers in words."""
    shown = [r for r in runs if r.entry.get("readme")]
    lines = [
        f"One bench run per group of rows: {setting(shown)}. Every method of a run ran on the same prompts, interleaved "
        "prompt by prompt; *vs our plain* is against the plain row of the same run, *ids = plain's* counts the prompts "
        f"whose output ids equal our plain decoding's. The commands, environments and per-set tables are {details}.",
        "",
        summary_table(shown),
        "",
    ]
    lines += [f"- {s}" for r in shown for s in (peer_ratios(r), vllm_ratios(r)) if s]
    unequal = [kernel_label(r.env) + ", " + weights_label(r.env) for r in shown if unequal_heads(r.env) and has_eagle3(r)]
    if unequal:
        lines.append(
            f"- Runs without an EAGLE3 row ({'; '.join(unequal)}) were made with an EAGLE3 head trained for fewer steps than "
            f"DART's; their EAGLE3 rows, labelled with the head's step, are {details}."
        )
    return "\n".join(lines).rstrip() + "\n"


def cell(r: dict | None, plain: dict, tau: bool = True) -> str:
    """A compact table's cell: tokens/s, then the ratio to the run's plain decoding (and τ)."""
    if r is None:
        return "–"
    extra = [f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x"] + ([f"τ {fmt(r['tau'])}"] if tau else [])
    return f"{r['tokens_per_s']:.1f} ({', '.join(extra)})"


def ids_cell(methods: dict, names: tuple[str, ...]) -> str:
    """The same-ids column: one count where the drafting methods agree, else each by name."""
    counts = {LABELS[m]: str(methods[m].get("same_as_ar", "–")) for m in names if m in methods}
    if not counts:
        return "–"
    if len(set(counts.values())) == 1:
        return next(iter(counts.values()))
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def compact_tables(shown: list[Run]) -> list[str]:
    """A short table per CPU (its kernel build and model): a row per weights path, the columns plain,
    EAGLE3, DART and llama.cpp's plain decoding, in tokens/s. An EAGLE3 head trained for fewer steps
    than DART's shows as –."""
    lines: list[str] = []
    groups: dict[str, list[Run]] = {}
    for run in shown:
        groups.setdefault(kernel_label(run.env), []).append(run)
    header = ["weights", "plain", "EAGLE3", "DART", "llama.cpp", "same ids"]
    for kind, runs in groups.items():
        rows = []
        for run in runs:
            m = run.data["methods"]
            eagle3 = None if unequal_heads(run.env) else m.get("eagle3")
            ids = ids_cell(m, ("eagle3", "dart") if eagle3 else ("dart",))
            rows.append([weights_label(run.env), fmt(m["ar"]["tokens_per_s"], ".1f"), cell(eagle3, m["ar"]), cell(m.get("dart"), m["ar"]),
                         cell(m.get("llamacpp"), m["ar"], tau=False), ids])  # fmt: skip
        lines += [f"**{kind}**", "", table(header, rows), ""]
    return lines


def footnotes(shown: list[Run]) -> list[str]:
    """The tree sizes, the training budget and vLLM's ratios, once each."""
    sizes = []
    for run in shown:
        trees = run.env.get("tree_sizes") or {}
        each = [str(trees.get(m, {}).get("max_nodes", "–")) for m in ("eagle3", "dart")]
        sizes.append(f"{kernel_label(run.env)} {weights_label(run.env)} {'/'.join(each)}")
    lines = []
    if sizes:
        lines.append(
            f"- Tree sizes, EAGLE3/DART (drafted nodes besides the root, chosen by the calibration on each machine): {'; '.join(sizes)}."
        )
    steps = {(h.get("dart", {}).get("step"), h.get("eagle3", {}).get("step")) for h in ((r.env.get("heads") or {}) for r in shown)}
    if len(steps) == 1 and None not in next(iter(steps)):
        dart, eagle3 = next(iter(steps))
        if dart == eagle3:
            lines.append(f"- Training budget: both heads trained {dart:,} steps on the same self-distilled corpus.")
        else:
            lines.append(f"- Training budget: DART's head trained {dart:,} steps, EAGLE3's {eagle3:,}.")
    unequal = [kernel_label(r.env) + ", " + weights_label(r.env) for r in shown if unequal_heads(r.env) and has_eagle3(r)]
    if unequal:
        lines.append(f"- EAGLE3 shows – where its head trained fewer steps than DART's ({'; '.join(unequal)}).")
    for run in shown:
        m = run.data["methods"]
        plain = m.get("vllm")
        best = {base: max((k for k in m if k.partition("@")[0] == base), key=lambda k: m[k]["tokens_per_s"], default=None)
                for base in ("vllm-eagle3", "vllm-dart")}  # fmt: skip
        e, d = best["vllm-eagle3"], best["vllm-dart"]
        if plain and e and d:
            lines.append(
                f"- In vLLM's CPU build ({kernel_label(run.env)}, the same prompts, {plain['tokens_per_s']:.1f} tokens/s plain), "
                f"DART's chain through our plugin ran {m[d]['tokens_per_s'] / plain['tokens_per_s']:.2f}x its plain decoding and "
                f"{m[d]['tokens_per_s'] / m[e]['tokens_per_s']:.2f}x its EAGLE3 chain ([docs/vllm.md](docs/vllm.md))."
            )
    return lines


def gpu_table(root: Path) -> list[str]:
    """The GPU's row, from the kept GPU check's embedded stage (GPU_RESULT), when the file is there."""
    path = root / GPU_RESULT
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    result = data["runs"]["embedded"]["result"]
    argv = list(result["argv"])
    if "--out" in argv:  # the folder the run wrote to is the machine's: the command names it DIR
        argv[argv.index("--out") + 1] = "DIR"
    tokens = argv[argv.index("--max-new-tokens") + 1] if "--max-new-tokens" in argv else "?"
    for dtype, res in result["stages"]["embedded"].items():
        if not isinstance(res, dict) or "ar" not in res:
            continue
        plain = res["ar"]
        drafting = {k.partition("@")[0]: (k, v) for k, v in res.items() if k.partition("@")[0] in ("dart", "eagle3")}

        def gcell(base: str) -> str:
            r = drafting.get(base, (None, None))[1]
            return "–" if r is None else f"{r['tokens_per_s']:.1f} ({r['vs_ar']:.2f}x, τ {r['tau']:.2f})"

        same = sorted({f"{r['ids_equal_ar']}/{r['prompts']}" for _, r in drafting.values()})
        nodes = sorted({k.partition("@")[2] for k, _ in drafting.values() if "@" in k})
        weights = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
        row = [weights, fmt(plain["tokens_per_s"], ".1f"), gcell("eagle3"), gcell("dart"), "–", ", ".join(same) or "–"]
        notes = [f"{r['ms_a_step']['draft']:.1f} ms for {LABELS[b]}" for b, (_, r) in sorted(drafting.items())]
        return [
            f"**GPU: {data['device'].split(' (')[0]}** ({data['date']}; {plain['prompts']} prompts x {tokens} tokens"
            + (f", trees of {', '.join(nodes)} nodes" if nodes else "")
            + f"; `python {shlex.join(argv)}`, [{GPU_RESULT.as_posix()}]({GPU_RESULT.as_posix()}); not a bench run). "
            f"A step's drafting took {' and '.join(notes)} in that run ([docs/gpu.md](docs/gpu.md)).",
            "",
            table(["weights", "plain", "EAGLE3", "DART", "llama.cpp", "same ids"], [row]),
            "",
        ]
    return []


def readme_block(runs: list[Run], root: Path | None = None) -> str:
    """The README's results: a short table per CPU kind from the runs marked "readme", the GPU's row,
    what τ and "same ids" mean, the tree sizes and the training budget once each."""
    shown = [r for r in runs if r.entry.get("readme")]
    lines = [
        f"Tokens/s end to end (prefill included) on {setting(shown)}. "
        "Each row is one bench run: its methods ran on the same prompts, interleaved prompt by prompt; "
        "in brackets, the ratio to that row's plain decoding and τ. `dart-kernels` prints your CPU's kind. "
        f"Written by `{COMMAND}` from `{RESULTS}/`; every row, llama.cpp's id counts, the commands and the per-set tables "
        "are in [docs/benchmarks.md](docs/benchmarks.md).",
        "",
        *compact_tables(shown),
        *(gpu_table(root if root is not None else ROOT)),
        "- τ: new tokens per target forward (accepted drafts plus the target's own next token); plain decoding's is 1.",
        "- same ids: prompts whose output token ids equal our plain decoding's, for EAGLE3 and DART; n/n is what lossless means.",
        *footnotes(shown),
    ]
    return "\n".join(lines).rstrip() + "\n"


def has_eagle3(run: Run) -> bool:
    return any(method_head(m) == "eagle3" for m in run.data["methods"])


def env_table(run: Run) -> str:
    e = run.env
    rows = [["CPU", f"{e['cpu']} (kind `{e.get('cpu_kind', '?')}`), {e['threads']} threads"], ["kernels", e.get("kernels", "–")]]
    choice = e.get("weights_choice") or {}
    rows.append(["weights", choice.get("reason") or e.get("weights") or e["dtype"]])
    heads = heads_text(e)
    if heads:
        rows.append(["heads", heads])
    for m, size in (e.get("tree_sizes") or {}).items():
        rows.append([f"{LABELS.get(m, m)} tree size", size.get("reason", str(size.get("max_nodes")))])
    mem = e.get("memory")
    if mem:
        rows.append(
            [
                "memory",
                f"a one-token step streams {mem['step_weight_bytes']:,} bytes of weights; read bandwidth measured in the run "
                f"{mem['read_gb_s']} GB/s, so a step takes at least {mem['streaming_limit_ms']} ms",
            ]
        )
    peer = e.get("llamacpp")
    if peer:
        rows.append(["llama.cpp", f"{peer_label(e)} of {peer.get('version', '?')}, the same GGUF"])
    if e.get("vllm"):
        rows.append(["vLLM", f"{vllm_label(e)}: the embedded model's converted checkpoint (`make vllm`; docs/vllm.md)"])
    sets = ", ".join(Path(d).stem for d in e["dataset"])
    rows.append(["prompts", f"first {e['limit']} of each of {sets}; {e['max_new_tokens']} new tokens; temperature {e['temperature']:g}"])
    rows.append(["software", f"torch {e['torch']}, transformers {e['transformers']}, python {e['python']}"])
    rows.append(["date", e["date"].replace("T", " ")])  # the code's commit stays in the result file (env.git_commit)
    return table(["", ""], rows)


def totals_table(run: Run) -> str:
    rows = []
    for method, r in run.data["methods"].items():
        split = " / ".join(fmt(r.get(k)) for k in ("draft_ms", "prune_ms", "verify_ms", "other_ms"))
        rows.append([
            engine_prefix(method) + method_label(run, method), fmt(r["tokens_per_s"], ".1f"),
            fmt(r.get("decode_tokens_per_s"), ".1f"), fmt(r.get("prefill_s"), ".2f"), fmt(r["speedup_vs_ar"]) + "x", fmt(r["tau"]),
            str(r["new_tokens"]), str(r.get("steps") or "–"), split, same_ids(r),
        ])  # fmt: skip
    header = ["method", "tokens/s", "decode tokens/s", "prefill s", "vs plain", "τ", "new tokens", "target forwards",
              "draft / prune / verify / other ms a step", "ids = plain's"]  # fmt: skip
    return table(header, rows)


def per_set_table(run: Run) -> str:
    sets = run.data.get("datasets") or {}
    if len(sets) < 2:
        return ""
    methods = [m for m in run.data["methods"] if m != "ar"]
    rows = []
    for name, res in sets.items():
        rows.append([name, fmt(res["ar"]["tokens_per_s"], ".1f")]
                    + [f"{fmt(res[m]['speedup_vs_ar'])}x / {fmt(res[m]['tau'])}" if m in res else "–" for m in methods])  # fmt: skip
    header = ["set", "plain tokens/s"] + [engine_prefix(m) + method_label(run, m) for m in methods]
    return "Per set, speed-up over plain decoding / τ:\n\n" + table(header, rows)


def acceptance_table(run: Run) -> str:
    rows = [[method_label(run, m)] + [f"{p:.2f}" for p in r["acceptance_by_depth"]]
            for m, r in run.data["methods"].items() if r.get("acceptance_by_depth")]  # fmt: skip
    if not rows:
        return ""
    width = max(len(r) for r in rows)
    rows = [r + ["–"] * (width - len(r)) for r in rows]
    return "P(a step accepts at least k drafts):\n\n" + table(["method", *[f"k = {k}" for k in range(1, width)]], rows)


def calibration_table(run: Run) -> str:
    """The target's forward cost by rows on each weights path the run measured, and DART's expected
    tokens/s at the tree size that verifies that many rows: what --dtype auto and the tree size were
    chosen from."""
    e = run.env
    dart = (e.get("tree_sizes") or {}).get("dart")
    paths = (e.get("weights_choice") or {}).get("paths") or []
    if not paths and not (dart and dart.get("table")):
        return ""
    if not paths:  # the weights were given: the tree-size table alone has the verify costs
        weights = (e.get("weights") or e["dtype"]).split(" (")[0]
        paths = [
            {"dtype": weights, "chosen": True, "dart": dart, "forward_ms": {str(t["nodes"] + 1): t["verify_ms"] for t in dart["table"]}}
        ]
    rows_n = sorted({int(k) for p in paths for k in p["forward_ms"]})
    taus = {t["nodes"]: t for p in paths for t in (p.get("dart") or {}).get("table", [])}
    # runs before CALIBRATION_VERSION 4 ranked by forward + drafting by replay (one drafting column);
    # later ones by each path's loop step (a column per path)
    old_style = any("draft_ms" in t for t in taus.values())
    rows = []
    for k in rows_n:
        n = k - 1
        row = [
            str(k),
            str(n) if n else "– (plain)",
            fmt(taus[n]["tau"]) if n in taus else "–",
        ]
        if old_style:
            row.append(fmt(taus[n].get("draft_ms")) if n in taus else "–")
        for p in paths:
            ms = p["forward_ms"].get(str(k))
            mine = next((t for t in (p.get("dart") or {}).get("table", []) if t["nodes"] == n), {})
            exp = mine.get("tokens_per_s")
            if n == 0:
                exp = p.get("plain_tokens_per_s") or (1000 / ms if ms else None)
            if not old_style:
                step = mine.get("step_ms") if n else (1000 / p["plain_tokens_per_s"] if p.get("plain_tokens_per_s") else None)
                row.append(fmt(step))
            chosen = p.get("chosen") and (p.get("dart") or {}).get("max_nodes") == n
            cell = fmt(exp, ".1f")
            row += [fmt(ms), f"**{cell}**" if chosen else cell]
        rows.append(row)
    header = ["rows", "DART nodes", "DART τ"] + (["drafting ms"] if old_style else [])
    for p in paths:
        name = p["dtype"] + (" (chosen)" if p.get("chosen") and len(paths) > 1 else "")
        header += ([] if old_style else [f"{name}: loop step ms"]) + [f"{name}: forward ms", f"{name}: expected tokens/s"]
    how = (
        "its drafting timed by replay; expected tokens/s = τ / (forward + drafting)"
        if old_style
        else "the generation loop's step timed at each tree size, plain decoding's on the first row; expected tokens/s = τ / loop step"
    )
    return (
        "The calibration the run chose its weights and DART's tree size from (median ms of one forward after 200 cached "
        f"tokens; DART's τ by tree size from its `tree_sizes.json`, {how}, bold where chosen):\n\n" + table(header, rows)
    )


def run_section(run: Run) -> str:
    e = run.env
    title = f"## {kernel_label(e)} kernels, {weights_label(e)} weights (`{RESULTS}/{run.name}.json`)"
    parts = [title, "    " + run.command().replace("\n", "\n    ")]
    if run.entry.get("note"):
        parts.append(run.entry["note"])
    parts.append(env_table(run))
    parts.append(totals_table(run))
    by_error: dict[str, list[str]] = {}
    for method, errors in (run.data.get("peer_errors") or {}).items():
        for error in errors:
            by_error.setdefault(
                error.split(": ", 1)[0] + ": " + re.sub(r"^llama-[\w-]+", "llama.cpp", error.split(": ", 1)[-1]), []
            ).append(method)
    for error, methods in by_error.items():
        whose = "their totals leave" if len(methods) > 1 else "its totals leave"
        parts.append(f"Not run by {', '.join(f'`{m}`' for m in methods)} ({whose} it out): {error}.")
    parts += [x for x in (fidelity_text(run), per_set_table(run), acceptance_table(run), calibration_table(run)) if x]
    return "\n\n".join(parts)


def doc_block(runs: list[Run]) -> str:
    intro = (
        f"Generated by `{COMMAND}` from the result files in `{RESULTS}/` (the commands below wrote them; "
        f"`{RESULTS}/runs.json` lists them); rerunning it rewrites everything from here to the end of the document. Every number here "
        "is one a run recorded, on the machine its section names.\n\n"
        "How to read the tables: *tokens/s* is new tokens over wall time, the prompt's prefill included; *decode tokens/s* "
        "leaves the prefill and the first token out; *τ* is new tokens per target forward (the bonus token included); "
        "*vs plain* is the ratio to the run's own plain decoding (`ar`, our loop drafting nothing); *ids = plain's* counts "
        "prompts whose output ids equal plain decoding's (at temperature 0 a lossless method scores n/n; llama.cpp computes "
        "otherwise and promises no bit-exactness, so its count is a report, not a check: [peers.md](peers.md)). A method's tree "
        "size is in brackets (drafted nodes besides the root). The draft / prune / verify / other split is ms per target forward."
    )
    parts = [intro, "## Summary", full_summary(runs).rstrip()]
    parts += [run_section(r) for r in runs]
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------- files


def replace_block(text: str, marks: tuple[str, str], block: str, where: Path) -> str:
    start, end = marks
    if start not in text or end not in text:
        raise SystemExit(f"{where} lacks the markers {start} ... {end}")
    return text[: text.index(start)] + f"{start}\n{block}{end}" + text[text.index(end) + len(end) :]


def rendered(root: Path) -> dict[Path, str]:
    """The README and docs/benchmarks.md as the kept results give them."""
    runs = load_runs(root)
    out = {}
    for rel, marks, block in ((README, README_MARKS, readme_block(runs, root)), (DOC, DOC_MARKS, doc_block(runs))):
        path = root / rel
        out[path] = replace_block(path.read_text(), marks, block, rel)
    return out


def measure(root: Path, name: str) -> None:
    """Run one runs.json entry's bench command again; its result file is replaced only when it finishes."""
    manifest = json.loads((root / RESULTS / "runs.json").read_text())
    entry = next((e for e in manifest["runs"] if e["name"] == name), None)
    if entry is None:
        raise SystemExit(f"no run named {name!r} in {RESULTS / 'runs.json'} (runs: {', '.join(e['name'] for e in manifest['runs'])})")
    out = root / RESULTS / f"{name}.json"
    tmp = out.with_suffix(".tmp")
    args = [os.path.expanduser(a) for a in entry["args"]]
    cmd = [*installed_command(BENCH_COMMAND), *args, "--out", str(tmp)]
    print(f"[{name}] {Run(name, entry, {}).command()}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=root, env={**os.environ, **entry.get("env", {})})
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dart-report",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if README.md or docs/benchmarks.md differ from what the results give"
    )
    p.add_argument(
        "--measure", nargs="+", metavar="NAME", default=[], help="run these runs.json entries' bench commands again first (minutes each)"
    )
    args = p.parse_args(argv)
    for name in args.measure:
        measure(ROOT, name)
    texts = rendered(ROOT)
    stale = [path for path, text in texts.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is not what {RESULTS}/ gives: run {COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(texts[path])
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    if not stale:
        print("README.md and docs/benchmarks.md are up to date", file=sys.stderr)
    return 0
