"""The self-distilled corpus: the target's own answers to chat prompts, with its hidden states.

Draft heads learn best from the text the target itself writes (the field's practice: EAGLE3 and DART
regenerate ShareGPT/UltraChat answers with the target). This module turns a pool of chat prompts into
that corpus on a CPU, in batches, resumably, and captures the target's states *in the generating
forward*, so no second teacher-forced pass over the corpus is needed:

    prompt pool     first user turns of every training file (ShareGPT and the instruction sets),
                    deduplicated, the evaluation prompts (bench sets) removed, shuffled with a seed
    generation      continuous batching (`ContinuousBatcher`, which only schedules: the forwards are
                    the model's prefill and `Transformer.decode_rows`): `batch_size` sequences decode
                    together, a finished one is replaced at once by the next prompt;
                    a fixed share of prompts is answered by sampling at a temperature (so the heads
                    also serve sampling), the rest greedily. The dtype is the run's choice and may
                    change between resumes (each shard records the dtype that generated it)
    capture         the generating forwards keep, for every token the target reads, the input residual
                    stream of the three captured layers (the heads' input) and the final-normed hidden
                    state (the teacher's distribution is recomputed from it)

The run directory is a target-state cache in the format `dart_core.training` trains from (meta.json
plus shards of tokens/offsets/aux/final), with per-record extras: `answer_start` (where the
target's answer begins: the loss only trains drafting inside answers), `index` (the prompt's place in
the pool), `sampled` and `last` (the final token, which is never fed to the target and so has no
states). A shard is written every few thousand tokens and then listed in meta.json (atomically), so
an interrupted run loses at most one shard's worth of work and resumes where it stopped.

`export_corpus` writes the compact, versioned corpus that is committed to the repository (token ids
and offsets only, compressed) and `corpus_to_cache` rebuilds a cache from it with one teacher-forced
pass, for a machine that has the corpus but not the states.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...model import RowCache
from ...target import Target
from ..data import iter_records
from .cache import CACHE_META, DRAFT_VOCAB_FILE, SHARD_TOKENS, mmap_safetensors, record_tensors, write_shard
from .loop import stop_on_sigterm

log = logging.getLogger(__name__)

CORPUS_FORMAT = "dart-demo-corpus/1"
CORPUS_META = "corpus.json"


@dataclass
class PoolPrompt:
    source: str  # file stem
    messages: list[dict]  # the chat up to (not including) the answer to generate


def prompt_pool(paths: list[str], exclude: list[str] = (), seed: int = 0) -> list[PoolPrompt]:
    """First user turns of every conversation in `paths` (system turns before it are kept),
    deduplicated by text, minus any prompt that is a turn of a file in `exclude` (question.jsonl
    files: the evaluation sets stay unseen), shuffled with `seed`. Plain-text records have no prompt
    and are skipped."""
    held_out = set()
    for path in exclude:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                held_out.update(_norm(t) for t in json.loads(line)["turns"])
    seen: set[str] = set()
    pool = []
    for path in paths:
        for rec in iter_records(path):
            if isinstance(rec, str):
                continue
            first_user = next((k for k, m in enumerate(rec) if m["role"] == "user"), None)
            if first_user is None:
                continue
            messages = [dict(m) for m in rec[: first_user + 1]]
            key = _norm(messages[-1]["content"])
            if not key or key in seen or key in held_out:
                continue
            seen.add(key)
            pool.append(PoolPrompt(Path(path).stem, messages))
    random.Random(seed).shuffle(pool)
    return pool


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


@dataclass
class CorpusConfig:
    data: list[str]
    out_dir: str
    exclude: list[str] = field(default_factory=list)
    max_prompt_tokens: int = 768  # longer prompts are skipped, not cut (a cut prompt is a broken prompt)
    max_new_tokens: int = 256
    batch_size: int = 48  # sequences decoding together (continuous batching)
    sample_share: float = 0.25  # prompts answered by sampling (the rest greedily)
    temperature: float = 0.7
    val_prompts: int = 300  # the first pool prompts form the validation split
    seed: int = 0
    capture: bool = True  # keep the target's states (a cache); without, tokens only
    max_minutes: float | None = None
    max_prompts: int | None = None  # stop after this many pool prompts

    def fingerprint(self) -> dict:
        """The settings a resumed run must share with the run it resumes."""
        keep = ("data", "exclude", "max_prompt_tokens", "max_new_tokens", "sample_share", "temperature", "val_prompts", "seed")
        return {k: v for k, v in asdict(self).items() if k in keep}


def is_sampled(index: int, share: float, seed: int) -> bool:
    """Whether pool prompt `index` is answered by sampling: a fixed, seeded draw per prompt."""
    h = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < share


@dataclass
class Generated:
    index: int
    prompt: list[int]
    answer: list[int]  # EOS included when the target emitted it
    sampled: bool
    aux: torch.Tensor | None  # (len(prompt) + len(answer) - 1, 3H) bf16: every token the target read
    final: torch.Tensor | None  # (same, H) bf16


@dataclass
class _Job:
    index: int
    prompt: list[int]
    generator: torch.Generator | None  # None: greedy
    answer: list[int] = field(default_factory=list)
    aux: list[torch.Tensor] = field(default_factory=list)
    final: list[torch.Tensor] = field(default_factory=list)


class ContinuousBatcher:
    """Batched generation with continuous batching: `slots` sequences decode together, one token each
    per step, each in its own row of a `RowCache`; a sequence that ends (EOS or its token limit) is
    replaced at once by the next prompt, prefilled alone into the freed row. The batcher only
    schedules and picks tokens: the forwards are the model's (its prefill, then `decode_rows`, whose
    rows on the kernels are bit for bit the one-token steps of plain decoding). Greedy and sampled
    sequences share the batch; states are captured in the same forwards."""

    def __init__(self, target: Target, slots: int, capacity: int, temperature: float, capture: bool):
        a = target.model.args
        self.target, self.model = target, target.model
        self.slots, self.capacity, self.temperature, self.capture = slots, capacity, temperature, capture
        self.cache = RowCache(a.n_layers, a.n_kv_heads, a.head_dim, slots, capacity, target.cache_dtype, target.device)
        self.jobs: list[_Job | None] = [None] * slots
        self.next_token = torch.zeros(slots, dtype=torch.long, device=target.device)

    def _pick(self, job: _Job, logits: torch.Tensor) -> int:
        """The next token from logits (V,) fp32: argmax, or a draw at the temperature."""
        if job.generator is None:
            return int(logits.argmax())
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=job.generator))

    @torch.inference_mode()
    def start(self, slot: int, job: _Job) -> None:
        """Prefill job's prompt alone into row `slot` and pick its first answer token."""
        T = len(job.prompt)
        cache = self.target.new_cache(T)
        out = self.model(
            torch.tensor(job.prompt, device=self.target.device),
            torch.arange(T, device=self.target.device),
            cache,
            capture=self.capture,
            final=self.capture,
            logits=not self.capture,
            logits_at=None if self.capture else slice(-1, None),
        )
        cache.commit(T)
        # with capture the final states of every position are kept, but only the last one's logits
        # are needed: the LM head over all T would cost as much as the rest of the prefill
        last_logits = self.model.output(out.final[-1:]).float()[-1] if self.capture else out.logits[-1]
        self.cache.load(slot, cache)
        if self.capture:
            job.aux.append(out.hidden.to(torch.bfloat16))
            job.final.append(out.final.to(torch.bfloat16))
        token = self._pick(job, last_logits)
        job.answer.append(token)
        self.next_token[slot] = token
        self.jobs[slot] = job

    @torch.inference_mode()
    def step(self) -> None:
        """Feed every row its last token (one `decode_rows` forward), then pick the next ones. Rows
        without a job run a dummy token at slot 0 whose result is ignored."""
        out = self.model.decode_rows(self.next_token, self.cache, capture=self.capture, final=self.capture)
        self.cache.commit()
        greedy = out.logits.argmax(-1).tolist()
        for s, job in enumerate(self.jobs):
            if job is None:
                self.cache.clear(s)
                continue
            if self.capture:
                job.aux.append(out.hidden[s : s + 1].to(torch.bfloat16))
                job.final.append(out.final[s : s + 1].to(torch.bfloat16))
            token = greedy[s] if job.generator is None else self._pick(job, out.logits[s])
            job.answer.append(token)
            self.next_token[s] = token

    def finished(self, slot: int, max_new: int) -> bool:
        job = self.jobs[slot]
        return job is not None and (job.answer[-1] in self.target.eos_ids or len(job.answer) >= max_new)

    def release(self, slot: int) -> Generated:
        job = self.jobs[slot]
        self.jobs[slot] = None
        self.cache.clear(slot)
        self.next_token[slot] = 0
        aux = torch.cat(job.aux) if self.capture else None
        final = torch.cat(job.final) if self.capture else None
        if aux is not None and aux.shape[0] != len(job.prompt) + len(job.answer) - 1:
            raise RuntimeError(
                f"prompt {job.index}: {aux.shape[0]} captured positions for {len(job.prompt) + len(job.answer) - 1} fed tokens"
            )
        return Generated(job.index, job.prompt, job.answer, job.generator is not None, aux, final)


