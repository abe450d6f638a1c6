"""The pruner's fitted ranking (a logistic model of acceptance per level) and its adaptive tree size:
the C++ features and trees against the Python reference on random cases, a hand-derived golden
tree, the adaptive cut's rule, and the fitted file the drafter loads."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ngram_cpp
from ngram_cpp.reference import (
    ACCEPTANCE_FEATURES,
    PruneParams,
    PyContextIndex,
    acceptance_features,
    pool_features,
    prune_reference,
)

from support import assert_same_nodes, assert_same_tree, check_invariants, corpus_tries, random_case, random_eagle3_head

needs_cpp = pytest.mark.skipif(not ngram_cpp.HAVE_CPP, reason="the C++ extension is not built")
TRIES = {order: corpus_tries(order) for order in (2, 3)}


def random_weights(rng: random.Random, levels: int) -> tuple:
    return tuple(rng.uniform(-1.5, 1.5) for _ in range(levels * ACCEPTANCE_FEATURES))


def random_fitted_case(rng: random.Random, seed: int):
    tokens, probs, root, context, params, eos = random_case(rng, seed)
    seq = [rng.randrange(6) for _ in range(rng.randrange(0, 40))] + context
    if rng.random() < 0.6:
        root = rng.randrange(6)
    index = PyContextIndex(rng.randrange(1, 6))
    index.extend(seq)
    levels = rng.randrange(1, 6)
    costs = tuple(1.0 + 0.3 * r + rng.uniform(0, 0.2) for r in range(rng.randrange(1, 30))) if rng.random() < 0.4 else ()
    params = dataclasses.replace(
        params,
        context_weight=rng.choice([0.0, 0.5, 1.0]),
        context_extend=rng.randrange(0, 3),
        context_max_candidates=rng.randrange(0, 4),
        acceptance=random_weights(rng, levels),
        row_costs=costs,
    )
    return tokens, probs, root, seq, params, eos, index


@needs_cpp
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), order=st.sampled_from([2, 3]))
def test_cpp_agrees_with_reference_fitted(seed, order):
    model, ref = TRIES[order]
    tokens, probs, root, seq, params, eos, ref_index = random_fitted_case(random.Random(seed), seed)
    index = ngram_cpp.ContextIndex(ref_index.max_order, seq)
    a = ngram_cpp.prune(tokens, probs, root, seq, model, params, int(eos), index=index)
    b = prune_reference(tokens, probs, root, seq, ref, params, int(eos), ref_index)
    assert_same_tree(a, b)
    np.testing.assert_array_equal(a.sources, b.sources)
    check_invariants(a, params, tokens.shape[0] + (params.context_extend if params.context_weight > 0 else 0))
    assert_same_nodes(ngram_cpp.Pruner(model, params, int(eos), index).nodes(tokens, probs, root, seq), a)
    assert np.all(a.scores[1:] < 0)  # ln P(accepted) of every drafted node
    if params.row_costs:
        assert len(a.tokens) - 1 <= len(params.row_costs) - 1


@needs_cpp
@settings(max_examples=200, deadline=None)
@given(
    score=st.floats(-50, 0),
    inc=st.floats(-20, 0),
    head=st.booleans(),
    p=st.floats(0, 1),
    rank=st.integers(0, 30),
    head_row=st.booleans(),
    row_top=st.floats(0, 1),
    q=st.floats(0, 1),
    match=st.integers(0, 6),
    c=st.floats(0, 1),
    pf=st.floats(-20, 0),
)
def test_cpp_features_equal_reference(score, inc, head, p, rank, head_row, row_top, q, match, c, pf):
    args = (score, inc, head, p, rank if head else -1, head_row, row_top, q, match, 6, c, pf)
    assert ngram_cpp._ngram.acceptance_features(*args) == acceptance_features(*args)


def test_golden_fitted_scores():
    # the score alone (no trie, level weights 1): 10 ln .6, 11 ln .4, 10.20 ln .6 + 2^-.7 * .9 ln .7, ...
    # a one-row model z = 3 * score + 1 (every other weight 0) reranks by the score, so the tree is the
    # score's, with scores ln sigmoid(3 * score + 1) (a child never above its parent)
    w = [0.0] * ACCEPTANCE_FEATURES
    w[0], w[1] = 1.0, 3.0
    probs = [[0.6, 0.4], [0.7, 0.3]]
    params = PruneParams(use_ngram=False, max_nodes=4, beam_width=2)
    plain = ngram_cpp.prune([[10, 11], [20, 21]], probs, 5, [], None, params)
    fitted = ngram_cpp.prune([[10, 11], [20, 21]], probs, 5, [], None, dataclasses.replace(params, acceptance=tuple(w)))
    for f in ("tokens", "parents", "positions"):
        np.testing.assert_array_equal(getattr(fitted, f), getattr(plain, f))
    want = [min(-math.log1p(math.exp(-(3 * s + 1))), 0.0) for s in plain.scores[1:].tolist()]
    for i in range(1, len(want) + 1):
        want[i - 1] = min(want[i - 1], want[plain.parents[i] - 1] if plain.parents[i] > 0 else 0.0)
    np.testing.assert_allclose(fitted.scores[1:], want, atol=1e-5)
    # a model that prefers depth 2 (z = -3 * score + ...) still keeps parents: depth-1 nodes first
    w[1] = -3.0
    flipped = ngram_cpp.prune([[10, 11], [20, 21]], probs, 5, [], None, dataclasses.replace(params, max_nodes=2, acceptance=tuple(w)))
    check_invariants(flipped, params, 2)
    # the adaptive cut: P(accepted) = exp(fitted score); with costs 1, 1.1, 10, ... a second node never pays
    w[1] = 3.0
    adaptive = ngram_cpp.prune(
        [[10, 11], [20, 21]], probs, 5, [], None, dataclasses.replace(params, acceptance=tuple(w), row_costs=(1.0, 1.1, 10.0, 10.0, 10.0))
    )
    assert adaptive.tokens.tolist() == [5, 10]
    # and at equal costs every node pays
    flat = ngram_cpp.prune([[10, 11], [20, 21]], probs, 5, [], None, dataclasses.replace(params, acceptance=tuple(w), row_costs=(1.0,) * 5))
    assert_same_tree(flat, fitted)


def test_bad_fitted_params_raise():
    for bad in (
        PruneParams(acceptance=(1.0,) * 5),
        PruneParams(acceptance=(float("nan"),) * ACCEPTANCE_FEATURES),
        PruneParams(row_costs=(1.0, 2.0)),
        PruneParams(acceptance=(0.0,) * ACCEPTANCE_FEATURES, row_costs=(1.0, 0.0)),
    ):
        with pytest.raises(ValueError):
            ngram_cpp.prune([[1, 2]], [[0.5, 0.5]], 3, [], None, bad)
        with pytest.raises(ValueError):
            prune_reference([[1, 2]], [[0.5, 0.5]], 3, [], None, bad, -1)


def test_pool_features_are_the_pruners():
    """The fit's rows (pool_features) are the nodes the pruner's search expands, with the features it
    scores them with: a one-row model on them reproduces the fitted tree's scores."""
    model, ref = TRIES[3]
    rng = random.Random(4)
    tokens = np.array([rng.sample(range(30), 6) for _ in range(3)])
    probs = np.random.default_rng(4).dirichlet(np.ones(6), size=3).astype(np.float32)
    index = PyContextIndex(4)
    index.extend([1, 2, 3, 1, 2])
    w = [0.0] * ACCEPTANCE_FEATURES
    w[0], w[3], w[8], w[13] = 0.5, 1.0, 0.3, 0.7
    params = PruneParams(top_k=6, beam_width=50, max_nodes=500, context_weight=1.0, acceptance=tuple(w))
    tree = prune_reference(tokens, probs, 3, [1, 2], ref, params, -1, index)
    pool = pool_features(tokens, probs, 3, [1, 2], ref, params, index)
    assert len(pool) == len(tree.tokens) - 1  # max_nodes above the pool's size: every node kept
    fit = []
    for tok, parent, depth, x in pool:
        x = list(x)
        x[-1] = fit[parent] if parent >= 0 else 0.0  # the parent's fitted value
        fit.append(min(-math.log1p(math.exp(-sum(a * b for a, b in zip(w, x)))), x[-1] if parent >= 0 else 0.0))
    np.testing.assert_allclose(sorted(fit), sorted(tree.scores[1:].tolist()), atol=1e-6)


