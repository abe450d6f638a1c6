"""Benchmark CLI: every method on the same prompts, interleaved prompt by prompt.

    python -m dart_core.bench --methods ar,hf --dataset ../shared/data/bench/mt_bench.jsonl \\
        --limit 5 --max-new-tokens 64 --out results.json

Methods run on the same target weights. `ar` (and every drafter) go through our one generation
loop; `hf` is transformers' own `generate` and `pld` its prompt-lookup decoding, i.e. what a user
would run instead. `llamacpp*` run llama.cpp's binaries on the GGUF the target came from (the peers:
see dart_core/peers.py and docs/peers.md; skipped with a message where they are not built).
Interleaving methods per prompt cancels slow machine drift; a warm-up run of each method precedes
the timed ones. Progress goes to stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import calibrate, kernels, peers
from .generate import ARDrafter, Drafter, GenerationParams, StageTimes, Summary, complete
from .drafters.registry import DRAFTERS, add_drafter_flags, build_drafter, check_drafter_flags
from .loading import AUTO, DEFAULT_MODEL, TARGET_DTYPE_CHOICES
from .sampling import SamplingParams
from .target import Target, load_target

WARMUP_NEW_TOKENS = 16
PLD_NUM_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens


@dataclass
class Run:
    """One method on one prompt."""

    output_ids: list[int]
    wall_s: float
    steps: int | None = None  # target forwards; None where the method does not report them
    times: StageTimes | None = None
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per step
    prefill_s: float | None = None  # the part of wall_s spent on the prompt (it yields the first token)
    new_tokens: int | None = None  # where the engine's own count differs from len(output_ids) (the peers)
    drafted: int | None = None  # totals, where an engine reports only totals (the peers)
    accepted_drafts: int | None = None


@dataclass
class Totals:
    new_tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0
    times: StageTimes = field(default_factory=StageTimes)
    has_steps: bool = True
    has_times: bool = True
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[a] = steps that accepted a drafts
    runs: int = 0
    prefill_s: float = 0.0
    has_prefill: bool = True
    drafted: int = 0
    accepted_drafts: int = 0
    has_drafts: bool = True

    def add(self, run: Run) -> None:
        self.runs += 1
        self.new_tokens += len(run.output_ids) if run.new_tokens is None else run.new_tokens
        self.wall_s += run.wall_s
        if run.prefill_s is None:
            self.has_prefill = False
        else:
            self.prefill_s += run.prefill_s
        if run.drafted is None:
            self.has_drafts = False
        else:
            self.drafted += run.drafted
            self.accepted_drafts += run.accepted_drafts
        if run.steps is None:
            self.has_steps = False
        else:
            self.steps += run.steps
            if run.times is None:
                self.has_times = False
            else:
                self.times += run.times
            for a in run.accepted:
                self.accept_hist.extend([0] * (a + 1 - len(self.accept_hist)))
                self.accept_hist[a] += 1

    def report(self, ar_tps: float | None) -> dict:
        tps = self.new_tokens / self.wall_s if self.wall_s else 0.0
        decode_s = self.wall_s - self.prefill_s
        # decode-only: the tokens after each prompt's first (which the prefill yields) over the time after it
        decode_tps = (self.new_tokens - self.runs) / decode_s if self.has_prefill and self.runs and decode_s > 0 else None
        verify_steps = sum(self.accept_hist)  # steps after prefill, where the stage times were taken
        timed = self.has_steps and self.has_times and verify_steps
        per_step = (lambda s: 1000.0 * s / verify_steps) if timed else (lambda s: None)
        per_step_hist = self.has_steps and bool(self.accept_hist or self.has_times)
        return {
            "tokens_per_s": tps,
            "decode_tokens_per_s": decode_tps,
            "prefill_s": self.prefill_s if self.has_prefill else None,
            "drafted": self.drafted if self.has_drafts else None,
            "accepted_drafts": self.accepted_drafts if self.has_drafts else None,
            "tau": self.new_tokens / self.steps if self.has_steps and self.steps else None,
            "speedup_vs_ar": tps / ar_tps if ar_tps else None,
            "new_tokens": self.new_tokens,
            "wall_s": self.wall_s,
            "steps": self.steps if self.has_steps else None,
            "draft_ms": per_step(self.times.draft),
            "prune_ms": per_step(self.times.prune),
            "verify_ms": per_step(self.times.verify),
            "other_ms": per_step(self.times.other),
            "accept_hist": self.accept_hist if per_step_hist else None,
            "acceptance_by_depth": self.acceptance_by_depth() if per_step_hist else None,
        }

    def acceptance_by_depth(self) -> list[float]:
        """P(a step accepts at least k drafts), k = 1, 2, ...: the per-position acceptance rate."""
        total = sum(self.accept_hist)
        return [sum(self.accept_hist[k:]) / total for k in range(1, len(self.accept_hist))] if total else []


Runner = Callable[[list[int], GenerationParams], Run]


def loop_runner(target: Target, drafter: Drafter) -> Runner:
    def run(ids: list[int], params: GenerationParams) -> Run:
        s: Summary = complete(target, ids, drafter, params)
        return Run(s.output_ids, s.wall_s, s.steps, s.times, s.accepted, prefill_s=s.prefill_s)

    return run


def hf_runner(target: Target, prompt_lookup: bool) -> Runner:
    """transformers' generate on the same checkpoint, dtype and device."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target.model_dir), dtype=target.dtype).to(target.device).eval()
    eos = sorted(target.eos_ids)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0]

    def run(ids: list[int], params: GenerationParams) -> Run:
        sp = params.sampling
        kwargs: dict = dict(max_new_tokens=params.max_new_tokens, eos_token_id=eos, pad_token_id=pad)
        if sp.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k)
            if sp.seed is not None:
                torch.manual_seed(sp.seed)
        if prompt_lookup:
            kwargs.update(prompt_lookup_num_tokens=PLD_NUM_TOKENS)
        x = torch.tensor([ids], device=target.device)
        sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        sync()
        return Run(out[0, len(ids) :].tolist(), time.perf_counter() - t0)

    return run


