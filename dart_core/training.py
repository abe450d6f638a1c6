"""Training draft heads: data, the target-state cache, the draft vocabulary, checkpoints, logging.

Compute is the scarce resource (a 2-core CPU runs the 135M target teacher-forced at ~500 tokens/s),
so the target runs over the data exactly once: `build_cache` stores, per token, the three captured
hidden states (the head's input) and the final-normed hidden state (from which the teacher's
distribution over the draft vocabulary is recomputed with the target's LM head rows). Every epoch
then reuses the cache. Labels are the target's own distributions (distillation); the data's texts
only supply the contexts (or the target's own answers, with self-distillation).

Two objectives share everything but the forward that produces the draft rows (`train_head`):
  DART    one prefix-packed forward per record: D mask slots after each sampled anchor give D+1 rows;
  EAGLE3  the training-time test: a causal forward over the record, then D unrolled steps at the
          sampled anchors, each fed the head's own previous output state (what drafting does).
Both minimise Σ_j γ^j · KL(target ‖ draft) over their rows (`rows_loss`).

Cache layout (a directory):
    meta.json                     target, draft vocab, shard list, token counts
    {split}-{k:05d}.safetensors   tokens (N,) int32, offsets (R+1,) int64 record boundaries,
                                  aux (N, 3H) bf16, final (N, H) bf16
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .data import iter_records, render
from .model import apply_rope
from .target import Target

log = logging.getLogger(__name__)

CACHE_META = "meta.json"
SELF_DISTILL_FILE = "self_distill.jsonl"
MIN_RECORD_TOKENS = 8  # shorter records hold no useful prefix to draft from
SHARD_TOKENS = 40_000  # tokens per cache shard (~180 MB at H=576)


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
            input_ids=ids.to(target.device), attention_mask=mask.to(target.device), max_new_tokens=max_new,
            do_sample=False, eos_token_id=eos, pad_token_id=pad,
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
                torch.tensor(ids, device=target.device), torch.arange(len(ids), device=target.device), cache, capture=True, final=True, logits=False
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


def _write_shard(out: Path, split: str, buf, meta: dict, records_done: int) -> None:
    name = f"{split}-{len(meta['shards'][split]):05d}.safetensors"
    lengths = torch.tensor([0] + [len(b[0]) for b in buf])
    tensors = {
        "tokens": torch.tensor([t for b in buf for t in b[0]], dtype=torch.int32),
        "offsets": lengths.cumsum(0),
        "aux": torch.cat([b[1] for b in buf]),
        "final": torch.cat([b[2] for b in buf]),
        "answer_start": torch.tensor([b[3] for b in buf], dtype=torch.int64),
    }
    tmp = out / (name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.rename(out / name)
    meta["shards"][split].append(name)
    meta["tokens"][split] += int(lengths.sum())
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


_SAFETENSORS_DTYPES = {"BF16": (np.uint16, torch.bfloat16), "F32": (np.float32, None), "F16": (np.float16, None),
                       "I64": (np.int64, None), "I32": (np.int32, None), "BOOL": (np.bool_, None)}


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


DRAFT_VOCAB_FILE = "draft_vocab.json"  # a corpus cache's draft vocabulary (its meta.json is the generator's)


def cache_meta(cache_dir: str | Path) -> dict:
    """A cache's meta.json; for a self-distilled corpus (dart_core.corpus), the draft vocabulary
    chosen for it comes from draft_vocab.json beside it."""
    meta = json.loads((Path(cache_dir) / CACHE_META).read_text())
    vocab_file = Path(cache_dir) / DRAFT_VOCAB_FILE
    if "draft_ids" not in meta and vocab_file.exists():
        meta["draft_ids"] = json.loads(vocab_file.read_text())["draft_ids"]
    if "draft_ids" not in meta:
        raise ValueError(f"{cache_dir} has no draft vocabulary yet: choose one with dart_core.corpus.choose_draft_vocab")
    return meta


@dataclass
class TrainConfig:
    cache_dir: str
    out_dir: str
    epochs: float = 3.0
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    grad_clip: float = 1.0
    batch_records: int = 4  # records per optimizer step
    anchors_per_record: int = 48  # prefix positions trained per record (sampled)
    gamma: float = 0.6  # loss weight decay over draft positions (paper)
    eval_every: int = 100
    val_records: int = 40  # validation records used for the periodic evaluation
    checkpoint_every_s: float = 300.0
    max_minutes: float | None = None
    seed: int = 0
    threads: int | None = None
    extra: dict = field(default_factory=dict)


def cosine_lr(step: int, total: int, base: float, warmup: int, time_progress: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 0. The decay follows whichever ends first: the step
    count or the time budget (time_progress = elapsed / budget), so that a run cut by its time
    budget still ends annealed instead of stopping at a high learning rate."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_progress))
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------------
# DART objective


def dart_attention_mask(R: int, anchors: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix-packed training layout for one record: R real positions, then D mask slots per anchor.

    Real position i attends to real positions <= i. Mask slot s (1..D) of anchor a sits at rope
    position a+s and attends to real positions <= a and to the earlier slots of its own anchor, which
    is exactly what it sees at inference after committing tokens 0..a. One forward thus trains every
    sampled prefix. Returns the (Q, Q) bool mask and the (Q,) rope positions, Q = R + len(anchors)*D.
    """
    m = anchors.numel()
    slot = torch.arange(1, D + 1).repeat(m)  # (m*D,)
    owner = anchors.repeat_interleave(D)  # (m*D,)
    block = torch.arange(m).repeat_interleave(D)
    Q = R + m * D
    limit = torch.cat((torch.arange(R), owner))  # last real position each query may see
    is_mask = torch.cat((torch.zeros(R, dtype=torch.bool), torch.ones(m * D, dtype=torch.bool)))
    key_real = torch.arange(R)
    mask = torch.zeros(Q, Q, dtype=torch.bool)
    mask[:, :R] = key_real[None, :] <= limit[:, None]
    mask_block = torch.cat((torch.full((R,), -1), block))
    mask_slot = torch.cat((torch.zeros(R, dtype=torch.long), slot))
    same = (mask_block[:, None] == block[None, :]) & (slot[None, :] <= mask_slot[:, None]) & is_mask[:, None]
    mask[:, R:] = same
    positions = torch.cat((torch.arange(R), owner + slot))
    return mask, positions


