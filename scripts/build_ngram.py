"""Build an n-gram trie for DART's tree pruner: `python -m dart_core.cli.ngram`, same arguments."""

import sys

from dart_core.cli.ngram import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