def peer_runner(name: str, target: Target, gguf: Path, bin_dir: Path, threads: int, draft: Path | None = None) -> Runner:
    """A llama.cpp method (dart_core/peers.py) on the same prompt ids, measured by llama.cpp's own timers."""
    peer = peers.LlamaCppPeer(name, bin_dir, gguf, threads, target.tokenizer, target.eos_ids, draft=draft)

    def run(ids: list[int], params: GenerationParams) -> Run:
        r = peer.generate(ids, params.max_new_tokens, params.sampling)
        return Run(r.output_ids, r.wall_s, r.target_forwards, None, [], prefill_s=r.timings.prefill_s, new_tokens=r.new_tokens,
                   drafted=r.timings.drafted, accepted_drafts=r.accepted)

    return run


def peer_gguf(args: argparse.Namespace) -> Path | None:
    """--gguf, else the GGUF the embedded target was converted from; None for another target."""
    if args.gguf:
        return args.gguf
    if args.model == DEFAULT_MODEL:
        from .loading import embedded_gguf_path

        try:
            return embedded_gguf_path()
        except (FileNotFoundError, ImportError):
            return None
    return None


def peer_draft(name: str, args: argparse.Namespace) -> Path | None:
    """The draft GGUF of a llama.cpp method that reads one (llamacpp-eagle3): the bench's EAGLE3 head
    (--eagle3-model, else the default head) exported for the peer's GGUF, cached (export_gguf); None
    for the other methods, or when there is no GGUF to export against."""
    if not peers.needs_draft(name):
        return None
    gguf = peer_gguf(args)
    if gguf is None or not Path(gguf).is_file():
        return None
    from .drafters.registry import DEFAULT_EAGLE3_HEAD
    from .export_gguf import cached_eagle3_gguf

    return cached_eagle3_gguf(args.eagle3_model or DEFAULT_EAGLE3_HEAD, gguf)


def split_method(name: str) -> tuple[str, int | None]:
    """'dart@16' -> ('dart', 16): a drafter method at another tree size (max_nodes); 'dart' -> ('dart', None).
    llama.cpp methods take a draft length the same way ('llamacpp-lookup@4')."""
    if name.partition("@")[0] in peers.PEER_METHODS:
        return peers.split_peer_method(name)
    base, at, size = name.partition("@")
    if base not in METHODS:
        raise ValueError(f"unknown method {base!r}: choose from {', '.join(METHODS)}")
    if not at:
        return base, None
    if base not in SIZED_METHODS:
        raise ValueError(f"{name!r}: only {', '.join(SIZED_METHODS)} take a tree size (@N)")
    if not size.isdigit() or int(size) < 1:
        raise ValueError(f"{name!r}: the tree size after @ must be a positive integer (drafted nodes besides the root)")
    return base, int(size)


