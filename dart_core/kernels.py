"""Batch-invariant CPU kernels for the target's decode and tree-verify forwards (C++: csrc/cpu_kernels.cpp).

A tree verify is lossless bit for bit only if every node's logits equal those of the one-token step
plain decoding would run at that position. torch's CPU matmuls choose kernels by row count (in bf16 a
1-row down-projection sums in another order than a 2-row one) and SDPA over a tree mask sums a node's
keys at other offsets than a one-token call, so the eager path parts in the last bit. These kernels
compute every output element with one fixed sequence of fp32 operations that depends only on that
row's own inputs, and attention over each node's logical key sequence (committed prefix, ancestors
by depth, itself), so a row's result never depends on how many rows run with it. They are also the
fast path: the linear streams each weight row once for all rows, and the attention call applies RoPE
and writes the cache itself.

    linear(x, weight, bias)      x (M, K) with unit inner stride -> (M, N), as F.linear
    silu_mul(gu)                 gu (M, 2I) gate|up -> (M, I), silu(gate) * up
    add_rmsnorm(x, delta, w)     x + delta and RMSNorm of it (the residual add fused with the next norm)
    tree_attention(...)          one layer's attention for T new rows, see the function
    TreeAttention(...)           the same, its geometry checked once for a forward's layers
    decode_attention(...)        one query row for each of B sequences with their own caches (batched generation)

All tensors live on the CPU in float32, bfloat16 or float16. `AVAILABLE` is False where the extension
was not built (no compiler); the model then runs its eager path (exact in fp32 only up to rounding).
"""

from __future__ import annotations

import math

import torch

try:
    from . import _cpu_kernels as _ext
except ImportError:  # built optionally (setup.py); the eager path remains
    _ext = None

AVAILABLE = _ext is not None
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Largest number of new rows (tree nodes) a forward sends through the kernels. The linear streams the
# weights once per call and computes rows in the core, so it is the fast path for decode-sized
# batches; longer runs (prompt prefill) go to torch's GEMMs, which no exactness argument needs.
MAX_ROWS = 64


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    return AVAILABLE and device.type == "cpu" and dtype in DTYPES


def _code(t: torch.Tensor) -> int:
    if t.device.type != "cpu" or t.dtype not in DTYPES:
        raise TypeError(f"CPU kernels take float32/bfloat16/float16 CPU tensors, got {t.dtype} on {t.device}")
    return DTYPES[t.dtype]


def _rows(t: torch.Tensor, name: str) -> int:
    """Row stride of a 2-D tensor whose rows are contiguous."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D with contiguous rows, got shape {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias (N,) -> (M, N) in x's dtype."""
    code = _code(x)
    M, K = x.shape
    N = weight.shape[0]
    if weight.dtype != x.dtype or not weight.is_contiguous() or weight.shape[1] != K:
        raise ValueError(f"weight must be a contiguous ({N}, {K}) {x.dtype} tensor, got {tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({N},) {x.dtype} tensor")
    out = torch.empty(M, N, dtype=x.dtype)
    _ext.linear(code, x.data_ptr(), _rows(x, "x"), M, K, weight.data_ptr(), N, 0 if bias is None else bias.data_ptr(), out.data_ptr(), N)
    return out