def dart_anchor_logits(head, embed: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Draft logits (m, D+1, Vd) for every anchor a: what the head outputs at inference right after
    committing tokens 0..a with token a+1 as the root. tokens (T,), aux (T, 3Ht), anchors (m,) <= T-2."""
    c = head.config
    D = c.draft_length
    R = tokens.numel() - 1  # real positions 0..T-2: position i pairs hidden state i with the embedding of token i+1
    layer = head.midlayer
    u, residual = head.inputs(aux[:R].to(embed.dtype), None, embed[tokens[1:]])
    m = anchors.numel()
    u = torch.cat((u, layer.mask_rep.expand(m * D, -1)))
    residual = torch.cat((residual, layer.mask_rep[: c.hidden_size].expand(m * D, -1)))
    mask, positions = dart_attention_mask(R, anchors.cpu(), D)
    cos, sin = head.rope(positions.to(u.device), u.dtype)
    h = residual + layer.attention(u, cos, sin, mask[None, None].to(u.device), None)
    rows = torch.cat((anchors[:, None].cpu(), R + torch.arange(m * D).view(m, D)), dim=1).to(u.device)  # (m, D+1) query indices
    h = layer.mlp_block(h[rows.reshape(-1)])
    return head.logits(h).view(m, D + 1, -1)


def rows_loss(
    head,
    logits: torch.Tensor,
    teacher_rows: torch.Tensor,
    rec: CachedRecord,
    anchors: torch.Tensor,
    gamma: float,
    target_best: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ_j γ^j · KL(target ‖ draft) over the rows of every anchor of one record; both objectives.

    logits (m, J, Vd): row j of anchor a drafts the token after position a+1+j, so its teacher is the
    target's distribution at position a+1+j; teacher_rows (Vd, H) the target LM head rows of the draft
    vocabulary; with target_best (T,), the target's argmax at every position, also returns whether each
    row's draft top-1 equals it. Returns (weighted KL sum, weight sum, hits (m, J), valid (m, J)).
    """
    m, J = logits.shape[:2]
    T = rec.tokens.numel()
    dev = teacher_rows.device  # the cache lives on the CPU; only what this record needs moves to the device
    anchors = anchors.cpu()
    logq = logits.float().log_softmax(-1).view(m * J, -1)
    target_pos = anchors[:, None] + 1 + torch.arange(J)[None, :]  # (m, J): teacher position per row
    valid = target_pos <= T - 1
    tp = target_pos.clamp(max=T - 1).reshape(-1)
    final = rec.final[tp].to(dev).float()
    with torch.no_grad():
        logp = (final @ teacher_rows.T).float().log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).view(m, J)
    w = (gamma ** torch.arange(J, dtype=torch.float)[None, :] * valid).to(dev)
    hits = torch.zeros(m, J, dtype=torch.bool)
    if target_best is not None:
        with torch.no_grad():
            best = target_best[tp].view(m, J)
            draft_best = head.to_target_ids(logq.argmax(-1)).view(m, J).cpu()
            hits = (best == draft_best) & valid
    return (kl * w).sum(), w.sum(), hits, valid