def method_drafter(name: str, target: Target, args: argparse.Namespace) -> Drafter:
    """The drafter of one of the loop's methods ('ar', 'dart', 'dart-noctx', 'eagle3', each maybe @N)."""
    name, size = split_method(name)
    if size is not None:  # this method's own tree size; the other methods keep the flags'
        args = argparse.Namespace(**{**vars(args), "max_nodes": size, "eagle3_max_nodes": size})
    default_target = args.model == DEFAULT_MODEL
    if name == "ar":
        return ARDrafter()
    if name in DRAFTERS:
        return build_drafter(name, target, args, default_target)
    if name == "dart-noctx":
        return build_drafter("dart", target, args, default_target, context=False)
    raise ValueError(f"{name!r} is not a method of the generation loop")


def build_runner(name: str, target: Target, args: argparse.Namespace) -> Runner:
    base, _ = split_method(name)
    if base == "hf":
        return hf_runner(target, prompt_lookup=False)
    if base == "pld":
        return hf_runner(target, prompt_lookup=True)
    if base in peers.PEER_METHODS:
        return peer_runner(name, target, peer_gguf(args), peers.resolve_bin_dir(args.llamacpp_bin), torch.get_num_threads(),
                           peer_draft(name, args))
    return loop_runner(target, method_drafter(name, target, args))


METHODS = ("ar", "hf", "pld", "dart", "dart-noctx", "eagle3") + peers.PEER_METHODS
SIZED_METHODS = ("dart", "dart-noctx", "eagle3")  # method@N runs it with N drafted nodes (a tree-size sweep in one run)


def read_questions(path: Path, limit: int | None) -> list[dict]:
    """question.jsonl rows ({"question_id", "turns": [...]}), first `limit` of them."""
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not row.get("turns"):
                raise ValueError(f"{path}:{lineno}: a question needs a non-empty 'turns' list")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path} holds no questions")
    return rows


def dataset_names(paths: list[Path]) -> list[str]:
    """A short name per dataset file: its stem, made unique with the parent directory if needed."""
    stems = [p.stem for p in paths]
    return [p.stem if stems.count(p.stem) == 1 else f"{p.parent.name}/{p.stem}" for p in paths]


def held_out_questions(paths: list[Path], skip: int, limit: int) -> list[tuple[str, dict]]:
    """(dataset name, question) for questions skip+1 .. skip+limit of each file (the bench reports
    on the first ones; the tuning scripts hold them out). Raises ValueError if a file has none there."""
    out = []
    for name, path in zip(dataset_names(paths), paths):
        rows = read_questions(path, skip + limit)[skip:]
        if not rows:
            raise ValueError(f"{path} has no prompts after the first {skip}")
        out += [(name, q) for q in rows]
    return out


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
        "target_path": "eager" if args.eager or not target.model.kernel_path(1, target.device) else "kernels",
        "cpu_kind": peers.cpu_kind(),
    }


def same_as_ar(samples: list[dict], methods: list[str]) -> dict[str, str]:
    """Per method, 'k/n': the prompts whose output ids equal ar's exactly."""
    ar = {(s["dataset"], s["question_id"]): s["output_ids"] for s in samples if s["method"] == "ar"}
    counts = {m: [0, 0] for m in methods}
    for s in samples:
        c = counts[s["method"]]
        c[0] += s["output_ids"] == ar[(s["dataset"], s["question_id"])]
        c[1] += 1
    return {m: f"{k}/{n}" for m, (k, n) in counts.items()}


