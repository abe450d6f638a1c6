"""The fixed-shape forward's attention as Triton kernels (CUDA), with the contract of dart_core/fixed.py.

Row r of a forward attends over its logical key sequence: the P committed keys in place, then its path
through this forward's pending keys (slots P + node). The keys are cut at fixed logical positions into
splits of SPLIT keys (one program each: row x key-value head x split), every split into chunks of BLOCK
keys read in order with an online softmax; a second kernel combines a row's splits in split order. Every
boundary is a logical position, and every chunk runs the same instructions (one tl.dot for the scores,
one for the values), so a node's output depends on its own sequence only: a verified node and its
one-token step (the same sequence, its ancestors by then committed) get the same bits, whatever the
other rows and wherever the keys sit in memory. The arithmetic differs from the torch reference in
fixed.py (an online softmax, tensor-core products), so the two are each exact on their own, not equal.

P and the number of real rows are read from a device tensor, and the grid is fixed by the cache's
capacity, so a forward using these kernels can be captured once as a CUDA graph and replayed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # keys a chunk
SPLIT = 512  # keys a split (a multiple of BLOCK)


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
    q = tl.load(q_ptr + r * stride_qr + (g * G + rows)[:, None] * HD + dims[None, :], mask=(rows < G)[:, None], other=0.0)
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
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)
    tl.store(acc_ptr + out[:, None] * HD + dims[None, :], acc)


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, o_ptr, NKV, NSPLIT, stride_or,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, NH: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)
    g = h // G
    j = h % G
    dims = tl.arange(0, HD)
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([HD], tl.float32)
    for s in range(0, NSPLIT):
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
    """The partial results of the split kernel for a fixed row count and cache capacity (reused, so a
    captured graph keeps its addresses)."""

    def __init__(self, rows: int, n_kv: int, group: int, head_dim: int, capacity: int, device):
        self.gp = max(16, triton.next_power_of_2(group))
        self.nsplit = triton.cdiv(capacity, SPLIT)
        n = rows * n_kv * self.nsplit * self.gp
        self.m = torch.empty(n, dtype=torch.float32, device=device)
        self.l = torch.empty(n, dtype=torch.float32, device=device)
        self.acc = torch.empty(n, head_dim, dtype=torch.float32, device=device)
        self.key = (rows, n_kv, group, head_dim, capacity, str(device))


def attention(q, k_cache, v_cache, path, plen, meta, out, ws: Workspace) -> torch.Tensor:
    """q (R, nh, hd) contiguous; k_cache / v_cache (nkv, capacity, hd) with this forward's keys at slots
    P + row; path (R, D) int32 tree nodes of each row's path in depth order, plen (R,) int32 their
    count, meta (2,) int32 = (P, real rows). Writes out (R, nh, hd) (zeros on padding rows)."""
    R, nh, hd = q.shape
    nkv = k_cache.shape[0]
    G = nh // nkv
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"the Triton attention needs a power-of-two head dim >= 16, got {hd}")
    ieee = q.dtype == torch.float32
    _split_kernel[(R, nkv, ws.nsplit)](
        q, k_cache, v_cache, path, plen, meta, ws.m, ws.l, ws.acc,
        hd**-0.5, nkv, ws.nsplit,
        q.stride(0), k_cache.stride(0), k_cache.stride(1),
        D=path.shape[1], G=G, GP=ws.gp, HD=hd, BLOCK_N=BLOCK, SPLIT_N=SPLIT, IEEE=ieee,
    )  # fmt: skip
    _combine_kernel[(R, nh)](ws.m, ws.l, ws.acc, out, nkv, ws.nsplit, out.stride(0), G=G, GP=ws.gp, HD=hd, NH=nh)
    return out
