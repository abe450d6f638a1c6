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


def test_context_lookups_past_the_first_level_table():
    """Level 1's table covers ids below 2**22; larger ids (possible in a trie read from an upstream
    file) take the binary search: the same answers as the reference on both sides of the bound."""
    big = 1 << 22
    ids = [3, 7, 11, big - 1, big, big + 5, 5_000_000]
    rng = random.Random(3)
    seqs = [[rng.choice(ids) for _ in range(rng.randrange(1, 12))] for _ in range(80)]
    model, ref = both(seqs, 3, vocab=5_000_001)
    for _ in range(400):
        ctx = [rng.choice(ids + [4, big + 1]) for _ in range(rng.randrange(0, 4))]
        tok = rng.choice(ids + [4, big + 1])
        assert model.prob(ctx, tok) == ref.prob(ctx, tok), (ctx, tok)


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
    # smoothed: 0.01/10 + 0.99 * (1 * c(t)/12 + 2 * c(2 t)/c(2) + 4 * c(1 2 t)/c(1 2)) / (1 + 2 + 4); 12 tokens in all
    assert model.prob([1, 2], 3, smoothed=True) == pytest.approx(0.001 + 0.99 * (3 / 12 + 2 * 3 / 4 + 4 * 2 / 3) / 7)
    # neither "2" nor "1 2" ends a sequence, so every level's ratios sum to 1 and so does the mixture
    assert sum(model.prob([1, 2], t, smoothed=True) for t in range(10)) == pytest.approx(1.0)
    # an unseen context drops its level: only the unigram and "2" remain
    assert model.prob([9, 2], 4, smoothed=True) == pytest.approx(0.001 + 0.99 * (1 / 12 + 2 * 1 / 4) / 3)


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
    assert data == upstream_bytes(2, nodes)
    (tmp_path / "hand.trie").write_bytes(data)
    model = ngram_cpp.load(tmp_path / "hand.trie")
    assert (model.order, model.num_nodes, model.total) == (2, 4, 3)
    assert model.prob([7], 8) == 0.5
    model.save(tmp_path / "again.trie", "upstream")
    assert (tmp_path / "again.trie").read_bytes() == data  # children were already in token order


def upstream_bytes(order: int, nodes) -> bytes:
    """An upstream .trie assembled by hand: nodes = [(token, parent, freq, [(child token, child index)])]."""
    data = struct.pack("<QQ", order, len(nodes))
    for tok, parent, freq, kids in nodes:
        data += struct.pack("<iQiQ", tok, parent, freq, len(kids))
        for t, i in kids:
            data += struct.pack("<iQ", t, i)
    return data


def test_upstream_file_has_no_vocab_until_stamped(tmp_path):
    # root -> 7 -> 8, root -> 9: the largest id is 9, but an upstream file cannot say the vocabulary is larger
    data = upstream_bytes(2, [(0, 0, 3, [(9, 2), (7, 1)]), (7, 0, 2, [(8, 3)]), (9, 0, 1, []), (8, 1, 1, [])])
    (tmp_path / "m.trie").write_bytes(data)
    model = ngram_cpp.load(tmp_path / "m.trie")
    assert (model.vocab_size, model.vocab_known, model.fingerprint) == (10, False, "")
    # converting keeps the "lower bound" flag unless the tokenizer is stamped
    ngram_cpp.convert(tmp_path / "m.trie", tmp_path / "plain.ngram")
    assert not ngram_cpp.load(tmp_path / "plain.ngram").vocab_known
    ngram_cpp.convert(tmp_path / "m.trie", tmp_path / "m.ngram", vocab_size=100, fingerprint="ab" * 16)
    stamped = ngram_cpp.load(tmp_path / "m.ngram")
    assert (stamped.vocab_size, stamped.vocab_known, stamped.fingerprint) == (100, True, "ab" * 16)
    assert PyNGramModel.load(tmp_path / "m.ngram").vocab_known
    with pytest.raises(ValueError, match="smaller than"):
        ngram_cpp.convert(tmp_path / "m.trie", tmp_path / "x.ngram", vocab_size=5)
    # the children were written out of token order: the writer sorts them, the reader does not care
    model.save(tmp_path / "again.trie", "upstream")
    assert ngram_cpp.load(tmp_path / "again.trie").prob([7], 8) == 0.5


@pytest.mark.parametrize(
    "nodes",
    [[(0, 0, 0, [])], [(0, 0, 5, [(4, 1)]), (4, 0, 5, [])]],
    ids=["root alone", "one level of three"],
)
def test_a_trie_shallower_than_its_order_is_read_safely(tmp_path, nodes):
    """An upstream trie whose deeper levels are empty (found by the fuzz test: a root alone crashed
    validate()) loads, validates and answers lookups as the Python reader does, and converts."""
    (tmp_path / "s.trie").write_bytes(upstream_bytes(3, nodes))
    cpp, py = ngram_cpp.load(tmp_path / "s.trie"), PyNGramModel.load(tmp_path / "s.trie")
    cpp.validate()
    assert (cpp.num_nodes, cpp.total) == (py.num_nodes, py.total) == (len(nodes), nodes[0][2] if len(nodes) > 1 else 0)
    for ctx in ([], [4], [4, 4], [1, 2]):
        np.testing.assert_array_equal(cpp.probs(ctx, [0, 4, 5]), py.probs(ctx, [0, 4, 5]))
    cpp.save(tmp_path / "s.ngram")
    ngram_cpp.load(tmp_path / "s.ngram").validate()


