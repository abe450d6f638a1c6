"""How the fixed-shape forward runs on CUDA: one typed setting (CudaForward), and the names of the forward
paths a command line spells (`fixed`, `fixed-grouped-16-split-64`, ...) read into it at the edge.

A model carries its CudaForward as `Transformer.cuda_forward` (None: the defaults below); the forward
(dart_core/cuda/forward.py) reads it when it builds a cache's kernels and graph, and builds them again
when it changes. Every setting is exact (a verified node keeps its one-token step's bits); they differ
in speed, which only a device can rank (the GPU check, dart_core/cuda/check/, times them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Keys of a chunk of the Triton attention (triton_kernels.BLOCK): a split holds whole chunks.
SPLIT_UNIT = 64


def default_row_group(group: int) -> int:
    """Rows an attention program serves when rows are grouped (triton_kernels._group_split_kernel): enough
    that their queries (G = query heads a key-value head each) fill a 16-row tile, the smallest
    tensor-core product, so a committed chunk read once serves them all."""
    return max(1, 16 // group)


def valid_split(keys: int) -> bool:
    """Keys a split may hold: whole chunks of SPLIT_UNIT keys (triton_kernels.Workspace refuses the rest)."""
    return keys >= SPLIT_UNIT and keys % SPLIT_UNIT == 0


@dataclass(frozen=True)
class CudaForward:
    """kernels: the attention (and the work between the GEMMs) as Triton kernels and the forward
    captured as a CUDA graph: None where Triton imports on CUDA, False the torch reference (not
    captured), True demanded (on a CPU, Triton's interpreter, uncaptured: how the tests run them).
    fused: the element-wise work between the GEMMs in Triton kernels too (False: torch ops there, the
    attention alone in Triton). row_group: rows an attention program serves (1: a program a row; more:
    the rows share each committed chunk's read, exact where a dot product gives a row the same bits at
    any place of its tile, which only a GPU run shows); None: grouped (default_row_group) on the GPU
    kinds where a run showed it exact, else 1 (forward.row_group_here). split: keys an attention
    program reads at most (a multiple of SPLIT_UNIT; None: triton_kernels.SPLIT); it sets how many
    programs a short context's step spreads over. gemm: the linears by our Triton GEMM with the
    element-wise work in its prologue and epilogue (triton_kernels.linear; needs fused), off by default
    until a device times it against torch's. gemm_parts: with gemm, K in this many parts for the
    linears whose column programs are fewer than the device's multiprocessors (1: one part)."""

    kernels: bool | None = None
    fused: bool = True
    row_group: int | None = None
    split: int | None = None
    gemm: bool = False
    gemm_parts: int = 1

    def __post_init__(self):
        if self.row_group is not None and self.row_group < 1:
            raise ValueError(f"an attention program serves at least one row, got row_group={self.row_group}")
        if self.split is not None and not valid_split(self.split):
            raise ValueError(f"a split holds a multiple of {SPLIT_UNIT} keys, got {self.split}")
        if self.gemm_parts < 1:
            raise ValueError(f"K in at least one part, got gemm_parts={self.gemm_parts}")
        if self.gemm and not self.fused:
            raise ValueError("our GEMMs (gemm) take the element-wise work the fused kernels do: they need fused")

    def replace(self, **changes) -> "CudaForward":
        return dataclasses.replace(self, **changes)


# The forward paths by name; also fixed-grouped-N, fixed-gemm-kP, and a -split-S ending. `eager` is
# not a CudaForward: the caller turns the fixed-shape forward off (Transformer.fixed_rows = 0).
PATHS = ("fixed", "fixed-ungrouped", "fixed-grouped", "fixed-gemm", "fixed-attn", "fixed-torch", "eager")
SPLIT_MARK = "-split-"  # a path's attention split: fixed-split-128, fixed-grouped-16-split-64
NO_TRITON = ("fixed-torch", "eager")  # paths whose attention is not the Triton kernels': no split to set
GEMM_PARTS_MARK = "fixed-gemm-k"  # fixed-gemm-kP: our GEMMs with K in P parts where a linear's programs are few
PATH_HELP = (
    "fixed: the fixed-shape forward as the engine runs it on this device (on CUDA: Triton attention and fused "
    "element-wise kernels, a CUDA graph; rows grouped in the attention where the device is known exact with it); "
    "fixed-ungrouped: the same with a program a row; fixed-grouped: 16 query rows a program; fixed-grouped-N: N rows "
    "a program; fixed-gemm: our Triton GEMMs with the element-wise work in them; fixed-gemm-kP: the same with K in "
    "P parts where a linear's programs are few; fixed-attn: torch ops between the GEMMs, the attention alone in "
    "Triton; fixed-torch: the torch reference attention, not captured; eager: plain torch. Any path on the Triton "
    "attention may end in -split-S: S keys an attention program (a multiple of 64)"
)


def split_of(path: str) -> tuple[str, int | None]:
    """'fixed-grouped-16-split-128' -> ('fixed-grouped-16', 128); a path without a split -> (path, None)."""
    base, mark, n = path.rpartition(SPLIT_MARK)
    if not mark:
        return path, None
    return base, int(n) if n.isdigit() else -1


def gemm_parts_of(path: str) -> int | None:
    """'fixed-gemm-k2' -> 2 (CudaForward.gemm_parts); any other path -> None ('fixed-gemm-kx' -> -1)."""
    if not path.startswith(GEMM_PARTS_MARK):
        return None
    n = path.removeprefix(GEMM_PARTS_MARK)
    return int(n) if n.isdigit() else -1


def known_path(path: str) -> bool:
    """A forward path of PATHS, fixed-grouped-N (N rows an attention program, N >= 1) or fixed-gemm-kP (K
    in P >= 1 parts); a path on the Triton attention may end in -split-S (S keys a split: a multiple of 64)."""
    path, split = split_of(path)
    base, _, n = path.rpartition("-")
    if split is not None and (path in NO_TRITON or not valid_split(split)):
        return False
    parts = gemm_parts_of(path)
    if parts is not None:
        return parts >= 1
    return path in PATHS or (base == "fixed-grouped" and n.isdigit() and int(n) >= 1)


def from_path(path: str, group: int, split: int | None = None) -> CudaForward:
    """The CudaForward a forward path names (PATH_HELP), for a model whose key-value heads serve `group`
    query heads each (fixed-grouped's rows a program); split: the keys a program where the path names none
    (None: the default)."""
    if not known_path(path):
        raise ValueError(
            f"unknown forward path {path!r}: from {', '.join(PATHS)} or fixed-grouped-N or fixed-gemm-kP, each maybe with -split-S"
        )
    path, own_split = split_of(path)
    parts = gemm_parts_of(path)
    if parts is not None:
        path = "fixed-gemm"
    if path in ("fixed", "fixed-gemm"):
        row_group = None
    elif path == "fixed-grouped":
        row_group = default_row_group(group)
    elif path.startswith("fixed-grouped-"):
        row_group = int(path.rpartition("-")[2])
    else:
        row_group = 1
    return CudaForward(
        kernels=False if path == "fixed-torch" else None,
        fused=path != "fixed-attn",
        row_group=row_group,
        split=own_split or split or None,
        gemm=path == "fixed-gemm",
        gemm_parts=parts or 1,
    )
