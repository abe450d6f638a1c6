"""The fixed-shape forward's attention as Triton kernels (CUDA), with the contract of dart_core/fixed_shape.py.

Row r of a forward attends over its logical key sequence: the P committed keys in place, then its path
through this forward's pending keys (slots P + node). The keys are cut at fixed logical positions into
splits of SPLIT keys (one program each: row x key-value head x split), every split into chunks of BLOCK
keys read in order with an online softmax; a second kernel combines a row's splits in split order (only
those holding its keys: the first kernel writes no others, so neither the work nor the bits depend on
the cache's capacity, and a one-row step writes a few KiB of partial results, not the whole grid's). Every
boundary is a logical position, and every chunk runs the same instructions (one tl.dot for the scores,
one for the values), so a node's output depends on its own sequence only: a verified node and its
one-token step (the same sequence, its ancestors by then committed) get the same bits, whatever the
other rows and wherever the keys sit in memory. The arithmetic differs from the torch reference in
fixed_shape.py (an online softmax, tensor-core products), so the two are each exact on their own, not equal.

P and the number of real rows are read from a device tensor, and the grid is fixed by the cache's
capacity, so a forward using these kernels can be captured once as a CUDA graph and replayed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # keys a chunk
# Keys a split, by default (CudaForward.split sets another: any multiple of BLOCK). Every value
# is exact, as every boundary is a logical position; it sets how many programs a forward's attention
# spreads over: a one-row step over P cached keys runs KV heads x cdiv(P, split) programs, each reading
# its split's keys in turn, so a short context's step waits on a few programs' loops (the H200 timed
# 17.8 us a layer at 512 keys, 8 programs at the 8B shape), while a small split writes and combines
# more partial results. The GPU check's sweep (dart_core/cuda/check/) times the choice on a device.
SPLIT = 512


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, path_ptr, plen_ptr, meta_ptr, m_ptr, l_ptr, acc_ptr,
    scale, NKV, NSPLIT,
    stride_qr, stride_kh, stride_ks,
    D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    P = tl.load(meta_ptr)
    T = tl.load(meta_ptr + 1)
    n = tl.where(r < T, P + tl.load(plen_ptr + r), 0)  # the row's logical keys (none on a padding row)
    start = s * SPLIT_N
    end = tl.minimum(start + SPLIT_N, n)
    rows = tl.arange(0, GP)
    dims = tl.arange(0, HD)
    # query rows with keys in this split (none on padding rows, nor past n); the comparison broadcast to
    # the rows first (Triton's interpreter refuses a scalar bool in an `&` with a vector)
    live = (rows < G) & (rows * 0 + start < n)
    q = tl.load(q_ptr + r * stride_qr + (g * G + rows)[:, None] * HD + dims[None, :], mask=live[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HD], tl.float32)
    for c in range(start, end, BLOCK_N):
        offs = c + tl.arange(0, BLOCK_N)
        valid = offs < end
        node = tl.load(path_ptr + r * D + (offs - P), mask=valid & (offs >= P), other=0)
        slot = tl.where(offs < P, offs, P + node)
        kv_off = g * stride_kh + slot[:, None] * stride_ks + dims[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(valid[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = ((r * NKV + g) * NSPLIT + s) * GP + rows
    tl.store(m_ptr + out, m_i, mask=live)  # the combine reads a row's splits below cdiv(n, SPLIT_N) only
    tl.store(l_ptr + out, l_i, mask=live)
    tl.store(acc_ptr + out[:, None] * HD + dims[None, :], acc, mask=live[:, None])


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in fp32: exact fp32 products where the inputs are fp32 (no TF32), tensor cores otherwise."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _chunk_keys(path_ptr, plen_ptr, r, T, R, P, start, offs, D: tl.constexpr, SPLIT_N: tl.constexpr):
    """Cache slots of row r's logical positions offs (a chunk of split `start`), and which are its keys."""
    n = tl.where(r < T, P + tl.load(plen_ptr + r, mask=r < R, other=0), 0)
    ok = offs < tl.minimum(start + SPLIT_N, n)
    node = tl.load(path_ptr + r * D + (offs - P), mask=ok & (offs >= P), other=0)
    return tl.where(offs < P, offs, P + node), ok


