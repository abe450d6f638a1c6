"""Builds the ngram_cpp C++ extension (the rest of the project is pure Python, see pyproject.toml)."""

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
        )
    ]
)
