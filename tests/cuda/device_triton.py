"""The GPU's own Triton, beside the test extra's, for the sm_90 compile check (tests/cuda/triton_compiled.py).

A GPU image runs the kernels through the Triton it ships (the H200 image's 3.6.0, with its ptxas; the
GPU check's env stage records the version a run saw, and its --targets says when it is not
dart_core/cuda/check/report.py's COMPILE_CHECK_TRITON), while CI's interpreter tests need the test
extra's (>= 3.9: 3.6's interpreter fails under numpy 2.4). A compiler's version decides what lowers and
how many registers a kernel takes, so the compile check runs under both: the GPU's is installed here,
outside the venv, as a folder put first on PYTHONPATH for that run only (PyPI's wheel, no dependencies:
torch is the venv's).

    python tests/cuda/device_triton.py            # install it if missing (seconds and ~190 MB of PyPI once)
    python tests/cuda/device_triton.py --check    # say where it is; exit 1 if it is not there
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from dart_core.cuda.check.report import COMPILE_CHECK_TRITON as VERSION
from dart_core.loading import cache_root

_MARK = ".installed"


def folder() -> Path:
    """Where it lives: beside the embedded model's conversion and vLLM's venv (DART_CACHE_DIR)."""
    return cache_root() / f"triton-{VERSION}"


def installed() -> bool:
    return (folder() / _MARK).is_file() and (folder() / "triton" / "__init__.py").is_file()


def env() -> dict:
    """This process's environment, with the device's Triton first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder()), env.get("PYTHONPATH", "")) if p)
    return env


def install() -> Path:
    if installed():
        return folder()
    target = folder()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target), f"triton=={VERSION}"],
        check=True,
    )
    (target / _MARK).write_text(VERSION + "\n")
    return target


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        print(folder() if installed() else f"not installed: {folder()} (run: make triton-compile-check)")
        return 0 if installed() else 1
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        print("Triton has no wheel for this platform: the compile check skips here (tests/cuda/test_triton_kernels.py)")
        return 0
    print(f"the device's Triton {VERSION}: {install()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
