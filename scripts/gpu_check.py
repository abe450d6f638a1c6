"""The GPU check, run from the checkout: dart_core/cuda/check (`dart-gpu-check`, or
`python -m dart_core.cuda.check`); this path stays for the instructions that name it.

    python scripts/gpu_check.py --help
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, installed or not

from dart_core.cuda.check.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
