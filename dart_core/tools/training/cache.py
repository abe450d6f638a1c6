"""Training data for draft heads: records, self-distillation through transformers, the target-state
cache (build, shards, memory-mapped loading) and the draft vocabulary. See dart_core/tools/training/__init__.py."""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ...target import Target
from ..data import iter_records, render

log = logging.getLogger(__name__)

# The cache's format, shared by build_cache and the self-distilled corpus (training/corpus.py)
CACHE_META = "meta.json"
DRAFT_VOCAB_FILE = "draft_vocab.json"  # a corpus cache's draft vocabulary (its meta.json is the generator's)
SHARD_TOKENS = 24_000  # tokens per state shard (~110 MB at H=576): a resumable run loses at most one
SELF_DISTILL_FILE = "self_distill.jsonl"
MIN_RECORD_TOKENS = 8  # shorter records hold no useful prefix to draft from


@dataclass
class CacheConfig:
    data: list[str]
    out_dir: str
    max_tokens: int = 1_000_000  # training tokens to cache (the validation split comes on top)
    max_minutes: float | None = None  # stop caching early, keeping the shards written so far
    max_seq_len: int = 512
    val_records: int = 200
    draft_vocab_size: int = 8192
    seed: int = 0
    # Self-distillation: regenerate the assistant turn of the first N conversations (validation ones
    # first) with the target itself, greedy, in batches through transformers' generate. On a 2-core CPU
    # in bf16, batches of 32 short chat prompts give ~300 tokens/s (one sequence at a time: ~25); on the
    # training data (prompts up to 512 tokens, answers up to 256) it managed ~13 records a minute with
    # its cores shared. The generations are kept in out_dir and reused; a time limit stops generating
    # and keeps what is done.
    self_distill: int = 0
    self_distill_max_new: int = 256
    self_distill_batch: int = 32
    self_distill_minutes: float | None = None


