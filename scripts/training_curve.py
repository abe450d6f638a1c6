"""The heads' training curve (validation hit@1 and bench τ by training hours): `python -m dart_core.cli.curve`, same arguments."""

import sys

from dart_core.cli.curve import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
