"""Fit a drafter's ranking of tree nodes (P(node accepted)) by exact replay: `python -m dart_core.cli.fit`, same flags."""

import sys

from dart_core.cli.fit import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