def test_upstream_counts_as_upstream_leaves_them(tmp_path):
    """A zero-count node (what upstream's reduce() can leave), a count past int32 (stored wrapped) and a
    negative root (reduce() again) all load; the root count is recomputed from level 1."""
    wrapped = 2**32 - 2  # upstream's int32 freq holds -2
    nodes = [
        (0, 0, -7, [(1, 1), (2, 2)]),
        (1, 0, wrapped - 2**32, [(3, 3), (4, 4)]),
        (2, 0, 5, []),
        (3, 1, 0, []),
        (4, 1, 6, []),
    ]
    (tmp_path / "r.trie").write_bytes(upstream_bytes(2, nodes))
    model = ngram_cpp.load(tmp_path / "r.trie")
    ref = PyNGramModel.load(tmp_path / "r.trie")
    model.validate()
    assert model.total == ref.total == wrapped + 5
    assert model.prob([1], 4) == ref.prob([1], 4) == 6 / wrapped
    # 3 exists after 1 with count 0: the context matched, so no backoff (upstream gives 0 too)
    assert model.prob([1], 3) == ref.prob([1], 3) == 0.0
    model.save(tmp_path / "w.trie", "upstream")
    model2 = ngram_cpp.load(tmp_path / "w.trie")
    model2.save(tmp_path / "w2.trie", "upstream")
    assert (tmp_path / "w.trie").read_bytes() == (tmp_path / "w2.trie").read_bytes()
    assert struct.unpack_from("<i", (tmp_path / "w.trie").read_bytes(), 16 + 24 + 2 * 12 + 12)[0] == -2  # node 1's freq


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


class ValidFiles(tuple):
    """(compact bytes, upstream bytes) of one small trie; a short repr keeps hypothesis' reports readable."""

    def __repr__(self) -> str:
        return "ValidFiles(...)"


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("valid")
    model, _ = both(corpus(9))
    model.save(d / "m.ngram")
    model.save(d / "m.trie", "upstream")
    return ValidFiles(((d / "m.ngram").read_bytes(), (d / "m.trie").read_bytes()))


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


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0, 1), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=4))
def test_fuzzed_upstream_files_both_readers_agree(valid_files, tmp_path, cut, flips):
    """Both readers check an upstream file fully while reading, so they accept exactly the same files,
    and read them the same; the Python reader raises RuntimeError (never another exception)."""
    data = bytearray(valid_files[1])
    data = data[: int(len(data) * cut)] if cut < 0.9 else data
    for pos, byte in flips:
        if data:
            data[int(pos * (len(data) - 1))] = byte
    path = tmp_path / "f.trie"
    path.write_bytes(bytes(data))
    try:
        cpp = ngram_cpp.load(path)
    except RuntimeError:
        cpp = None
    try:
        py = PyNGramModel.load(path)
    except RuntimeError:
        py = None
    assert (cpp is None) == (py is None)
    if cpp is not None:
        cpp.validate()
        assert (cpp.num_nodes, cpp.total, cpp.vocab_size) == (py.num_nodes, py.total, py.vocab_size)
        for ctx in ([1, 2], [3], [19, 19]):
            np.testing.assert_array_equal(cpp.probs(ctx, list(range(V))), py.probs(ctx, list(range(V))))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0, 1), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=4))
def test_fuzzed_compact_files_python_reader(valid_files, tmp_path, cut, flips):
    """The Python fallback's compact reader raises RuntimeError on damage, never another exception."""
    data = bytearray(valid_files[0])
    data = data[: int(len(data) * cut)] if cut < 0.9 else data
    for pos, byte in flips:
        if data:
            data[int(pos * (len(data) - 1))] = byte
    path = tmp_path / "f.ngram"
    path.write_bytes(bytes(data))
    try:
        model = PyNGramModel.load(path)
    except RuntimeError:
        return
    for ctx in ([1, 2], [3], []):
        model.probs(ctx, list(range(V)))


def test_corrupt_compact_header_fields(tmp_path):
    model, _ = both(corpus(4))
    model.save(tmp_path / "m.ngram")
    good = (tmp_path / "m.ngram").read_bytes()
    cases = {  # offset in the header -> (bytes, expected message)
        "version": (8, struct.pack("<I", 2), "version"),
        "order": (12, struct.pack("<I", 9), "order"),
        "flags": (20, struct.pack("<I", 0x80), "flags"),
        "levels beyond the order": (32 + 8 * 3, struct.pack("<Q", 1), "beyond the order"),
        "level size": (32, struct.pack("<Q", 10**12), "exceed the file"),
    }
    for name, (offset, patch, message) in cases.items():
        bad = good[:offset] + patch + good[offset + len(patch) :]
        (tmp_path / "bad.ngram").write_bytes(bad)
        with pytest.raises(RuntimeError, match=message):
            ngram_cpp.load(tmp_path / "bad.ngram")
        with pytest.raises(RuntimeError):
            PyNGramModel.load(tmp_path / "bad.ngram")
    with pytest.raises(RuntimeError, match="bad magic|not a compact"):
        (tmp_path / "magic.ngram").write_bytes(b"DARTNGRX" + good[8:])
        ngram_cpp._ngram.NGramModel.load_compact(str(tmp_path / "magic.ngram"))


