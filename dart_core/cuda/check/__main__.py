"""python -m dart_core.cuda.check: dart-gpu-check from a checkout that is not installed (cli.py)."""

import sys

from .cli import main

sys.exit(main())
