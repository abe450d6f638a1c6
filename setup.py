"""Builds the two C++ extensions (the rest of the project is pure Python, see pyproject.toml):
ngram_cpp._ngram (n-gram trie, context index, tree pruner) and dart_core._cpu_kernels_* (the target's
batch-invariant decode / verify kernels, one build per instruction set)."""

import copy
import os
import platform

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

# dart_core._cpu_kernels_<path>: the sources of dart_core/csrc compiled once per instruction set (every
# translation unit with that build's flags), so that one build (a wheel, a Space image) runs on any
# x86-64 CPU: dart_core/kernels/builds.py imports the best build the CPU runs when it loads
# (DART_CPU_KERNELS forces one). Never -march=native: that ties a build to the machine that compiled
# it. Elsewhere (ARM) only the generic build.
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
KERNEL_PATHS = (
    {"generic": [], "avx2": AVX2, "avx512": AVX512, "avx512bf16": AVX512 + ["-mavx512bf16", "-mavx512vnni"]} if X86 else {"generic": []}
)


KERNEL_SOURCES = [
    f"dart_core/csrc/{name}.cpp"
    for name in (
        "bindings",
        "linear",
        "linear_float",
        "linear_q8",
        "linear_x16",
        "linear_bf16",
        "elementwise",
        "attention",
        "stack",
        "probe",
    )
]
KERNEL_HEADERS = [f"dart_core/csrc/{name}.h" for name in ("vec", "formats", "linear", "kernels")]


def cpu_kernel_builds():
    for path, isa in KERNEL_PATHS.items():
        yield Pybind11Extension(
            f"dart_core._cpu_kernels_{path}",
            sources=KERNEL_SOURCES,
            include_dirs=["dart_core/csrc"],
            depends=KERNEL_HEADERS,  # rebuild when a header changes
            cxx_std=17,
            define_macros=[("DART_KERNELS_MODULE", f"_cpu_kernels_{path}"), ("DART_KERNELS_PATH", f'"{path}"')],
            # -ffp-contract=off: no fused or reordered float operations beyond the explicit fma calls, so
            # every output element follows the one fixed sequence the kernels spell out.
            # -fopenmp links libgomp.so.1, which resolves to the copy torch has loaded (one thread pool).
            # -Wall -Wextra: the sources compile without a warning on every build.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fopenmp", "-Wall", "-Wextra", *isa],
            extra_link_args=["-fopenmp"],
            # Without it the target runs its eager torch path (not batch-invariant; see dart_core/kernels/__init__.py).
            optional=True,
        )


class ParallelBuildExt(build_ext):
    """build_ext compiling the extensions side by side, one compiler per core (`-j` still overrides):
    the four kernel builds are a ~30 s compile each, and `pip install -e .` and space.py would
    otherwise run them one after another. Each kernel build compiles the same sources with its own
    flags, so each gets its own object directory (in a shared one, builds running side by side would
    overwrite each other's objects and link them)."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext):
        if not ext.name.startswith("dart_core._cpu_kernels_"):
            return super().build_extension(ext)
        own = copy.copy(self)  # the builds run in threads: a copy with its build_temp, not a shared attribute
        own.build_temp = os.path.join(self.build_temp, ext.name.rsplit(".", 1)[1])
        return build_ext.build_extension(own, ext)


setup(
    cmdclass={"build_ext": ParallelBuildExt},
    ext_modules=[
        Pybind11Extension(
            "ngram_cpp._ngram",
            sources=[
                "ngram_cpp/src/ngram.cpp",
                "ngram_cpp/src/context.cpp",
                "ngram_cpp/src/pruner.cpp",
                "ngram_cpp/src/tree.cpp",
                "ngram_cpp/src/bindings.cpp",
            ],
            include_dirs=["ngram_cpp/src"],
            depends=[
                "ngram_cpp/src/ngram.h",
                "ngram_cpp/src/context.h",
                "ngram_cpp/src/pruner.h",
                "ngram_cpp/src/tree.h",
            ],  # rebuild when a header changes
            cxx_std=17,
            extra_compile_args=["-O3"],  # no OpenMP: the pruner measured faster single-threaded (pruner.cpp)
            # Where no compiler is available (some hosted runtimes), install without the extension:
            # ngram_cpp then runs its pure-Python pruner and says so (ngram_cpp.HAVE_CPP, the app's header).
            # `make setup` checks that the extension was built.
            optional=True,
        ),
        *cpu_kernel_builds(),
    ],
)
