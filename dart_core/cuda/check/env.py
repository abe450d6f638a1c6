"""The env stage: the device, torch, Triton, and the memory bandwidth a large copy and a reduction measure
(the HBM limit the big stage's step is held to)."""

from __future__ import annotations

import platform

import torch

import ngram_cpp

from .common import Report, timed_ms


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def stage_env(dev: torch.device, small: bool, rep: Report) -> dict:
    r = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(dev),
        "ngram_cpp_built": ngram_cpp.HAVE_CPP,
        "triton": triton_version(),  # what compiles the kernels here (report.COMPILE_CHECK_TRITON: CI's compile check takes it)
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        r.update(name=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
    n = (2**24 if small else 2**31) // 2  # bf16 elements: 32 MiB / 4 GiB a buffer
    a = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    ms = timed_ms(lambda: b.copy_(a), dev, warmup=3, reps=10)
    r["copy_gb_s"] = round(2 * a.nbytes / ms / 1e6, 1)  # bytes read + written
    ms = timed_ms(lambda: a.sum(dtype=torch.float32), dev, warmup=3, reps=10)
    r["read_gb_s"] = round(a.nbytes / ms / 1e6, 1)  # a reduction reads each byte once
    a = b = None  # free the buffers
    rep.log(f"env: {r}")
    return r