def dart_record_loss(head, embed, teacher_rows, rec: CachedRecord, anchors, gamma: float, target_best=None):
    """The DART objective on one record: the D+1 rows of one prefix-packed forward (see rows_loss)."""
    logits = dart_anchor_logits(head, embed, rec.tokens.to(embed.device), rec.aux.to(embed.device), anchors.cpu())
    return rows_loss(head, logits, teacher_rows, rec, anchors, gamma, target_best)


# ---------------------------------------------------------------------------------------------------
# EAGLE3 objective: training-time test


def _attend(u: torch.Tensor, positions: torch.Tensor, head, keys: list, values: list, mask: torch.Tensor) -> torch.Tensor:
    """One attention of the head's layer for queries u (Tq, 2H) at rope `positions` over the keys and
    values already in `keys`/`values` plus the queries' own (appended to the lists). mask (Tq, Tk) bool."""
    c, a = head.config, head.midlayer.self_attn
    Tq = u.shape[0]
    cos, sin = head.rope(positions, u.dtype)
    q = apply_rope(a.q_proj(u).view(Tq, c.num_attention_heads, c.head_dim).transpose(0, 1)[None], cos, sin)
    keys.append(apply_rope(a.k_proj(u).view(Tq, c.num_key_value_heads, c.head_dim).transpose(0, 1)[None], cos, sin))
    values.append(a.v_proj(u).view(Tq, c.num_key_value_heads, c.head_dim).transpose(0, 1)[None])
    out = F.scaled_dot_product_attention(
        q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask[None, None],
        enable_gqa=c.num_attention_heads != c.num_key_value_heads,
    )
    return a.o_proj(out[0].transpose(0, 1).reshape(Tq, -1))


def eagle3_anchor_logits(head, embed: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor, steps: int) -> torch.Tensor:
    """Draft logits (m, steps+1, Vd) of EAGLE3's training-time test for every anchor a, teacher-forced
    on the record's tokens: what autoregressive drafting computes right after committing tokens 0..a
    with token a+1 as the root, along the chain of the record's next tokens.

    Step 0 runs every real position i (target states of position i through fc, embedding of token
    i+1; causal). Step k >= 1 runs the anchors only: the head's own step k-1 output state at the anchor,
    the embedding of token a+1+k, rope position a+k; it attends to step-0 keys 0..a and to its own
    chain's keys of steps 1..k, as a drafted node attends to the committed prefix and its ancestors.
    tokens (T,), aux (T, 3Ht), anchors (m,) <= T-2; rows whose token is past the record are garbage and
    masked by the loss."""
    T = tokens.numel()
    R = T - 1
    m = anchors.numel()
    dev = embed.device
    layer = head.midlayer
    u, residual = head.inputs(aux[:R].to(embed.dtype), None, embed[tokens[1:]])
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    causal = torch.ones(R, R, dtype=torch.bool, device=dev).tril_()
    h = layer.mlp_block(residual + _attend(u, torch.arange(R, device=dev), head, keys, values, causal))
    anchors = anchors.to(dev)
    prefix = torch.arange(R, device=dev)[None, :] <= anchors[:, None]  # (m, R): step-0 keys an anchor's chain sees
    eye = torch.eye(m, dtype=torch.bool, device=dev)
    state = h[anchors]
    rows = [head.logits(state)]
    for k in range(1, steps + 1):
        ids = tokens[(anchors + 1 + k).clamp(max=T - 1)]
        u, residual = head.inputs(None, state, embed[ids])
        mask = torch.cat([prefix] + [eye] * k, dim=1)
        state = layer.mlp_block(residual + _attend(u, anchors + k, head, keys, values, mask))
        rows.append(head.logits(state))
    return torch.stack(rows, dim=1)


def eagle3_record_loss(head, embed, teacher_rows, rec: CachedRecord, anchors, gamma: float, target_best=None, steps: int = 7):
    """The EAGLE3 objective on one record: steps+1 unrolled rows per anchor (see rows_loss)."""
    logits = eagle3_anchor_logits(head, embed, rec.tokens.to(embed.device), rec.aux.to(embed.device), anchors, steps)
    return rows_loss(head, logits, teacher_rows, rec, anchors, gamma, target_best)


