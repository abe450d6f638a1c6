"""Builds the two C++ extensions (the rest of the project is pure Python, see pyproject.toml):
ngram_cpp._ngram (n-gram trie, context index, tree pruner) and dart_core._cpu_kernels (the target's
batch-invariant decode / verify kernels)."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "ngram_cpp._ngram",
            sources=["ngram_cpp/src/ngram.cpp", "ngram_cpp/src/context.cpp", "ngram_cpp/src/pruner.cpp", "ngram_cpp/src/bindings.cpp"],
            include_dirs=["ngram_cpp/src"],
            depends=["ngram_cpp/src/ngram.h", "ngram_cpp/src/context.h", "ngram_cpp/src/pruner.h"],  # rebuild when a header changes
            cxx_std=17,
            extra_compile_args=["-O3"],  # no OpenMP: the pruner measured faster single-threaded (pruner.cpp)
            # Where no compiler is available (some hosted runtimes), install without the extension:
            # ngram_cpp then runs its pure-Python pruner and says so (ngram_cpp.HAVE_CPP, the app's header).
            # `make setup` checks that the extension was built.
            optional=True,
        ),
        Pybind11Extension(
            "dart_core._cpu_kernels",
            sources=["dart_core/csrc/cpu_kernels.cpp"],
            cxx_std=17,
            # -march=native: the extension is always compiled on the machine that runs it (pip install -e).
            # -ffp-contract=off: no fused or reordered float operations beyond the explicit fmaf calls, so
            # every output element follows the one fixed sequence the kernels spell out.
            # -fopenmp links libgomp.so.1, which resolves to the copy torch has loaded (one thread pool).
            extra_compile_args=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            # Without it the target runs its eager torch path (not batch-invariant; see dart_core/kernels.py).
            optional=True,
        ),
    ]
)
