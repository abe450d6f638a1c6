"""Tune the DART pruner's score weights by exact replay: `python -m dart_core.cli.tune scoring`, same flags."""

import sys

from dart_core.cli.tune import scoring_main

if __name__ == "__main__":
    sys.exit(scoring_main(sys.argv[1:]))
