"""Choose DART's tree size (and score floor) for this machine: `python -m dart_core.cli.tune tree`, same flags."""

import sys

from dart_core.cli.tune import tree_main

if __name__ == "__main__":
    sys.exit(tree_main(sys.argv[1:]))
