"""The benchmark: every method on the same prompts, interleaved prompt by prompt. Its command line
is dart_core/cli/bench.py (`dart-bench`, also `dart-bench`).

Methods run on the same target weights. `ar` (and every drafter) go through our one generation
loop; `hf` is transformers' own `generate` and `pld` its prompt-lookup decoding, i.e. what a user
would run instead. `llamacpp*` run llama.cpp's binaries on the GGUF the target came from (the peers:
see dart_core/tools/peers.py and docs/peers.md). Every method's run is a `Summary` (dart_core/generate.py),
summed per method by `Totals`. Interleaving methods per prompt cancels slow machine drift; a warm-up
run of each method precedes the timed ones. The peers run each prompt first, then our methods with
the first of them rotating prompt by prompt (`method_order`): the first of ours after a llama.cpp
process, and the first run of a new prompt, pay costs the others do not, which with a fixed order
all fell on plain decoding (its prefill took 6-50% longer than the other methods' in the runs kept
before the rotation).
"""

from __future__ import annotations

import atexit
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ..drafters.config import DrafterConfigs
from ..generate import ARDrafter, Drafter, GenerationParams, StageTimes, Summary, complete, generate
from ..kernels import MAX_ROWS as KERNEL_ROWS
from ..prefix_cache import DEFAULT_PREFIX_CACHE_MB, PrefixScope, PrefixStore
from ..sampling import SamplingParams
from ..target import Target
from . import calibrate, peers, vllm_peer
from .methods import HF, LOOP, METHODS, PEER, VLLM, is_peer, is_vllm, split_method

WARMUP_NEW_TOKENS = 16
PLD_NUM_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens


@dataclass
class Totals:
    """One method's Summaries summed (a dataset's, or every prompt's), and its report."""

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

    def add(self, run: Summary) -> None:
        self.runs += 1
        self.new_tokens += run.new_tokens
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


Runner = Callable[[list[int], GenerationParams], Summary]


def loop_runner(target: Target, drafter: Drafter) -> Runner:
    def run(ids: list[int], params: GenerationParams) -> Summary:
        return complete(target, ids, drafter, params)

    return run


def hf_runner(target: Target, prompt_lookup: bool) -> Runner:
    """transformers' generate on the same checkpoint, dtype and device (it reports no steps)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target.model_dir), dtype=target.dtype).to(target.device).eval()
    eos = sorted(target.eos_ids)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0]

    def run(ids: list[int], params: GenerationParams) -> Summary:
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
        sync = (lambda: torch.cuda.synchronize(target.device)) if target.device.type == "cuda" else (lambda: None)  # the target's own GPU
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        sync()
        return Summary(len(ids), out[0, len(ids) :].tolist(), None, time.perf_counter() - t0, None, None, None)

    return run


def peer_runner(name: str, target: Target, gguf: Path, bin_dir: Path, threads: int, draft: Path | None = None) -> Runner:
    """A llama.cpp method (dart_core/tools/peers.py) on the same prompt ids, measured by llama.cpp's own timers."""
    peer = peers.LlamaCppPeer(name, bin_dir, gguf, threads, target.tokenizer, target.eos_ids, draft=draft)

    def run(ids: list[int], params: GenerationParams) -> Summary:
        r = peer.generate(ids, params.max_new_tokens, params.sampling)
        stop = "eos" if r.stop == "eos" else "max_new_tokens"
        return Summary(
            len(ids),
            r.output_ids,
            r.target_forwards,
            r.wall_s,
            r.timings.prefill_s,
            None,
            stop,
            [],
            counted_tokens=r.new_tokens,
            drafted=r.timings.drafted,
            accepted_drafts=r.accepted,
        )

    return run


def vllm_dtype(target: Target) -> str:
    """The dtype vLLM runs the target's checkpoint in: bfloat16 where ours does, else float32 (vLLM
    dequantizes nothing on the CPU: the GGUF paths' weights are the converted checkpoint's)."""
    return "bfloat16" if target.dtype == torch.bfloat16 else "float32"


