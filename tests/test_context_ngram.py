"""The context n-gram (the conversation's own repeats) in the DART pruner: the index against its
Python reference, hand-derived trees, C++ against the reference pruner on random cases, and the
off switch leaving trees unchanged."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ngram_cpp
from ngram_cpp.reference import FROM_CONTEXT, FROM_HEAD, HEAD_AND_CONTEXT, PruneParams, PyContextIndex, PyNGramModel, prune_reference

from support import PRUNER_VOCAB as V
from support import assert_same_nodes, assert_same_tree, check_invariants, corpus_tries, random_case


def test_index_lookup_by_hand():
    idx = ngram_cpp.ContextIndex(4, [1, 2, 3, 4, 1, 2, 3, 5])
    assert len(idx) == 8 and idx.max_order == 4
    assert idx.lookup([1, 2]) == (2, {3: 2}, 3)  # "1 2" occurred twice, followed by 3 both times
    assert idx.lookup([1, 2, 3]) == (3, {4: 1, 5: 1}, 5)  # the most recent continuation is 5
    assert idx.lookup([9]) == (0, {}, -1)
    assert idx.lookup([3], min_len=2) == (0, {}, -1)  # "5 3" never occurred; 1-grams are below min_len
    # an occurrence ending at the last indexed token is followed by the root (the first virtual token)
    tail = ngram_cpp.ContextIndex(4, [7, 8, 9, 7, 8])
    assert tail.lookup([7, 8]) == (2, {9: 1, 7: 1}, 7)
    idx.extend([6])
    assert idx.lookup([3]) == (1, {4: 1, 5: 1}, 5)
    assert idx.lookup([5]) == (1, {6: 1}, 6)  # the new token is indexed as the continuation of "5"


@pytest.mark.skipif(not ngram_cpp.HAVE_CPP, reason="the C++ extension is not built")
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_index_agrees_with_reference(seed):
    rng = random.Random(seed)
    order = rng.randrange(1, 6)
    vocab = rng.randrange(2, 8)  # small: many repeats
    seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
    cpp, ref = ngram_cpp.ContextIndex(order), PyContextIndex(order)
    cut = rng.randrange(0, len(seq) + 1)
    for part in (seq[:cut], seq[cut:]):  # extended in two pieces: the same index as in one
        cpp.extend(part)
        ref.extend(part)
    for _ in range(10):
        virt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
        min_len = rng.randrange(1, 4)
        assert cpp.lookup(virt, min_len) == ref.lookup(virt, min_len)
        m, counts, last = ref.lookup(virt, min_len)
        if m:  # brute force: every occurrence of the suffix ending in the indexed tokens, and what followed it
            full = seq + virt
            suffix = full[-m:]
            follow = [full[i + m] for i in range(min(len(seq), len(full) - 1) - m + 1) if full[i : i + m] == suffix]
            assert sum(counts.values()) == len(follow) and set(counts) == set(follow) and last == follow[-1]


def test_golden_context_reorders_and_extends():
    # indexed "1 2 3 4 1 2", root 3: the suffix "1 2 3" (m = 3 of max order 4) occurred once, followed by 4
    # lambda = 0.8 * 3 / 4 = 0.6; row 0 candidates 10 (p .9) and 4 (p .1):
    #   10 -> (1 - .6) * .9 = .36          4 -> .4 * .1 + .6 * 1 = .64     4 now ranks first
    # one head row (d = 1) and context_extend = 2: below 4 the context alone continues the branch
    #   level 1: "2 3 4" ... the longest suffix is "1 2 3 4" (m = 4, lambda .8), followed by 1: p' = .8
    #   level 2: "2 3 4 1" (m = 4) followed by 2: p' = .8
    idx = ngram_cpp.ContextIndex(4, [1, 2, 3, 4, 1, 2])
    params = PruneParams(use_ngram=False, max_nodes=10, beam_width=4, context_weight=0.8, context_extend=2, context_extend_min_match=2)
    tree = ngram_cpp.prune([[10, 4]], [[0.9, 0.1]], 3, [1, 2, 3, 4, 1, 2], None, params, index=idx)
    assert tree.tokens.tolist() == [3, 4, 10, 1, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert tree.sources.tolist() == [FROM_HEAD, HEAD_AND_CONTEXT, FROM_HEAD, FROM_CONTEXT, FROM_CONTEXT]
    w1, w2 = 2**-0.7 * 0.9, 3**-0.7 * 0.81
    s4 = math.log(0.64)
    np.testing.assert_allclose(
        tree.scores, [0, s4, math.log(0.36), s4 + w1 * math.log(0.8), s4 + w1 * math.log(0.8) + w2 * math.log(0.8)], atol=1e-6
    )
    # off: the same call without the weight is the plain DART tree
    plain = ngram_cpp.prune(
        [[10, 4]], [[0.9, 0.1]], 3, [1, 2, 3, 4, 1, 2], None, PruneParams(use_ngram=False, max_nodes=10, beam_width=4), index=idx
    )
    assert plain.tokens.tolist() == [3, 10, 4] and plain.sources.tolist() == [FROM_HEAD] * 3
    # indexed "3 4", root 3: row 0 sees only the 1-gram "3" (lambda .2: 10 -> .72, 4 -> .28); below 4 the
    # suffix "3 4" (m = 2) is followed by the root 3, which extends the branch at min match 2 but not at 3
    short = [
        ngram_cpp.prune(
            [[10, 4]],
            [[0.9, 0.1]],
            3,
            [],
            None,
            PruneParams(use_ngram=False, context_weight=0.8, context_extend=2, context_extend_min_match=m),
            index=ngram_cpp.ContextIndex(4, [3, 4]),
        )
        for m in (2, 3)
    ]
    assert short[0].tokens.tolist() == [3, 10, 4, 3] and short[0].parents.tolist() == [-1, 0, 0, 2]
    assert short[1].tokens.tolist() == [3, 10, 4]


def random_context_case(rng: random.Random, seed: int):
    tokens, probs, root, context, params, eos = random_case(rng, seed)
    seq = [rng.randrange(6) for _ in range(rng.randrange(0, 40))] + context  # repeats of a few ids
    if rng.random() < 0.6:
        root = rng.randrange(6)  # a root the conversation has seen: the context has something to say
    index = PyContextIndex(rng.randrange(1, 6))
    index.extend(seq)
    params = dataclasses.replace(
        params,
        context_weight=rng.choice([0.0, 0.3, 0.7, 1.0]),
        context_min_match=rng.randrange(1, 4),
        context_extend=rng.randrange(0, 4),
        context_extend_min_match=rng.randrange(1, 4),
        context_max_candidates=rng.randrange(0, 5),
    )
    return tokens, probs, root, seq, params, eos, index


@pytest.mark.skipif(not ngram_cpp.HAVE_CPP, reason="the C++ extension is not built")
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), order=st.sampled_from([2, 3]))
def test_cpp_agrees_with_reference_with_context(seed, order):
    model, ref = TRIES[order]
    tokens, probs, root, seq, params, eos, ref_index = random_context_case(random.Random(seed), seed)
    index = ngram_cpp.ContextIndex(ref_index.max_order, seq)
    a = ngram_cpp.prune(tokens, probs, root, seq, model, params, int(eos), index=index)
    b = prune_reference(tokens, probs, root, seq, ref, params, int(eos), ref_index)
    assert_same_tree(a, b)
    np.testing.assert_array_equal(a.sources, b.sources)
    check_invariants(a, params, tokens.shape[0] + params.context_extend)
    assert_same_nodes(ngram_cpp.Pruner(model, params, int(eos), index).nodes(tokens, probs, root, seq), a)
    if params.context_weight == 0:  # off: exactly the plain tree
        assert_same_tree(a, ngram_cpp.prune(tokens, probs, root, seq, model, params, int(eos)))


TRIES = {order: corpus_tries(order) for order in (2, 3)}


def test_bad_context_params_raise():
    idx = ngram_cpp.ContextIndex(3, [1, 2])
    for bad in (dict(context_weight=1.5), dict(context_weight=-0.1), dict(context_min_match=0), dict(context_extend=-1)):
        with pytest.raises(ValueError):
            ngram_cpp.prune([[1]], [[1.0]], 2, [], None, PruneParams(**bad), index=idx)
    with pytest.raises(ValueError):
        ngram_cpp.ContextIndex(0)
    with pytest.raises(ValueError):
        ngram_cpp.ContextIndex(3, [1, -2])


def test_golden_context_is_not_vetoed_by_the_trie():
    # trie: "5 10 21" x3, so after (5, 10) the trie gives 21 q = 1 and 29 q = 0 (never seen: ln(eps) = -23)
    # conversation "5 10 29 7", root 5. Level 0 (no trie term): the suffix "5" (m = 1, lambda .25) was followed
    # by 10, so 10 scores ln(.75 * .9 + .25 * 1). Level 1: the suffix "5 10" (m = 2, lambda .5) was followed by 29;
    # both probabilities are mixed with that continuation c:
    #   29 (context only): p' = .5,            q' = .5 * 0 + .5 * 1 = .5
    #   21 (head p .6):    p' = .5 * .6 = .3,  q' = .5 * 1 + 0 = .5        -> 29 ranks first
    seqs = [[5, 10, 21]] * 3
    conversation = [5, 10, 29, 7]
    tokens, probs = [[10, 11], [21, 22]], [[0.9, 0.1], [0.6, 0.4]]
    params = PruneParams(max_nodes=2, beam_width=1, context_weight=1.0)
    tree = ngram_cpp.prune(tokens, probs, 5, conversation, ngram_cpp.build(seqs, V), params, index=ngram_cpp.ContextIndex(4, conversation))
    assert tree.tokens.tolist() == [5, 10, 29] and tree.sources.tolist() == [FROM_HEAD, HEAD_AND_CONTEXT, FROM_CONTEXT]
    level0 = math.log(0.75 * 0.9 + 0.25 * 1.0)
    np.testing.assert_allclose(tree.scores[2], level0 + 2**-0.7 * (0.9 * math.log(0.5) + 0.5 * math.log(0.5)), atol=1e-6)
    ref_trie = PyNGramModel(3, V)
    for seq in seqs:
        ref_trie.add(seq)
    ref_index = PyContextIndex(4)
    ref_index.extend(conversation)
    assert_same_tree(tree, prune_reference(tokens, probs, 5, conversation, ref_trie, params, -1, ref_index))
