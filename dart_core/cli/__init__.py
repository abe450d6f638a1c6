"""Every command line of the project, each a thin `main` over library functions, installed as a
console script (pyproject.toml [project.scripts]; `make setup` puts them in .venv/bin):

    dart-app                   the Gradio demo (app/launch.py)
    dart-bench                 the benchmark: methods interleaved prompt by prompt (dart_core/tools/bench.py)
    dart-calibrate             this machine's forward costs, tree sizes and weights path (dart_core/tools/calibrate/)
    dart-kernels               the CPU kernel builds, their row costs and stage split
    dart-train dart|eagle3     train a draft head (dart_core/tools/training)
    dart-corpus                generate the self-distilled corpus (dart_core/tools/training/corpus.py)
    dart-ngram                 build an n-gram trie for the pruner (ngram_cpp)
    dart-ngram-convert         convert a trie between our format and upstream's (ngram_cpp/convert_cli.py)
    dart-ngram-bench           micro-benchmark of the trie and the pruner (ngram_cpp/bench.py)
    dart-tune tree|scoring     tree size or score weights by replay (dart_core/tools/tuning.py)
    dart-fit                   fit a drafter's ranking of tree nodes by replay (dart_core/tools/fitting.py)
    dart-curve                 the heads' training curve (assets/training/)
    dart-report                docs/benchmarks.md and the README's table from the kept bench results
    dart-fidelity              a weights path's top-1 agreement with the fp32 copy (dart_core/tools/fidelity.py)
    dart-export-gguf           an EAGLE3 head as a GGUF draft model for llama.cpp
    dart-export-upstream       a DART head for upstream's loader
    dart-screenshot            the README's screenshot of the app (app/screenshot.py)

Flags become the library's typed settings in one module, dart_core/cli/options.py, which the app's
command line (app/launch.py) uses too.
"""

from __future__ import annotations

import sys
from pathlib import Path


def installed_command(name: str) -> list[str]:
    """The argv prefix that runs console script `name` of this installation (it sits beside the
    running interpreter): how one command starts another in a fresh process."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise SystemExit(f"{name} is not installed beside {sys.executable}: run `make setup` (pip install -e .)")
    return [str(path)]
