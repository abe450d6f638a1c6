"""Attention with RoPE and the cache write in one call: a tree's rows over one cache (TreeAttention,
tree_attention) and one new row for each of B sequences (RowsAttention); the RoPE table they share."""

from __future__ import annotations

import math

import torch

from . import builds
from .formats import CACHE_DTYPES
from .ops import _code, _rows


def _row_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """The address and row stride of q, k and v, as the attention kernels take them."""
    return q.data_ptr(), _rows(q, "q"), k.data_ptr(), _rows(k, "k"), v.data_ptr(), _rows(v, "v")


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


class _AttentionPlan:
    """What TreeAttention and RowsAttention share: a layer's call checks only what can differ between
    layers (its tensors' dtypes and shapes) against the geometry checked once per forward."""

    dtype: torch.dtype
    cache_dtype: torch.dtype
    cache_shape: tuple[int, ...]
    q_shape: tuple[int, int]
    kv_shape: tuple[int, int]
    T: int
    n_heads: int
    hd: int

    def _output(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """Check one layer's tensors; the (T, nh*hd) output to fill."""
        dt = self.dtype
        if not (q.dtype == k.dtype == v.dtype == dt):
            raise TypeError(f"q, k and v must all be {dt}")
        if not (k_cache.dtype == v_cache.dtype == self.cache_dtype):
            raise TypeError(f"the caches must be {self.cache_dtype}")
        if q.shape != self.q_shape or k.shape != self.kv_shape or v.shape != self.kv_shape:
            raise ValueError(
                f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)}: expected {self.q_shape}/{self.kv_shape}/{self.kv_shape}"
            )
        if (
            k_cache.shape != self.cache_shape
            or v_cache.shape != self.cache_shape
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        ):
            raise ValueError(f"k_cache and v_cache must be contiguous {self.cache_shape} tensors")
        return torch.empty(self.T, self.n_heads * self.hd, dtype=dt)

    def _set_dtypes(self, dtype: torch.dtype, cache_dtype: torch.dtype | None) -> None:
        """The activations' and the cache's dtypes and their codes: the same dtype, or an fp16 cache
        beside fp32 activations (CACHE_DTYPES); cache_dtype None: `dtype`."""
        cache_dtype = dtype if cache_dtype is None else cache_dtype
        if cache_dtype != dtype and cache_dtype not in CACHE_DTYPES.get(dtype, ()):
            raise TypeError(f"a {cache_dtype} KV cache beside {dtype} activations: the cache is of their dtype, or float16 beside float32")
        self.code, self.cache_code = _code(torch.empty(0, dtype=dtype)), _code(torch.empty(0, dtype=cache_dtype))
        self.dtype, self.cache_dtype = dtype, cache_dtype

    def _rope_args(self) -> tuple[int, int, int]:
        return self.rope.cos.data_ptr(), self.rope.sin.data_ptr(), self.positions.data_ptr()

    def _head_args(self, out: torch.Tensor) -> tuple:
        """The heads' geometry, the softmax scale and the output, as the attention kernels take them."""
        nh, hd = self.n_heads, self.hd
        return nh, self.n_kv_heads, hd, 1.0 / math.sqrt(hd), out.data_ptr(), nh * hd


