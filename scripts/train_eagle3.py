"""Train an EAGLE3 draft head for a target model (the baseline DART is compared with).

    python scripts/train_eagle3.py --data ../shared/data/train/*.json* --work runs/eagle3 \\
        --cache runs/dart/cache --train-minutes 30 --export assets/eagle3

The same pipeline as scripts/train_dart.py (self-distillation, the target-state cache, which
`--cache` can share with a DART run, the draft vocabulary, checkpoints, logging), with EAGLE3's
objective: the training-time test, a causal forward over each record followed by --ttt-steps
unrolled steps in which the head is fed its own previous output state, as when it drafts; the loss
is Σ_j γ^j·KL(target ‖ draft) over the steps+1 rows.
"""

from __future__ import annotations

import sys

from dart_core.cli.train import main

if __name__ == "__main__":
    sys.exit(main("eagle3", __doc__, sys.argv[1:]))
