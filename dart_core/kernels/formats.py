"""The weight formats the linear reads (codes of dart_core/csrc/formats.h WFormat) and the packed
weights: GGUF blocks (`BlockWeight`, as stored or 16 rows interleaved) and bf16 with 16 rows
interleaved (`InterleavedBF16`); the activation dtypes' codes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import builds
from .builds import _need_ext

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# KV cache dtypes the attention takes beside activations of another dtype: an fp16 cache beside fp32
# activations (half the bytes a long context's attention reads; the GGUF paths with integer
# activations keep theirs so, see docs/engine.md). Otherwise the cache is of the activations' dtype.
CACHE_DTYPES = {torch.float32: (torch.float16,)}
# Weight formats the linear reads (codes of csrc/formats.h WFormat): the float dtypes, GGUF blocks.
WEIGHT_FORMATS = {"float32": 0, "bfloat16": 1, "float16": 2, "Q4_0": 3, "Q4_1": 4, "Q8_0": 5, "BF16X16": 9}
BLOCK_FORMATS = ("Q8_0", "Q4_0", "Q4_1")
# How block weights meet activations: "float" (exact: the fp32 values of the GGUF's dequantization),
# "int8" (activations quantized per block of 32 as llama.cpp does; integer dot products) or "int16"
# (quantized to 16 bits per block, held as two int8 digits: twice int8's integer dot products,
# ~256x finer; interleaved weights only). The contracts q8 (csrc/linear_q8.cpp), q8x16 and q16 (csrc/linear_x16.cpp).
ACTIVATIONS = ("float", "int8", "int16")
QUANTIZED_ACTIVATIONS = ("int8", "int16")
X16_FORMATS = ("Q4_0", "Q4_1", "Q8_0")  # block formats that interleave 16 rows (BlockWeight.interleaved)
X16_CODE_OFFSET = 3  # Q4_0 -> Q4_0X16 (6), Q4_1 -> Q4_1X16 (7), Q8_0 -> Q8_0X16 (8) in the extension's format codes
BF16X16 = "BF16X16"  # bf16 with 16 rows interleaved element by element (InterleavedBF16)


def supports(dtype: torch.dtype | str, device: torch.device) -> bool:
    """Whether the kernels run weights of this dtype (or block format, e.g. "Q4_1", or BF16X16) on this device."""
    return builds.AVAILABLE and device.type == "cpu" and (dtype in DTYPES or dtype in BLOCK_FORMATS or dtype == BF16X16)


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
    # exact; see ACTIVATIONS, csrc/linear_q8.cpp and csrc/linear_x16.cpp).
    activations: str = "float"
    # "gguf": rows as the file stores them; "x16": 16 rows interleaved per block (against quantized
    # activations: one integer lane per weight row, see `interleaved` and csrc/linear_x16.cpp).
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
        flag = (
            builds._ext.Q16_ACTIVATIONS if self.activations == "int16" else builds._ext.Q8_ACTIVATIONS if self.activations == "int8" else 0
        )
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
    BF16X16 of csrc/linear_bf16.cpp): `data` (rows, 2 * cols) uint8, per group of 16 rows and element k the
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
    builds._ext.dequantize(
        w.storage_code, w.data.data_ptr(), w.data.shape[1], w.cols, w.rows, rows_ptr, n, out.data_ptr(), w.cols, DTYPES[dtype]
    )
    return out
