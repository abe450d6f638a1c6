"""The benchmark report (docs/benchmarks.md and the README's results table) from the kept bench
results: `python -m dart_core.cli.report`, same arguments."""

import sys

from dart_core.cli.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