class CharTokenizer:
    """Just enough of a HF tokenizer for dart-ngram: one id per character, EOS = 0."""

    eos_token_id = 0

    def __init__(self):
        self.vocab = {"<eos>": 0, **{chr(c): c - 31 for c in range(32, 127)}, "\n": 96}

    def __len__(self) -> int:
        return len(self.vocab)

    def get_vocab(self) -> dict:
        return dict(self.vocab)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [self.vocab[c] for c in text]}

    def apply_chat_template(self, messages, tokenize=False, **_) -> str:
        return "".join(f"[{m['role'][0]}]{m['content']}\n" for m in messages)


def build_script(monkeypatch, tok):
    """dart-ngram's module, loading `tok` for any tokenizer name."""
    from dart_core.cli import ngram as script

    monkeypatch.setattr(script, "load_tokenizer", lambda name: tok)
    return script


def test_build_script_is_deterministic_and_counts_every_record(tmp_path, monkeypatch):
    import json

    tok = CharTokenizer()
    script = build_script(monkeypatch, tok)
    (tmp_path / "a.txt").write_text("hello world\n\nsecond doc\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "plain"}) + "\n" + json.dumps({"prompt": "Q?", "completion": "A."}) + "\n")
    (tmp_path / "c.json").write_text(json.dumps([{"instruction": "Do", "input": "", "output": "Done"}]))
    files = [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.json")]
    for out in ("one.ngram", "two.ngram"):
        assert script.main([*files, "--out", str(tmp_path / out), "--slices-in-memory", "7"]) == 0
    assert (tmp_path / "one.ngram").read_bytes() == (tmp_path / "two.ngram").read_bytes()

    # the same documents, rendered by hand: plain texts end with EOS, conversations with the template
    docs = ["hello world", "second doc", "plain"]
    expected = PyNGramModel(3, len(tok))
    for d in docs:
        expected.add(tok(d)["input_ids"] + [0])
    for conv in ("[u]Q?\n[a]A.\n", "[u]Do\n[a]Done\n"):
        expected.add(tok(conv)["input_ids"])
    model = ngram_cpp.load(tmp_path / "one.ngram", expected_fingerprint=ngram_cpp.tokenizer_fingerprint(tok))
    assert (model.total, model.num_nodes, model.vocab_size, model.vocab_known) == (expected.total, expected.num_nodes, len(tok), True)
    o, c = tok("oc")["input_ids"]
    assert model.prob([o, c], 0) == expected.prob([o, c], 0) == 1.0  # "...doc" ends its document


def test_build_script_adds_the_training_records_of_a_corpus(tmp_path, monkeypatch):
    import hashlib
    import json

    import numpy as np

    tok = CharTokenizer()
    script = build_script(monkeypatch, tok)
    records = [([5, 6, 7, 0], False), ([5, 6, 9], True), ([8, 8, 8, 0], False)]  # (ids, held out for validation)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    np.savez_compressed(
        corpus / "part-00000.npz",
        tokens=np.array([t for ids, _ in records for t in ids], dtype=np.uint16),
        offsets=np.cumsum([0] + [len(ids) for ids, _ in records]),
        answer_start=np.array([1, 1, 2], dtype=np.int32),
        index=np.arange(3, dtype=np.int32),
        sampled=np.zeros(3, dtype=bool),
        val=np.array([v for _, v in records]),
    )
    part = {"name": "part-00000.npz", "records": 3, "sha256": hashlib.sha256((corpus / "part-00000.npz").read_bytes()).hexdigest()}
    manifest = {"format": "dart-demo-corpus/1", "target": "default", "generated_dtype": "bfloat16", "parts": [part]}
    (corpus / "corpus.json").write_text(json.dumps(manifest))
    assert script.main(["--corpus", str(corpus), "--out", str(tmp_path / "c.ngram")]) == 0
    expected = PyNGramModel(3, len(tok))
    for ids, val in records:
        if not val:
            expected.add(ids)
    model = ngram_cpp.load(tmp_path / "c.ngram")
    assert (model.total, model.num_nodes) == (expected.total, expected.num_nodes)
    assert model.prob([5, 6], 7) == 1.0  # the validation record's 5 6 -> 9 is not in the trie
    with pytest.raises(SystemExit):  # a corpus of another target's token ids
        script.main(["--corpus", str(corpus), "--tokenizer", "some/other-model", "--out", str(tmp_path / "x.ngram")])