# ---------------------------------------------------------------------------------------------------
# The training loop (objective-agnostic: `record_loss` decides what is trained)


def new_head_from_target(target, draft_ids: torch.Tensor, draft_length: int | None, seed: int = 0):
    """A fresh head shaped like the target's layers; lm_head and final norm start from the target's
    own (restricted to the draft vocabulary), which the head must imitate anyway."""
    from .drafters.head import DraftHead, HeadConfig

    a = target.model.args
    c = HeadConfig(
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        rms_norm_eps=a.rms_norm_eps,
        rope_theta=float(1.0 / float(target.model.inv_freq[1]) ** (a.head_dim / 2.0)) if a.head_dim > 2 else 10000.0,
        max_position_embeddings=a.max_position_embeddings,
        vocab_size=a.vocab_size,
        draft_vocab_size=draft_ids.numel(),
        target_hidden_size=a.hidden_size,
        draft_length=draft_length,
        double_norm=False,
    )
    torch.manual_seed(seed)
    head = DraftHead(c)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            nn_init_normal(p)
    d2t, t2d = vocab_mapping(draft_ids, a.vocab_size)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.model.output.weight[draft_ids].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head


def nn_init_normal(p: torch.Tensor, std: float = 0.02) -> None:
    with torch.no_grad():
        p.normal_(0.0, std)


def target_argmax(records: list[CachedRecord], full_lm: torch.Tensor) -> list[torch.Tensor]:
    """The target's greedy next token at every position of every record (computed once, kept on the CPU)."""
    with torch.no_grad(), torch.autocast(full_lm.device.type, dtype=torch.bfloat16):
        return [(r.final.to(full_lm.device).float() @ full_lm.T).argmax(-1).cpu() for r in records]


def evaluate(head, embed, teacher_rows, best: list[torch.Tensor], records: list[CachedRecord], anchors_per_record: int, gamma: float,
             seed: int = 1234, record_loss=None, rows: int | None = None):
    """Validation KL and per-position hit@1 (draft top-1 == the target's argmax), fixed anchors.
    record_loss defaults to the DART objective (rows = D+1)."""
    record_loss = record_loss or dart_record_loss
    rows = rows or head.config.draft_length + 1
    g = torch.Generator().manual_seed(seed)
    tot_kl = tot_w = 0.0
    hits = torch.zeros(rows)
    valid = torch.zeros(rows)
    with torch.no_grad():
        for rec, rec_best in zip(records, best):
            anchors = sample_anchors(rec.tokens.numel(), anchors_per_record, g, rec.first_anchor)
            kl, w, h, v = record_loss(head, embed, teacher_rows, rec, anchors, gamma, rec_best)
            tot_kl += float(kl)
            tot_w += float(w)
            hits += h.sum(0)
            valid += v.sum(0)
    return tot_kl / max(tot_w, 1e-9), (hits / valid.clamp(min=1)).tolist()


def sample_anchors(T: int, m: int, g: torch.Generator, first: int = 0) -> torch.Tensor:
    """Up to m distinct anchor positions in [first, T-2], sorted (first: the record's first_anchor, so
    that only prefixes inside the answer are trained)."""
    first = min(max(0, first), max(0, T - 2))
    R = T - 1 - first
    if R <= m:
        return torch.arange(first, first + max(R, 0))
    return first + torch.randperm(R, generator=g)[:m].sort().values


OBJECTIVES = ("dart", "eagle3")


def train_dart(target, cfg: TrainConfig, draft_length: int = 7) -> Path:
    """Train (or resume) a DART head with D = draft_length mask slots; returns the exported head dir."""
    return train_head(target, cfg, "dart", draft_length + 1)


def train_eagle3(target, cfg: TrainConfig, ttt_steps: int = 7) -> Path:
    """Train (or resume) an EAGLE3 head with a training-time test of ttt_steps unrolled steps."""
    return train_head(target, cfg, "eagle3", ttt_steps + 1)


