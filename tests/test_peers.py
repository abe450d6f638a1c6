"""llama.cpp as the bench's peer (dart_core/tools/peers.py): parsing of llama.cpp's real output (captured
from `make peers` binaries on the embedded GGUF, in tests/fixtures/llamacpp/), the skip when the
binaries are absent, and real runs of llama-completion (and the bench with it) where they are built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dart_core.cli import bench
from dart_core.tools import peers
from dart_core.tools.methods import split_method

from support import fake_bin_dir

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"
# The fixtures' prompt: the chat template applied to this message by the embedded target's tokenizer
REPEAT_PROMPT = "Repeat exactly, three times: the blue cat sat on the red mat."
EMBEDDED_EOS = frozenset({2})  # <|im_end|>
# What the captured stderr files say, copied from their lines by hand (not computed by the code under test)
PERF = {
    "completion": {"prompt_ms": 355.46, "eval_ms": 226.95, "sampling_ms": 1.56, "eval_runs": 9},
    "lookup": {"encoded_s": 0.354, "decoded_s": 0.189, "n_predict": 12, "n_drafted": 6, "n_accept": 6},
    "eagle3": {"encoded_s": 0.322, "decoded_s": 0.414, "n_predict": 10, "n_drafted": 21, "n_accept": 3, "n_draft": 3},
}


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.fixture(scope="module")
def tokenizer():
    from dart_core.loading import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": REPEAT_PROMPT}], tokenize=False, add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------- parsing, offline


def test_cpu_kind_from_flags():
    assert peers.cpu_kind("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_int8\n") == "avx512bf16"
    assert peers.cpu_kind("flags\t\t: fpu avx2 avx512f avx512bw\n") == "avx512"
    assert peers.cpu_kind("flags\t\t: fpu sse4_2 avx2 fma\n") == "avx2"
    assert peers.cpu_kind("flags\t\t: fpu sse4_2\n") == "generic"


def test_method_names_and_draft_lengths():
    assert peers.split_peer_method("llamacpp") == ("llamacpp", None)
    assert peers.split_peer_method("llamacpp-lookup@4") == ("llamacpp-lookup", 4)
    assert split_method("llamacpp-lookup@2") == ("llamacpp-lookup", 2)
    for bad in ("llamacpp@2", "llamacpp-lookup@0", "llamacpp-lookup@x", "llamacpp-foo", "llamacpp-ngram-mod@3"):
        with pytest.raises(ValueError):
            peers.split_peer_method(bad)


def test_parse_completion_stderr_real_capture():
    t = peers.parse_completion_stderr(fixture("completion_repeat.stderr"))
    # the capture's own perf lines, read back (prompt eval, eval + sampling, eval runs + 1)
    assert t.prompt_tokens == 45
    assert t.prefill_s == pytest.approx(PERF["completion"]["prompt_ms"] / 1e3)
    assert t.decode_s == pytest.approx((PERF["completion"]["eval_ms"] + PERF["completion"]["sampling_ms"]) / 1e3)
    assert t.new_tokens == PERF["completion"]["eval_runs"] + 1
    assert t.drafted is None and t.accepted is None


def test_parse_lookup_stderr_real_capture():
    t = peers.parse_speculative_stderr(fixture("lookup_repeat.stderr"))
    assert t.prompt_tokens == 45
    assert t.prefill_s == pytest.approx(PERF["lookup"]["encoded_s"])
    assert t.decode_s == pytest.approx(PERF["lookup"]["decoded_s"])
    assert (t.new_tokens, t.drafted, t.accepted) == (PERF["lookup"]["n_predict"], PERF["lookup"]["n_drafted"], PERF["lookup"]["n_accept"])
    assert t.accepted > 0  # this prompt repeats itself: llama-lookup's drafts are accepted


def test_parse_refuses_truncated_or_inconsistent_output():
    err = fixture("completion_repeat.stderr")
    with pytest.raises(peers.PeerError, match="eval time"):
        peers.parse_completion_stderr("\n".join(line for line in err.splitlines() if " eval time" not in line))
    lookup = fixture("lookup_repeat.stderr")
    with pytest.raises(peers.PeerError, match="n_accept"):
        peers.parse_speculative_stderr("\n".join(line for line in lookup.splitlines() if "n_accept" not in line))
    with pytest.raises(peers.PeerError, match="decoded"):
        peers.parse_speculative_stderr(lookup.replace("decoded", "produced"))


def test_outputs_read_back_to_the_same_ids(tmp_path, tokenizer, prompt):
    """The three binaries' captured outputs on one prompt: each re-tokenizes to the same ids, cut at
    the EOS; llama-lookup's drafts accepted past the EOS are not counted."""
    text, ids = prompt
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    bin_dir = fake_bin_dir(tmp_path)
    runs = {}
    for method, stem in (("llamacpp", "completion"), ("llamacpp-lookup", "lookup"), ("llamacpp-ngram-simple", "spec_ngram_simple")):
        peer = peers.LlamaCppPeer(method, bin_dir, gguf, 2, tokenizer, EMBEDDED_EOS)
        assert peer.prompt_text(ids) == text
        runs[method] = peer.read_output(ids, text, fixture(f"{stem}_repeat.stdout"), fixture(f"{stem}_repeat.stderr"), 48)
    plain, lookup, simple = runs["llamacpp"], runs["llamacpp-lookup"], runs["llamacpp-ngram-simple"]
    assert plain.stop == lookup.stop == simple.stop == "eos"
    assert plain.output_ids[-1] == 2 and plain.output_ids == lookup.output_ids == simple.output_ids
    assert tokenizer.decode(plain.output_ids, skip_special_tokens=True) == plain.text
    assert plain.new_tokens == len(plain.output_ids) == plain.target_forwards  # one token a forward
    assert lookup.after_eos == PERF["lookup"]["n_predict"] - len(lookup.output_ids) > 0
    assert lookup.new_tokens == len(lookup.output_ids)
    assert lookup.target_forwards == lookup.new_tokens - lookup.accepted < lookup.new_tokens