def apply_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x), through `linear` where it applies (CPU, no autograd, 2-D x of <= MAX_ROWS rows
    with contiguous rows), else through torch. For the draft heads: speed only, no exactness claim."""
    w = module.weight
    if (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and supports(w.dtype, w.device)
        and x.dtype == w.dtype
        and (x.shape[1] == 1 or x.stride(1) == 1)
        and w.is_contiguous()
        and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
    ):
        return linear(x, w, module.bias)
    return module(x)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu (M, 2I) = gate | up -> silu(gate) * up (M, I), each op rounded to gu's dtype."""
    code = _code(gu)
    M, two_i = gu.shape
    if two_i % 2:
        raise ValueError(f"gate|up width must be even, got {two_i}")
    out = torch.empty(M, two_i // 2, dtype=gu.dtype)
    _ext.silu_mul(code, gu.data_ptr(), _rows(gu, "gu"), M, two_i // 2, out.data_ptr())
    return out


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta (M, H) -> (x + delta, weight * rmsnorm(x + delta)); delta None skips the add.

    The eager equivalent is `h = x + delta; weight * F.rms_norm(h.float(), (H,), eps=eps).to(h.dtype)`."""
    code = _code(x)
    M, H = x.shape
    if not x.is_contiguous() or (delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or not delta.is_contiguous())):
        raise ValueError("x and delta must be contiguous (M, H) tensors of one dtype")
    if weight.shape != (H,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous ({H},) {x.dtype} tensor")
    x_out = torch.empty_like(x)
    normed = torch.empty_like(x)
    _ext.add_rmsnorm(code, x.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(), M, H, float(eps), x_out.data_ptr(), normed.data_ptr())
    return x_out, normed


class RopeTable:
    """cos / sin (positions, head_dim/2) in fp32 for every position below `len(self)`, grown on demand.

    One table per model: a position's angles are computed once, so a row's RoPE never depends on
    which other positions ran with it."""

    def __init__(self, inv_freq: torch.Tensor, scale: float):
        self.inv_freq = inv_freq.float().cpu()
        self.scale = scale
        self.cos = self.sin = torch.empty(0, self.inv_freq.numel())

    def __len__(self) -> int:
        return self.cos.shape[0]

    def ensure(self, n: int) -> None:
        if n <= len(self):
            return
        n = max(n, 2 * len(self), 256)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        self.cos = (freqs.cos() * self.scale).contiguous()
        self.sin = (freqs.sin() * self.scale).contiguous()


class TreeAttention:
    """One forward's attention geometry, checked once for all its layers.

    positions (T,) int64 rope positions; parents (T,) int64, parents[i] < i (-1 for the root);
    `committed` cache entries precede the new rows; caches of `cache_shape` (nkv, capacity, hd) and
    `dtype`. Calling it runs one layer (see `tree_attention`); a layer's call checks only what can
    differ between layers (its tensors' dtypes and shapes), so the per-layer cost is the C++ call."""

    def __init__(self, rope: RopeTable, positions: torch.Tensor, parents: torch.Tensor, committed: int,
                 n_heads: int, n_kv_heads: int, cache_shape: tuple[int, int, int], dtype: torch.dtype):
        T = positions.shape[0] if positions.dim() == 1 else -1
        if positions.shape != (T,) or parents.shape != (T,) or positions.dtype != torch.long or parents.dtype != torch.long:
            raise ValueError("positions and parents must be (T,) int64 tensors")
        nkv, self.capacity, hd = cache_shape
        if nkv != n_kv_heads:
            raise ValueError(f"the cache holds {nkv} KV heads, the model {n_kv_heads}")
        self.code = _code(torch.empty(0, dtype=dtype))
        self.dtype, self.cache_shape = dtype, tuple(cache_shape)
        self.positions, self.parents = positions.contiguous(), parents.contiguous()
        self.committed, self.T, self.n_heads, self.n_kv_heads, self.hd = committed, T, n_heads, n_kv_heads, hd
        self.q_shape, self.kv_shape = (T, n_heads * hd), (T, nkv * hd)
        rope.ensure(int(self.positions.max()) + 1)
        self.rope = rope

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        dt = self.dtype
        if not (q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == dt):
            raise TypeError(f"q, k, v and the caches must all be {dt}")
        if q.shape != self.q_shape or k.shape != self.kv_shape or v.shape != self.kv_shape:
            raise ValueError(f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)}: expected {self.q_shape}/{self.kv_shape}/{self.kv_shape}")
        if k_cache.shape != self.cache_shape or v_cache.shape != self.cache_shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError(f"k_cache and v_cache must be contiguous {self.cache_shape} tensors")
        nh, hd = self.n_heads, self.hd
        out = torch.empty(self.T, nh * hd, dtype=dt)
        _ext.tree_attention(
            self.code,
            q.data_ptr(), _rows(q, "q"), k.data_ptr(), _rows(k, "k"), v.data_ptr(), _rows(v, "v"),
            self.rope.cos.data_ptr(), self.rope.sin.data_ptr(), self.positions.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), self.capacity, self.committed, self.T, self.parents.data_ptr(),
            nh, self.n_kv_heads, hd, 1.0 / math.sqrt(hd), out.data_ptr(), nh * hd,
        )
        return out


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: RopeTable,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    committed: int,
    parents: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
) -> torch.Tensor:
    """One layer's attention for T new rows after `committed` cache entries.

    q (T, nh*hd), k and v (T, nkv*hd): rows contiguous, q and k before RoPE; positions (T,) int64;
    k_cache / v_cache (nkv, capacity, hd) contiguous: row i's key and value are written at slot
    committed+i; parents (T,) int64, parents[i] < i (-1 for the root). Row i attends to slots
    0..committed-1, its ancestors' slots root first, then its own. Returns (T, nh*hd). A forward over
    many layers builds one `TreeAttention` instead (the same call, checked once).
    """
    if q.dim() != 2:
        raise ValueError(f"q must be (T, n_heads*head_dim), got {tuple(q.shape)}")
    plan = TreeAttention(rope, positions, parents, committed, n_heads, n_kv_heads, tuple(k_cache.shape), q.dtype)
    return plan(q, k, v, k_cache, v_cache)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, n_heads: int) -> torch.Tensor:
    """One layer's attention for one new row of each of B sequences (continuous batching).

    q (B, nh*hd) with contiguous rows, RoPE applied; k_cache / v_cache (B, nkv, capacity, hd)
    contiguous, the new rows' keys and values already written; lengths (B,) int64, the keys visible to
    each sequence (its new row's included). Returns (B, nh*hd). Each sequence reads only its own
    lengths[b] keys (no padding to the longest, no copy of the cache)."""
    code = _code(q)
    B, nkv, cap, hd = k_cache.shape
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError("q and the caches must share one dtype")
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (B, nkv, capacity, head_dim) tensors")
    if q.shape != (B, n_heads * hd) or n_heads % nkv:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)} with {n_heads} heads")
    if lengths.shape != (B,) or lengths.dtype != torch.long:
        raise ValueError("lengths must be a (B,) int64 tensor")
    lengths = lengths.contiguous().cpu()
    out = torch.empty(B, n_heads * hd, dtype=q.dtype)
    _ext.decode_attention(code, q.data_ptr(), _rows(q, "q"), k_cache.data_ptr(), v_cache.data_ptr(), cap, lengths.data_ptr(),
                          B, n_heads, nkv, hd, 1.0 / math.sqrt(hd), out.data_ptr(), n_heads * hd)
    return out