def run_batcher(batcher: ContinuousBatcher, jobs, max_new: int, deadline: float | None = None, stop=None):
    """Yield a Generated for every job of the iterable `jobs`, as they finish (not in order), keeping
    every row busy while jobs remain. With a deadline (perf_counter time), stops taking new jobs then
    and drops the unfinished ones; likewise once `stop` (a threading.Event) is set."""
    jobs = iter(jobs)
    exhausted = False

    def over() -> bool:
        return (deadline is not None and time.perf_counter() > deadline) or (stop is not None and stop.is_set())

    def refill():
        nonlocal exhausted
        for s in range(batcher.slots):
            if batcher.jobs[s] is None and not exhausted:
                if over():
                    exhausted = True
                    return
                job = next(jobs, None)
                if job is None:
                    exhausted = True
                    return
                batcher.start(s, job)

    while True:
        while True:  # release what has ended; a refilled job can end at once (EOS as its first token)
            ended = [s for s in range(batcher.slots) if batcher.finished(s, max_new)]
            for s in ended:
                yield batcher.release(s)
            refill()
            if not any(batcher.finished(s, max_new) for s in range(batcher.slots)):
                break
        if all(j is None for j in batcher.jobs) or over():
            return
        batcher.step()


def _read_meta(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def _new_meta(target: Target, config: dict, pool_size: int, **extra) -> dict:
    """The meta.json of a fresh run directory (the cache layout dart_core.training reads, plus the
    corpus's own bookkeeping)."""
    return {
        "target": target.name,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "capture_layers": list(target.model.args.capture_layers()),
        "dtype": str(target.dtype).removeprefix("torch."),
        "shards": {"val": [], "train": []},
        "tokens": {"val": 0, "train": 0},
        "records_done": {"val": 0, "train": 0},
        "corpus": {
            "format": CORPUS_FORMAT,
            "config": config,
            "pool_size": pool_size,
            "done": [],  # pool indices finished (generated, or skipped: see "skipped")
            "skipped": [],  # pool indices whose prompt was too long
            "answer_tokens": 0,
            "generate_s": 0.0,
            **extra,
        },
    }


def dtype_label(labels) -> str:
    """One generation-dtype label for records of the given labels: "bfloat16", or "bfloat16+float32"
    for a mix (a label may itself be a mix)."""
    return "+".join(sorted({d for label in labels for d in label.split("+")}))


def _write_shard(out: Path, meta: dict, split: str, recs: list[Generated], dtype: str) -> None:
    """Write recs, whose tokens were generated in `dtype` (e.g. "bfloat16"), as the split's next shard
    (the training cache's shard, plus the corpus's per-record last token, pool index and sampled flag)
    and count them in meta (not yet saved)."""
    capture = recs[0].aux is not None
    tensors = record_tensors(
        [(g.prompt + g.answer)[:-1] for g in recs],
        [len(g.prompt) for g in recs],
        [g.aux for g in recs] if capture else None,
        [g.final for g in recs] if capture else None,
    )
    tensors["last"] = torch.tensor([g.answer[-1] for g in recs], dtype=torch.int32)
    tensors["index"] = torch.tensor([g.index for g in recs], dtype=torch.int64)
    tensors["sampled"] = torch.tensor([g.sampled for g in recs], dtype=torch.bool)
    name = write_shard(out, meta, split, tensors)
    meta["corpus"].setdefault("shard_dtype", {})[name] = dtype
    meta["records_done"][split] += len(recs)
    meta["corpus"]["done"].extend(g.index for g in recs)
    meta["corpus"]["answer_tokens"] += sum(len(g.answer) for g in recs)


def generate_corpus(target: Target, cfg: CorpusConfig) -> Path:
    """Generate (or resume) the corpus in cfg.out_dir; returns the directory. See the module doc."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / CACHE_META
    meta = _read_meta(meta_path)
    if meta is not None and meta["corpus"]["config"] != cfg.fingerprint():
        changed = sorted(k for k, v in cfg.fingerprint().items() if meta["corpus"]["config"].get(k) != v)
        raise ValueError(f"{out} was generated with other {', '.join(changed)}: use the same settings to resume it, or another directory")
    pool = prompt_pool(cfg.data, cfg.exclude, cfg.seed)
    if meta is None:
        meta = _new_meta(target, cfg.fingerprint(), len(pool))
    if meta["corpus"]["pool_size"] != len(pool):
        raise ValueError(f"{out}: the prompt pool now has {len(pool)} prompts, the run was started with {meta['corpus']['pool_size']}")
    done = set(meta["corpus"]["done"])
    limit = len(pool) if cfg.max_prompts is None else min(len(pool), cfg.max_prompts)
    batcher = ContinuousBatcher(target, cfg.batch_size, cfg.max_prompt_tokens + cfg.max_new_tokens, cfg.temperature, cfg.capture)
    buffers: dict[str, list[Generated]] = {"val": [], "train": []}
    skipped: list[int] = []
    t0 = time.perf_counter()
    prior_s = meta["corpus"]["generate_s"]
    new_tokens = 0

    def flush(split: str) -> None:
        if buffers[split]:
            _write_shard(out, meta, split, buffers[split], str(target.dtype).removeprefix("torch."))
        meta["corpus"]["skipped"].extend(skipped)
        meta["corpus"]["done"].extend(skipped)
        skipped.clear()
        meta["corpus"]["generate_s"] = prior_s + time.perf_counter() - t0
        _write_json(meta_path, meta)
        buffers[split] = []

    def jobs():
        for i in range(limit):
            if i in done:
                continue
            ids = target.encode(pool[i].messages)
            if len(ids) > cfg.max_prompt_tokens:
                skipped.append(i)
                continue
            g = None
            if is_sampled(i, cfg.sample_share, cfg.seed):
                g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
            yield _Job(i, ids, g)

    deadline = None if cfg.max_minutes is None else t0 + 60 * cfg.max_minutes
    last_log = time.perf_counter()
    # SIGTERM: stop taking prompts, keep every finished record (the rows in flight are dropped, as at
    # the deadline; their prompts stay undone) and exit; the same command resumes
    with stop_on_sigterm() as sigterm:
        for g in run_batcher(batcher, jobs(), cfg.max_new_tokens, deadline, sigterm):
            split = "val" if g.index < cfg.val_prompts else "train"
            buffers[split].append(g)
            new_tokens += len(g.answer)
            if sum(len(x.prompt) + len(x.answer) for x in buffers[split]) >= SHARD_TOKENS:
                flush(split)
            if time.perf_counter() - last_log > 60:
                last_log = time.perf_counter()
                log.warning(
                    "prompts done %d/%d  answer tokens %d  (this run: %.1f answer tok/s)",
                    len(meta["corpus"]["done"]) + sum(map(len, buffers.values())),
                    limit,
                    meta["corpus"]["answer_tokens"] + sum(len(x.answer) for v in buffers.values() for x in v),
                    new_tokens / (time.perf_counter() - t0),
                )
        for split in buffers:
            flush(split)
        if sigterm.is_set():
            log.warning("SIGTERM: %d answer tokens kept in %s; the same command resumes", meta["corpus"]["answer_tokens"], out)
            raise SystemExit(128 + signal.SIGTERM)
    return out


def corpus_records(run_dir: str | Path, split: str | None = None):
    """Token data of every finished record of a run directory, shard by shard, without its states:
    dicts of index, ids (prompt + answer, the last token included), answer_start, sampled, split and
    dtype (the dtype that generated it)."""
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / CACHE_META).read_text())
    for sp in ("val", "train") if split is None else (split,):
        for name in meta["shards"][sp]:
            # runs begun before shards recorded their dtype generated everything in the run's dtype
            dtype = meta["corpus"].get("shard_dtype", {}).get(name, meta["dtype"])
            t = mmap_safetensors(run_dir / name)
            off = t["offsets"].tolist()
            tokens = t["tokens"].tolist()
            for r, (a, b) in enumerate(zip(off, off[1:])):
                yield {
                    "index": int(t["index"][r]),
                    "ids": tokens[a:b] + [int(t["last"][r])],
                    "answer_start": int(t["answer_start"][r]),
                    "sampled": bool(t["sampled"][r]),
                    "split": sp,
                    "dtype": dtype,
                }


def choose_draft_vocab(run_dir: str | Path, size: int, vocab_size: int, rechoose: bool = False) -> dict:
    """Pick the draft vocabulary of a corpus: the `size` target ids most frequent in its answers, and
    measure how much of the target's argmax it covers. In a greedy answer every token *is* the
    target's argmax at the position before it, so the coverage of greedy answer tokens is the share of
    drafting positions whose greedy token the head can propose at all. Written to draft_vocab.json in
    the run directory (training reads it from there); returns it.

    A vocabulary chosen before (draft_vocab.json of the same size) is kept and only its coverage is
    measured again on the grown corpus, unless `rechoose`: heads trained on the run use its ids, and
    heads meant to be compared (DART and EAGLE3) should share them."""
    from collections import Counter

    counts: Counter = Counter()
    greedy: Counter = Counter()
    for rec in corpus_records(run_dir):
        answer = rec["ids"][rec["answer_start"] :]
        counts.update(answer)
        if not rec["sampled"]:
            greedy.update(answer)
    if not counts:
        raise ValueError(f"{run_dir} holds no finished records yet")
    path = Path(run_dir) / DRAFT_VOCAB_FILE
    before = json.loads(path.read_text()) if path.exists() else None
    if before is not None and not rechoose and before["size"] == min(size, vocab_size):
        ids = before["draft_ids"]
    else:
        top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
        ids = sorted(t for t, _ in top)
        fill = (t for t in range(vocab_size) if t not in counts)
        while len(ids) < min(size, vocab_size):
            ids.append(next(fill))
        ids.sort()
    chosen = set(ids)
    cover_all = sum(c for t, c in counts.items() if t in chosen) / sum(counts.values())
    cover_greedy = sum(c for t, c in greedy.items() if t in chosen) / max(1, sum(greedy.values()))
    info = {
        "draft_ids": ids,
        "size": len(ids),
        "kept": ids == (before or {}).get("draft_ids"),
        "answer_tokens": sum(counts.values()),
        "distinct_answer_tokens": len(counts),
        "coverage_answer_tokens": cover_all,
        "coverage_greedy_argmax": cover_greedy,
    }
    _write_json(path, info)
    return info


def export_corpus(run_dir: str | Path, out_dir: str | Path, command: str, min_records: int = 1) -> dict:
    """Append the records of a run directory that are not exported yet to out_dir as one new part,
    part-NNNNN.npz (compressed: tokens uint16/int32, offsets int64, answer_start int32, index int32 (the
    prompt's place in the pool), sampled bool, val bool), and rewrite corpus.json (format, provenance,
    settings, counts, parts with their sha256 and the dtype that generated them). Parts are never rewritten, so each export adds only
    the new records to the repository; fewer than min_records new records write no part."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    meta = json.loads((run_dir / CACHE_META).read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / CORPUS_META
    parts = json.loads(manifest_path.read_text())["parts"] if manifest_path.exists() else []
    exported: set[int] = set()
    for part in parts:
        with np.load(out_dir / part["name"]) as z:
            exported.update(z["index"].tolist())
    recs = sorted((r for r in corpus_records(run_dir) if r["index"] not in exported), key=lambda r: r["index"])
    if len(recs) >= max(1, min_records):
        name = f"part-{len(parts):05d}.npz"
        lengths = np.array([0] + [len(r["ids"]) for r in recs], dtype=np.int64)
        dtype = np.uint16 if meta["vocab_size"] <= 65536 else np.int32
        np.savez_compressed(
            out_dir / name,
            tokens=np.array([t for r in recs for t in r["ids"]], dtype=dtype),
            offsets=lengths.cumsum(),
            answer_start=np.array([r["answer_start"] for r in recs], dtype=np.int32),
            index=np.array([r["index"] for r in recs], dtype=np.int32),
            sampled=np.array([r["sampled"] for r in recs], dtype=bool),
            val=np.array([r["split"] == "val" for r in recs], dtype=bool),
        )
        parts.append(
            {
                "name": name,
                "records": len(recs),
                "tokens": int(lengths.sum()),
                "answer_tokens": int(sum(len(r["ids"]) - r["answer_start"] for r in recs)),
                "sha256": hashlib.sha256((out_dir / name).read_bytes()).hexdigest(),
                "generated_dtype": dtype_label(r["dtype"] for r in recs),
            }
        )
    c = meta["corpus"]
    manifest = {
        "format": CORPUS_FORMAT,
        "target": meta["target"],
        # parts exported before parts recorded their dtype were generated in the run's first dtype
        "generated_dtype": dtype_label(p.get("generated_dtype", meta["dtype"]) for p in parts),
        "command": command,
        "settings": c["config"],
        "pool_size": c["pool_size"],
        "records": sum(p["records"] for p in parts),
        "answer_tokens": sum(p["answer_tokens"] for p in parts),
        "tokens": sum(p["tokens"] for p in parts),
        "parts": parts,
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    vocab = run_dir / DRAFT_VOCAB_FILE  # the heads' vocabulary goes with the corpus (a rebuild reuses it)
    if vocab.exists():
        (out_dir / DRAFT_VOCAB_FILE).write_text(vocab.read_text())
    return manifest


def read_corpus(corpus_dir: str | Path):
    """The records of an exported corpus (see export_corpus), part by part, checking each part's
    sha256: dicts of index, ids, answer_start, sampled, split, dtype (the part's generation dtype)."""
    corpus_dir = Path(corpus_dir)
    manifest = json.loads((corpus_dir / CORPUS_META).read_text())
    if manifest.get("format") != CORPUS_FORMAT:
        raise ValueError(f"{corpus_dir}: not a {CORPUS_FORMAT} corpus (format {manifest.get('format')!r})")
    for part in manifest["parts"]:
        dtype = part.get("generated_dtype", manifest["generated_dtype"])  # e.g. "bfloat16+float32" for a mixed part
        path = corpus_dir / part["name"]
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != part["sha256"]:
            raise ValueError(f"{path}: sha256 {digest} does not match the manifest's {part['sha256']}")
        with np.load(path) as z:
            off = z["offsets"]
            for r in range(len(off) - 1):
                yield {
                    "index": int(z["index"][r]),
                    "ids": z["tokens"][off[r] : off[r + 1]].astype(np.int64).tolist(),
                    "answer_start": int(z["answer_start"][r]),
                    "sampled": bool(z["sampled"][r]),
                    "split": "val" if z["val"][r] else "train",
                    "dtype": dtype,
                }


def corpus_to_cache(target: Target, corpus_dir: str | Path, out_dir: str | Path, max_minutes: float | None = None) -> Path:
    """Rebuild a run directory (the states cache) from an exported corpus with one teacher-forced
    pass of the target over every record, for a machine that has the committed corpus but not the
    generator's states. Resumable like generation: finished shards are kept."""
    corpus_dir, out = Path(corpus_dir), Path(out_dir)
    manifest = json.loads((corpus_dir / CORPUS_META).read_text())
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / CACHE_META
    meta = _read_meta(meta_path) or _new_meta(target, manifest["settings"], manifest["pool_size"], rebuilt_from=str(corpus_dir))
    done = set(meta["corpus"]["done"])
    t0 = time.perf_counter()
    buffers: dict[str, list[Generated]] = {"val": [], "train": []}
    shard_dtype: dict[str, str] = {}  # the generation dtype of each split's buffered records

    def flush(split: str) -> None:
        if not buffers[split]:
            return
        _write_shard(out, meta, split, buffers[split], shard_dtype[split])
        _write_json(meta_path, meta)
        buffers[split] = []

    for rec in read_corpus(corpus_dir):
        if rec["index"] in done:
            continue
        if max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes:
            break
        ids = rec["ids"]
        fed = torch.tensor(ids[:-1], device=target.device)
        cache = target.new_cache(len(fed))
        fwd = target.model(fed, torch.arange(len(fed), device=target.device), cache, capture=True, final=True, logits=False)
        start = rec["answer_start"]
        if buffers[rec["split"]] and shard_dtype[rec["split"]] != rec["dtype"]:
            flush(rec["split"])  # a shard holds one generation dtype (of the parts it comes from)
        shard_dtype[rec["split"]] = rec["dtype"]
        buffers[rec["split"]].append(
            Generated(
                rec["index"],
                ids[:start],
                ids[start:],
                rec["sampled"],
                fwd.hidden.to(torch.bfloat16).cpu(),
                fwd.final.to(torch.bfloat16).cpu(),
            )
        )
        if sum(len(g.prompt) + len(g.answer) for g in buffers[rec["split"]]) >= SHARD_TOKENS:
            flush(rec["split"])
    for split in buffers:
        flush(split)
    vocab = corpus_dir / DRAFT_VOCAB_FILE
    if vocab.exists() and not (out / DRAFT_VOCAB_FILE).exists():
        (out / DRAFT_VOCAB_FILE).write_text(vocab.read_text())
    return out