def write_ranking(head_dir, rows: int = 2, trie: str = "t.ngram", **override) -> None:
    import json

    data = {
        "format": "dart-acceptance/1",
        "trie": trie,
        "features": ["f"] * ACCEPTANCE_FEATURES,
        "weights": [[0.1 * (r + 1)] * ACCEPTANCE_FEATURES for r in range(rows)],
        "tree": {"top_k": 7, "context_max_candidates": 3, "context_extend": 2, "context_order": 5},
        **override,
    }
    (head_dir / "acceptance.json").write_text(json.dumps(data))


def test_fitted_ranking_file_and_choice(tmp_path):
    from dart_core.drafters.dart import DartParams, load_fitted_ranking, ranked_params

    assert load_fitted_ranking(tmp_path) is None
    base = DartParams(PruneParams(top_k=10, context_weight=0.65, context_extend=4))
    assert ranked_params(base, None, tmp_path, tmp_path / "t.ngram") == base  # no file: the score
    with pytest.raises(ValueError, match="no fitted ranking"):
        ranked_params(base, "fitted", tmp_path, tmp_path / "t.ngram")
    write_ranking(tmp_path)
    r = load_fitted_ranking(tmp_path)
    assert len(r.weights) == 2 * ACCEPTANCE_FEATURES and (r.top_k, r.context_max_candidates, r.context_extend, r.context_order) == (
        7,
        3,
        2,
        5,
    )
    got = ranked_params(base, None, tmp_path, tmp_path / "t.ngram")
    assert got.prune.acceptance == r.weights and got.prune.top_k == 7 and got.prune.context_extend == 2 and got.context_order == 5
    assert ranked_params(base, "score", tmp_path, tmp_path / "t.ngram") == base
    # another trie, or the context off: the default keeps the score (the features would mean something else)
    assert ranked_params(base, None, tmp_path, tmp_path / "other.ngram") == base
    off = DartParams(PruneParams(top_k=10, context_weight=0.0))
    assert ranked_params(off, None, tmp_path, tmp_path / "t.ngram") == off
    assert ranked_params(off, "fitted", tmp_path, None).prune.acceptance == r.weights  # asked for: given
    write_ranking(tmp_path, features=["f"] * 3)
    with pytest.raises(ValueError, match="not a fitted ranking"):
        load_fitted_ranking(tmp_path)


