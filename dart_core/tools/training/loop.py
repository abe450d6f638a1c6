"""The training loop shared by both objectives: a fresh head, the schedule, evaluation, checkpoints
that resume across sessions, export. See dart_core/tools/training/__init__.py."""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ...drafters.head import TRAINED_FILE, trained_record
from .cache import CachedRecord, cache_meta, load_split, vocab_mapping
from .objectives import dart_record_loss, eagle3_record_loss

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    cache_dir: str
    out_dir: str
    epochs: float = 3.0
    steps: int | None = None  # optimizer steps in all, overriding epochs (two heads, one token budget)
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
    keep_heads_every: int | None = None  # also keep a copy of the head every N steps (out_dir/heads/step-N), to compare runs at equal steps
    max_minutes: float | None = None
    seed: int = 0
    threads: int | None = None
    # resuming with a cache whose draft vocabulary is not the checkpoint's: False keeps the
    # checkpoint's; True moves the head to the cache's (`adopt_vocabulary`)
    adopt_cache_vocab: bool = False
    # a new run directory (no checkpoint yet) may start from a head saved before instead of a fresh one:
    # the head's weights, and its TRAINED_FILE (step, training seconds) and the history in init_history
    # so that the step count and the time-budgeted schedule go on (`checkpoint_from_head`)
    init_head: str | None = None
    init_history: str | None = None
    extra: dict = field(default_factory=dict)


@contextmanager
def stop_on_sigterm():
    """While training: SIGTERM asks the loop to stop after the step in progress, save a checkpoint and
    exit, so `kill PID` pauses a run cleanly (a SIGSTOP pause would count towards the time budget).
    Yields an Event that is set once the signal came. No-op outside the main thread."""
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: requested.set())
    try:
        yield requested
    finally:
        signal.signal(signal.SIGTERM, previous)


def cosine_lr(step: int, total: int, base: float, warmup: int, time_progress: float = 0.0, rewarm_from: int | None = None) -> float:
    """Linear warm-up, then cosine decay to 0. The decay follows whichever ends first: the step
    count or the time budget (time_progress = elapsed / budget), so that a run cut by its time
    budget still ends annealed instead of stopping at a high learning rate. rewarm_from: the step
    where the optimizer started afresh mid-schedule (a restart from a saved head): the rate ramps up
    again over `warmup` steps from there, towards the schedule's value."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_progress))
    lr = base * 0.5 * (1.0 + math.cos(math.pi * progress))
    if rewarm_from is not None and 0 <= step - rewarm_from < warmup:
        lr *= (step - rewarm_from + 1) / warmup
    return lr


# ---------------------------------------------------------------------------------------------------
# The training loop (objective-agnostic: `record_loss` decides what is trained)


def new_head_from_target(target, draft_ids: torch.Tensor, draft_length: int | None, seed: int = 0):
    """A fresh head shaped like the target's layers; lm_head and final norm start from the target's
    own (restricted to the draft vocabulary), which the head must imitate anyway."""
    from ...drafters.head import DraftHead, HeadConfig

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
        out = target.model.output.weight  # a tensor, or a packed layout (a bf16 target's on AVX2: InterleavedBF16)
        head.lm_head.weight.copy_(out[draft_ids].float() if isinstance(out, torch.Tensor) else out.dequantize(draft_ids))
        head.norm.weight.copy_(target.model.norm.weight.float())
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head


def state_draft_ids(head_state: dict) -> torch.Tensor:
    """The target ids of a head state dict's draft vocabulary (d2t holds offsets), on the CPU."""
    d2t = head_state["d2t"].cpu()
    return d2t + torch.arange(d2t.numel())


