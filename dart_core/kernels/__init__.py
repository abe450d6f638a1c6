"""Batch-invariant CPU kernels for the target's decode and tree-verify forwards (C++: dart_core/csrc,
kernels.h for the overview).

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
    RowsAttention(...)           one new row for each of B sequences with their own caches (batched generation)

Weights are float32/bfloat16/float16 tensors or `BlockWeight`s: GGUF blocks (Q8_0, Q4_0, Q4_1) read
as stored and dequantized in registers to the exact fp32 values of the GGUF's own dequantization, so
a model on its GGUF blocks computes bit for bit what the same model computes on its fp32 copy. An
`InterleavedBF16` is a bf16 weight with 16 rows interleaved, for builds without bf16 arithmetic (one
fma chain per output: the same bits on every build). Activations are CPU tensors in float32, bfloat16
or float16.

The extension is built once per instruction set (setup.py); this module imports the best build the
CPU runs (`PATH`: avx512bf16 > avx512 > avx2 > generic). `DART_CPU_KERNELS=<path>` forces one (to test
a path on a CPU that has a better one). The generic, avx2 and avx512 builds give the same bits; the
avx512bf16 build differs from them for bf16 weights only (bf16 pair products in hardware). `AVAILABLE`
is False where no build exists (no compiler); the model then runs its eager path (exact in fp32 only

The package's modules: builds (finding, loading and choosing the extension build: `PATH`, `AVAILABLE`,
`use_path`), formats (the weight formats and packed weights), ops (linear, silu_mul, add_rmsnorm),
attention (RopeTable, TreeAttention, RowsAttention), stack (LayerStack and the draft forward's call).
`PATH`, `AVAILABLE` and `_ext` are read from builds on every access, so they always name the build in
use (use_path switches it).
"""

from __future__ import annotations

# `name as name`: the semi-private names that callers and tests use, re-exported as they were.
from . import builds
from .attention import RopeTable, RowsAttention, TreeAttention, tree_attention
from .attention import _AttentionPlan as _AttentionPlan
from .attention import _row_args as _row_args
from .builds import (
    ENV,
    PATHS,
    bf16_arithmetic,
    built_paths,
    cpu_features,
    describe,
    read_bandwidth,
    runnable_paths,
    use_path,
)
from .builds import _choose as _choose
from .builds import _import as _import
from .builds import _need_ext as _need_ext
from .formats import (
    ACTIVATIONS,
    BF16X16,
    BLOCK_FORMATS,
    CACHE_DTYPES,
    DTYPES,
    QUANTIZED_ACTIVATIONS,
    WEIGHT_FORMATS,
    X16_CODE_OFFSET,
    X16_FORMATS,
    BlockWeight,
    InterleavedBF16,
    PackedWeight,
    quantize_q8_0,
    supports,
)
from .formats import _dequantize as _dequantize
from .formats import _PackedRows as _PackedRows
from .ops import MAX_ROWS, add_rmsnorm, apply_linear, linear, silu_mul
from .ops import _code as _code
from .ops import _rows as _rows
from .stack import LayerStack, draft_fields, draft_forward, plan_fields

# The state use_path rebinds, kept in builds alone and read from there on each access (PEP 562).
_LIVE = ("_ext", "PATH", "AVAILABLE")


def __getattr__(name: str):
    if name in _LIVE:
        return getattr(builds, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LIVE})


__all__ = [
    "ACTIVATIONS",
    "AVAILABLE",
    "BF16X16",
    "BLOCK_FORMATS",
    "BlockWeight",
    "CACHE_DTYPES",
    "DTYPES",
    "ENV",
    "InterleavedBF16",
    "LayerStack",
    "MAX_ROWS",
    "PATH",
    "PATHS",
    "PackedWeight",
    "QUANTIZED_ACTIVATIONS",
    "RopeTable",
    "RowsAttention",
    "TreeAttention",
    "WEIGHT_FORMATS",
    "X16_CODE_OFFSET",
    "X16_FORMATS",
    "add_rmsnorm",
    "apply_linear",
    "bf16_arithmetic",
    "built_paths",
    "cpu_features",
    "describe",
    "draft_fields",
    "draft_forward",
    "linear",
    "plan_fields",
    "quantize_q8_0",
    "read_bandwidth",
    "runnable_paths",
    "silu_mul",
    "supports",
    "tree_attention",
    "use_path",
]
