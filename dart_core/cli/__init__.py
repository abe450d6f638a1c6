"""Every command line of the project, each a thin `main` over library functions:

    python -m dart_core.cli.bench            the benchmark: methods interleaved prompt by prompt (dart_core/bench.py)
    python -m dart_core.cli.train dart|eagle3   train a draft head (dart_core/training)
    python -m dart_core.cli.corpus           generate the self-distilled corpus (dart_core/training/corpus.py)
    python -m dart_core.cli.ngram            build an n-gram trie for the pruner (ngram_cpp)
    python -m dart_core.cli.tune tree|scoring   tree size or score weights by replay (dart_core/tuning.py)
    python -m dart_core.cli.fit              fit a drafter's ranking of tree nodes by replay (dart_core/fitting.py)
    python -m dart_core.cli.curve            the heads' training curve (assets/training/)
    python -m dart_core.cli.report           docs/benchmarks.md and the README's table from the kept bench results
    python -m dart_core.cli.fidelity         a weights path's top-1 agreement with the fp32 copy (dart_core/fidelity.py)
    python -m dart_core.cli.export_gguf      an EAGLE3 head as a GGUF draft model for llama.cpp
    python -m dart_core.cli.export_upstream  a DART head for upstream's loader

Flags become the library's typed settings in one module, dart_core/cli/options.py, which the app's
command line (app/__main__.py) uses too. The scripts/ directory keeps the old script names as entry
points to these commands.
"""