def adopt_vocabulary(ck: dict, new_ids: torch.Tensor, target, param_names: list[str]) -> dict:
    """A training checkpoint moved to another draft vocabulary `new_ids` (sorted target ids).

    A token's LM head row and its AdamW moments go with the token: rows of ids in both vocabularies
    are carried over, the new ids' rows start from the target's own LM head rows (as a fresh head's
    do) with zero moments. Everything else (the layer, fc, norms, the step count, the history) is
    kept, so the run resumes where it was. d2t/t2d are rebuilt; records the change under "vocab_changes".
    param_names: the head's parameter names in head.parameters() order (the optimizer state's keys)."""
    head_state = dict(ck["head"])
    old_w = head_state["lm_head.weight"]
    old_ids = state_draft_ids(head_state).tolist()
    new_ids = new_ids.cpu().long()
    old_pos = {t: i for i, t in enumerate(old_ids)}
    keep_new = [i for i, t in enumerate(new_ids.tolist()) if t in old_pos]
    keep_old = [old_pos[new_ids[i].item()] for i in keep_new]
    keep_new_t, keep_old_t = torch.tensor(keep_new, dtype=torch.long), torch.tensor(keep_old, dtype=torch.long)

    def moved(old: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        fresh = fresh.to(device=old.device, dtype=old.dtype).clone()
        fresh[keep_new_t.to(old.device)] = old[keep_old_t.to(old.device)]
        return fresh

    head_state["lm_head.weight"] = moved(old_w, target.model.output.weight.detach()[new_ids.to(target.device)])
    d2t, t2d = vocab_mapping(new_ids, head_state["t2d"].numel())
    head_state["d2t"], head_state["t2d"] = d2t.to(head_state["d2t"].device), t2d.to(head_state["t2d"].device)

    changes = list(ck.get("vocab_changes", [])) + [{"step": ck["step"], "size": new_ids.numel(), "carried_over": len(keep_new)}]
    if ck["opt"] is None:  # a run started from a saved head: no moments to move
        return {**ck, "head": head_state, "vocab_changes": changes}
    opt_state = {**ck["opt"], "state": dict(ck["opt"]["state"])}
    idx = param_names.index("lm_head.weight")
    if idx in opt_state["state"]:
        st = dict(opt_state["state"][idx])
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                st[k] = moved(st[k], torch.zeros(new_ids.numel(), st[k].shape[1]))
        opt_state["state"][idx] = st
    return {**ck, "head": head_state, "opt": opt_state, "vocab_changes": changes}


def bf16_arithmetic(device: torch.device) -> bool:
    """Whether bf16 matmuls run in hardware here: a GPU, or a CPU with AVX512-BF16. Elsewhere torch
    emulates them, and training runs in fp32 instead: on a 2-core AMD EPYC with AVX2 only, an EAGLE3
    step under bf16 autocast took 10.6 s (threads 1)."""
    if device.type != "cpu":
        return True
    from ... import kernels

    return kernels.cpu_features().get("avx512bf16", False)


def checkpoint_from_head(head_dir: str | Path, target, objective: str, history_file: str | Path | None = None) -> dict:
    """A training checkpoint that continues a run from a head saved before, for a machine that has the
    head (e.g. the committed assets/dart) but not the run's checkpoint.pt.

    The head's weights come back as they were saved (bf16 in the published format: the fp32 master
    weights are lost to that rounding); the optimizer starts afresh (moments are not saved with a head,
    so `train_head` warms the learning rate up again over warmup_steps). The step count and training
    seconds come from TRAINED_FILE beside the head (0 without it) and the validation history from
    history_file (its entries up to that step), so the curve and the time-budgeted schedule go on.
    The restart is recorded under "restarts"."""
    from ...drafters.head import load_head

    head_dir = Path(head_dir)
    head = load_head(head_dir, objective == "dart", target, dtype=torch.float32, device=target.device)
    trained = trained_record(head_dir) or {"step": 0, "elapsed_s": 0.0}  # ValueError on a malformed file
    if trained["step"] < 0 or not isinstance(trained.get("elapsed_s"), (int, float)):  # resuming needs both
        raise ValueError(f"{head_dir / TRAINED_FILE}: expected {{\"step\": int >= 0, \"elapsed_s\": seconds}}, got {trained}")
    history = []
    if history_file is not None:
        history = [h for h in json.loads(Path(history_file).read_text()) if h["step"] <= trained["step"]]
    restart = {"step": trained["step"], "from": str(head_dir), "optimizer": "fresh"}
    return {
        "head": head.state_dict(),
        "opt": None,
        "step": trained["step"],
        "history": history,
        "elapsed_s": float(trained["elapsed_s"]),
        "objective": objective,
        "restarts": [restart],
    }


def nn_init_normal(p: torch.Tensor, std: float = 0.02) -> None:
    with torch.no_grad():
        p.normal_(0.0, std)


def target_argmax(records: list[CachedRecord], full_lm: torch.Tensor) -> list[torch.Tensor]:
    """The target's greedy next token at every position of every record (computed once, kept on the CPU)."""
    with torch.no_grad(), torch.autocast(full_lm.device.type, dtype=torch.bfloat16):
        return [(r.final.to(full_lm.device).float() @ full_lm.T).argmax(-1).cpu() for r in records]


def evaluate(
    head,
    embed,
    teacher_rows,
    best: list[torch.Tensor],
    records: list[CachedRecord],
    anchors_per_record: int,
    gamma: float,
    seed: int = 1234,
    record_loss=None,
    rows: int | None = None,
):
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
    ckpt_path = out / "checkpoint.pt"
    ck = torch.load(ckpt_path, weights_only=False, map_location=target.device) if ckpt_path.exists() else None
    resumed_from = ckpt_path  # where a resumed run's state comes from, for the log
    if ck is None and cfg.init_head is not None:
        ck, resumed_from = (
            checkpoint_from_head(cfg.init_head, target, objective, cfg.init_history),
            f"the head {cfg.init_head} (optimizer afresh)",
        )
    elif ck is not None and cfg.init_head is not None:
        log.warning("%s exists: resuming it, --init-head ignored", ckpt_path)
    adopt = False
    if ck is not None:
        # the head's vocabulary is the one it started with: a corpus that grew since may have chosen
        # another (its draft_vocab.json is re-chosen on export), and teacher rows of that vocabulary
        # would train the head's outputs towards other tokens' distributions
        head_ids = state_draft_ids(ck["head"])
        if not torch.equal(head_ids, draft_ids):
            shared = len(set(head_ids.tolist()) & set(draft_ids.tolist()))
            if cfg.adopt_cache_vocab:
                log.warning(
                    "%s: adopting the cache's draft vocabulary: %d of its %d ids carried over from the checkpoint's %d, "
                    "the others start from the target's LM head rows",
                    cfg.cache_dir,
                    shared,
                    draft_ids.numel(),
                    head_ids.numel(),
                )
                adopt = True
            else:
                log.warning(
                    "%s: the cache's draft vocabulary differs from the checkpoint's (%d of %d ids shared): "
                    "the run goes on with the checkpoint's",
                    cfg.cache_dir,
                    shared,
                    head_ids.numel(),
                )
                draft_ids = head_ids
    train = load_split(cfg.cache_dir, "train")
    val = load_split(cfg.cache_dir, "val")[: cfg.val_records]
    if not train:
        raise ValueError(f"{cfg.cache_dir} holds no training records")
    embed = target.model.tok_embeddings.weight.detach().float()
    full_lm = target.model.output.weight.detach().float()
    teacher_rows = full_lm[draft_ids.to(full_lm.device)].contiguous()
    val_best = target_argmax(val, full_lm)

    mixed = bf16_arithmetic(target.device)

    def autocast():  # bf16 matmuls where the hardware has them; master weights and the loss stay fp32
        return torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=mixed)

    head = new_head_from_target(target, draft_ids, draft_length, cfg.seed).to(target.device)
    if adopt:
        ck = adopt_vocabulary(ck, draft_ids, target, [name for name, _ in head.named_parameters()])
    # fused: one kernel over all tensors (the foreach AdamW took ~8% of a CPU step); same update rule
    fused = target.device.type in ("cpu", "cuda")
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=fused)
    steps_per_epoch = math.ceil(len(train) / cfg.batch_records)
    total_steps = cfg.steps if cfg.steps is not None else max(1, int(cfg.epochs * steps_per_epoch))
    if total_steps < 1:
        raise ValueError(f"steps must be >= 1, got {total_steps}")
    step, history, prior_s, vocab_changes, restarts = 0, [], 0.0, [], []
    if ck is not None:
        if ck.get("objective", "dart") != objective:
            raise ValueError(f"{ckpt_path} is a {ck.get('objective', 'dart')} checkpoint; this run trains {objective}: use another out_dir")
        head.load_state_dict(ck["head"])
        if ck["opt"] is not None:  # None: a run started from a saved head (checkpoint_from_head)
            opt.load_state_dict(ck["opt"])
        for group in opt.param_groups:  # a checkpoint's groups carry its implementation flags: use this run's
            group["fused"], group["foreach"] = fused, None
        step, history, vocab_changes, restarts = ck["step"], ck["history"], ck.get("vocab_changes", []), ck.get("restarts", [])
        if ck.get("rows", rows) != rows:  # the weights do not depend on it: a run may go on with fewer or more rows
            log.warning("%s trained %d rows per anchor; this run trains %d", ckpt_path, ck["rows"], rows)
        # training time spent before this process (older checkpoints: the last logged time)
        prior_s = ck.get("elapsed_s", history[-1]["elapsed_s"] if history else 0.0)
        log.warning("resumed from %s at step %d (%.1f min trained)", resumed_from, step, prior_s / 60)
    budget_s = None if cfg.max_minutes is None else 60.0 * cfg.max_minutes  # over all resumes
    # fresh AdamW moments after a restart from a saved head: warm the learning rate up again from there
    rewarm_from = restarts[-1]["step"] if restarts and restarts[-1]["optimizer"] == "fresh" and restarts[-1]["step"] > 0 else None
    t_start = last_ckpt = time.perf_counter()

    def elapsed() -> float:
        return prior_s + time.perf_counter() - t_start

    def save_checkpoint():
        tmp = ckpt_path.with_suffix(".tmp")
        state = {
            "head": head.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "history": history,
            "elapsed_s": elapsed(),
            "config": asdict(cfg),
            "objective": objective,
            "rows": rows,
            "vocab_changes": vocab_changes,
            "restarts": restarts,
        }
        torch.save(state, tmp)
        tmp.rename(ckpt_path)
        head.save(out / "head")
        (out / "history.json").write_text(json.dumps(history, indent=1))

    def run_eval(train_loss: float | None) -> None:
        head.eval()
        with autocast():
            val_kl, acc = evaluate(
                head, embed, teacher_rows, val_best, val, cfg.anchors_per_record, cfg.gamma, record_loss=record_loss, rows=rows
            )
        head.train()
        history.append({"step": step, "train_loss": train_loss, "val_kl": val_kl, "val_hit1": acc, "elapsed_s": elapsed()})
        log.warning("step %d val_kl %.4f hit@1 %s", step, val_kl, " ".join(f"{a:.3f}" for a in acc))

    g = torch.Generator().manual_seed(cfg.seed + step)
    # into a log file (a background run), a progress line a minute instead of several a second
    bar = tqdm(total=total_steps, initial=step, desc=f"train {objective}", unit="step", mininterval=0.1 if sys.stderr.isatty() else 60.0)
    head.train()
    loss = None
    with stop_on_sigterm() as sigterm:
        while step < total_steps:
            if sigterm.is_set():
                save_checkpoint()
                log.warning("SIGTERM: checkpoint saved at step %d (%.1f min trained); the same command resumes", step, elapsed() / 60)
                raise SystemExit(128 + signal.SIGTERM)
            if budget_s is not None and elapsed() > budget_s:
                log.warning("time budget reached at step %d", step)
                break
            lr = cosine_lr(step, total_steps, cfg.lr, cfg.warmup_steps, 0.0 if budget_s is None else elapsed() / budget_s, rewarm_from)
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
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}", refresh=False)
            if step % cfg.eval_every == 0 or step == total_steps:
                run_eval(loss.item())
            if cfg.keep_heads_every and step % cfg.keep_heads_every == 0:
                kept = out / "heads" / f"step-{step:06d}"
                head.save(kept)
                (kept / TRAINED_FILE).write_text(json.dumps({"step": step, "elapsed_s": elapsed()}) + "\n")
            if time.perf_counter() - last_ckpt > cfg.checkpoint_every_s:
                save_checkpoint()
                last_ckpt = time.perf_counter()
    bar.close()
    if not history or history[-1]["step"] != step:  # stopped by the time budget: evaluate the final head
        run_eval(None if loss is None else loss.item())
    head.eval()
    save_checkpoint()
    return out / "head"