def train_head(target, cfg: TrainConfig, objective: str, rows: int) -> Path:
    """Train (or resume) a draft head on a cache built by `build_cache`: the shared loop of both
    objectives. `rows` drafted depths per anchor: DART's D+1, EAGLE3's unrolled steps + 1."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}: choose one of {OBJECTIVES}")
    if rows < 1:
        raise ValueError("a head drafts at least one depth")
    if objective == "dart":
        draft_length, record_loss = rows - 1, dart_record_loss
    else:
        draft_length = None

        def record_loss(head, embed, teacher_rows, rec, anchors, gamma, target_best=None):
            return eagle3_record_loss(head, embed, teacher_rows, rec, anchors, gamma, target_best, steps=rows - 1)

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = cache_meta(cfg.cache_dir)
    draft_ids = torch.tensor(meta["draft_ids"])
    train = load_split(cfg.cache_dir, "train")
    val = load_split(cfg.cache_dir, "val")[: cfg.val_records]
    if not train:
        raise ValueError(f"{cfg.cache_dir} holds no training records")
    embed = target.model.tok_embeddings.weight.detach().float()
    full_lm = target.model.output.weight.detach().float()
    teacher_rows = full_lm[draft_ids.to(full_lm.device)].contiguous()
    val_best = target_argmax(val, full_lm)

    def autocast():  # bf16 matmuls on CPU (avx512-bf16) and GPU; master weights and the loss stay fp32
        return torch.autocast(target.device.type, dtype=torch.bfloat16)

    ckpt_path = out / "checkpoint.pt"
    head = new_head_from_target(target, draft_ids, draft_length, cfg.seed).to(target.device)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(train) / cfg.batch_records)
    total_steps = max(1, int(cfg.epochs * steps_per_epoch))
    step, history, prior_s = 0, [], 0.0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False, map_location=target.device)
        if ck.get("objective", "dart") != objective:
            raise ValueError(f"{ckpt_path} is a {ck.get('objective', 'dart')} checkpoint; this run trains {objective}: use another out_dir")
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        step, history = ck["step"], ck["history"]
        # training time spent before this process (older checkpoints: the last logged time)
        prior_s = ck.get("elapsed_s", history[-1]["elapsed_s"] if history else 0.0)
        log.warning("resumed from %s at step %d (%.1f min trained)", ckpt_path, step, prior_s / 60)
    budget_s = None if cfg.max_minutes is None else 60.0 * cfg.max_minutes  # over all resumes
    t_start = last_ckpt = time.perf_counter()

    def elapsed() -> float:
        return prior_s + time.perf_counter() - t_start

    def save_checkpoint():
        tmp = ckpt_path.with_suffix(".tmp")
        state = {"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "history": history, "elapsed_s": elapsed(), "config": asdict(cfg), "objective": objective}
        torch.save(state, tmp)
        tmp.rename(ckpt_path)
        head.save(out / "head")
        (out / "history.json").write_text(json.dumps(history, indent=1))

    def run_eval(train_loss: float | None) -> None:
        head.eval()
        with autocast():
            val_kl, acc = evaluate(head, embed, teacher_rows, val_best, val, cfg.anchors_per_record, cfg.gamma, record_loss=record_loss, rows=rows)
        head.train()
        history.append({"step": step, "train_loss": train_loss, "val_kl": val_kl, "val_hit1": acc, "elapsed_s": elapsed()})
        log.warning("step %d val_kl %.4f hit@1 %s", step, val_kl, " ".join(f"{a:.3f}" for a in acc))

    g = torch.Generator().manual_seed(cfg.seed + step)
    bar = tqdm(total=total_steps, initial=step, desc=f"train {objective}", unit="step")
    head.train()
    loss = None
    while step < total_steps:
        if budget_s is not None and elapsed() > budget_s:
            log.warning("time budget reached at step %d", step)
            break
        lr = cosine_lr(step, total_steps, cfg.lr, cfg.warmup_steps, 0.0 if budget_s is None else elapsed() / budget_s)
        for group in opt.param_groups:
            group["lr"] = lr
        order = torch.randperm(len(train), generator=g)[: cfg.batch_records]
        opt.zero_grad(set_to_none=True)
        tot_w = 0.0
        losses = []
        with autocast():
            for i in order.tolist():
                rec = train[i]
                anchors = sample_anchors(rec.tokens.numel(), cfg.anchors_per_record, g, rec.first_anchor)
                kl, w, _, _ = record_loss(head, embed, teacher_rows, rec, anchors, cfg.gamma)
                losses.append(kl)
                tot_w += float(w)
        loss = torch.stack(losses).sum() / max(tot_w, 1e-9)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
        if step % cfg.eval_every == 0 or step == total_steps:
            run_eval(loss.item())
        if time.perf_counter() - last_ckpt > cfg.checkpoint_every_s:
            save_checkpoint()
            last_ckpt = time.perf_counter()
    bar.close()
    if not history or history[-1]["step"] != step:  # stopped by the time budget: evaluate the final head
        run_eval(None if loss is None else loss.item())
    head.eval()
    save_checkpoint()
    return out / "head"
