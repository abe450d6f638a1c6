"""The tree pruner: hand-derived golden trees, C++ against the Python reference on random cases,
validation of bad input, and the tree invariants the verifier relies on."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ngram_cpp
from ngram_cpp.reference import PruneParams, PyNGramModel, prune_reference

from support import PRUNER_VOCAB as V
from support import assert_same_nodes, assert_same_tree, check_invariants, corpus_tries, random_case

NO_NGRAM = PruneParams(use_ngram=False)


def test_golden_beam_and_global_cut():
    # row 0 (depth 1): 10 p=.6, 11 p=.4 ; row 1 (depth 2): 20 p=.7, 21 p=.3 ; no n-gram
    # level 0 scores: 10 -> ln .6 = -0.511, 11 -> ln .4 = -0.916
    # level 1 increments: 2^-0.7 * 0.9 * ln p: 20 -> -0.198, 21 -> -0.667
    # all nodes: 10 (-0.511), 10.20 (-0.708), 11 (-0.916), 11.20 (-1.114), 10.21 (-1.178), 11.21 (-1.583)
    # top 4: 10, 10.20, 11, 11.20 ; depth order, best first within a depth
    tree = ngram_cpp.prune(
        [[10, 11], [20, 21]], [[0.6, 0.4], [0.7, 0.3]], 5, [1, 2], None, PruneParams(beam_width=2, max_nodes=4, use_ngram=False)
    )
    assert tree.tokens.tolist() == [5, 10, 11, 20, 20]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2]
    assert tree.positions.tolist() == [0, 1, 1, 2, 2]
    assert tree.retrieve.tolist() == [[0, 1, 3], [0, 2, 4]]
    assert tree.mask.astype(int).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    w1 = 2**-0.7 * 0.9
    np.testing.assert_allclose(
        tree.scores, [0, math.log(0.6), math.log(0.4), math.log(0.6) + w1 * math.log(0.7), math.log(0.4) + w1 * math.log(0.7)], atol=1e-6
    )


def test_golden_global_cut_keeps_nodes_outside_the_beam():
    # row 0: 10 p=.5, 11 p=.3, 12 p=.2 ; row 1: 20 p=.9, 21 p=.1 ; beam width 1, no n-gram
    # level 0: 10 -> ln .5 = -0.693, 11 -> ln .3 = -1.204, 12 -> ln .2 = -1.609 ; the beam keeps only 10
    # level 1 (parent 10): 2^-0.7 * 0.9 = 0.554 ; 20 -> -0.693 + 0.554 ln .9 = -0.752 ; 21 -> -0.693 + 0.554 ln .1 = -1.969
    # global top 4: 10, 10.20, 11, 12 -- 11 and 12 were never in the beam but survive as leaves
    # depth order, best first: [5, 10, 11, 12, 20]; leaves in token order: (10 20), (11), (12)
    tree = ngram_cpp.prune(
        [[10, 11, 12], [20, 21, 22]],
        [[0.5, 0.3, 0.2], [0.9, 0.1, 0.0]],
        5,
        [],
        None,
        PruneParams(beam_width=1, max_nodes=4, use_ngram=False),
    )
    assert tree.tokens.tolist() == [5, 10, 11, 12, 20]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1]
    assert tree.positions.tolist() == [0, 1, 1, 1, 2]
    assert tree.retrieve.tolist() == [[0, 1, 4], [0, 2, -1], [0, 3, -1]]


def test_golden_ties_keep_the_parent_first():
    # p = 1 at both levels: ln(1 + 1e-10) > 0 is clamped to 0, so 10 and 10.20 both score exactly 0.
    # With room for one node the tie goes to the shallower one (the parent): the tree stays prefix-closed.
    one = ngram_cpp.prune([[10], [20]], [[1.0], [1.0]], 5, [], None, PruneParams(max_nodes=1, use_ngram=False))
    assert one.tokens.tolist() == [5, 10] and one.scores.tolist() == [0.0, 0.0]
    two = ngram_cpp.prune([[10], [20]], [[1.0], [1.0]], 5, [], None, PruneParams(max_nodes=2, use_ngram=False))
    assert two.tokens.tolist() == [5, 10, 20] and two.retrieve.tolist() == [[0, 1, 2]]


def test_golden_score_floor_sizes_the_tree():
    # the scores of test_golden_beam_and_global_cut: 10 (-0.511), 10.20 (-0.708), 11 (-0.916), 11.20 (-1.114)
    tokens, probs = [[10, 11], [20, 21]], [[0.6, 0.4], [0.7, 0.3]]
    full = PruneParams(beam_width=2, max_nodes=4, use_ngram=False)
    assert ngram_cpp.prune(tokens, probs, 5, [], None, full).tokens.tolist() == [5, 10, 11, 20, 20]
    floor = dataclasses.replace(full, min_score=-0.8)
    assert ngram_cpp.prune(tokens, probs, 5, [], None, floor).tokens.tolist() == [5, 10, 20]
    assert ngram_cpp.prune(tokens, probs, 5, [], None, dataclasses.replace(floor, min_nodes=3)).tokens.tolist() == [5, 10, 11, 20]
    assert ngram_cpp.prune(tokens, probs, 5, [], None, dataclasses.replace(floor, min_score=-0.1)).tokens.tolist() == [5]
    for bad in (dataclasses.replace(full, min_nodes=-1), dataclasses.replace(full, min_score=float("nan"))):
        with pytest.raises(ValueError, match="min_"):
            ngram_cpp.prune(tokens, probs, 5, [], None, bad)


def test_golden_eos_is_never_extended_but_can_be_a_leaf():
    # row 0: 10 p=.4, EOS(3) p=.6 ; beam width 1 keeps 10 although EOS scores higher
    # pool: EOS (-0.511), 10 (-0.916), 10.20 (-1.114), 10.21 (-1.583); top 3 -> EOS, 10, 10.20
    tree = ngram_cpp.prune(
        [[10, 3], [20, 21]], [[0.4, 0.6], [0.7, 0.3]], 5, [], None, PruneParams(beam_width=1, max_nodes=3, use_ngram=False), eos_id=3
    )
    assert tree.tokens.tolist() == [5, 3, 10, 20]
    assert tree.parents.tolist() == [-1, 0, 0, 2]
    assert tree.retrieve.tolist() == [[0, 1, -1], [0, 2, 3]]  # leaves in token order: (3), (10, 20)


def test_golden_ngram_reorders_depth_two():
    # trie from "5 10 21" x3 and "5 10 20": after (root 5, 10) the n-gram favours 21 (q=.75) over 20 (q=.25)
    trie = ngram_cpp.build([[5, 10, 21]] * 3 + [[5, 10, 20]], V)
    probs = [[0.9, 0.1], [0.55, 0.45]]
    with_ng = ngram_cpp.prune([[10, 11], [20, 21]], probs, 5, [], trie, PruneParams(beam_width=1, max_nodes=2))
    without = ngram_cpp.prune([[10, 11], [20, 21]], probs, 5, [], trie, PruneParams(beam_width=1, max_nodes=2, use_ngram=False))
    assert without.tokens.tolist() == [5, 10, 20]
    assert with_ng.tokens.tolist() == [5, 10, 21]


@pytest.fixture(scope="module")
def tries():
    return corpus_tries(3)


@pytest.fixture(scope="module")
def tries_by_order():
    return {order: corpus_tries(order) for order in (2, 3, 4)}


@pytest.mark.skipif(not ngram_cpp.HAVE_CPP, reason="the C++ extension is not built")
@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), order=st.sampled_from([2, 3, 3, 4]))
def test_cpp_agrees_with_reference(tries_by_order, seed, order):
    model, ref = tries_by_order[order]
    tokens, probs, root, context, params, eos = random_case(random.Random(seed), seed)
    a = ngram_cpp.prune(tokens, probs, root, context, model, params, int(eos))
    b = prune_reference(tokens, probs, root, context, ref, params, int(eos))
    assert_same_tree(a, b)
    check_invariants(a, params, tokens.shape[0])
    assert_same_nodes(ngram_cpp.Pruner(model, params, int(eos)).nodes(tokens, probs, root, context), a)


@pytest.mark.skipif(not ngram_cpp.HAVE_CPP, reason="the C++ extension is not built")
def test_python_fallback_matches_cpp(tries, tmp_path, monkeypatch):
    """Without the extension, ngram_cpp.load reads both formats into the Python model and prune runs the
    reference: the trees must be the C++ trees."""
    model, _ = tries
    model.save(tmp_path / "m.ngram")
    model.save(tmp_path / "m.trie", "upstream")
    cases = [random_case(random.Random(seed), seed) for seed in range(40)]
    expected = [ngram_cpp.prune(t, p, r, c, model, prm, int(e)) for t, p, r, c, prm, e in cases]
    monkeypatch.setattr(ngram_cpp, "HAVE_CPP", False)
    for name in ("m.ngram", "m.trie"):
        fallback = ngram_cpp.load(tmp_path / name)
        assert fallback.native is None and isinstance(fallback._impl, PyNGramModel)
        for (t, p, r, c, prm, e), want in zip(cases, expected):
            assert_same_tree(ngram_cpp.prune(t, p, r, c, fallback, prm, int(e)), want)
            assert_same_nodes(ngram_cpp.Pruner(fallback, prm, int(e)).nodes(t, p, r, c), want)
    assert_same_tree(
        ngram_cpp.prune(*cases[0][:4], None, cases[0][4], int(cases[0][5])),
        prune_reference(*cases[0][:4], None, cases[0][4], int(cases[0][5])),
    )


@pytest.mark.parametrize(
    "tokens, probs, match",
    [
        ([[1, 2]], [[0.5]], "shape"),
        ([[1, 1]], [[0.5, 0.5]], "twice"),
        ([[1, V + 100]], [[0.5, 0.5]], "out of range"),
        ([[1, -1]], [[0.5, 0.5]], "out of range"),
        ([[1, 2]], [[0.5, float("nan")]], r"\[0, 1\]"),
        ([[1, 2]], [[1.5, 0.1]], r"\[0, 1\]"),
        ([1, 2], [0.5, 0.5], "2-D|d, k"),
        (np.zeros((0, 3), dtype=np.int64), np.zeros((0, 3), dtype=np.float32), "d >= 1|d, k"),
    ],
)
def test_bad_inputs_raise(tries, tokens, probs, match):
    model, _ = tries
    with pytest.raises(ValueError, match=match):
        ngram_cpp.prune(tokens, probs, 1, [2], model, PruneParams())


def test_root_out_of_range(tries):
    with pytest.raises(ValueError, match="out of range"):
        ngram_cpp.prune([[1]], [[1.0]], V + 5, [], tries[0], PruneParams())
    with pytest.raises(ValueError, match="context"):
        ngram_cpp.prune([[1]], [[1.0]], 2, [3, V], tries[0], PruneParams())
    with pytest.raises(ValueError, match="out of range"):
        ngram_cpp.prune([[1]], [[1.0]], 2, [3, -1], None, PruneParams())
    with pytest.raises(ValueError, match="out of range"):
        ngram_cpp.prune([[2**31]], [[1.0]], 2, [], None, PruneParams())


def test_bad_params_raise(tries):
    for params, match in [
        (PruneParams(beam_width=0), "beam_width"),
        (PruneParams(top_k=0), "top_k"),
        (PruneParams(max_nodes=-1), "max_nodes"),
        (PruneParams(eps=0.0), "eps"),
        (PruneParams(ngram_weight=float("inf")), "finite"),
        (PruneParams(beam_width=10**7), "too large"),
    ]:
        with pytest.raises(ValueError, match=match):
            ngram_cpp.prune([[1, 2]] * 3, [[0.5, 0.5]] * 3, 1, [2], tries[0], params)


@pytest.mark.skipif(not ngram_cpp.HAVE_CPP, reason="the C++ extension is not built")
def test_native_params_are_built_once_per_value(tries):
    """The extension's copy of the parameters is reused for equal values (a drafter passes the same
    ones every step) and never for other values; a list-valued field (unhashable) still works."""
    from ngram_cpp import _native_params

    a = PruneParams(max_nodes=7, acceptance=(0.5,) * 14)
    assert _native_params(a) is _native_params(PruneParams(max_nodes=7, acceptance=(0.5,) * 14))
    assert _native_params(a) is not _native_params(PruneParams(max_nodes=8, acceptance=(0.5,) * 14))
    assert _native_params(a).max_nodes == 7 and list(_native_params(a).acceptance) == [0.5] * 14
    tokens, probs = [[5, 6, 7], [8, 9, 10]], [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]
    as_list = PruneParams(max_nodes=4, acceptance=[0.1] * 14)
    as_tuple = PruneParams(max_nodes=4, acceptance=(0.1,) * 14)
    got, want = ngram_cpp.prune(tokens, probs, 1, [2, 3], tries[0], as_list), ngram_cpp.prune(tokens, probs, 1, [2, 3], tries[0], as_tuple)
    assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()


def test_upstream_trie_does_not_bound_token_ids(tries, tmp_path):
    """An upstream .trie only knows its largest token id, not the tokenizer's vocabulary: larger ids are
    valid candidates (never seen, so q = 0); a trie built here knows the vocabulary and refuses them."""
    model, _ = tries
    model.save(tmp_path / "m.trie", "upstream")
    upstream = ngram_cpp.load(tmp_path / "m.trie")
    assert not upstream.vocab_known and upstream.vocab_size <= V
    tokens, probs = [[1, V + 7]], [[0.5, 0.5]]
    tree = ngram_cpp.prune(tokens, probs, V + 3, [2, 3], upstream, PruneParams())
    assert sorted(tree.tokens[1:].tolist()) == [1, V + 7]
    assert_same_tree(tree, prune_reference(tokens, probs, V + 3, [2, 3], PyNGramModel.load(tmp_path / "m.trie"), PruneParams(), -1))
    with pytest.raises(ValueError, match="out of range"):
        ngram_cpp.prune(tokens, probs, 1, [2, 3], model, PruneParams())


@settings(max_examples=200, deadline=None)
@given(
    d=st.integers(0, 4),
    k=st.integers(0, 4),
    data=st.lists(st.integers(-3, V + 3), min_size=0, max_size=20),
    p=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0, max_size=20),
)
def test_fuzzed_inputs_never_crash(tries, d, k, data, p):
    tokens = np.resize(np.array(data or [0], dtype=np.int64), d * k).reshape(d, k)
    probs = np.resize(np.array(p or [0.5], dtype=np.float32), (d, k))
    params = PruneParams(max_nodes=10)
    try:
        tree = ngram_cpp.prune(tokens, probs, 1, data[:3], tries[0], params)
    except ValueError:
        tree = None
    try:  # the reference accepts and refuses the same inputs
        ref = prune_reference(tokens, probs, 1, data[:3], tries[1], params, -1)
    except ValueError:
        ref = None
    assert (tree is None) == (ref is None)
    if tree is not None:
        assert_same_tree(tree, ref)
        check_invariants(tree, params, d)


EMBEDDED_TRIE = Path(__file__).resolve().parent.parent / "assets" / "ngram" / "smollm2-3gram.ngram.xz"


@pytest.mark.skipif(not ngram_cpp.HAVE_CPP, reason="the C++ extension is not built")
def test_cpp_agrees_with_reference_at_full_size():
    """Upstream's sizes (d=8, k=25, beam 20, 60 nodes) on the embedded trie, whose frequent tokens have
    thousands of continuations: candidates drawn among them so that most lookups hit long child lists."""
    model = ngram_cpp.load(EMBEDDED_TRIE)
    ref = PyNGramModel.load(ngram_cpp.decompressed(EMBEDDED_TRIE))
    tok1, cnt1, _ = model.native.level_arrays(1)
    frequent = tok1[np.argsort(-cnt1, kind="stable")[:300]]
    rng = np.random.default_rng(0)
    for case in range(6):
        tokens = np.stack([rng.choice(frequent, 25, replace=False) for _ in range(8)])
        logits = rng.standard_normal((8, 25)) * (1.0 + case % 4)
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32)
        root, context = int(frequent[case]), rng.choice(frequent, 3).tolist()
        eos = int(tokens[2, 0]) if case % 3 == 0 else 2
        a = ngram_cpp.prune(tokens, probs, root, context, model, PruneParams(), eos)
        b = prune_reference(tokens, probs, root, context, ref, PruneParams(), eos)
        assert_same_tree(a, b)
        assert len(a.tokens) == 61
        check_invariants(a, PruneParams(), 8)
        # small trees: the C++ search stops at max_nodes levels and a beam of max_nodes, the
        # reference searches all 8 levels with the full beam of 20; the trees must not differ
        for nodes in (1, 2, 3, 5, 8, 12):
            small = PruneParams(max_nodes=nodes)
            a = ngram_cpp.prune(tokens, probs, root, context, model, small, eos)
            assert_same_tree(a, prune_reference(tokens, probs, root, context, ref, small, eos))
            assert len(a.tokens) == nodes + 1