def markdown_table(methods: dict[str, dict]) -> str:
    def fmt(v, spec):
        return "–" if v is None else format(v, spec)

    def drafts(m):
        if m.get("drafted") is None:
            return "–"
        return f"{m['accepted_drafts']}/{m['drafted']}"

    lines = [
        "| method | tokens/s | decode tokens/s | speed-up vs ar | τ | accepted/drafted | new tokens | draft ms/step | prune ms/step | verify ms/step | same ids as ar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in methods.items():
        lines.append(
            f"| {name} | {m['tokens_per_s']:.2f} | {fmt(m.get('decode_tokens_per_s'), '.2f')} | {fmt(m['speedup_vs_ar'], '.2f')} | "
            f"{fmt(m['tau'], '.2f')} | {drafts(m)} | "
            f"{m['new_tokens']} | {fmt(m['draft_ms'], '.2f')} | {fmt(m['prune_ms'], '.2f')} | {fmt(m['verify_ms'], '.2f')} | "
            f"{m.get('same_as_ar', '–')} |"
        )
    return "\n".join(lines)


def dataset_table(datasets: dict[str, dict[str, dict]]) -> str:
    """Speed-up vs ar and τ per dataset (rows) and method (columns)."""
    methods = list(next(iter(datasets.values())))
    lines = ["| dataset | " + " | ".join(f"{m} speed-up / τ" for m in methods) + " |", "|---|" + "---|" * len(methods)]
    for d, rep in datasets.items():
        cells = []
        for m in methods:
            su, tau = rep[m]["speedup_vs_ar"], rep[m]["tau"]
            cells.append(("–" if su is None else f"{su:.2f}x") + " / " + ("–" if tau is None else f"{tau:.2f}"))
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dart_core.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ar,hf", help=f"comma-separated, from: {', '.join(METHODS)} (default: ar,hf); "
                   f"{', '.join(SIZED_METHODS)} take a tree size as method@N (e.g. dart@8,dart@16: a sweep in one run)")
    p.add_argument("--dataset", type=Path, nargs="+", required=True,
                   help="question.jsonl file(s) (first turn of each row is used); with several, the report has a section per file")
    p.add_argument("--limit", type=int, default=None, help="use the first N questions of each file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: seed + question index)")
    p.add_argument("--dtype", choices=TARGET_DTYPE_CHOICES, default=AUTO,
                   help="float32/bfloat16/float16, or gguf: the embedded default in its own GGUF blocks on the CPU kernels. "
                        "Default auto: for the embedded default on the CPU kernels, the path (gguf or bfloat16) whose DART is "
                        "expected fastest from this machine's measured costs (dart_core/calibrate.py, cached); else (and with --no-calibration) bfloat16. "
                        "Every method runs on the one path chosen; env.weights_choice records it and why"),
    p.add_argument(
        "--eager",
        action="store_true",
        help="run the target on the eager torch path instead of the batch-invariant CPU kernels (dart_core/kernels.py)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: 'default' (embedded SmolLM2-135M-Instruct), a local dir or a hub id")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=None, help="write results JSON here")
    g = p.add_argument_group("llama.cpp peers (the llamacpp* methods; see docs/peers.md)")
    g.add_argument("--llamacpp-bin", default=None,
                   help=f"directory of llama.cpp's binaries (default: ${peers.BIN_ENV}, else what `make peers` builds: "
                        "~/.cache/dart-demo/llamacpp/<cpu kind>/bin)")
    g.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF llama.cpp runs (default: the one the embedded target came from; needed for another target)")
    add_drafter_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise SystemExit(f"no method given: choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise SystemExit(f"a method is named twice in {args.methods!r}")
    try:
        for m in methods:
            split_method(m)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    try:
        check_drafter_flags(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    names = dataset_names(args.dataset)
    questions = [(name, q) for name, path in zip(names, args.dataset) for q in read_questions(path, args.limit)]
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    skipped = {}
    for m in methods:  # a peer that cannot run here is skipped with the reason; the other methods still run
        if split_method(m)[0] in peers.PEER_METHODS:
            bin_dir = peers.resolve_bin_dir(args.llamacpp_bin)
            draft = None
            if peers.needs_draft(m) and (bin_dir / peers.binary_for(m)).is_file():  # no export where llama.cpp is absent
                try:
                    draft = peer_draft(m, args)
                except (ValueError, FileNotFoundError) as e:  # a head that cannot be exported is the user's error
                    raise SystemExit(f"{m}: cannot export the EAGLE3 head for llama.cpp: {e}") from None
            reason = peers.unavailable(m, bin_dir, peer_gguf(args), draft)
            if reason:
                skipped[m] = reason
                log(f"skipping {reason}")
    methods = [m for m in methods if m not in skipped]
    if not methods:
        raise SystemExit("no method left to run: " + "; ".join(skipped.values()))

    log(f"loading target {args.model!r} ({args.dtype}, {args.device})")
    known = {}
    if args.dtype == AUTO:  # one weights path for every method: losslessness is per path (ids equal plain decoding's on it)
        target, weights, dart_size = calibrate.choose_weights(args.model, args.device, not args.eager, args, log=log)
        if weights.paths:
            log(calibrate.weights_table(weights))
        if dart_size is not None:
            known["dart"] = dart_size  # timed on this target with these flags while choosing: not timed again
    else:
        target = load_target(args.model, args.device, args.dtype, kernels=not args.eager)
        weights = calibrate.WeightsChoice(args.dtype, f"{args.dtype} (given: --dtype {args.dtype})")
    # the tree sizes of the drafters run at the flags' size (not method@N) and left unset: this machine's
    unsized = {"eagle3" if base == "eagle3" else "dart" for base, size in map(split_method, methods) if size is None and base in ("dart", "dart-noctx", "eagle3")}
    sizes = calibrate.calibrate_unset_sizes(target, args, unsized, args.model == DEFAULT_MODEL, log, known)
    runners = {m: build_runner(m, target, args) for m in methods}
    prompts = [target.encode([{"role": "user", "content": q["turns"][0]}]) for _, q in questions]

    log("warm-up")
    for name, run in runners.items():
        run(prompts[0], GenerationParams(WARMUP_NEW_TOKENS, sampling=sampling))

    totals = {m: Totals() for m in methods}
    by_set = {d: {m: Totals() for m in methods} for d in names}
    samples = []
    peer_errors: dict[str, list[str]] = {}  # peer method -> prompts it could not run, with the reason
    for i, ((dataset, q), ids) in enumerate(zip(questions, prompts)):
        for name, run in runners.items():
            sp = SamplingParams(args.temperature, args.top_p, args.top_k, seed=args.seed + i)
            try:
                r = run(ids, GenerationParams(args.max_new_tokens, sampling=sp))
            except peers.PeerError as e:  # e.g. llama.cpp tokenized the rendered prompt otherwise: that prompt is not compared
                peer_errors.setdefault(name, []).append(f"{dataset} {q.get('question_id', i)}: {e}")
                log(f"[{i + 1}/{len(questions)}] {dataset} {name:>10}: not run ({e})")
                continue
            totals[name].add(r)
            by_set[dataset][name].add(r)
            samples.append({"dataset": dataset, "question_id": q.get("question_id", i), "method": name, "output_ids": r.output_ids})
            n = len(r.output_ids) if r.new_tokens is None else r.new_tokens
            tau = f" τ {n / r.steps:.2f}" if r.steps else ""
            log(f"[{i + 1}/{len(questions)}] {dataset} {name:>10}: {n:4d} tokens {n / r.wall_s:7.2f} tok/s{tau}")

    def reports(tot: dict) -> dict:
        ar_tps = tot["ar"].report(None)["tokens_per_s"] if "ar" in tot else None
        return {m: t.report(ar_tps) for m, t in tot.items()}

    report = reports(totals)
    datasets = {d: reports(t) for d, t in by_set.items()}
    if "ar" in methods:  # lossless check: how many prompts give exactly ar's output ids
        same = same_as_ar(samples, methods)
        for m in methods:
            report[m]["same_as_ar"] = same[m]
    result = {"env": environment(args, target), "methods": report, "datasets": datasets, "samples": samples}
    if target.device.type == "cpu":  # a step's memory limit: the bytes it streams over the bandwidth measured now
        step_bytes, gb_s = target.model.step_weight_bytes(), kernels.read_bandwidth()
        result["env"]["memory"] = {"step_weight_bytes": step_bytes, "read_gb_s": round(gb_s, 2),
                                   "streaming_limit_ms": round(step_bytes / gb_s / 1e6, 3)}
        log(f"a step streams {step_bytes / 1e6:.1f} MB of weights; read bandwidth {gb_s:.1f} GB/s: "
            f"memory limit {step_bytes / gb_s / 1e6:.2f} ms a step")
    result["env"]["weights_choice"] = weights.as_dict()  # the --dtype the run used, why, and (auto) each path's measured costs
    if sizes:
        result["env"]["tree_sizes"] = {m: c.as_dict() for m, c in sizes.items()}
    if any(split_method(m)[0] in peers.PEER_METHODS for m in methods):
        result["env"]["llamacpp"] = peers.describe(peers.resolve_bin_dir(args.llamacpp_bin), peer_gguf(args))
        drafted_by_head = [m for m in methods if peers.needs_draft(m)]
        if drafted_by_head:  # which head llama.cpp drafted with, as the file it read
            result["env"]["llamacpp"]["draft_gguf"] = str(peer_draft(drafted_by_head[0], args))
    if skipped:
        result["skipped"] = skipped
    if peer_errors:
        result["peer_errors"] = peer_errors
    if len(names) > 1:
        print(dataset_table(datasets) + "\n\nAll prompts:\n")
    print(markdown_table(report))
    for reason in skipped.values():
        print(f"\nskipped {reason}")
    for m, errs in peer_errors.items():
        print(f"\n{m}: {len(errs)} of {len(prompts)} prompts not run (its totals leave them out), e.g. {errs[0]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