@triton.jit
def _row_scores(
    sc, q, k_ptr, path_ptr, plen_ptr, r, mine, T, R, P, start, offs, dims, k_head, stride_ks,
    D: tl.constexpr, SPLIT_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """sc with the tile rows `mine` (row r's queries) replaced by their scores against row r's keys at offs."""
    slot, ok = _chunk_keys(path_ptr, plen_ptr, r, T, R, P, start, offs, D, SPLIT_N)
    k = tl.load(k_ptr + k_head + slot[:, None] * stride_ks + dims[None, :], mask=ok[:, None], other=0.0)
    return tl.where(mine[:, None], _dot(q, tl.trans(k), IEEE), sc)


@triton.jit
def _row_values(
    pv, p, v_ptr, path_ptr, plen_ptr, r, mine, T, R, P, start, offs, dims, v_head, stride_ks,
    D: tl.constexpr, SPLIT_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """pv with the tile rows `mine` (row r's queries) replaced by their weights p times row r's values at offs."""
    slot, ok = _chunk_keys(path_ptr, plen_ptr, r, T, R, P, start, offs, D, SPLIT_N)
    v = tl.load(v_ptr + v_head + slot[:, None] * stride_ks + dims[None, :], mask=ok[:, None], other=0.0)
    return tl.where(mine[:, None], _dot(p.to(v.dtype), v, IEEE), pv)


@triton.jit
def _group_split_kernel(
    q_ptr, k_ptr, v_ptr, path_ptr, plen_ptr, meta_ptr, m_ptr, l_ptr, acc_ptr,
    scale, NKV, NSPLIT, R,
    stride_qr, stride_kh, stride_ks,
    D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, RG: tl.constexpr, M: tl.constexpr, HD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr, IEEE: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """_split_kernel for RG rows at once (program: row group x key-value head x split), the group's
    queries one tile of M = RG x G rows: a chunk of committed keys, the same for every row, is read once
    and enters one product for all of them; a chunk holding tree keys runs one product a row (against
    that row's keys; the rest of the tile's rows discarded). Both products have the tile's shape, so
    each query row gets the same instructions on the same values either way, and its online softmax
    is _split_kernel's, guarded where a row has no keys in a chunk (exact zeros, no NaN).

    What this adds to _split_kernel's contract: a node sits at another place of the tile in its verify
    than in its one-token step (row 0), beside other rows' queries, so it is exact where the dot
    product gives a row the same bits at any place of its tile and whatever the other rows hold. That
    is the hardware's to show (the GPU check's fixed-grouped path); numpy's fp32 matmul, which
    Triton's interpreter uses, does not give it (tests/cuda/triton_interpreted.py), its fp16 one does."""
    grp = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    P = tl.load(meta_ptr)
    T = tl.load(meta_ptr + 1)
    mrow = tl.arange(0, M)
    sub = mrow // G  # the row within the group
    head = mrow % G
    row = grp * RG + sub
    live = (sub < RG) & (row < T)
    n = tl.where(live, P + tl.load(plen_ptr + row, mask=live, other=0), 0)
    start = s * SPLIT_N
    end_m = tl.minimum(start + SPLIT_N, n)  # each query row's keys in this split end here
    end = tl.max(end_m, 0)
    dims = tl.arange(0, HD)
    has = start < n  # query rows with keys in this split
    q = tl.load(q_ptr + row[:, None] * stride_qr + (g * G + head)[:, None] * HD + dims[None, :], mask=(live & has)[:, None], other=0.0)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HD], tl.float32)
    for c in range(start, end, BLOCK_N):
        offs = c + tl.arange(0, BLOCK_N)
        valid = offs[None, :] < end_m[:, None]
        shared = c + BLOCK_N <= P
        if shared:
            k = tl.load(k_ptr + g * stride_kh + offs[:, None] * stride_ks + dims[None, :])
            sc = _dot(q, tl.trans(k), IEEE)
        else:
            sc = tl.zeros([M, BLOCK_N], tl.float32)
            for i in tl.range(0, RG, loop_unroll_factor=UNROLL):
                sc = _row_scores(
                    sc, q, k_ptr, path_ptr, plen_ptr, grp * RG + i, sub == i, T, R, P, start, offs, dims,
                    g * stride_kh, stride_ks, D, SPLIT_N, IEEE,
                )  # fmt: skip
        sc = tl.where(valid, sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
        p = tl.where(valid, tl.exp(sc - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        if shared:
            v = tl.load(v_ptr + g * stride_kh + offs[:, None] * stride_ks + dims[None, :])
            pv = _dot(p.to(v.dtype), v, IEEE)
        else:
            pv = tl.zeros([M, HD], tl.float32)
            for i in tl.range(0, RG, loop_unroll_factor=UNROLL):
                pv = _row_values(
                    pv, p, v_ptr, path_ptr, plen_ptr, grp * RG + i, sub == i, T, R, P, start, offs, dims,
                    g * stride_kh, stride_ks, D, SPLIT_N, IEEE,
                )  # fmt: skip
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = ((row * NKV + g) * NSPLIT + s) * GP + head
    keep = (sub < RG) & (row < R) & has
    tl.store(m_ptr + out, m_i, mask=keep)
    tl.store(l_ptr + out, l_i, mask=keep)
    tl.store(acc_ptr + out[:, None] * HD + dims[None, :], acc, mask=keep[:, None])


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, o_ptr, plen_ptr, meta_ptr, NKV, NSPLIT, stride_or,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, NH: tl.constexpr, SPLIT_N: tl.constexpr,
):  # fmt: skip
    """Row r's query head h: its splits combined in split order, those holding its keys only (the split
    kernels write no others), so the work and the bits depend on the row's key count, not on the
    cache's capacity; a padding row has none and gets zeros."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    g = h // G
    j = h % G
    P = tl.load(meta_ptr)
    T = tl.load(meta_ptr + 1)
    n = tl.where(r < T, P + tl.load(plen_ptr + r), 0)  # r < R: plen has a count for every row
    dims = tl.arange(0, HD)
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([HD], tl.float32)
    for s in range(0, tl.cdiv(n, SPLIT_N)):
        idx = ((r * NKV + g) * NSPLIT + s) * GP + j
        m_s = tl.load(m_ptr + idx + tl.zeros([1], tl.int32))
        l_s = tl.load(l_ptr + idx + tl.zeros([1], tl.int32))
        a_s = tl.load(acc_ptr + idx * HD + dims)
        m_new = tl.maximum(m_run, m_s)
        keep = m_new > float("-inf")
        w_run = tl.where(keep & (m_run > float("-inf")), tl.exp(m_run - m_new), 0.0)
        w_s = tl.where(keep & (m_s > float("-inf")), tl.exp(m_s - m_new), 0.0)
        l_run = l_run * w_run + l_s * w_s
        acc = acc * w_run + a_s * w_s
        m_run = tl.where(keep, m_new, m_run)
    out = tl.where(l_run > 0, acc / l_run, 0.0)
    tl.store(o_ptr + r * stride_or + h * HD + dims, out.to(o_ptr.dtype.element_ty))


class Workspace:
    """The partial results of the split kernel for a fixed row count, cache capacity and split size
    (reused, so a captured graph keeps its addresses)."""

    def __init__(self, rows: int, n_kv: int, group: int, head_dim: int, capacity: int, device, split: int = SPLIT):
        if split < BLOCK or split % BLOCK:
            raise ValueError(f"a split holds a whole number of {BLOCK}-key chunks, got {split} keys")
        self.split = split
        self.gp = max(16, triton.next_power_of_2(group))
        self.nsplit = triton.cdiv(capacity, split)
        n = rows * n_kv * self.nsplit * self.gp
        # NaN until written: the split kernels write only the splits holding a row's keys and the combine
        # reads only those, so a read of anything else would show in every output it touched
        self.m = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
        self.l = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
        self.acc = torch.full((n, head_dim), float("nan"), dtype=torch.float32, device=device)
        self.key = (rows, n_kv, group, head_dim, capacity, str(device), split)


# The grouped attention's tree chunks run a product a row of the group (UNROLL: the loop's unroll
# factor): unrolled up to this many rows (the kernel the H200 run measured, at 4 rows a program; the
# same PTX instructions static_range gave it), a loop past it (16 rows unrolled spill registers:
# tests/cuda/triton_compiled.py counts them)
UNROLLED_ROWS = 8


def group_warps(tile: int) -> int:
    """Warps of a grouped attention program: 4 up to a 32-row tile, a warp for each 8 rows past that (a
    64-row tile's accumulators and queries spill 4 warps' registers: tests/cuda/triton_compiled.py)."""
    return max(4, tile // 8)


def attention(q, k_cache, v_cache, path, plen, meta, out, ws: Workspace, row_group: int = 1) -> torch.Tensor:
    """q (R, nh, hd) contiguous; k_cache / v_cache (nkv, capacity, hd) with this forward's keys at slots
    P + row; path (R, D) int32 tree nodes of each row's path in depth order, plen (R,) int32 their
    count, meta (2,) int32 = (P, real rows). Writes out (R, nh, hd) (zeros on padding rows).
    row_group: rows a program (_group_split_kernel; 1: a program a row, _split_kernel)."""
    R, nh, hd = q.shape
    nkv = k_cache.shape[0]
    G = nh // nkv
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"the Triton attention needs a power-of-two head dim >= 16, got {hd}")
    ieee = q.dtype == torch.float32
    if row_group > 1:
        tile = max(16, triton.next_power_of_2(row_group * G))
        _group_split_kernel[(triton.cdiv(R, row_group), nkv, ws.nsplit)](
            q, k_cache, v_cache, path, plen, meta, ws.m, ws.l, ws.acc,
            hd**-0.5, nkv, ws.nsplit, R,
            q.stride(0), k_cache.stride(0), k_cache.stride(1),
            D=path.shape[1], G=G, GP=ws.gp, RG=row_group, M=tile, HD=hd, BLOCK_N=BLOCK, SPLIT_N=ws.split, IEEE=ieee,
            UNROLL=row_group if row_group <= UNROLLED_ROWS else 1, num_warps=group_warps(tile),
        )  # fmt: skip
    else:
        _split_kernel[(R, nkv, ws.nsplit)](
            q, k_cache, v_cache, path, plen, meta, ws.m, ws.l, ws.acc,
            hd**-0.5, nkv, ws.nsplit,
            q.stride(0), k_cache.stride(0), k_cache.stride(1),
            D=path.shape[1], G=G, GP=ws.gp, HD=hd, BLOCK_N=BLOCK, SPLIT_N=ws.split, IEEE=ieee,
        )  # fmt: skip
    _combine_kernel[(R, nh)](
        ws.m, ws.l, ws.acc, out, plen, meta, nkv, ws.nsplit, out.stride(0), G=G, GP=ws.gp, HD=hd, NH=nh, SPLIT_N=ws.split,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------ the element-wise work
#
# The fixed forward's work between its GEMMs, fused: one program a row (or a row and a head), so a row's
# values depend on its own inputs only, as the contract asks. The rounding follows the torch ops they
# replace (model.RMSNorm, apply_rope, SiLU times up, the residual add): fp32 arithmetic, a result rounded
# to the model's dtype wherever torch rounds it. Between the GEMMs of a one-row step on a large model the
# torch ops are ~25 small kernels a layer (docs/gpu.md); these are five.


@triton.jit
def _rmsnorm_kernel(
    x_ptr, y_ptr, w_ptr, res_ptr, out_ptr, N, eps,
    stride_x, stride_y, stride_res, stride_out,
    ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out = RMSNorm(x (+ y)) with weight w; with ADD, res = x + y (the residual stream) too."""
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        y = tl.load(y_ptr + r * stride_y + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + r * stride_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_kernel(
    qkv_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, meta_ptr, eps,
    stride_qkv, stride_q, stride_kh, stride_ks,
    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """One row's head h of the fused q|k|v projection: a query head (h < NH) normed (Qwen3) and rotated
    into q; a key head normed and rotated into the cache at slot P + row; a value head copied there."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HD)
    half = HD // 2
    rd = (d + half) % HD  # rotate-half: element d pairs with element d +- HD/2
    base = qkv_ptr + r * stride_qkv + h * HD
    dt = q_ptr.dtype.element_ty
    slot = tl.load(meta_ptr) + r
    if h < NH + NKV:
        x = tl.load(base + d).to(tl.float32)
        xr = tl.load(base + rd).to(tl.float32)
        if NORM:
            is_q = h < NH
            w = tl.where(is_q, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
            wr = tl.where(is_q, tl.load(qw_ptr + rd), tl.load(kw_ptr + rd)).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
            x = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xr = (wr * (xr * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        pos = tl.load(pos_ptr + r)
        c = tl.load(cos_ptr + pos * HD + d).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * HD + d).to(dt).to(tl.float32)
        rot = tl.where(d < half, -xr, xr)
        out = ((x * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)).to(dt)
        if h < NH:
            tl.store(q_ptr + r * stride_q + h * HD + d, out)
        else:
            tl.store(k_ptr + (h - NH) * stride_kh + slot * stride_ks + d, out.to(k_ptr.dtype.element_ty))
    else:
        v = tl.load(base + d)
        tl.store(v_ptr + (h - NH - NKV) * stride_kh + slot * stride_ks + d, v.to(v_ptr.dtype.element_ty))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_out, BLOCK: tl.constexpr):
    """out = SiLU(gate) * up for gate|up = gu's two halves (SiLU rounded to the dtype first, as torch)."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + r * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + r * stride_out + cols, (act * u).to(dt), mask=mask)


def _warps(n: int) -> int:
    return 8 if n >= 4096 else 4 if n >= 1024 else 2 if n >= 256 else 1


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, y: torch.Tensor | None = None):
    """RMSNorm of x (R, N) (of x + y with y: then returns (x + y, the norm)); one program a row."""
    R, N = x.shape
    block = triton.next_power_of_2(N)
    out = torch.empty_like(x)
    res = torch.empty_like(x) if y is not None else out
    _rmsnorm_kernel[(R,)](
        x, y if y is not None else x, weight, res, out, N, eps,
        x.stride(0), (y if y is not None else x).stride(0), res.stride(0), out.stride(0),
        ADD=y is not None, BLOCK=block, num_warps=_warps(block),
    )  # fmt: skip
    return (res, out) if y is not None else out


def qkv_rope(qkv, q_out, k_cache, v_cache, q_weight, k_weight, eps, cos, sin, positions, meta, n_heads, n_kv, head_dim):
    """Split the (R, (nh + 2 nkv) hd) projection: rotated queries into q_out (R, nh, hd), rotated keys
    and the values into the caches (nkv, capacity, hd) at slots meta[0] + row. q_weight / k_weight:
    Qwen3's per-head norms (None: no norm); cos / sin (positions, hd) fp32, gathered by positions (R,)."""
    R = qkv.shape[0]
    norm = q_weight is not None
    _qkv_kernel[(R, n_heads + 2 * n_kv)](
        qkv, q_out, k_cache, v_cache, q_weight if norm else cos, k_weight if norm else cos, cos, sin, positions, meta, eps,
        qkv.stride(0), q_out.stride(0), k_cache.stride(0), k_cache.stride(1),
        NH=n_heads, NKV=n_kv, HD=head_dim, NORM=norm, num_warps=1,
    )  # fmt: skip
    return q_out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    R, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty(R, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(R, triton.cdiv(inter, block))](gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block, num_warps=_warps(block))
    return out


class Kernels:
    """The Triton side of one FixedRunner: the attention's workspace and output buffer, and, with
    `fused`, the element-wise work between the GEMMs (the methods model.Transformer.fixed_body calls);
    with `gemm` too, the GEMMs themselves with that work in them (`linear`)."""

    def __init__(
        self,
        rows: int,
        args,
        capacity: int,
        dtype: torch.dtype,
        device,
        fused: bool,
        row_group: int = 1,
        split: int | None = None,
        gemm: bool = False,
        gemm_parts: int = 1,
    ):
        if gemm and not fused:
            raise ValueError("our GEMMs (CudaForward.gemm) take the element-wise work the fused kernels do: they need fused")
        if gemm_parts < 1:
            raise ValueError(f"our GEMMs take K in at least one part, got {gemm_parts}")
        self.gemm, self.gemm_parts = gemm, gemm_parts
        self.multiprocessors = multiprocessors(device)
        G = args.n_heads // args.n_kv_heads
        self.ws = Workspace(rows, args.n_kv_heads, G, args.head_dim, capacity, device, SPLIT if split is None else split)
        self.out = torch.empty(rows, args.n_heads, args.head_dim, dtype=dtype, device=device)
        self.fused = fused
        if row_group < 1:
            raise ValueError(f"an attention program serves at least one row, got {row_group}")
        self.row_group = row_group

    def attention(self, q, k_cache, v_cache, inputs) -> torch.Tensor:
        return attention(q.contiguous(), k_cache, v_cache, inputs.path, inputs.plen, inputs.meta, self.out, self.ws, self.row_group)

    rmsnorm = staticmethod(rmsnorm)
    silu_mul = staticmethod(silu_mul)

    def linear(self, x, weight, bias=None, norm=None, eps: float = 1e-6, residual=None, silu: bool = False):
        """Our GEMM at the fixed forward's configuration (gemm_config), with its prologue and epilogue; K
        in gemm_parts parts where the linear's column programs are fewer than the device's multiprocessors."""
        config = gemm_config(x.dtype, silu)
        n_out = weight.shape[0] // 2 if silu else weight.shape[0]
        if self.gemm_parts > 1 and triton.cdiv(n_out, config[0]) < self.multiprocessors:
            config = (*config[:4], self.gemm_parts)
        return linear(x, weight, bias, config, norm, eps, residual, silu)

    def qkv_rope(self, qkv, att, k_cache, v_cache, rope, inputs, args) -> torch.Tensor:
        """The fused q|k|v projection's output split, normed (Qwen3), rotated and written: returns q."""
        q = torch.empty(qkv.shape[0], args.n_heads, args.head_dim, dtype=qkv.dtype, device=qkv.device)
        norm = args.qk_norm
        return qkv_rope(
            qkv, q, k_cache, v_cache, att.q_norm.weight if norm else None, att.k_norm.weight if norm else None,
            args.rms_norm_eps, rope.cos, rope.sin, inputs.positions, inputs.meta, args.n_heads, args.n_kv_heads, args.head_dim,
        )  # fmt: skip


# ------------------------------------------------------------------------------ GEMMs of our own
#
# The fixed forward's linears run torch's GEMM (cuBLAS on CUDA) at the one row count, with the
# element-wise work between them in the kernels above: at the 8B shape some 200 small launches a step
# beside the GEMMs, which alone were 1.16x the HBM limit (docs/gpu.md). A GEMM of our own takes that
# work into its prologue and epilogue (CudaForward.gemm: the `fixed-gemm` forward): the RMSNorm
# before a linear (its weight multiplied into the input as it is loaded, the row's 1/RMS, summed over
# the same loads, applied to the products: a row's scale commutes with the product), the residual add
# after one, SiLU times up after the gate|up linear. A layer then runs four GEMMs, the q|k|v kernel and
# the attention's two: seven launches instead of ten. Each program computes all rows of BLOCK_N output
# columns over the whole K in one fixed order (no split of K, no atomics), so a row's bits depend on
# its own input row, the weights and its place in the tile; the last is the hardware's (the tensor
# cores' products), which the GPU check checks on the device, as it does for torch's GEMM. The
# rounding follows the torch ops replaced: each result rounded to the dtype where they round, but for
# the norm, whose normalised input is not rounded before the product (its weight's product is).

# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) configurations gpu_check's `gemm` part times: the
# two the fixed-gemm forward runs in 16 bits (gemm_config), two wider tiles, and K cut in 2 and 4 parts.
# A GEMM of 64 rows streams its weights, and at 64 columns a program the 8B shape's output and down
# products (4,096 columns) run 64 programs on the H200's 132 SMs: K in parts runs 2 or 4 times the
# programs, each a fixed range of K, then a second kernel sums a row's parts in order (exact as the
# one-part GEMM is: a row's bits depend on its own input, the weights and its place in the tile).
LINEAR_CONFIGS = ((32, 128, 8, 3, 1), (64, 128, 8, 3, 1), (64, 256, 4, 3, 1), (128, 128, 8, 3, 1), (64, 128, 8, 3, 2), (64, 128, 8, 3, 4))


# Multiprocessors where the device has none to ask (Triton's interpreter, a compile without a GPU): the H200's
H200_MULTIPROCESSORS = 132


def multiprocessors(device) -> int:
    """The device's streaming multiprocessors (programs that run at once, a program each)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_MULTIPROCESSORS


def gemm_config(dtype: torch.dtype, silu: bool) -> tuple[int, int, int, int, int]:
    """The fixed-gemm forward's configuration for a linear, until a device has ranked them: the widest
    tile that compiles for sm_90 without spilling registers (tests/cuda/triton_compiled.py), K in one part:
    SiLU's two accumulators take half the columns; fp32's tiles take twice the registers and shared memory."""
    if dtype == torch.float32:
        return (32, 64, 8, 3, 1)
    return (32, 128, 8, 3, 1) if silu else (64, 128, 8, 3, 1)


@triton.jit
def _linear_epilogue(
    acc, acc_up, ss, rows, cols, rmask, cmask, b_ptr, res_ptr, out_ptr, K, eps, stride_res, stride_out,
    BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    """What follows the products: NORM's 1/RMS onto them, + b (BIAS), SiLU(gate) times up (SILU), + res
    (RESIDUAL), each rounded to out's dtype where torch rounds; stored."""
    dt = out_ptr.dtype.element_ty
    if NORM:
        scale = 1.0 / tl.sqrt(ss / K + eps)
        acc = acc * scale[:, None]
        acc_up = acc_up * scale[:, None]
    if BIAS:
        acc = acc + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    omask = rmask[:, None] & cmask[None, :]
    y = acc.to(dt)
    if SILU:
        gate = y.to(tl.float32)
        up = acc_up.to(dt).to(tl.float32)
        y = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt)
    if RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=omask, other=0.0)
        y = (res.to(tl.float32) + y.to(tl.float32)).to(dt)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=omask)


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, res_ptr, out_ptr, part_ptr, M, N, K, UP, K_PART, eps,
    stride_x, stride_w, stride_res, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """out[:, cols] = x @ w[cols].T for this program's BLOCK_N columns, K in BLOCK_K steps in order; with
    NORM, x's rows RMS-normed with weight g first (g folded into the loads, 1/RMS onto the products);
    then + b (BIAS); with SILU, SiLU(that) times the same of w's rows UP + cols (gate|up: out has N = UP
    columns); with RESIDUAL, res + that (the residual stream). Each rounded to out's dtype where torch rounds.
    SPLIT_K > 1: this program takes part program_id(1) of K (K_PART elements, a multiple of BLOCK_K) and
    writes its fp32 sums to part_ptr ([SPLIT_K] x (products, up's products, the squares' sums by row));
    _linear_parts_kernel adds the parts in order and finishes."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    wcols = cols.to(tl.int64)  # a weight's offsets: past 2^31 elements for a large vocabulary's LM head
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    k_lo = tl.program_id(1) * K_PART
    k_hi = tl.minimum(K, k_lo + K_PART)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + ks
        kmask = kk < k_hi
        x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
            g = tl.load(g_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            x = (xf * g[None, :]).to(w_ptr.dtype.element_ty)
        wmask = kmask[:, None] & cmask[None, :]
        w = tl.load(w_ptr + wcols[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        if SILU:
            wu = tl.load(w_ptr + (UP + wcols)[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0)
            if IEEE:
                acc_up = tl.dot(x, wu, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(x, wu, acc_up)
    if SPLIT_K == 1:
        _linear_epilogue(
            acc, acc_up, ss, rows, cols, rmask, cmask, b_ptr, res_ptr, out_ptr, K, eps, stride_res, stride_out,
            BIAS, NORM, RESIDUAL, SILU,
        )  # fmt: skip
    else:
        # this part's sums, at [part, products | up's products | squares' sums]; padding rows and
        # columns are written too (zeros: masked loads), so the second kernel reads no unwritten memory
        base = part_ptr + tl.program_id(1) * (2 * BLOCK_M * N + BLOCK_M)
        at = rows[:, None] * N + cols[None, :]
        inside = cmask[None, :] & (rows[:, None] < BLOCK_M)
        tl.store(base + at, acc, mask=inside)
        if SILU:
            tl.store(base + BLOCK_M * N + at, acc_up, mask=inside)
        if NORM:
            if tl.program_id(0) == 0:  # every column program sums the same squares: one writes them
                tl.store(base + 2 * BLOCK_M * N + rows, ss)


@triton.jit
def _linear_parts_kernel(
    part_ptr, b_ptr, res_ptr, out_ptr, M, N, K, eps, stride_res, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    """_linear_kernel's SPLIT_K parts of K added for this program's BLOCK_N columns in part order (fp32),
    then its epilogue: a row's sums depend on its own parts only."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    at = rows[:, None] * N + cols[None, :]
    inside = cmask[None, :] & (rows[:, None] < BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for part in range(SPLIT_K):
        base = part_ptr + part * (2 * BLOCK_M * N + BLOCK_M)
        acc += tl.load(base + at, mask=inside, other=0.0)
        if SILU:
            acc_up += tl.load(base + BLOCK_M * N + at, mask=inside, other=0.0)
        if NORM:
            ss += tl.load(base + 2 * BLOCK_M * N + rows)
    _linear_epilogue(
        acc, acc_up, ss, rows, cols, rmask, cmask, b_ptr, res_ptr, out_ptr, K, eps, stride_res, stride_out,
        BIAS, NORM, RESIDUAL, SILU,
    )  # fmt: skip


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu: bool = False,
) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T (+ bias) in x's dtype, fp32 accumulation (exact fp32 products for fp32
    inputs), by _linear_kernel at `config` (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K; None:
    gemm_config's; SPLIT_K > 1: K in that many parts, added in order by _linear_parts_kernel). norm: an RMSNorm's
    weight (K,) applied to x's rows first (eps its epsilon); silu: weight is gate|up (2I, K), the result
    SiLU(gate) * up (M, I); residual (M, N): the result added to it."""
    if not isinstance(weight, torch.Tensor):  # a packed layout (kernels.formats: the CPU kernels' own)
        raise ValueError(f"linear: a weight tensor, not {type(weight).__name__}")
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or weight.dtype != x.dtype:
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype} against weight {tuple(weight.shape)} {weight.dtype}")
    if silu and (N % 2 or bias is not None):
        raise ValueError("linear: silu takes a gate|up weight of an even row count and no bias")
    up = N // 2 if silu else 0
    n_out = up if silu else N
    if residual is not None and residual.shape != (M, n_out):
        raise ValueError(f"linear: a residual of {(M, n_out)}, got {tuple(residual.shape)}")
    block_n, block_k, warps, stages, split_k = config or gemm_config(x.dtype, silu)
    if split_k < 1:
        raise ValueError(f"linear: K in at least one part, got {split_k}")
    # K's parts: whole blocks each, none empty (fewer parts where K has fewer blocks)
    blocks = triton.cdiv(K, block_k)
    split_k = min(split_k, blocks)
    k_part = triton.cdiv(blocks, split_k) * block_k
    split_k = triton.cdiv(K, k_part)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(M))
    parts = torch.empty(split_k, 2 * block_m * n_out + block_m, dtype=torch.float32, device=x.device) if split_k > 1 else out
    flags = dict(BIAS=bias is not None, NORM=norm is not None, RESIDUAL=residual is not None, SILU=silu)
    b = bias if bias is not None else w
    res = residual if residual is not None else out
    _linear_kernel[(triton.cdiv(n_out, block_n), split_k)](
        x, w, b, norm if norm is not None else w, res, out, parts,
        M, n_out, K, up, k_part, eps,
        x.stride(0), w.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, IEEE=x.dtype == torch.float32,
        num_warps=warps, num_stages=stages, **flags,
    )  # fmt: skip
    if split_k > 1:
        _linear_parts_kernel[(triton.cdiv(n_out, block_n),)](
            parts, b, res, out, M, n_out, K, eps, residual.stride(0) if residual is not None else 0, out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split_k, num_warps=4, **flags,
        )  # fmt: skip
    return out
