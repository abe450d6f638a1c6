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
up to rounding). `python -m dart_core.cli.kernels` prints what this machine has.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from dataclasses import dataclass

import torch

# Best first: each build needs the CPU features listed.
PATHS = {
    "avx512bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16", "avx512vnni", "avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"),
    "avx2": ("avx2", "fma"),
    "generic": (),
}
ENV = "DART_CPU_KERNELS"


def _import(path: str):
    try:
        return importlib.import_module(f"dart_core._cpu_kernels_{path}")
    except ImportError:
        return None


def cpu_features() -> dict[str, bool]:
    """The CPU features the builds need, as this CPU has them (empty without a generic build)."""
    generic = _import("generic")
    return dict(generic.cpu_features()) if generic is not None else {}


def built_paths() -> list[str]:
    """The builds present in this installation, best first."""
    return [p for p in PATHS if importlib.util.find_spec(f"dart_core._cpu_kernels_{p}") is not None]


def runnable_paths() -> list[str]:
    """The builds present that this CPU can run, best first."""
    feats = cpu_features()
    return [p for p in built_paths() if all(feats.get(f, False) for f in PATHS[p])]


def _choose():
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced != "auto":
        if forced not in PATHS:
            raise ImportError(f"{ENV}={forced!r}: choose one of {', '.join(PATHS)} or auto")
        if forced not in runnable_paths():
            why = (
                "was not built"
                if forced not in built_paths()
                else "needs CPU features this CPU lacks: " + ", ".join(f for f in PATHS[forced] if not cpu_features().get(f, False))
            )
            raise ImportError(f"{ENV}={forced}: the {forced} kernels {why}")
        return _import(forced)
    for p in runnable_paths():
        return _import(p)
    return None


_ext = _choose()
AVAILABLE = _ext is not None
PATH: str | None = _ext.PATH if _ext is not None else None
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# KV cache dtypes the attention takes beside activations of another dtype: an fp16 cache beside fp32
# activations (half the bytes a long context's attention reads; the GGUF paths with integer
# activations keep theirs so, see docs/engine.md). Otherwise the cache is of the activations' dtype.
CACHE_DTYPES = {torch.float32: (torch.float16,)}
# Weight formats the linear reads (codes of cpu_kernels.cpp WFormat): the float dtypes, GGUF blocks.
WEIGHT_FORMATS = {"float32": 0, "bfloat16": 1, "float16": 2, "Q4_0": 3, "Q4_1": 4, "Q8_0": 5, "BF16X16": 9}
# Largest number of new rows (tree nodes) a forward sends through the kernels. The linear streams the
# weights once per call and computes rows in the core, so it is the fast path for decode-sized
# batches; longer runs (prompt prefill) go to torch's GEMMs, which no exactness argument needs.
MAX_ROWS = 64
BLOCK_FORMATS = ("Q8_0", "Q4_0", "Q4_1")
# How block weights meet activations: "float" (exact: the fp32 values of the GGUF's dequantization),
# "int8" (activations quantized per block of 32 as llama.cpp does; integer dot products) or "int16"
# (quantized to 16 bits per block, held as two int8 digits: twice int8's integer dot products,
# ~256x finer; interleaved weights only). cpu_kernels.cpp's contracts q8, q8x16 and q16.
ACTIVATIONS = ("float", "int8", "int16")
QUANTIZED_ACTIVATIONS = ("int8", "int16")
X16_FORMATS = ("Q4_0", "Q4_1", "Q8_0")  # block formats that interleave 16 rows (BlockWeight.interleaved)
X16_CODE_OFFSET = 3  # Q4_0 -> Q4_0X16 (6), Q4_1 -> Q4_1X16 (7), Q8_0 -> Q8_0X16 (8) in the extension's format codes
BF16X16 = "BF16X16"  # bf16 with 16 rows interleaved element by element (InterleavedBF16)