# ------------------------------------------------------------------------------ EAGLE3's fitted ranking


def test_eagle3_fitted_scores_never_exceed_the_parent():
    from dart_core.drafters.eagle3 import FEATURES, eagle3_features, fitted_scores

    rng = random.Random(2)
    parents = [-1, -1, 0, 0, 1, 2, 2, 5]
    depths = [1, 1, 2, 2, 2, 3, 3, 4]
    own = [math.log(rng.uniform(0.01, 1)) for _ in parents]
    scores = [own[i] + (0.0 if parents[i] < 0 else 0.0) for i in range(len(parents))]
    for i, par in enumerate(parents):
        if par >= 0:
            scores[i] = scores[par] + own[i]
    feats = eagle3_features(scores, parents, own, [0, 1, 0, 1, 0, 0, 1, 0], [own[0]] * len(parents))
    weights = tuple(rng.uniform(-2, 2) for _ in range(2 * len(FEATURES)))
    fit = fitted_scores(weights, feats, parents, depths)
    assert all(f < 0 for f in fit)
    assert all(fit[i] <= fit[par] for i, par in enumerate(parents) if par >= 0)


def test_eagle3_fitted_ranking_is_lossless(tiny_llama):
    from dart_core import ARDrafter, GenerationParams, complete
    from dart_core.drafters.eagle3 import FEATURES, Eagle3Drafter, Eagle3Params

    rng = random.Random(5)
    weights = tuple(rng.uniform(-1, 1) for _ in range(3 * len(FEATURES)))
    head = random_eagle3_head(tiny_llama, seed=2)
    for n in (3, 12):
        d = Eagle3Drafter(head, tiny_llama, Eagle3Params(depth=4, top_k=4, max_nodes=n, ranking=weights))
        for prompt in ([5, 6, 7], [11, 40, 12, 90, 4, 4]):
            ar = complete(tiny_llama, prompt, ARDrafter(), GenerationParams(24))
            assert complete(tiny_llama, prompt, d, GenerationParams(24)).output_ids == ar.output_ids
    with pytest.raises(ValueError, match="rows of"):
        Eagle3Params(ranking=(1.0,) * 5)