def vllm_runner(name: str, target: Target, threads: int, configs: DrafterConfigs) -> Runner:
    """A vLLM method (dart_core/tools/vllm_peer.py) on the same prompt ids and the target's checkpoint
    (its converted safetensors), timed by vLLM's own request metrics; the engine starts here, once."""
    peer = vllm_peer.VllmPeer(
        name,
        target.model_dir,
        target.eos_ids,
        threads,
        dtype=vllm_dtype(target),
        dart_head=configs.dart.head,
        eagle3_head=configs.eagle3.head,
    )
    atexit.register(peer.close)

    def run(ids: list[int], params: GenerationParams) -> Summary:
        r = peer.generate(ids, params.max_new_tokens, params.sampling)
        return Summary(
            len(ids),
            r.output_ids,
            r.target_forwards,
            r.wall_s,
            r.prefill_s,
            None,
            "eos" if r.stop == "eos" else "max_new_tokens",
            [],
            counted_tokens=r.new_tokens,
            drafted=r.drafted,
            accepted_drafts=r.accepted,
            top2_gaps=r.top2_gaps,
        )

    return run


@dataclass(frozen=True)
class PeerSetup:
    """What the llama.cpp methods run with: their binaries, the target's GGUF (None: there is none)
    and the EAGLE3 head llamacpp-eagle3 drafts with."""

    bin_dir: Path
    gguf: Path | None
    eagle3_head: str | Path

    def draft(self, name: str) -> Path | None:
        """The draft GGUF of a llama.cpp method that reads one (llamacpp-eagle3): the EAGLE3 head
        exported for the peer's GGUF, cached (export_gguf); None for the other methods, or when there
        is no GGUF to export against."""
        if not peers.needs_draft(name) or self.gguf is None or not Path(self.gguf).is_file():
            return None
        from .export_gguf import cached_eagle3_gguf

        return cached_eagle3_gguf(self.eagle3_head, self.gguf)


def embedded_gguf_or_none() -> Path | None:
    """The GGUF the embedded target was converted from (None where it cannot be found)."""
    from ..loading import embedded_gguf_path

    try:
        return embedded_gguf_path()
    except (FileNotFoundError, ImportError):
        return None


def method_drafter(name: str, target: Target, configs: DrafterConfigs) -> Drafter:
    """The drafter of one of the loop's methods ('ar', 'dart', 'dart-noctx', 'dart-adaptive', 'eagle3',
    each maybe @N; dart-adaptive's N caps its per-step size)."""
    base, size = split_method(name)
    method = METHODS[base]
    if method.engine != LOOP:
        raise ValueError(f"{name!r} is not a method of the generation loop")
    if method.drafter is None:
        return ARDrafter()
    config = configs[method.drafter]
    if not method.context:
        config = replace(config, context=False)
    if method.adaptive:
        config = replace(config, adaptive=True)
    if size is not None:  # this method's own tree size; the other methods keep their configs'
        config = replace(config, max_nodes=size)
    return calibrate.build_measured(method.drafter, target, config)


def build_runner(name: str, target: Target, configs: DrafterConfigs, peer: PeerSetup | None = None) -> Runner:
    method = METHODS[split_method(name)[0]]
    if method.engine == HF:
        return hf_runner(target, prompt_lookup=method.prompt_lookup)
    if method.engine == PEER:
        if peer is None:
            raise ValueError(f"{name}: a llama.cpp method needs its binaries and GGUF (a PeerSetup)")
        return peer_runner(name, target, peer.gguf, peer.bin_dir, torch.get_num_threads(), peer.draft(name))
    if method.engine == VLLM:
        return vllm_runner(name, target, torch.get_num_threads(), configs)
    return loop_runner(target, method_drafter(name, target, configs))


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


