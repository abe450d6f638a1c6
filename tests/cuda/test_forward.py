"""dart_core/cuda's settings, read without a GPU: the attention's row groups by device kind
(forward.row_group_here), CudaForward's checks, and the forward paths' names as the GPU check's command
line spells them (config.from_path)."""

from __future__ import annotations

import pytest
import torch

from dart_core.cuda import forward
from dart_core.cuda.config import CudaForward, default_row_group, from_path, known_path


def test_rows_are_grouped_by_default_only_where_a_device_run_showed_it_exact(monkeypatch):
    """CudaForward.row_group None groups an attention program's rows (config.default_row_group) for a
    16-bit model on the CUDA kinds in GROUPED_EXACT_CAPABILITIES (the H200's sm_90); a program a row in
    fp32, on other GPUs and on a CPU (Triton's interpreter); a setting is taken as given, and one below
    1 is an error."""
    capability = {"now": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    cuda, cpu, bf16 = torch.device("cuda", 0), torch.device("cpu"), torch.bfloat16
    assert forward.GROUPED_EXACT_CAPABILITIES == {(9, 0)}
    assert forward.row_group_here(None, 4, cuda, bf16) == 4 == default_row_group(4)  # Qwen3-8B: 16 query rows a tile
    assert forward.row_group_here(None, 3, cuda, torch.float16) == 5  # SmolLM2: 15
    assert forward.row_group_here(None, 4, cuda, torch.float32) == 1
    capability["now"] = (8, 0)  # an A100: not shown yet
    assert forward.row_group_here(None, 4, cuda, bf16) == 1
    assert forward.row_group_here(None, 4, cpu, bf16) == 1
    assert forward.row_group_here(16, 4, cpu, bf16) == 16 and forward.row_group_here(1, 4, cuda, bf16) == 1
    with pytest.raises(ValueError, match="at least one row"):
        forward.row_group_here(0, 4, cuda, bf16)


def test_a_cuda_forward_refuses_what_no_kernel_runs():
    with pytest.raises(ValueError, match="at least one row"):
        CudaForward(row_group=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        CudaForward(split=96)
    with pytest.raises(ValueError, match="need fused"):
        CudaForward(fused=False, gemm=True)
    with pytest.raises(ValueError, match="at least one part"):
        CudaForward(gemm_parts=0)
    assert CudaForward().replace(split=128) == CudaForward(split=128)


def test_the_forward_paths_read_into_one_setting():
    """Each path sets the row group, split, fused work and GEMMs it names (None: the engine's own
    choice); a -split-S ending or the command line's split where the path names none; fixed-gemm-kP
    K in P parts; the names nobody runs are refused."""
    G = 4  # Qwen3-8B: 32 query heads over 8 key-value heads
    got = {}
    paths = ("fixed", "fixed-ungrouped", "fixed-grouped", "fixed-grouped-16", "fixed-gemm", "fixed-attn", "fixed-torch", "eager")
    for path in (*paths, "fixed-split-128", "fixed-grouped-16-split-64", "fixed-attn-split-256", "fixed-gemm-split-64"):
        c = from_path(path, G)
        got[path] = (c.row_group, c.split, c.fused, c.gemm)
    assert got == {
        "fixed": (None, None, True, False), "fixed-ungrouped": (1, None, True, False), "fixed-grouped": (4, None, True, False),
        "fixed-grouped-16": (16, None, True, False), "fixed-gemm": (None, None, True, True), "fixed-attn": (1, None, False, False),
        "fixed-torch": (1, None, True, False), "eager": (1, None, True, False), "fixed-split-128": (None, 128, True, False),
        "fixed-grouped-16-split-64": (16, 64, True, False), "fixed-attn-split-256": (1, 256, False, False),
        "fixed-gemm-split-64": (None, 64, True, True),
    }  # fmt: skip
    assert from_path("fixed-torch", G).kernels is False and from_path("fixed", G).kernels is None
    assert from_path("fixed-gemm", G).gemm_parts == 1 and from_path("fixed", G) == CudaForward()
    for path, split in (("fixed-gemm-k2", None), ("fixed-gemm-k4-split-128", 128)):
        c = from_path(path, G)
        assert (c.gemm, c.gemm_parts, c.split, c.row_group) == (True, int(path[12]), split, None)
    assert (from_path("fixed-grouped", G, split=256).row_group, from_path("fixed-grouped", G, split=256).split) == (4, 256)
    assert from_path("fixed-split-64", G, split=256).split == 64  # the path's own split first
    for bad in ("fixed-grouped-0", "fixed-grouped-x", "fixed-row", "fixed-split-32", "fixed-split-100", "eager-split-64",
                "fixed-gemm-k0", "fixed-gemm-kx"):  # fmt: skip
        assert not known_path(bad)
        with pytest.raises(ValueError, match="unknown forward path"):
            from_path(bad, G)
