"""The per-op kernels: linear (every weight format), silu_mul, add_rmsnorm."""

from __future__ import annotations

import torch

from . import builds
from .formats import DTYPES, PackedWeight, supports

# Largest number of new rows (tree nodes) a forward sends through the kernels. The linear streams the
# weights once per call and computes rows in the core, so it is the fast path for decode-sized
# batches; longer runs (prompt prefill) go to torch's GEMMs, which no exactness argument needs.
MAX_ROWS = 64


def _code(t: torch.Tensor) -> int:
    if t.device.type != "cpu" or t.dtype not in DTYPES:
        raise TypeError(f"CPU kernels take float32/bfloat16/float16 CPU tensors, got {t.dtype} on {t.device}")
    return DTYPES[t.dtype]


def _rows(t: torch.Tensor, name: str) -> int:
    """Row stride of a 2-D tensor whose rows are contiguous."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D with contiguous rows, got shape {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias (N,) -> (M, N) in x's dtype. A float weight has x's dtype; a
    BlockWeight or InterleavedBF16 takes x of any float dtype (each row converted to fp32 first, as
    for float weights)."""
    code = _code(x)
    M, K = x.shape
    if isinstance(weight, PackedWeight):
        N, fmt, w, row_bytes = weight.rows, weight.code, weight.data, weight.data.shape[1]
        if weight.cols != K:
            raise ValueError(f"{weight.fmt} weight of width {weight.cols} against x of width {K}")
    else:
        N = weight.shape[0]
        if weight.dtype != x.dtype or not weight.is_contiguous() or weight.shape[1] != K:
            raise ValueError(f"weight must be a contiguous ({N}, {K}) {x.dtype} tensor, got {tuple(weight.shape)} {weight.dtype}")
        fmt, w, row_bytes = code, weight, K * weight.element_size()
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({N},) {x.dtype} tensor")
    out = torch.empty(M, N, dtype=x.dtype)
    builds._ext.linear(
        code, x.data_ptr(), _rows(x, "x"), M, K, fmt, w.data_ptr(), row_bytes, N, 0 if bias is None else bias.data_ptr(), out.data_ptr(), N
    )
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
    builds._ext.silu_mul(code, gu.data_ptr(), _rows(gu, "gu"), M, two_i // 2, out.data_ptr())
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
    builds._ext.add_rmsnorm(
        code,
        x.data_ptr(),
        0 if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        M,
        H,
        float(eps),
        x_out.data_ptr(),
        normed.data_ptr(),
    )
    return x_out, normed
