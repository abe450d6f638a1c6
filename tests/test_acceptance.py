"""Acceptance: golden greedy cases on hand-built trees, and statistical tests that sampling is lossless."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from dart_core import GenerationParams, SamplingParams, complete
from dart_core.sampling import accept_greedy, accept_sampling, greedy_token, target_probs
from dart_core.tree import DraftTree

from support import TREE, RandomTreeDrafter, build_tiny_checkpoint, chi_square_p, random_tree_under, tiny_target
from support import TREE_VOCAB as V

P_VALUE = 1e-3  # a correct sampler fails each test about once in a thousand runs (seeds are fixed)


def logits_with_argmax(rows: list[int]) -> torch.Tensor:
    """(len(rows), V) logits whose row i has its maximum at token rows[i]."""
    logits = torch.zeros(len(rows), V)
    for i, tok in enumerate(rows):
        logits[i, tok] = 5.0
    return logits


@pytest.mark.parametrize(
    "argmax, path, bonus",
    [
        # target wants 4 after root, then 1, then 0, then 6: accepts 2 -> 5 -> 7, bonus 6
        ([4, 0, 1, 0, 0, 0, 0, 6], [0, 2, 5, 7], 6),
        # target wants 4, then 6 (node 6 is a leaf): accepts 2 -> 6, bonus from node 6's row
        ([4, 0, 6, 0, 0, 0, 3, 0], [0, 2, 6], 3),
        # target wants 2 then 3: path 1 -> 4, bonus from node 4
        ([2, 3, 0, 0, 5, 0, 0, 0], [0, 1, 4], 5),
        # target wants a token no child has: nothing accepted, bonus is the root's argmax
        ([6, 3, 0, 0, 0, 0, 0, 0], [0], 6),
        # target wants 4 then 3 (not a child of node 2): one accepted, bonus 3
        ([4, 0, 3, 0, 0, 0, 0, 0], [0, 2], 3),
    ],
)
def test_greedy_golden(argmax, path, bonus):
    for batched in (False, True):  # a row at a time (the CPU's walk), every row at once (a GPU's)
        acc = accept_greedy(TREE, logits_with_argmax(argmax), batched)
        assert acc.path == path and acc.bonus == bonus and acc.accepted == len(path) - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_walk_is_the_same_batched(dtype):
    """The batched reduction (every row's argmax in one op, as on a GPU) walks the same path as the
    row-at-a-time one, ties, NaN and all: random logits from a few values, so rows tie often."""
    g = torch.Generator().manual_seed(0)
    values = torch.tensor([0.0, 1.0, 2.0, math.nan, -math.inf])
    for _ in range(300):
        idx = torch.randint(len(values), (len(TREE), V), generator=g)
        idx[idx == 3] = torch.randint(3, (int((idx == 3).sum()),), generator=g) if torch.rand((), generator=g) < 0.8 else 3
        logits = values[idx].to(dtype)
        a, b = accept_greedy(TREE, logits, False), accept_greedy(TREE, logits, True)
        assert (a.path, a.bonus) == (b.path, b.bonus)


@pytest.mark.parametrize(
    "row",
    [
        [1.0, 3.0, 3.0, 2.0],  # a tie: the first maximum
        [-math.inf, -math.inf, -math.inf],  # all -inf: index 0
        [1.0, math.nan, 5.0, math.nan],  # NaN counts as the maximum: the first NaN
        [math.inf, 2.0, math.inf],
        [-0.0, 0.0, -1.0],  # -0.0 == 0.0: the first
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_token_is_torch_argmax(row, dtype):
    """greedy_token's numpy fast path picks what torch's argmax picks, edge values included."""
    t = torch.tensor(row, dtype=dtype)
    assert greedy_token(t) == int(t.argmax())
    wide = torch.randn(49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    wide[[7, 40000]] = wide.max() + 1  # a tie far apart
    assert greedy_token(wide) == int(wide.argmax()) == 7


def test_tree_structure():
    assert TREE.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert TREE.path_to(7) == [0, 2, 5, 7]
    assert TREE.leaf_paths() == [[0, 3], [0, 1, 4], [0, 2, 6], [0, 2, 5, 7]]
    assert TREE.mask[7].nonzero().flatten().tolist() == [0, 2, 5, 7]
    assert len(TREE.truncate(4)) == 4 and TREE.truncate(4).children[0] == (1, 2, 3)
    with pytest.raises(ValueError, match="parents must come before"):
        DraftTree.from_parents([1, 2, 3], [-1, 2, 0])
    with pytest.raises(ValueError, match="same token"):
        DraftTree.from_parents([1, 2, 2], [-1, 0, 0])
    with pytest.raises(ValueError, match="node 2 has two children"):
        DraftTree.from_parents([1, 2, 3, 4, 4], [-1, 0, 0, 2, 2])


def test_tree_masks_are_the_ancestor_relation():
    """The mask (built when first read, an ancestor level at a time) holds in row i exactly i and its
    ancestors; the depths and the greedy walks' child lookup agree with the parent links."""
    rng = random.Random(0)
    for n in (1, 2, 9, 33, 61):
        tree = random_tree_under(rng, 5, n, V)
        want = torch.zeros(len(tree), len(tree), dtype=torch.bool)
        for i in range(len(tree)):
            want[i, tree.path_to(i)] = True
        assert torch.equal(tree.mask, want), n
        assert tree.depths.tolist() == [len(tree.path_to(i)) - 1 for i in range(len(tree))]
        tokens = tree.tokens.tolist()
        for node in range(len(tree)):
            for t in range(V):
                want_child = next((c for c in tree.children[node] if tokens[c] == t), None)
                assert tree.child(node, t) == want_child, (n, node, t)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.7, top_p=0.95), SamplingParams(1.3, top_k=4)],
    ids=["t1", "t0.7-p0.95", "t1.3-k4"],
)
def test_sampling_one_step_is_lossless(params):
    """The first two emitted tokens of one step follow the target: P(x) = p_root(x) and, given an
    accepted child x, the next token follows the distribution at x's node."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(TREE), V, generator=gen) * 1.5
    logits[0, [2, 4]] += 2.0  # make the root's children with children likely, so both levels get tested
    probs = target_probs(logits, params)
    n = 20000
    first, second = {}, {}
    for _ in range(n):
        acc = accept_sampling(TREE, logits, params, gen)
        emitted = TREE.tokens[acc.path[1:]].tolist() + [acc.bonus]
        first[emitted[0]] = first.get(emitted[0], 0) + 1
        if len(emitted) > 1:
            second.setdefault(emitted[0], {})
            second[emitted[0]][emitted[1]] = second[emitted[0]].get(emitted[1], 0) + 1
    assert chi_square_p(first, {t: float(probs[0, t]) for t in range(V) if probs[0, t] > 0}, n) > P_VALUE
    tested = 0
    for node in (1, 2):  # root children that have children of their own
        counts = second.get(int(TREE.tokens[node]), {})
        m = sum(counts.values())
        if m < 500:  # too rare under this target to test
            continue
        assert chi_square_p(counts, {t: float(probs[node, t]) for t in range(V) if probs[node, t] > 0}, m) > P_VALUE
        tested += 1
    assert tested >= 1


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    target = tiny_target(build_tiny_checkpoint(tmp_path_factory.mktemp("v8"), "llama", seed=3, vocab=V, logit_scale=3.0))
    target.eos_ids = frozenset()  # every run must produce all the tokens whose law we test
    return target


def exact_sequence_probs(target, prompt, params, length) -> dict[tuple, float]:
    """P(first `length` generated tokens) under the target alone, by enumeration."""
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        ids = prompt + list(seq)
        logits = target.model(torch.tensor(ids), torch.arange(len(ids)), target.new_cache(len(ids))).logits
        probs = target_probs(logits[len(prompt) - 1 : -1], params)
        out[seq] = math.prod(float(probs[i, t]) for i, t in enumerate(seq))
    return out


@pytest.mark.slow  # 2 x 2000 generations: minutes of CPU
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=5, top_p=0.9)], ids=["t1", "t0.8-k5-p0.9"])
def test_sampling_end_to_end_is_lossless(small_vocab_target, params):
    """Through the whole loop with random trees, the joint law of the first 3 tokens is the target's."""
    target, prompt, length, n = small_vocab_target, [1, 5, 2], 3, 2000
    expected = {k: p for k, p in exact_sequence_probs(target, prompt, params, length).items() if p > 0}
    counts: dict[tuple, int] = {}
    for i in range(n):
        sp = SamplingParams(params.temperature, params.top_p, params.top_k, seed=i)
        s = complete(target, prompt, RandomTreeDrafter(V, max_nodes=7, seed=i), GenerationParams(length, sampling=sp))
        key = tuple(s.output_ids)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p(counts, expected, n) > P_VALUE


def test_a_child_that_held_all_the_mass_but_lost_the_draw_is_the_draw(monkeypatch):
    """p(x) = 1 - 2^-24 with every other token at 0 in float32: a uniform draw in [p(x), 1) rejects x,
    and the renormalised rest would be 0/0. The guard makes x the draw (it is the only token with
    mass), never a NaN distribution or a token of probability 0."""
    from dart_core import sampling

    tree = DraftTree.from_parents([7, 3], [-1, 0])
    p = torch.zeros(V)
    p[3] = 1.0 - 2.0**-24
    monkeypatch.setattr(sampling, "target_probs", lambda logits, params: p.clone())
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.tensor(1.0 - 2.0**-25, dtype=torch.float64))
    acc = accept_sampling(tree, torch.zeros(2, V), SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert acc.path == [0, 1] and 0 <= acc.bonus < V
