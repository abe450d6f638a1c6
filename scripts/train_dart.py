"""Train a DART draft head for a target model.

    python scripts/train_dart.py --data ../shared/data/train/*.json* --work runs/dart \\
        --self-distill 8000 --self-distill-minutes 30 --cache-tokens 700000 --train-minutes 30 --export assets/dart

Phases, each resumable by re-running the same command: (0) optionally regenerate the answers with
the target itself (self-distillation); (1) run the frozen target over the data once and cache its
captured hidden states and final hidden state; (2) train the head on the cache with the loss
Σ_j γ^j·KL(target ‖ draft) over its D+1 rows, prefix-packed so one forward trains many prefixes of a
record. scripts/train_eagle3.py is the same pipeline with EAGLE3's objective.
"""

from __future__ import annotations

import sys

from dart_core.cli.train import main

if __name__ == "__main__":
    sys.exit(main("dart", __doc__, sys.argv[1:]))