def draft_vocabulary(token_lists: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent target ids in the data (ties by id), sorted ascending: the draft vocab."""
    counts = Counter(t for ids in token_lists for t in ids)
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    ids = sorted(t for t, _ in top)
    # fill with the lowest unused ids if the data has fewer distinct tokens than `size`
    fill = (t for t in range(vocab_size) if t not in counts)
    while len(ids) < min(size, vocab_size):
        ids.append(next(fill))
    return torch.tensor(sorted(ids), dtype=torch.long)


def vocab_mapping(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE3/DART buffers: d2t[i] = target_id - i (an offset), t2d[v] = v is in the draft vocab."""
    d2t = draft_ids - torch.arange(draft_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def _load_records(cfg: CacheConfig, target: Target, generate: bool = True) -> tuple[list[list[int]], list[int]]:
    """Token ids of every usable record, shuffled with cfg.seed (val = the first cfg.val_records).
    The order depends only on the data and the seed, so an interrupted cache resumes where it stopped."""
    tokenizer = target.tokenizer
    pairs = []
    for path in cfg.data:
        for rec in iter_records(path):
            ids = render(tokenizer, rec)[: cfg.max_seq_len]
            if len(ids) >= MIN_RECORD_TOKENS:
                pairs.append((ids, rec))
    random.Random(cfg.seed).shuffle(pairs)
    if cfg.self_distill:
        _self_distill(pairs, cfg, target, generate)
    return [ids for ids, _ in pairs], [min(answer_start(tokenizer, rec), len(ids)) for ids, rec in pairs]


def answer_start(tokenizer, record) -> int:
    """Where the last assistant turn's text begins in the rendered record (0 for plain text or a
    conversation that does not end with the assistant): the tokens before it are context only."""
    if isinstance(record, str) or not record or record[-1]["role"] != "assistant":
        return 0
    full = render(tokenizer, record)
    text = tokenizer.apply_chat_template(record[:-1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    prefix = tokenizer(text, add_special_tokens=False)["input_ids"]
    return len(prefix) if full[: len(prefix)] == prefix else 0


def _self_distill(pairs: list, cfg: CacheConfig, target: Target, generate: bool = True) -> None:
    """Replace the assistant turn of conversations 0 .. self_distill-1 (after shuffling: the validation
    records come first) by the target's own greedy answer, in place. Generations are appended to
    out_dir/self_distill.jsonl batch by batch, so an interrupted run keeps them; records left without a
    generation (time limit) are dropped from the first self_distill, so every cached record is the
    target's own text."""
    store = Path(cfg.out_dir) / SELF_DISTILL_FILE
    done: dict[int, str] = {}
    if store.exists():
        for line in store.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["index"]] = row["response"]
    wanted = [
        i
        for i in range(min(len(pairs), cfg.self_distill))
        if isinstance(pairs[i][1], list) and pairs[i][1] and pairs[i][1][-1]["role"] == "assistant"
    ]
    todo = [i for i in wanted if i not in done]
    if todo and generate:
        t0 = time.perf_counter()
        generate = _batched_greedy(target)
        with store.open("a") as f, tqdm(total=len(wanted), initial=len(wanted) - len(todo), desc="self-distill", unit="rec") as bar:
            for b in range(0, len(todo), cfg.self_distill_batch):
                if cfg.self_distill_minutes is not None and time.perf_counter() - t0 > 60 * cfg.self_distill_minutes:
                    log.warning("self-distillation stopped by its time limit: %d of %d records", len(done), len(wanted))
                    break
                batch = todo[b : b + cfg.self_distill_batch]
                prompts = [target.encode(pairs[i][1][:-1])[: cfg.max_seq_len - 1] for i in batch]
                for i, out in zip(batch, generate(prompts, cfg.self_distill_max_new)):
                    done[i] = target.tokenizer.decode(out, skip_special_tokens=True)
                    f.write(json.dumps({"index": i, "response": done[i]}) + "\n")
                f.flush()
                bar.update(len(batch))
    for i in wanted:
        if i in done:
            rec = pairs[i][1][:-1] + [{"role": "assistant", "content": done[i]}]
            pairs[i] = (render(target.tokenizer, rec)[: cfg.max_seq_len], rec)
    n = min(len(pairs), cfg.self_distill)
    unfinished = set(wanted).difference(done)
    pairs[:n] = [pairs[i] for i in range(n) if i not in unfinished]


def _batched_greedy(target: Target):
    """A function (prompts, max_new) -> greedy continuations (ids, EOS excluded), batched with left
    padding through transformers' generate on the target's weights, dtype and device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target.model_dir, dtype=target.dtype).to(target.device).eval()
    eos = sorted(target.eos_ids)
    pad = eos[0]

    @torch.inference_mode()
    def generate(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(target.device),
            attention_mask=mask.to(target.device),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )[:, width:].tolist()
        return [row[: next((k for k, t in enumerate(row) if t in target.eos_ids), len(row))] for row in out]

    return generate


def build_cache(target: Target, cfg: CacheConfig) -> Path:
    """Run the target over the data once and store what training needs. Resumable: finished shards are kept."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / CACHE_META
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if meta is not None:
        fixed = ("data", "max_seq_len", "val_records", "draft_vocab_size", "seed", "self_distill", "self_distill_max_new")
        changed = [k for k in fixed if meta["config"].get(k) != asdict(cfg)[k]]
        if changed:
            raise ValueError(f"{out} was built with other {', '.join(changed)}: use the same settings to resume it, or another cache dir")
    records, starts = _load_records(cfg, target, generate=meta is None)
    if len(records) <= cfg.val_records:
        raise ValueError(f"only {len(records)} usable records in {cfg.data}")
    if meta is None:
        draft_ids = draft_vocabulary(records, cfg.draft_vocab_size, target.vocab_size)
        meta = {
            "target": target.name,
            "config": asdict(cfg),
            "draft_ids": draft_ids.tolist(),
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "shards": {"val": [], "train": []},
            "tokens": {"val": 0, "train": 0},
            "records_done": {"val": 0, "train": 0},
        }
    splits = {"val": list(zip(records, starts))[: cfg.val_records], "train": list(zip(records, starts))[cfg.val_records :]}
    t0 = time.perf_counter()
    for split, recs in splits.items():
        budget = None if split == "val" else cfg.max_tokens
        done = meta["records_done"][split]
        bar = tqdm(total=budget or sum(len(r) for r, _ in recs), initial=meta["tokens"][split], desc=f"cache {split}", unit="tok")
        buf: list[tuple[list[int], torch.Tensor, torch.Tensor, int]] = []
        i = done
        while i < len(recs) and (budget is None or meta["tokens"][split] + sum(len(b[0]) for b in buf) < budget):
            if cfg.max_minutes is not None and time.perf_counter() - t0 > 60 * cfg.max_minutes:
                break
            ids, start = recs[i]
            cache = target.new_cache(len(ids))
            out_fwd = target.model(
                torch.tensor(ids, device=target.device),
                torch.arange(len(ids), device=target.device),
                cache,
                capture=True,
                final=True,
                logits=False,
            )
            buf.append((ids, out_fwd.hidden.to(torch.bfloat16).cpu(), out_fwd.final.to(torch.bfloat16).cpu(), start))
            bar.update(len(ids))
            i += 1
            if sum(len(b[0]) for b in buf) >= SHARD_TOKENS:
                _write_shard(out, split, buf, meta, i)
                meta_path.write_text(json.dumps(meta))
                buf = []
        if buf:
            _write_shard(out, split, buf, meta, i)
            meta_path.write_text(json.dumps(meta))
        bar.close()
    meta_path.write_text(json.dumps(meta))
    return out


def record_tensors(
    records: list[list[int]], answer_starts: list[int], aux: list[torch.Tensor] | None, final: list[torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """The tensors of one shard of R records: tokens (N,) int32, offsets (R+1,) int64, answer_start (R,)
    int64 and, with states, aux (N, 3H) and final (N, H), the records' rows concatenated."""
    lengths = torch.tensor([0] + [len(r) for r in records])
    tensors = {
        "tokens": torch.tensor([t for r in records for t in r], dtype=torch.int32),
        "offsets": lengths.cumsum(0),
        "answer_start": torch.tensor(answer_starts, dtype=torch.int64),
    }
    if aux is not None:
        tensors["aux"], tensors["final"] = torch.cat(aux), torch.cat(final)
    return tensors


def write_shard(out: Path, meta: dict, split: str, tensors: dict[str, torch.Tensor]) -> str:
    """Write `tensors` (see record_tensors) as the split's next shard, atomically, and list it and its
    tokens in meta (which the caller saves). Returns the shard's file name."""
    name = f"{split}-{len(meta['shards'][split]):05d}.safetensors"
    tmp = out / (name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(out / name)
    meta["shards"][split].append(name)
    meta["tokens"][split] += int(tensors["offsets"][-1])
    return name


def _write_shard(out: Path, split: str, buf, meta: dict, records_done: int) -> None:
    write_shard(out, meta, split, record_tensors([b[0] for b in buf], [b[3] for b in buf], [b[1] for b in buf], [b[2] for b in buf]))
    meta["records_done"][split] = records_done


@dataclass
class CachedRecord:
    tokens: torch.Tensor  # (T,) int64
    aux: torch.Tensor  # (T, 3H) bf16
    final: torch.Tensor  # (T, H) bf16
    answer_start: int = 0  # first token of the answer: drafting (and so the loss) starts there

    @property
    def first_anchor(self) -> int:
        """The first prefix the head is trained on: the one whose root is the answer's first token."""
        return max(0, self.answer_start - 1)


_SAFETENSORS_DTYPES = {
    "BF16": (np.uint16, torch.bfloat16),
    "F32": (np.float32, None),
    "F16": (np.float16, None),
    "I64": (np.int64, None),
    "I32": (np.int32, None),
    "BOOL": (np.bool_, None),
}


def mmap_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file as zero-copy views of a memory map: a record's states are
    read from disk (or the page cache) when training touches them, so a cache larger than memory trains."""
    path = Path(path)
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    buf = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: never written, but torch wants writable memory
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        np_dtype, torch_dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        a, b = info["data_offsets"]
        arr = buf[8 + n + a : 8 + n + b].view(np_dtype).reshape(info["shape"])
        t = torch.from_numpy(arr)
        out[name] = t.view(torch_dtype) if torch_dtype is not None else t
    return out


def load_split(cache_dir: str | Path, split: str) -> list[CachedRecord]:
    """Every cached record of a split. Token ids are in memory; the states (bf16: ~4.6 KB per token at
    H=576) are views of memory-mapped shards."""
    cache_dir = Path(cache_dir)
    meta = json.loads((cache_dir / CACHE_META).read_text())
    out = []
    for name in meta["shards"][split]:
        t = mmap_safetensors(cache_dir / name)
        off = t["offsets"].tolist()
        tokens = t["tokens"].long()
        starts = t["answer_start"].tolist() if "answer_start" in t else [0] * (len(off) - 1)
        for (a, b), start in zip(zip(off, off[1:]), starts):
            if b - a - start < 1:  # no answer token to draft (an answer of one token: EOS at once)
                continue
            out.append(CachedRecord(tokens[a:b], t["aux"][a:b], t["final"][a:b], start))
    return out


def cache_meta(cache_dir: str | Path) -> dict:
    """A cache's meta.json; for a self-distilled corpus (training/corpus.py), the draft vocabulary
    chosen for it comes from draft_vocab.json beside it."""
    meta = json.loads((Path(cache_dir) / CACHE_META).read_text())
    vocab_file = Path(cache_dir) / DRAFT_VOCAB_FILE
    if "draft_ids" not in meta and vocab_file.exists():
        meta["draft_ids"] = json.loads(vocab_file.read_text())["draft_ids"]
    if "draft_ids" not in meta:
        raise ValueError(f"{cache_dir} has no draft vocabulary yet: choose one with dart_core.training.corpus.choose_draft_vocab")
    return meta