class _PackedRows:
    """What BlockWeight and InterleavedBF16 share: a `rows` x `cols` weight stored in `data` (rows,
    row bytes) uint8 under the format name `fmt`, which stands where a tensor's dtype would."""

    rows: int
    cols: int
    data: torch.Tensor
    fmt: str

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def dtype(self) -> str:
        return self.fmt

    @property
    def device(self) -> torch.device:
        return self.data.device


@dataclass(frozen=True)
class BlockWeight(_PackedRows):
    """A weight of `rows` x `cols` elements stored as GGUF blocks: `data` (rows, row_bytes) uint8, one
    row per output feature, in `fmt` (Q8_0, Q4_0, Q4_1). Read by `linear` as it is; `dequantize`
    gives the exact fp32 values."""

    fmt: str
    rows: int
    cols: int
    data: torch.Tensor
    # "float": activations enter in fp32 against the exact dequantized values; "int8" / "int16":
    # activations are quantized per block and meet the codes in integer dot products (faster, not
    # exact; see ACTIVATIONS and the int8 sections of cpu_kernels.cpp).
    activations: str = "float"
    # "gguf": rows as the file stores them; "x16": 16 rows interleaved per block (against quantized
    # activations: one integer lane per weight row, see `interleaved` and cpu_kernels.cpp).
    layout: str = "gguf"

    def __post_init__(self):
        if self.fmt not in BLOCK_FORMATS:
            raise ValueError(f"block format {self.fmt!r}: supported are Q8_0, Q4_0, Q4_1")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r}: supported are {', '.join(ACTIVATIONS)}")
        if self.layout not in ("gguf", "x16"):
            raise ValueError(f"layout {self.layout!r}: 'gguf' or 'x16'")
        if self.layout == "x16" and (self.fmt not in X16_FORMATS or self.rows % 16 or self.activations not in QUANTIZED_ACTIVATIONS):
            raise ValueError(
                f"an interleaved weight is {'/'.join(X16_FORMATS)} in whole groups of 16 rows against int8 or int16 activations, "
                f"got {self.fmt} {self.rows} rows, {self.activations} activations"
            )
        if self.cols % 32:
            raise ValueError(f"a {self.fmt} row holds whole blocks of 32 elements, got {self.cols}")
        per_block = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[self.fmt]
        want = (self.rows, self.cols // 32 * per_block)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or not self.data.is_contiguous():
            raise ValueError(
                f"{self.fmt} weight of {self.rows}x{self.cols}: data must be contiguous uint8 {want}, "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        """Rows of several weights of one format and width stacked (q|k|v, gate|up), as torch.cat on dim 0."""
        if len({(p.fmt, p.cols) for p in parts}) != 1:
            raise ValueError("only weights of one block format and width stack")
        if len({p.activations for p in parts}) != 1:
            raise ValueError("only weights of one activation mode stack")
        if any(p.layout != "gguf" for p in parts):
            raise ValueError("interleaved weights do not stack: stack first, then interleave")
        return BlockWeight(
            parts[0].fmt, sum(p.rows for p in parts), parts[0].cols, torch.cat([p.data for p in parts]), parts[0].activations
        )

    def select_rows(self, index: torch.Tensor) -> "BlockWeight":
        if self.layout != "gguf":
            raise ValueError("select rows before interleaving")
        return BlockWeight(self.fmt, int(index.numel()), self.cols, self.data.index_select(0, index.cpu()).contiguous(), self.activations)

    def with_activations(self, activations: str) -> "BlockWeight":
        """The same blocks (shared storage) multiplied against `activations` (ACTIVATIONS)."""
        return BlockWeight(self.fmt, self.rows, self.cols, self.data, activations, self.layout)

    def interleaved(self) -> "BlockWeight":
        """The same bytes with every 16 rows interleaved block by block (layout "x16"), for quantized
        activations (int16 if the weight meets int16, else int8): per group of 16 rows and block, the
        16 fp16 scales, Q4_1's 16 minimums, then 4 chunks of 64 bytes (Q8_0: 8), chunk j holding code
        bytes 4j..4j+3 of each row in turn."""
        if self.layout != "gguf" or self.fmt not in X16_FORMATS or self.rows % 16:
            raise ValueError(
                f"interleave {'/'.join(X16_FORMATS)} weights of whole groups of 16 rows as stored, "
                f"got {self.fmt} {self.rows} rows ({self.layout})"
            )
        head = 4 if self.fmt == "Q4_1" else 2  # bytes of scale (+ minimum) before a block's code bytes
        code_bytes = 32 if self.fmt == "Q8_0" else 16
        nb, per = self.cols // 32, head + code_bytes
        blocks = self.data.view(self.rows // 16, 16, nb, per).permute(0, 2, 1, 3)  # (G, nb, 16 rows, per)
        parts = [blocks[..., 0:2].reshape(-1, nb, 32)]
        if head == 4:
            parts.append(blocks[..., 2:4].reshape(-1, nb, 32))
        chunks = code_bytes // 4
        codes = blocks[..., head:].reshape(-1, nb, 16, chunks, 4).permute(0, 1, 3, 2, 4).reshape(-1, nb, 64 * chunks)  # chunk, row, byte
        data = torch.cat(parts + [codes], dim=-1).reshape(self.rows, -1).contiguous()
        return BlockWeight(self.fmt, self.rows, self.cols, data, "int16" if self.activations == "int16" else "int8", "x16")

    @property
    def storage_code(self) -> int:
        """The extension's format code for the bytes alone: the block format and layout."""
        return WEIGHT_FORMATS[self.fmt] + (X16_CODE_OFFSET if self.layout == "x16" else 0)

    @property
    def code(self) -> int:
        """The extension's format code: storage_code with the activations' flag."""
        if self.activations == "int16" and self.layout != "x16":
            raise ValueError("int16 activations multiply interleaved weights: call .interleaved() first")
        flag = _ext.Q16_ACTIVATIONS if self.activations == "int16" else _ext.Q8_ACTIVATIONS if self.activations == "int8" else 0
        return self.storage_code | flag

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(n, cols) values of `rows` (int64 indices; None: all): the exact fp32 values, rounded once
        to `dtype` (float32, bfloat16, float16) in the same pass."""
        return _dequantize(self, rows, dtype)


def quantize_q8_0(w: torch.Tensor, activations: str = "int8") -> BlockWeight:
    """A float weight (N, K) as Q8_0 blocks, quantized as GGUF does (per block of 32: d = max|w| / 127,
    stored in fp16; codes round(w / d) with the fp32 d): for weights that need no exactness, such as a
    draft head's, where half the bytes of bf16 and integer dot products make a draft step cheaper."""
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"Q8_0 quantizes (N, K) weights with K a multiple of 32, got {tuple(w.shape)}")
    N, K = w.shape
    x = w.detach().to("cpu", torch.float32).reshape(N, K // 32, 32)
    d = x.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
    data = torch.cat((d.half().view(torch.uint8).reshape(N, K // 32, 2), q.view(torch.uint8)), dim=-1)
    return BlockWeight("Q8_0", N, K, data.reshape(N, -1).contiguous(), activations)


@dataclass(frozen=True)
class InterleavedBF16(_PackedRows):
    """A bf16 weight of `rows` x `cols` with every 16 rows interleaved element by element (format
    BF16X16 of cpu_kernels.cpp): `data` (rows, 2 * cols) uint8, per group of 16 rows and element k the
    16 rows' values (row r at position 2r for r < 8, 2(r - 8) + 1 above). For CPUs without bf16
    arithmetic (the AVX2 and AVX-512F builds): an input element broadcast meets 16 weight rows in one
    fma pair, so a 6-row verify costs little more than one row (docs/engine.md). Its outputs are one
    fma chain over k in order: other bits than the same weight as a bf16 tensor (the 16-lane
    contract), the same bits on every build. `from_tensor` builds it; `dequantize` gives the values."""

    rows: int
    cols: int
    data: torch.Tensor
    fmt = BF16X16

    def __post_init__(self):
        if self.rows % 16 or self.rows < 16 or self.cols < 1:
            raise ValueError(f"an interleaved bf16 weight holds whole groups of 16 rows, got {self.rows} x {self.cols}")
        want = (self.rows, 2 * self.cols)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or not self.data.is_contiguous():
            got = f"{self.data.dtype} {tuple(self.data.shape)}"
            raise ValueError(f"BF16X16 weight of {self.rows}x{self.cols}: data must be contiguous uint8 {want}, got {got}")

    # row order within a group's 16 positions: position p holds row ORDER[p]
    ORDER = (0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15)

    @staticmethod
    def from_tensor(w: torch.Tensor) -> "InterleavedBF16":
        """A (N, K) weight, N a multiple of 16, rounded to bf16 (exact for a bf16 tensor) and interleaved."""
        if w.dim() != 2 or w.shape[0] % 16:
            raise ValueError(f"interleave (N, K) weights with N a multiple of 16, got {tuple(w.shape)}")
        N, K = w.shape
        order = torch.tensor(InterleavedBF16.ORDER)
        g = w.detach().to("cpu", torch.bfloat16).reshape(N // 16, 16, K)[:, order].transpose(1, 2)  # (groups, K, 16)
        return InterleavedBF16(N, K, g.contiguous().view(torch.uint8).reshape(N, 2 * K))

    @property
    def storage_code(self) -> int:
        return WEIGHT_FORMATS[BF16X16]

    @property
    def code(self) -> int:
        return self.storage_code

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(n, cols) values of `rows` (int64 indices; None: all), exactly (float32, bfloat16) or rounded to float16."""
        return _dequantize(self, rows, dtype)


# Weights stored in a layout of their own (anything but a plain float tensor): `linear`, `plan_fields`
# and model.BlockLinear take them alike (rows, cols, data, code, dequantize).
PackedWeight = BlockWeight | InterleavedBF16


def _dequantize(w: PackedWeight, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    _need_ext()
    if dtype not in DTYPES:
        raise TypeError(f"dequantize to float32, bfloat16 or float16, not {dtype}")
    idx = None if rows is None else rows.reshape(-1).to("cpu", torch.long).contiguous()
    n = w.rows if idx is None else idx.numel()
    out = torch.empty(n, w.cols, dtype=dtype)
    rows_ptr = 0 if idx is None else idx.data_ptr()
    _ext.dequantize(w.storage_code, w.data.data_ptr(), w.data.shape[1], w.cols, w.rows, rows_ptr, n, out.data_ptr(), w.cols, DTYPES[dtype])
    return out


def use_path(path: str | None) -> str | None:
    """Switch this process to another build (None: the automatic choice); returns the previous one.
    For tests that run every path the CPU offers in one process; a forward in flight keeps its build."""
    global _ext, PATH, AVAILABLE
    previous = PATH
    if path is None:
        mod = next((_import(p) for p in runnable_paths()), None)
    elif path not in runnable_paths():
        raise ValueError(f"the {path} kernels are not runnable here (runnable: {', '.join(runnable_paths()) or 'none'})")
    else:
        mod = _import(path)
    _ext, PATH, AVAILABLE = mod, (mod.PATH if mod is not None else None), mod is not None
    return previous


def bf16_arithmetic() -> bool:
    """Whether the build in use multiplies bf16 in hardware (AVX512-BF16's vdpbf16ps). Without it a bf16
    model's linears read InterleavedBF16 copies of their weights (target.load_target)."""
    return AVAILABLE and bool(_ext.BF16_DOT)


def _need_ext():
    if _ext is None:
        raise RuntimeError("the dart_core CPU kernels are not built (pip install -e . builds them; see setup.py)")


def supports(dtype: torch.dtype | str, device: torch.device) -> bool:
    """Whether the kernels run weights of this dtype (or block format, e.g. "Q4_1", or BF16X16) on this device."""
    return AVAILABLE and device.type == "cpu" and (dtype in DTYPES or dtype in BLOCK_FORMATS or dtype == BF16X16)


def _code(t: torch.Tensor) -> int:
    if t.device.type != "cpu" or t.dtype not in DTYPES:
        raise TypeError(f"CPU kernels take float32/bfloat16/float16 CPU tensors, got {t.dtype} on {t.device}")
    return DTYPES[t.dtype]


def _row_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """The address and row stride of q, k and v, as the attention kernels take them."""
    return q.data_ptr(), _rows(q, "q"), k.data_ptr(), _rows(k, "k"), v.data_ptr(), _rows(v, "v")


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
    _ext.linear(
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
    _ext.add_rmsnorm(
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
        _ext.tree_attention(self.code, self.cache_code, *_row_args(q, k, v), *self._rope_args(), k_cache.data_ptr(), v_cache.data_ptr(),
                            self.capacity, self.committed, self.T, self.parents.data_ptr(), *heads)  # fmt: skip
        return out


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
        if self.plan.shape[1] != _ext.PLAN_FIELDS:
            raise RuntimeError(f"LayerStack: the plan has {self.plan.shape[1]} fields, the extension wants {_ext.PLAN_FIELDS}")
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
        _ext.layers_forward(
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
        _ext.rows_attention(self.code, self.cache_code, *_row_args(q, k, v), *self._rope_args(), k_cache.data_ptr(), v_cache.data_ptr(),
                            k_cache.stride(0), self.capacity, self.T, *heads)  # fmt: skip
        return out


def draft_fields() -> int:
    """How many int64 fields the extension's draft_forward plan has (KernelHead builds it)."""
    _need_ext()
    return int(_ext.DRAFT_FIELDS)


def draft_forward(
    plan: torch.Tensor, S: int, masks: int, H: int, I: int, Vd: int, nh: int, nkv: int, hd: int, eps: float, double_norm: bool,
    aux: torch.Tensor, emb: torch.Tensor, rope: RopeTable, P: int, k_cache: torch.Tensor, v_cache: torch.Tensor, logits: torch.Tensor,
) -> None:  # fmt: skip
    """A DART head's draft forward in one call (see cpu_kernels.cpp draft_forward and KernelHead.draft):
    aux (S, 3H), emb (S, H), k_cache / v_cache (nkv, capacity, hd) of the head's one layer, logits
    (masks + 1, Vd) written; all contiguous, of one dtype."""
    code = _code(aux)
    for t in (emb, k_cache, v_cache, logits):
        if t.dtype != aux.dtype or not t.is_contiguous():
            raise ValueError("draft_forward: aux, emb, the caches and logits must be contiguous tensors of one dtype")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3 or logits.shape != (masks + 1, Vd):
        raise ValueError("draft_forward: caches (nkv, capacity, hd) and logits (masks + 1, Vd)")
    _ext.draft_forward(
        code, plan.data_ptr(), S, masks, H, I, Vd, nh, nkv, hd, float(eps), bool(double_norm), aux.data_ptr(), emb.data_ptr(),
        rope.cos.data_ptr(), rope.sin.data_ptr(), P, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], logits.data_ptr(),
    )  # fmt: skip


def read_bandwidth(mib: int = 256, repeats: int = 9) -> float:
    """This machine's read bandwidth in GB/s, as the weights of a step see it: the median time of
    torch's sum over `mib` MiB of fp32 (far past the caches) on the threads in use. With the bytes a
    step streams it gives the step's memory limit (the bench records both)."""
    import statistics
    import time

    a = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    a.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return a.numel() * 4 / statistics.median(times) / 1e9


def describe() -> str:
    """One line naming the kernel build in use, for logs, the bench's environment and the app's header."""
    if not AVAILABLE:
        return "no CPU kernels (eager torch path)"
    forced = os.environ.get(ENV, "").strip().lower()
    return f"{PATH} kernels" + (f" (forced by {ENV})" if forced and forced != "auto" else "")


# python -m dart_core.kernels still runs the command line (dart_core/cli/kernels.py), with a RuntimeWarning from
# runpy (the package imports this module first): the documented command is python -m dart_core.cli.kernels.
if __name__ == "__main__":
    from .cli.kernels import main

    raise SystemExit(main())
