"""The two training objectives: DART's prefix-packed forward and EAGLE3's training-time test, and the
loss both minimise (Σ_j γ^j · KL(target ‖ draft) over the drafted rows). See dart_core/tools/training/__init__.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...model import apply_rope
from .cache import CachedRecord

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
    # only the rows that draft (each anchor's real position and its D slots) are queried; every
    # position still provides keys and values
    rows = torch.cat((anchors[:, None].cpu(), R + torch.arange(m * D).view(m, D)), dim=1).reshape(-1)  # (m*(D+1),)
    h = residual[rows.to(u.device)] + layer.attention(u, cos, sin, mask[rows][None, None].to(u.device), None, queries=rows.to(u.device))
    h = layer.mlp_block(h)
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


def _attend(
    u: torch.Tensor, positions: torch.Tensor, head, keys: list, values: list, mask: torch.Tensor, queries: torch.Tensor | None = None
) -> torch.Tensor:
    """One attention of the head's layer for new rows u (T, 2H) at rope `positions` over the keys and
    values already in `keys`/`values` plus the new rows' own (appended to the lists). Returns the
    outputs of the rows `queries` (default all), mask (len(queries), Tk) bool."""
    c, a = head.config, head.midlayer.self_attn
    T = u.shape[0]
    cos, sin = head.rope(positions, u.dtype)
    uq, cq, sq = (u, cos, sin) if queries is None else (u[queries], cos[queries], sin[queries])
    Tq = uq.shape[0]
    q = apply_rope(a.q_proj(uq).view(Tq, c.num_attention_heads, c.head_dim).transpose(0, 1)[None], cq, sq)
    keys.append(apply_rope(a.k_proj(u).view(T, c.num_key_value_heads, c.head_dim).transpose(0, 1)[None], cos, sin))
    values.append(a.v_proj(u).view(T, c.num_key_value_heads, c.head_dim).transpose(0, 1)[None])
    out = F.scaled_dot_product_attention(
        q,
        torch.cat(keys, dim=2),
        torch.cat(values, dim=2),
        attn_mask=mask[None, None],
        enable_gqa=c.num_attention_heads != c.num_key_value_heads,
    )
    return a.o_proj(out[0].transpose(0, 1).reshape(Tq, -1))


def eagle3_anchor_logits(
    head, embed: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor, steps: int
) -> torch.Tensor:
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
    anchors = anchors.to(dev)
    prefix = torch.arange(R, device=dev)[None, :] <= anchors[:, None]  # (m, R): step-0 keys an anchor's chain sees
    # step 0 needs every position's keys and values but only the anchors' outputs (causal rows = prefix)
    state = layer.mlp_block(residual[anchors] + _attend(u, torch.arange(R, device=dev), head, keys, values, prefix, queries=anchors))
    eye = torch.eye(m, dtype=torch.bool, device=dev)
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