class TreeAttention(_AttentionPlan):
    """One forward's attention geometry, checked once for all its layers.

    positions (T,) int64 rope positions; parents (T,) int64, parents[i] < i (-1 for the root);
    `committed` cache entries precede the new rows; activations of `dtype`, caches of `cache_shape`
    (nkv, capacity, hd) and `cache_dtype` (default: `dtype`). Calling it runs one layer (see
    `tree_attention`); a layer's call checks only what can differ between layers (its tensors' dtypes
    and shapes), so the per-layer cost is the C++ call."""

    def __init__(
        self,
        rope: RopeTable,
        positions: torch.Tensor,
        parents: torch.Tensor,
        committed: int,
        n_heads: int,
        n_kv_heads: int,
        cache_shape: tuple[int, int, int],
        dtype: torch.dtype,
        cache_dtype: torch.dtype | None = None,
    ):
        T = positions.shape[0] if positions.dim() == 1 else -1
        if positions.shape != (T,) or parents.shape != (T,) or positions.dtype != torch.long or parents.dtype != torch.long:
            raise ValueError("positions and parents must be (T,) int64 tensors")
        nkv, self.capacity, hd = cache_shape
        if nkv != n_kv_heads:
            raise ValueError(f"the cache holds {nkv} KV heads, the model {n_kv_heads}")
        self._set_dtypes(dtype, cache_dtype)
        self.cache_shape = tuple(cache_shape)
        self.positions, self.parents = positions.contiguous(), parents.contiguous()
        self.committed, self.T, self.n_heads, self.n_kv_heads, self.hd = committed, T, n_heads, n_kv_heads, hd
        self.q_shape, self.kv_shape = (T, n_heads * hd), (T, nkv * hd)
        rope.ensure(int(self.positions.max()) + 1)
        self.rope = rope

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        out = self._output(q, k, v, k_cache, v_cache)
        heads = self._head_args(out)
        builds._ext.tree_attention(self.code, self.cache_code, *_row_args(q, k, v), *self._rope_args(), k_cache.data_ptr(),
                                   v_cache.data_ptr(), self.capacity, self.committed, self.T, self.parents.data_ptr(), *heads)  # fmt: skip
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
    k_cache / v_cache (nkv, capacity, hd) contiguous, of q's dtype or float16 beside float32 q: row i's
    key and value are written at slot committed+i; parents (T,) int64, parents[i] < i (-1 for the
    root). Row i attends to slots 0..committed-1, its ancestors' slots root first, then its own.
    Returns (T, nh*hd). A forward over many layers builds one `TreeAttention` instead (the same call,
    checked once).
    """
    if q.dim() != 2:
        raise ValueError(f"q must be (T, n_heads*head_dim), got {tuple(q.shape)}")
    plan = TreeAttention(rope, positions, parents, committed, n_heads, n_kv_heads, tuple(k_cache.shape), q.dtype, k_cache.dtype)
    return plan(q, k, v, k_cache, v_cache)


class RowsAttention(_AttentionPlan):
    """One forward's attention for B separate sequences, one new row each (continuous batching,
    `Transformer.decode_rows`), its geometry checked once for all layers.

    committed (B,) int64: sequence b's committed length, which is also its new row's position and
    cache slot; caches of `cache_shape` (B, nkv, capacity, hd) and `cache_dtype` (default: the
    activations' `dtype`), sequence b's in [b].
    Calling it runs one layer: q (B, nh*hd), k and v (B, nkv*hd), before RoPE; row b's key and value
    are written at slot committed[b] of cache b. Row b runs exactly the arithmetic of a one-token
    `TreeAttention` call on cache b alone (the C++ shares the code), so a sequence decoded beside
    others gets the bits plain decoding gives it, and no padding to the longest one is computed."""

    def __init__(
        self,
        rope: RopeTable,
        committed: torch.Tensor,
        n_heads: int,
        n_kv_heads: int,
        cache_shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        cache_dtype: torch.dtype | None = None,
    ):
        B, nkv, self.capacity, hd = cache_shape
        if committed.shape != (B,) or committed.dtype != torch.long:
            raise ValueError(f"committed must be a ({B},) int64 tensor, one length per cache row")
        if nkv != n_kv_heads or n_heads % nkv:
            raise ValueError(f"the cache holds {nkv} KV heads; the model has {n_heads} query and {n_kv_heads} KV heads")
        self.positions = committed.contiguous().cpu()
        if B and (int(self.positions.min()) < 0 or int(self.positions.max()) >= self.capacity):
            raise ValueError(f"every sequence needs a free cache slot: lengths {self.positions.tolist()}, capacity {self.capacity}")
        self._set_dtypes(dtype, cache_dtype)
        self.cache_shape = tuple(cache_shape)
        self.T, self.n_heads, self.n_kv_heads, self.hd = B, n_heads, n_kv_heads, hd
        self.q_shape, self.kv_shape = (B, n_heads * hd), (B, nkv * hd)
        rope.ensure(int(self.positions.max()) + 1 if B else 1)
        self.rope = rope

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        out = self._output(q, k, v, k_cache, v_cache)
        heads = self._head_args(out)
        builds._ext.rows_attention(self.code, self.cache_code, *_row_args(q, k, v), *self._rope_args(), k_cache.data_ptr(),
                                   v_cache.data_ptr(), k_cache.stride(0), self.capacity, self.T, *heads)  # fmt: skip
        return out
