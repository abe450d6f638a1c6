"""The fixed-shape forward (dart_core/fixed_shape.py) on CUDA: whether its Triton kernels run here, with
how many rows an attention program, built for a cache (`kernels_for`), and the forward captured as a
CUDA graph (`capture_graph`). FixedRunner imports this only where fixed_shape.cuda_asked says so."""

from __future__ import annotations

import os

import torch

from .config import CudaForward, default_row_group


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1, set before it is first
    imported): on a CPU's tensors, slowly, which is how the tests run the kernels without a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_kernels_here(device: torch.device, use: bool | None) -> bool:
    """Whether the Triton kernels (triton_kernels.py) run on `device`: use None takes them on CUDA where
    Triton imports, False never, True demands them (and on a CPU runs them in Triton's interpreter)."""
    device = torch.device(device)
    where = device.type == "cuda" or (bool(use) and device.type == "cpu" and triton_interpreting())
    return where and use is not False and triton_available()


def kernel_head_dim(head_dim: int) -> bool:
    """Whether the Triton attention takes this head dim: a power of two, at least 16."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


# The CUDA compute capabilities where a device run showed the grouped attention exact: a verified node's
# bits equal its one-token step's at every place of the tile (the GPU check's fixed-grouped path,
# bitwise on the tiny targets in bf16/fp16/fp32 and at the 8B shape). (9, 0): the H200 run of
# 2026-11-29 (docs/results/gpu-h200-2026-11-29.json). A kind not listed runs a program a row until a
# run there shows the same.
GROUPED_EXACT_CAPABILITIES = frozenset({(9, 0)})


def row_group_here(setting: int | None, group: int, device: torch.device, dtype: torch.dtype) -> int:
    """Rows an attention program serves for CudaForward.row_group = `setting` on `device`: the setting
    where given; None: default_row_group(group) for a 16-bit model on a CUDA device of a kind in
    GROUPED_EXACT_CAPABILITIES, else 1 (a program a row, exact on any hardware; in fp32 the grouped
    tile spills registers, tests/cuda/triton_compiled.py)."""
    if setting is not None:
        if setting < 1:
            raise ValueError(f"an attention program serves at least one row, got row_group={setting}")
        return setting
    device = torch.device(device)
    sixteen = dtype in (torch.bfloat16, torch.float16)
    if sixteen and device.type == "cuda" and torch.cuda.get_device_capability(device) in GROUPED_EXACT_CAPABILITIES:
        return default_row_group(group)
    return 1


def settings(model) -> CudaForward:
    """The model's CudaForward (Transformer.cuda_forward; None: the defaults)."""
    return model.cuda_forward or CudaForward()


def row_group_on(model, device: torch.device) -> int:
    """Rows an attention program of the model's fixed forward serves on this device (its row_group
    resolved by row_group_here)."""
    a = model.args
    return row_group_here(settings(model).row_group, a.n_heads // a.n_kv_heads, device, model.tok_embeddings.weight.dtype)


def kernels_for(model, cache, rows: int, device: torch.device):
    """The Triton kernels of the model's fixed forward at `rows` rows into `cache` on `device`
    (triton_kernels.Kernels), or None where they do not run (the torch reference then); a RuntimeError
    where the model's CudaForward demands them (kernels=True) and they cannot run."""
    cfg = settings(model)
    if not (triton_kernels_here(device, cfg.kernels) and kernel_head_dim(model.args.head_dim)):
        if cfg.kernels:
            raise RuntimeError(
                "CudaForward(kernels=True) needs Triton on CUDA (or its interpreter, TRITON_INTERPRET=1) and a power-of-two head dim >= 16"
            )
        return None
    from . import triton_kernels

    dtype = model.tok_embeddings.weight.dtype
    return triton_kernels.Kernels(
        rows, model.args, cache.k.shape[3], dtype, device, cfg.fused, row_group_on(model, device), cfg.split,
        gemm=cfg.gemm, gemm_parts=cfg.gemm_parts,
    )  # fmt: skip


def capture_graph(body, device: torch.device):
    """body() captured as a CUDA graph: warmed up twice on a side stream first (Triton compiles, cuBLAS
    settles its workspace). Returns (graph, body's outputs: static buffers each replay rewrites). The
    tests replace it (tests/cuda/graph_replay.py), so callers read it through this module."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = body()
    return graph, outputs