def same_as_ar(samples: list[dict], methods: list[str]) -> dict[str, str]:
    """Per method, 'k/n': the prompts whose output ids equal ar's exactly."""
    ar = {(s["dataset"], s["question_id"]): s["output_ids"] for s in samples if s["method"] == "ar"}
    counts = {m: [0, 0] for m in methods}
    for s in samples:
        c = counts[s["method"]]
        c[0] += s["output_ids"] == ar[(s["dataset"], s["question_id"])]
        c[1] += 1
    return {m: f"{k}/{n}" for m, (k, n) in counts.items()}


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two id lists differ (the shorter one's length where one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def vllm_fidelity(samples: list[dict]) -> dict | None:
    """vLLM's drafting methods against vLLM's own plain decoding, where `vllm` ran: per method, 'k/n'
    prompts with vLLM plain's ids exactly, and each prompt where one parts from it, with the first
    differing token, vLLM plain's top-2 logit gap there (its logprobs; a near-tie can round either way,
    vLLM verifies with other matrix shapes than it decodes with) and whether vLLM's EAGLE3 rows kept to
    vLLM plain on that prompt. None without a `vllm` row."""
    by_prompt: dict[tuple, dict[str, dict]] = {}
    for s in samples:
        by_prompt.setdefault((s["dataset"], s["question_id"]), {})[s["method"]] = s
    if not any("vllm" in runs for runs in by_prompt.values()):
        return None
    same: dict[str, list[int]] = {}
    parts = []
    for (dataset, qid), runs in by_prompt.items():
        plain = runs.get("vllm")
        if plain is None:
            continue
        ref = plain["output_ids"]
        for m, s in runs.items():
            if not is_vllm(m) or m == "vllm":
                continue
            count = same.setdefault(m, [0, 0])
            count[1] += 1
            if s["output_ids"] == ref:
                count[0] += 1
                continue
            i = first_difference(s["output_ids"], ref)
            gaps = plain.get("top2_gaps") or []
            parts.append({
                "dataset": dataset, "question_id": qid, "method": m, "index": i,
                "vllm_token": ref[i] if i < len(ref) else None, "token": s["output_ids"][i] if i < len(s["output_ids"]) else None,
                "top2_gap": gaps[i] if i < len(gaps) else None,
                "eagle3_same": {e: r["output_ids"] == ref for e, r in runs.items() if e.startswith("vllm-eagle3")},
            })  # fmt: skip
    return {"same_as_vllm": {m: f"{k}/{n}" for m, (k, n) in same.items()}, "parts": parts}


def fidelity_lines(fidelity: dict) -> list[str]:
    """The vLLM fidelity in words: one line per method, one per prompt where it parts from vLLM plain."""
    lines = [f"{m}: ids = vLLM plain's on {c} prompts" for m, c in fidelity["same_as_vllm"].items()]
    for p in fidelity["parts"]:
        gap = "–" if p["top2_gap"] is None else f"{p['top2_gap']:.4g}"
        eagle = ", ".join(f"{e} {'same' if ok else 'parts too'}" for e, ok in p["eagle3_same"].items()) or "no vllm-eagle3 row"
        lines.append(
            f"  {p['method']} parts from vllm on {p['dataset']} {p['question_id']} at new token {p['index']} "
            f"({p['token']} instead of {p['vllm_token']}; vLLM plain's top-2 logit gap there {gap}; {eagle})"
        )
    return lines


def markdown_table(methods: dict[str, dict]) -> str:
    def fmt(v, spec):
        return "–" if v is None else format(v, spec)

    def drafts(m):
        if m.get("drafted") is None:
            return "–"
        return f"{m['accepted_drafts']}/{m['drafted']}"

    lines = [
        "| method | tokens/s | decode tokens/s | speed-up vs ar | τ | accepted/drafted | new tokens | draft ms/step | prune ms/step | "
        "verify ms/step | same ids as ar |",
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


@dataclass
class BenchRun:
    """Every method's Summaries on every prompt, summed per method and per dataset."""

    totals: dict[str, Totals]
    by_set: dict[str, dict[str, Totals]]
    samples: list[dict] = field(default_factory=list)  # per run: dataset, question_id, method, output_ids
    peer_errors: dict[str, list[str]] = field(default_factory=dict)  # peer method -> prompts it could not run, with the reason

    def reports(self) -> tuple[dict, dict]:
        """(per method, per dataset and method) reports, speed-ups against ar where it ran; with ar,
        each method's `same_as_ar`: how many prompts give exactly ar's output ids."""

        def reports(tot: dict) -> dict:
            ar_tps = tot["ar"].report(None)["tokens_per_s"] if "ar" in tot else None
            return {m: t.report(ar_tps) for m, t in tot.items()}

        report = reports(self.totals)
        if "ar" in self.totals:
            same = same_as_ar(self.samples, list(self.totals))
            for m in self.totals:
                report[m]["same_as_ar"] = same[m]
        return report, {d: reports(t) for d, t in self.by_set.items()}


def method_order(methods: list[str], prompt_index: int, first: frozenset[str] = frozenset()) -> list[str]:
    """The order the methods run prompt `prompt_index` in: the methods in `first` (the peers, other
    processes) in their given order, then the rest rotated by one a prompt, so over n prompts each of
    those runs first once. Our first generation after a llama.cpp process prefills ~15-20% slower
    (measured on the Xeon of docs/benchmarks.md): with the peers ahead, every method of ours takes that
    turn equally often, instead of the one that follows the peer in a fixed cycle."""
    lead = [m for m in methods if m in first]
    rest = [m for m in methods if m not in first]
    k = prompt_index % len(rest) if rest else 0
    return lead + rest[k:] + rest[:k]


def run_interleaved(
    runners: dict[str, Runner],
    questions: list[tuple[str, dict]],
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    log: Callable[[str], None],
) -> BenchRun:
    """A warm-up run of each method, then every prompt through every method in turn: the peers
    first, then ours, prompt i starting with our method i mod n (method_order). Prompt i is sampled
    with seed sampling.seed + i. A llama.cpp method that cannot run a prompt (peers.PeerError)
    leaves it out of its totals, with the reason in peer_errors."""
    log("warm-up")
    for run in runners.values():
        run(prompts[0], GenerationParams(WARMUP_NEW_TOKENS, sampling=replace(sampling, seed=None)))
    peer_methods = frozenset(m for m in runners if is_peer(m))
    datasets = list(dict.fromkeys(d for d, _ in questions))
    result = BenchRun({m: Totals() for m in runners}, {d: {m: Totals() for m in runners} for d in datasets})
    for i, ((dataset, q), ids) in enumerate(zip(questions, prompts)):
        for name in method_order(list(runners), i, peer_methods):
            run = runners[name]
            sp = replace(sampling, seed=sampling.seed + i)
            try:
                r = run(ids, GenerationParams(max_new_tokens, sampling=sp))
            except (
                peers.PeerError,
                vllm_peer.VllmError,
            ) as e:  # e.g. llama.cpp tokenized the rendered prompt otherwise: that prompt is not compared
                result.peer_errors.setdefault(name, []).append(f"{dataset} {q.get('question_id', i)}: {e}")
                log(f"[{i + 1}/{len(questions)}] {dataset} {name:>10}: not run ({e})")
                continue
            result.totals[name].add(r)
            result.by_set[dataset][name].add(r)
            sample = {"dataset": dataset, "question_id": q.get("question_id", i), "method": name, "output_ids": r.output_ids}
            if r.top2_gaps is not None:
                sample["top2_gaps"] = r.top2_gaps
            result.samples.append(sample)
            n = r.new_tokens
            tau = f" τ {n / r.steps:.2f}" if r.steps else ""
            log(f"[{i + 1}/{len(questions)}] {dataset} {name:>10}: {n:4d} tokens {n / r.wall_s:7.2f} tok/s{tau}")
    return result


def conversation_turns(q: dict) -> list[str]:
    """A question's user turns (MT-Bench style rows hold two)."""
    return [t for t in q["turns"] if isinstance(t, str) and t.strip()]


def run_multi_turn(
    target: Target,
    drafters: dict[str, Drafter],
    questions: list[tuple[str, dict]],
    max_new_tokens: int,
    sampling: SamplingParams,
    log: Callable[[str], None],
    cache_bytes: int = DEFAULT_PREFIX_CACHE_MB << 20,
) -> dict:
    """The bench's multi-turn mode: each question with several turns played as a chat (each turn's
    prompt: the turns before, with the answers the method gave, and the next user turn) through every
    loop method twice, interleaved: `fresh` prefills each turn's whole conversation, `reuse` keeps it
    in a prefix cache (dart_core/prefix_cache.py) and prefills only what the turn adds. Reported over
    the turns after the first (the first is the same work either way): time to first token, end-to-end
    tokens/s, the tokens reused, and how many of those turns gave the same ids both ways (they must:
    reuse is exact). On the CPU kernels the prompts run in kernel forwards in both modes
    (model.kernel_prefill, what makes reuse exact); where the target loaded without them (eager GEMMs:
    e.g. gguf-int16 on the AVX-512 builds), a third mode, `gemm`, prefills each turn whole that way too: the full re-prefill a run
    without the cache pays (its ids need not be the kernel rows'). Where reuse cannot be exact, `reuse`
    keeps nothing."""
    chats = [(d, q) for d, q in questions if len(conversation_turns(q)) > 1]
    if not chats:
        raise ValueError("no question has a second turn: the multi-turn mode needs sets whose rows hold several turns")
    store = PrefixStore(cache_bytes)
    was = target.model.kernel_prefill
    kernel = target.model.kernel_path(KERNEL_ROWS, target.device)
    modes = ("fresh", "reuse") + (("gemm",) if kernel and not was else ())
    turns = {m: {k: [] for k in modes} for m in drafters}
    try:
        log("warm-up")
        for d in drafters.values():
            complete(target, [{"role": "user", "content": conversation_turns(chats[0][1])[0]}], d, GenerationParams(WARMUP_NEW_TOKENS))
        for i, (dataset, q) in enumerate(chats):
            for j, name in enumerate(method_order(list(drafters), i)):
                for mode in modes[(i + j) % len(modes) :] + modes[: (i + j) % len(modes)]:
                    target.model.kernel_prefill = was if mode == "gemm" else (kernel or was)
                    scope = PrefixScope(store, (dataset, q.get("question_id", i), name)) if mode == "reuse" else None
                    messages: list[dict] = []
                    for k, text in enumerate(conversation_turns(q)):
                        messages.append({"role": "user", "content": text})
                        sp = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + 1000 * i + k)
                        s = None
                        for s in generate(target, messages, drafters[name], GenerationParams(max_new_tokens, sampling=sp), scope):
                            pass
                        messages.append({"role": "assistant", "content": target.decode(s.output_ids)})
                        if k:
                            turns[name][mode].append(s)
                    last = turns[name][mode][-1]
                    log(
                        f"[{i + 1}/{len(chats)}] {dataset} {name:>8} {mode:>5}: last turn {last.prompt_tokens} prompt tokens "
                        f"({last.reused_tokens} reused), first token {last.prefill_s * 1000:.0f} ms, {last.tokens_per_s:.2f} tok/s"
                    )
    finally:
        target.model.kernel_prefill = was
    report = {}
    for name, by_mode in turns.items():
        fresh, reuse = by_mode["fresh"], by_mode["reuse"]
        ttft = {k: sum(s.prefill_s for s in v) / len(v) for k, v in by_mode.items()}
        tps = {k: sum(s.new_tokens for s in v) / sum(s.wall_s for s in v) for k, v in by_mode.items()}
        report[name] = {
            "turns": len(fresh),
            "prompt_tokens": sum(s.prompt_tokens for s in fresh) / len(fresh),
            "reused_tokens": sum(s.reused_tokens for s in reuse) / len(reuse),
            "ttft_fresh_s": ttft["fresh"],
            "ttft_reuse_s": ttft["reuse"],
            "ttft_ratio": ttft["reuse"] / ttft["fresh"] if ttft["fresh"] > 0 else None,
            "tokens_per_s_fresh": tps["fresh"],
            "tokens_per_s_reuse": tps["reuse"],
            "same_ids": f"{sum(a.output_ids == b.output_ids for a, b in zip(fresh, reuse))}/{len(fresh)}",
            "ttft_gemm_s": ttft.get("gemm"),
            "ttft_ratio_gemm": ttft["reuse"] / ttft["gemm"] if ttft.get("gemm") else None,
            "tokens_per_s_gemm": tps.get("gemm"),
        }
    return {"methods": report, "prefix_cache": store.report(), "prompts_in_kernel_forwards": kernel}


def multi_turn_table(report: dict) -> str:
    lines = [
        "| method | later turns | prompt tokens | reused | first token fresh ms | first token reuse ms | ratio | "
        "first token eager-GEMM prefill ms | ratio to it | tokens/s fresh | tokens/s reuse | same ids |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(v, spec):
        return "–" if v is None else format(v, spec)

    for name, m in report["methods"].items():
        gemm = None if m.get("ttft_gemm_s") is None else m["ttft_gemm_s"] * 1000
        to_gemm = fmt(m.get("ttft_ratio_gemm"), ".3f")
        lines.append(
            f"| {name} | {m['turns']} | {m['prompt_tokens']:.0f} | {m['reused_tokens']:.0f} | {m['ttft_fresh_s'] * 1000:.1f} | "
            f"{m['ttft_reuse_s'] * 1000:.1f} | {fmt(m['ttft_ratio'], '.3f')} | {fmt(gemm, '.1f')} | {to_gemm} | "
            f"{m['tokens_per_s_fresh']:.2f} | {m['tokens_per_s_reuse']:.2f} | {m['same_ids']} |"
        )
    return "\n".join(lines)


def loop_methods(methods: list[str]) -> tuple[list[str], list[str]]:
    """(the methods of the generation loop, the others): the multi-turn mode runs the first."""
    ours = [m for m in methods if METHODS[split_method(m)[0]].engine == LOOP]
    return ours, [m for m in methods if m not in ours]
