"""The tree size (and, for the embedded default, the weights path) that makes a drafter fastest on
this machine, from measured costs.

Speculation pays only while a verify of n+1 rows costs little more than a one-row step, and that
ratio depends on the CPU, the kernel build, the weights (bf16, GGUF blocks) and the thread count
(docs/engine.md has the costs by rows). So the CPU default is measured, not a constant:

    expected tokens/s at n drafted nodes = τ(n) / step(n)      plain decoding: 1 / step(0)

- step(n): the generation loop's own step at n drafted nodes (n = 0: plain decoding), timed in the
  loop itself on one prompt of about PREFIX tokens (loop_step_ms): drafting, pruning, the verify of
  n + 1 rows, acceptance and the loop's bookkeeping, each after the others as they run. Timed apart,
  the pieces added up to less than the loop spends (the drafting and pruning cost more right after a
  verify, whose data the caches then hold; docs/changelog.md);
- forward(k): the target's forward of k new rows after PREFIX committed tokens, measured alone (median
  of a few runs, 1..MAX_CALIBRATED_ROWS rows on the CPU kernels, 1..CUDA_CALIBRATED_ROWS on a CUDA GPU's
  fixed-shape forward, synchronized: calibrated_rows): what a verify costs by rows, for the tables and the docs;
  both are cached per machine, kernel build, weights and threads under ~/.cache/dart-demo/calibration/
  (a second start reads them back);
- τ(n): the head's tokens per target forward at n nodes, measured offline by exact replay on held-out
  prompts and shipped beside the head as TAU_FILE (`dart-calibrate --write-tau HEAD`
  writes it, with the command and prompts). A head without one keeps the device default, and says so.

Where no size beats plain decoding the choice is still the fastest size (DART is what was asked
for), and its reason says that plain decoding is expected faster on this machine.

The same rule picks the weights path of the embedded default (`--dtype auto`, the default of the bench,
the app and this module's command line; choose_weights): each candidate path (its own GGUF blocks,
bf16) is loaded and measured, and the one whose DART is expected fastest at its best tree size runs.

The choice is a prediction; the bench CLI is the measurement (`--max-nodes N` and `--dtype` override).

The package, one module a part: measure.py (the costs and their cache), tau.py (τ by tree size),
tree_size.py (the choice of a drafter's size), weights.py (the weights path).
"""

from . import measure, tau, tree_size, weights
from .measure import (
    CALIBRATION_VERSION,
    CUDA_CALIBRATED_ROWS,
    MAX_CALIBRATED_ROWS,
    OVERHEAD_PROMPT,
    OVERHEAD_TOKENS,
    PREFIX,
    ForwardCosts,
    ForwardSplit,
    build_measured,
    cached_forward_costs,
    calibrated_rows,
    calibration_dir,
    cpu_model,
    drafting_ms,
    forward_costs,
    forward_split,
    host_key,
    loop_sizes,
    loop_step_ms,
    machine_key,
    measure_forwards,
    with_row_costs,
)
from .tau import TAU_FILE, read_tau_table, tau_by_size
from .tree_size import SizeChoice, calibrate_drafter, calibrate_unset_sizes, choose_max_nodes
from .weights import AUTO_FALLBACK, WEIGHTS_CANDIDATES, WeightsChoice, choose_weights, fixed_weights, rank_weights, weights_table

__all__ = [
    "measure", "tau", "tree_size", "weights",
    "CALIBRATION_VERSION", "CUDA_CALIBRATED_ROWS", "MAX_CALIBRATED_ROWS", "OVERHEAD_PROMPT", "OVERHEAD_TOKENS", "PREFIX", "ForwardCosts",
    "ForwardSplit", "build_measured", "cached_forward_costs", "calibrated_rows", "calibration_dir", "cpu_model",
    "drafting_ms", "forward_costs", "forward_split", "host_key", "loop_sizes", "loop_step_ms", "machine_key", "measure_forwards",
    "with_row_costs",
    "SizeChoice", "calibrate_drafter", "calibrate_unset_sizes", "choose_max_nodes", "TAU_FILE", "read_tau_table", "tau_by_size",
    "AUTO_FALLBACK", "WEIGHTS_CANDIDATES", "WeightsChoice", "choose_weights", "fixed_weights", "rank_weights", "weights_table",
]  # fmt: skip
