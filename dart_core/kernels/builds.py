"""The extension's builds (setup.py: one per instruction set): which exist, which this CPU runs, the one
in use (`PATH`, `AVAILABLE`, `_ext`: chosen at import, switched by `use_path`; the package reads them
from here), and what it offers (`bf16_arithmetic`, `describe`)."""

from __future__ import annotations

import importlib
import importlib.util
import os

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


def read_bandwidth(mib: int = 256, repeats: int = 9) -> float:
    """This machine's read bandwidth in GB/s, as the weights of a step see it: the fastest of `repeats`
    passes of torch's sum over `mib` MiB of fp32 (far past the caches) on the threads in use. With the
    bytes a step streams it gives the step's memory limit (the bench records both). The fastest pass,
    not the median: a limit is what the memory can give, and a shared host's other tenants only ever
    slow a pass (a median once read 12.3 GB/s at the end of a bench whose one-token steps streamed the
    weights at ~20)."""
    import time

    a = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    a.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return a.numel() * 4 / min(times) / 1e9


def describe() -> str:
    """One line naming the kernel build in use, for logs, the bench's environment and the app's header."""
    if not AVAILABLE:
        return "no CPU kernels (eager torch path)"
    forced = os.environ.get(ENV, "").strip().lower()
    return f"{PATH} kernels" + (f" (forced by {ENV})" if forced and forced != "auto" else "")
