"""Whole forwards in one extension call: the target's decoder layers (LayerStack) and a DART head's
draft forward (draft_forward, KernelHead.draft)."""

from __future__ import annotations

import torch

from . import builds
from .attention import RopeTable, RowsAttention, TreeAttention
from .builds import _need_ext
from .formats import DTYPES, PackedWeight
from .ops import _code


def plan_fields(w: torch.Tensor | PackedWeight, dtype: torch.dtype) -> list[int]:
    """A weight as the C++ plans take it (LayerStack, KernelHead.draft): format code, data pointer, row
    bytes. A float weight must be a contiguous `dtype` tensor (the activations' dtype)."""
    if isinstance(w, PackedWeight):
        return [w.code, w.data.data_ptr(), w.data.shape[1]]
    if w.dtype != dtype or not w.is_contiguous():
        raise ValueError(f"weights must be contiguous {dtype} tensors or BlockWeights, got {w.dtype}")
    return [DTYPES[dtype], w.data_ptr(), w.shape[1] * w.element_size()]


class LayerStack:
    """The decoder layers of a model as one kernel call per forward (`layers_forward` in the C++):
    the per-op loop of `Transformer._forward_kernels` (add + norm, q|k|v, tree attention, o, add +
    norm, gate|up, silu * up, down) run in C++ with the same kernels in the same order, so the same
    bits, without the ~100 us of Python and allocation per layer that cost ~3 ms of a 9-15 ms forward
    of the 30-layer embedded target. Built once per model from its layers' weights (the plan holds
    raw pointers: `stale()` says when the model's tensors were replaced); Qwen3's q/k norms are not in
    it (such models keep the per-op loop)."""

    def __init__(self, layers, dtype: torch.dtype, eps: float, intermediate: int):
        _need_ext()
        rows, keep = [], []

        def weight(lin) -> list[int]:
            keep.append(lin.weight.data)  # the storage, kept alive even if the module's tensor is replaced
            return plan_fields(lin.weight, dtype)

        for layer in layers:
            att, ffn = layer.attention, layer.feed_forward
            bias = att.wqkv.bias
            if bias is not None:
                keep.append(bias.data)
            norms = (layer.attention_norm.weight, layer.ffn_norm.weight)
            for t in (bias, *norms):
                if t is not None and (t.dtype != dtype or not t.is_contiguous()):
                    raise ValueError(f"LayerStack: biases and norm weights must be contiguous {dtype} tensors")
            keep.extend(t.data for t in norms)
            rows.append(
                [
                    *weight(att.wqkv),
                    0 if bias is None else bias.data_ptr(),
                    *weight(att.wo),
                    *weight(ffn.w13),
                    *weight(ffn.w2),
                    norms[0].data_ptr(),
                    norms[1].data_ptr(),
                ]
            )
        self.plan = torch.tensor(rows, dtype=torch.int64)
        if self.plan.shape[1] != builds._ext.PLAN_FIELDS:
            raise RuntimeError(f"LayerStack: the plan has {self.plan.shape[1]} fields, the extension wants {builds._ext.PLAN_FIELDS}")
        self._keep, self._layers = keep, layers
        self._ends = self._end_pointers()
        self.dtype, self.code, self.eps, self.intermediate = dtype, DTYPES[dtype], float(eps), intermediate

    def _end_pointers(self) -> tuple[int, int]:
        first, last = self._layers[0].attention.wqkv.weight, self._layers[-1].feed_forward.w2.weight
        return (first.data.data_ptr(), last.data.data_ptr())

    def stale(self) -> bool:
        """Whether the model's weights moved since the plan was built (`model.to()`, a reload): checked
        on the first and last layer's weights, which every whole-model conversion moves, at ~1 us a
        forward instead of ~100 us for every tensor. A single weight swapped for another tensor after
        the first forward is not seen (the plan keeps the old storage alive, so it is never a dangling
        pointer): the model's own code never does that; `Transformer.reset_layer_stack()` rebuilds."""
        return self._end_pointers() != self._ends

    def __call__(
        self,
        x: torch.Tensor,
        attention: "TreeAttention | RowsAttention",
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x (T, H) embeddings; k_cache, v_cache (L, *attention.cache_shape) views whose layers are a
        fixed stride apart: (L, nkv, capacity, hd) for a tree over one cache, (L, B, nkv, capacity, hd)
        for rows of separate sequences. Returns (residual before the last MLP output, that output, the
        residual at the input of each layer in `capture`, concatenated (T, len(capture) * H), or None)."""
        T, H = x.shape
        if x.dtype != self.dtype or T != attention.T or attention.dtype != self.dtype:
            raise ValueError(f"LayerStack: x must be ({attention.T}, H) {self.dtype}, got {tuple(x.shape)} {x.dtype}")
        L = self.plan.shape[0]
        shape = (L, *attention.cache_shape)
        for c in (k_cache, v_cache):
            if tuple(c.shape) != shape or c.dtype != attention.cache_dtype or not c[0].is_contiguous():
                raise ValueError(f"LayerStack: caches must be ({shape}) {attention.cache_dtype} with contiguous layers")
        if k_cache.stride() != v_cache.stride():
            raise ValueError("LayerStack: the k and v caches must have one layout")
        tree = isinstance(attention, TreeAttention)
        x = x.contiguous().clone()
        pending = torch.empty_like(x)
        capture = tuple(sorted(capture))  # columns in layer order, as the per-op loop appends them
        cap_idx = torch.tensor(capture, dtype=torch.int64)
        captured = torch.empty(T, len(capture) * H, dtype=x.dtype) if capture else None
        builds._ext.layers_forward(
            self.code,
            attention.cache_code,
            self.plan.data_ptr(),
            L,
            T,
            H,
            self.intermediate,
            attention.n_heads,
            attention.n_kv_heads,
            attention.hd,
            self.eps,
            attention.rope.cos.data_ptr(),
            attention.rope.sin.data_ptr(),
            attention.positions.data_ptr(),
            attention.parents.data_ptr() if tree else 0,
            attention.committed if tree else 0,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.stride(0),
            0 if tree else k_cache.stride(1),
            attention.capacity,
            x.data_ptr(),
            pending.data_ptr(),
            cap_idx.data_ptr(),
            len(capture),
            0 if captured is None else captured.data_ptr(),
        )
        return x, pending, captured


def draft_fields() -> int:
    """How many int64 fields the extension's draft_forward plan has (KernelHead builds it)."""
    _need_ext()
    return int(builds._ext.DRAFT_FIELDS)


def draft_forward(
    plan: torch.Tensor, S: int, masks: int, H: int, I: int, Vd: int, nh: int, nkv: int, hd: int, eps: float, double_norm: bool,
    aux: torch.Tensor, emb: torch.Tensor, rope: RopeTable, P: int, k_cache: torch.Tensor, v_cache: torch.Tensor, logits: torch.Tensor,
) -> None:  # fmt: skip
    """A DART head's draft forward in one call (see csrc/stack.cpp draft_forward_impl and KernelHead.draft):
    aux (S, 3H), emb (S, H), k_cache / v_cache (nkv, capacity, hd) of the head's one layer, logits
    (masks + 1, Vd) written; all contiguous, of one dtype."""
    code = _code(aux)
    for t in (emb, k_cache, v_cache, logits):
        if t.dtype != aux.dtype or not t.is_contiguous():
            raise ValueError("draft_forward: aux, emb, the caches and logits must be contiguous tensors of one dtype")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3 or logits.shape != (masks + 1, Vd):
        raise ValueError("draft_forward: caches (nkv, capacity, hd) and logits (masks + 1, Vd)")
    builds._ext.draft_forward(
        code, plan.data_ptr(), S, masks, H, I, Vd, nh, nkv, hd, float(eps), bool(double_norm), aux.data_ptr(), emb.data_ptr(),
        rope.cos.data_ptr(), rope.sin.data_ptr(), P, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], logits.data_ptr(),
    )  # fmt: skip
