"""N-gram trie: counts and the upstream query rule against the Python reference, both file formats,
round trips, and fuzzed corrupt files (which must raise, never crash)."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ngram_cpp
from ngram_cpp.reference import PyNGramModel

pytestmark = pytest.mark.skipif(not ngram_cpp.HAVE_CPP, reason="the C++ extension is not built")

V = 20


def corpus(seed: int, n: int = 60, vocab: int = V) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def both(seqs, order=3, vocab=V):
    ref = PyNGramModel(order, vocab)
    for s in seqs:
        ref.add(s)
    return ngram_cpp.build(seqs, vocab, order, fingerprint="f" * 32), ref


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_counts_and_probs_match_reference(order):
    seqs = corpus(order)
    model, ref = both(seqs, order)
    model.validate()
    assert model.num_nodes == ref.num_nodes and model.total == ref.total == sum(map(len, seqs))
    rng = random.Random(7)
    for _ in range(300):
        ctx = [rng.randrange(V) for _ in range(rng.randrange(0, 5))]
        tok = rng.randrange(V)
        assert model.prob(ctx, tok) == ref.prob(ctx, tok)
        assert model.prob(ctx, tok, smoothed=True) == pytest.approx(ref.prob(ctx, tok, smoothed=True), abs=1e-12)
    cands = list(range(V))
    np.testing.assert_array_equal(model.probs([3, 4], cands), ref.probs([3, 4], cands))


def test_upstream_rule_by_hand():
    # "1 2 3" twice, "1 2 4" once, "5 2 3" once; order 3
    model, _ = both([[1, 2, 3], [1, 2, 3], [1, 2, 4], [5, 2, 3]], vocab=10)
    assert model.prob([1, 2], 3) == pytest.approx(2 / 3)  # count(1 2 3) / count(1 2)
    assert model.prob([1, 2], 4) == pytest.approx(1 / 3)
    assert model.prob([5, 2], 4) == pytest.approx(1 / 4)  # "5 2 4" unseen: backs off to count(2 4)/count(2)
    assert model.prob([9, 2], 3) == pytest.approx(3 / 4)  # context "9 2" unseen: count(2 3)/count(2)
    assert model.prob([1, 2], 7) == 0.0  # never seen after any context: no unigram level
    assert model.prob([], 3) == 0.0  # empty context
    assert sum(model.prob([1, 2], t) for t in range(10)) <= 1.0
    assert 0.0 < model.prob([1, 2], 7, smoothed=True) < 0.01


def test_round_trips_and_upstream_bytes(tmp_path):
    model, ref = both(corpus(11))
    model.save(tmp_path / "a.ngram")
    model.save(tmp_path / "a.trie", "upstream")
    ngram_cpp.convert(tmp_path / "a.trie", tmp_path / "b.ngram")
    ngram_cpp.convert(tmp_path / "b.ngram", tmp_path / "b.trie")
    assert (tmp_path / "a.trie").read_bytes() == (tmp_path / "b.trie").read_bytes()
    rng = random.Random(3)
    queries = [([rng.randrange(V) for _ in range(2)], rng.randrange(V)) for _ in range(200)]
    for name in ("a.ngram", "a.trie", "b.ngram"):
        loaded = ngram_cpp.load(tmp_path / name)
        loaded.validate()
        py_loaded = PyNGramModel.load(tmp_path / name)
        assert loaded.num_nodes == model.num_nodes == py_loaded.num_nodes
        for ctx, tok in queries:
            assert loaded.prob(ctx, tok) == model.prob(ctx, tok) == py_loaded.prob(ctx, tok)
    assert ngram_cpp.load(tmp_path / "a.ngram").fingerprint == "f" * 32


def test_hand_assembled_upstream_file(tmp_path):
    """A 2-gram trie written byte by byte in the upstream layout: root(freq 3) -> 7(2) -> 8(1), root -> 9(1)."""
    nodes = [  # token, parent, freq, children [(token, index)]
        (0, 0, 3, [(7, 1), (9, 2)]),
        (7, 0, 2, [(8, 3)]),
        (9, 0, 1, []),
        (8, 1, 1, []),
    ]
    data = struct.pack("<QQ", 2, len(nodes))
    for tok, parent, freq, kids in nodes:
        data += struct.pack("<iQiQ", tok, parent, freq, len(kids))
        for t, i in kids:
            data += struct.pack("<iQ", t, i)
    (tmp_path / "hand.trie").write_bytes(data)
    model = ngram_cpp.load(tmp_path / "hand.trie")
    assert (model.order, model.num_nodes, model.total) == (2, 4, 3)
    assert model.prob([7], 8) == 0.5
    model.save(tmp_path / "again.trie", "upstream")
    assert (tmp_path / "again.trie").read_bytes() == data  # children were already in token order


def test_spilled_build_equals_in_memory(tmp_path):
    seqs = corpus(5, n=200)
    small = ngram_cpp.build(seqs, V, 3, slices_in_memory=37, spill_dir=tmp_path)  # many sorted runs
    big, _ = both(seqs)
    small.save(tmp_path / "small.ngram")
    big.save(tmp_path / "big.ngram")
    assert (tmp_path / "small.ngram").read_bytes().replace(b"f" * 32, b"\0" * 32) == (tmp_path / "big.ngram").read_bytes().replace(
        b"f" * 32, b"\0" * 32
    )


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        ngram_cpp.build([[1, 2, V]], V)
    with pytest.raises(ValueError, match="out of range"):
        ngram_cpp.build([[1, -2]], V)
    model, _ = both(corpus(1))
    with pytest.raises(ValueError, match="out of range"):
        model.prob([1, -5], 3)
    with pytest.raises(FileNotFoundError):
        ngram_cpp.load(tmp_path / "missing.ngram")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(RuntimeError, match="truncated"):
        ngram_cpp.load(tmp_path / "empty")
    (tmp_path / "junk").write_bytes(b"hello world, not a trie at all" * 3)
    with pytest.raises(RuntimeError):
        ngram_cpp.load(tmp_path / "junk")


def test_wrong_tokenizer_is_refused(tmp_path):
    model, _ = both(corpus(2))
    model.save(tmp_path / "m.ngram")
    with pytest.raises(ValueError, match="another tokenizer"):
        ngram_cpp.load(tmp_path / "m.ngram", expected_fingerprint="0" * 32)
    with pytest.raises(ValueError, match="beyond the tokenizer's vocabulary"):
        ngram_cpp.load(tmp_path / "m.ngram", expected_vocab_size=5)


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("valid")
    model, _ = both(corpus(9))
    model.save(d / "m.ngram")
    model.save(d / "m.trie", "upstream")
    return (d / "m.ngram").read_bytes(), (d / "m.trie").read_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from([0, 1]), cut=st.floats(0, 1), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=6))
def test_fuzzed_files_never_crash(valid_files, tmp_path, which, cut, flips):
    """Truncated or bit-flipped files either load (and answer queries safely) or raise an exception."""
    data = bytearray(valid_files[which])
    data = data[: int(len(data) * cut)] if cut < 0.97 else data
    for pos, byte in flips:
        if data:
            data[int(pos * (len(data) - 1))] = byte
    path = tmp_path / ("f.ngram" if which == 0 else "f.trie")
    path.write_bytes(bytes(data))
    try:
        model = ngram_cpp.load(path)
    except (RuntimeError, ValueError):
        return
    for ctx in ([1, 2], [3], [], [19, 19]):  # lookups on a damaged but loadable file stay in bounds
        model.probs(ctx, list(range(V)))
    try:
        model.validate()  # may pass (the damage hit nothing structural) or raise RuntimeError
    except RuntimeError:
        pass