def test_prompt_mismatch_is_refused(tmp_path, tokenizer, prompt):
    text, ids = prompt
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    peer = peers.LlamaCppPeer("llamacpp", fake_bin_dir(tmp_path), gguf, 2, tokenizer, EMBEDDED_EOS)
    out, err = fixture("completion_repeat.stdout"), fixture("completion_repeat.stderr")
    with pytest.raises(peers.PeerError, match="prompt tokens"):
        peer.read_output(ids[1:], text, out, err, 48)  # llama.cpp read one token more than this prompt has
    swapped = list(ids)
    swapped[5] = swapped[5] + 1  # same length, another id: caught by --verbose-prompt's listing
    with pytest.raises(peers.PeerError, match="tokenized the prompt differently"):
        peer.read_output(swapped, text, out, err, 48)


# ------------------------------------------------------------------------------- absent binaries


def test_absent_binary_names_make_peers(tmp_path):
    reason = peers.unavailable("llamacpp-lookup", tmp_path, tmp_path / "x.gguf")
    assert "make peers" in reason and str(tmp_path / "llama-lookup") in reason
    with pytest.raises(peers.PeerError, match="make peers"):
        peers.LlamaCppPeer("llamacpp", tmp_path, tmp_path / "x.gguf", 2, None, EMBEDDED_EOS)
    assert "--gguf" in peers.unavailable("llamacpp", fake_bin_dir(tmp_path), None)


def test_eagle3_peer_reads_a_draft_gguf(tmp_path, tokenizer):
    """llamacpp-eagle3 runs llama-speculative-simple with our exported head as -md: without a draft
    file it cannot run, with one the command carries it, the spec type and the draft length."""
    gguf, draft = tmp_path / "model.gguf", tmp_path / "eagle3.gguf"
    gguf.write_bytes(b"GGUF")
    bin_dir = fake_bin_dir(tmp_path)
    assert "draft GGUF" in peers.unavailable("llamacpp-eagle3", bin_dir, gguf)
    assert "not found" in peers.unavailable("llamacpp-eagle3@2", bin_dir, gguf, draft)
    draft.write_bytes(b"GGUF")
    assert peers.unavailable("llamacpp-eagle3@2", bin_dir, gguf, draft) is None
    assert peers.unavailable("llamacpp", bin_dir, gguf) is None  # the draft matters only to the methods that read one
    with pytest.raises(peers.PeerError, match="draft GGUF"):
        peers.LlamaCppPeer("llamacpp-eagle3", bin_dir, gguf, 2, tokenizer, EMBEDDED_EOS)
    cmd = peers.LlamaCppPeer("llamacpp-eagle3@3", bin_dir, gguf, 2, tokenizer, EMBEDDED_EOS, draft=draft).command("hi", 8, 128)
    assert cmd[0].endswith("llama-speculative-simple")
    assert cmd[cmd.index("-md") + 1] == str(draft) and cmd[cmd.index("--spec-type") + 1] == "draft-eagle3"
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "3" and cmd[cmd.index("-td") + 1] == "2"
    plain = peers.LlamaCppPeer("llamacpp-lookup", bin_dir, gguf, 2, tokenizer, EMBEDDED_EOS, draft=draft).command("hi", 8, 128)
    assert "-md" not in plain


def test_eagle3_peer_real_capture(tmp_path, tokenizer, prompt):
    """llama.cpp's EAGLE3 drafting with our exported head: its summary parsed, its text read back to
    plain llama-completion's ids (the same answer), τ from its own accept count."""
    text, ids = prompt
    gguf, draft = tmp_path / "model.gguf", tmp_path / "eagle3.gguf"
    gguf.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    bin_dir = fake_bin_dir(tmp_path)
    peer = peers.LlamaCppPeer("llamacpp-eagle3@3", bin_dir, gguf, 1, tokenizer, EMBEDDED_EOS, draft=draft)
    r = peer.read_output(ids, text, fixture("spec_eagle3_repeat.stdout"), fixture("spec_eagle3_repeat.stderr"), 48)
    p = PERF["eagle3"]
    t = r.timings
    assert (t.prefill_s, t.decode_s, t.new_tokens, t.drafted, t.accepted, t.draft_max) == (
        p["encoded_s"],
        p["decoded_s"],
        p["n_predict"],
        p["n_drafted"],
        p["n_accept"],
        p["n_draft"],
    )
    plain = peers.LlamaCppPeer("llamacpp", bin_dir, gguf, 1, tokenizer, EMBEDDED_EOS).read_output(
        ids, text, fixture("completion_repeat.stdout"), fixture("completion_repeat.stderr"), 48
    )
    assert r.stop == "eos" and r.output_ids == plain.output_ids
    assert r.target_forwards == p["n_predict"] - p["n_accept"]


