"""dart_core/tools/fitting.py (dart-fit): the per-level logistic fit of P(node accepted),
capped by the parent's, on a synthetic table whose labels follow a known rule."""

from __future__ import annotations

import numpy as np
import pytest

from dart_core.tools.fitting import PARENT_FIT, fit, fitted_values, logistic, report, stack


def synthetic_steps(n_steps: int = 300, seed: int = 0):
    """Steps of a root's two children and their one child each; a node is accepted with a probability
    that grows with its feature 1, and only if its parent is."""
    rng = np.random.default_rng(seed)
    F = PARENT_FIT + 1
    steps = []
    for _ in range(n_steps):
        depth, parent = np.array([1, 1, 2, 2]), np.array([-1, -1, 0, 1])
        X = np.zeros((4, F))
        X[:, 0] = 1.0
        X[:, 1] = rng.normal(size=4)
        acc = np.zeros(4)
        for i in range(4):
            p = 1.0 / (1.0 + np.exp(-2.0 * X[i, 1]))
            acc[i] = float(rng.random() < p and (parent[i] < 0 or acc[parent[i]] == 1.0))
        steps.append((depth, parent, X, acc))
    return steps


def test_logistic_recovers_a_known_slope():
    rng = np.random.default_rng(1)
    x = rng.normal(size=4000)
    X = np.stack([np.ones_like(x), x], axis=1)
    y = (rng.random(4000) < 1.0 / (1.0 + np.exp(-(0.5 + 2.0 * x)))).astype(float)
    w = logistic(X, y, l2=0.0)
    assert w == pytest.approx([0.5, 2.0], abs=0.25)


def test_fitted_values_never_exceed_the_parents_and_beat_a_constant_rate():
    table = stack(synthetic_steps())
    depth, parent, _, _ = table
    assert parent.max() < len(depth) and (parent[depth == 1] == -1).all()  # parents as global rows
    W = fit(table, n_rows=2, l2=1.0)
    _, ln_p = fitted_values(table, W)
    child = depth == 2
    assert (ln_p[child] <= ln_p[parent[child]] + 1e-12).all()
    rows = report(table, W)["per_row"]
    assert len(rows) == 2 and all(r["log_loss"] < r["log_loss_constant"] for r in rows)