def test_bin_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv(peers.BIN_ENV, raising=False)
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))
    assert peers.resolve_bin_dir(None) == tmp_path / "llamacpp" / peers.cpu_kind() / "bin"
    monkeypatch.setenv(peers.BIN_ENV, str(tmp_path / "env"))
    assert peers.resolve_bin_dir(None) == tmp_path / "env"
    assert peers.resolve_bin_dir(tmp_path / "flag") == tmp_path / "flag"


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "questions.jsonl"
    path.write_text(json.dumps({"question_id": 1, "turns": [REPEAT_PROMPT]}) + "\n")
    return path


def test_bench_skips_absent_peers_and_runs_the_rest(questions, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main(
        [
            "--methods",
            "ar,llamacpp,llamacpp-lookup",
            "--llamacpp-bin",
            str(tmp_path / "nothing"),
            "--dataset",
            str(questions),
            "--max-new-tokens",
            "4",
            "--dtype",
            "float32",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| ar |" in printed and "| llamacpp |" not in printed
    assert printed.count("make peers") == 2
    result = json.loads(out.read_text())
    assert set(result["methods"]) == {"ar"}
    assert set(result["skipped"]) == {"llamacpp", "llamacpp-lookup"}
    assert result["methods"]["ar"]["decode_tokens_per_s"] > 0


# ------------------------------------------------------------------------------- real runs

BIN_DIR = peers.resolve_bin_dir(None)


def _require(method: str) -> None:
    from dart_core.loading import embedded_gguf_path

    reason = peers.unavailable(method, BIN_DIR, embedded_gguf_path())
    if reason:
        pytest.skip(reason)


@pytest.mark.peers
def test_real_llama_completion_on_the_embedded_gguf(tokenizer, prompt):
    _require("llamacpp")
    from dart_core.loading import embedded_gguf_path

    text, ids = prompt
    peer = peers.LlamaCppPeer("llamacpp", BIN_DIR, embedded_gguf_path(), 1, tokenizer, EMBEDDED_EOS)
    r = peer.generate(ids, max_new_tokens=8)
    assert r.timings.prompt_tokens == len(ids)  # no BOS added, no special token split
    assert 1 <= r.new_tokens <= 8 and r.timings.prefill_s > 0 and r.timings.decode_s > 0
    assert r.command[r.command.index("-t") + 1] == "1" and "--temp" in r.command
    # its text re-tokenizes to as many ids as it generated (what the comparison with ours relies on)
    assert len(r.output_ids) == r.new_tokens, (r.text, r.output_ids)


def run_bench(methods: str, questions, tmp_path) -> dict:
    """One real bench run (12 tokens, fp32, one thread) of `methods`; its JSON result."""
    out = tmp_path / "r.json"
    rc = bench.main(
        [
            "--methods",
            methods,
            "--dataset",
            str(questions),
            "--max-new-tokens",
            "12",
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.peers
def test_real_bench_eagle3_row(questions, tmp_path, capsys):
    """The bench exports the default EAGLE3 head for llama.cpp and runs it beside ours."""
    _require("llamacpp")
    result = run_bench("ar,llamacpp-eagle3@2", questions, tmp_path)
    rep = result["methods"]["llamacpp-eagle3@2"]
    assert rep["drafted"] > 0 and 0 <= rep["accepted_drafts"] <= rep["drafted"] and rep["tau"] >= 1.0
    assert result["env"]["llamacpp"]["draft_gguf"].endswith(".gguf")


@pytest.mark.peers
def test_real_bench_row_beside_ar(questions, tmp_path, capsys):
    _require("llamacpp-lookup")
    result = run_bench("ar,llamacpp,llamacpp-lookup", questions, tmp_path)
    printed = capsys.readouterr().out
    assert "| llamacpp |" in printed and "| llamacpp-lookup |" in printed
    assert "skipped" not in result
    for m in ("llamacpp", "llamacpp-lookup"):
        rep = result["methods"][m]
        assert rep["tokens_per_s"] > 0 and rep["decode_tokens_per_s"] > 0 and rep["tau"] >= 1.0
        assert rep["same_as_ar"].endswith("/1")
    assert result["methods"]["llamacpp"]["drafted"] is None
    assert result["methods"]["llamacpp-lookup"]["drafted"] >= result["methods"]["llamacpp-lookup"]["accepted_drafts"] >= 0
    assert result["env"]["llamacpp"]["bin_dir"] == str(BIN_DIR)
