"""The app's llama.cpp row in compare mode (app/engine.py Peer, PeerResult; app/render.py; the
--compare-llamacpp flag in app/launch.py).

Offline: the panes and the summary table built from real llama.cpp output (the captured stdout and
stderr in tests/fixtures/llamacpp/, read by dart_core.tools.peers.LlamaCppPeer.read_output through the
engine's own run_peer), failures shown rather than raised, and the header's reason when the binaries
are absent. Where `make peers` has built the binaries: a real compare turn with the embedded model
whose summary has the llama.cpp row."""

from __future__ import annotations

import html
import re
import threading
from argparse import Namespace
from pathlib import Path

import pytest

from app import render
from app.engine import Engine, Peer, PeerResult, Run, append_step, peer_label
from dart_core import StageTimes, StepEvent, Summary
from dart_core.tools import peers

from support import fake_bin_dir

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"
# the fixtures' prompt (tests/fixtures/llamacpp/README.md): this message, the chat template applied
FIXTURE_MESSAGES = [{"role": "user", "content": "Repeat exactly, three times: the blue cat sat on the red mat."}]
FIXTURE_MAX_NEW = 48
# What the captured completion_repeat.stderr says, copied from its lines by hand (not computed by the code under test)
COMPLETION_MS = {"prompt": 355.46, "eval": 226.95, "sampling": 1.56, "eval_runs": 9}


class FixtureRunner:
    """A LlamaCppPeer whose generate() reads the captured output instead of running the binary: the
    ids the engine passes must be the fixture's prompt (read_output checks the count and, for
    llama-completion, every id), and the thread it runs on is recorded."""

    def __init__(self, peer: peers.LlamaCppPeer, stem: str):
        self.peer, self.stem, self.calls = peer, stem, []

    @property
    def exe(self) -> Path:
        return self.peer.exe

    def generate(self, ids, max_new_tokens, sampling=None):
        self.calls.append((list(ids), max_new_tokens, sampling, threading.current_thread().name))
        out, err = ((FIXTURES / f"{self.stem}_repeat.{ext}").read_text() for ext in ("stdout", "stderr"))
        return self.peer.read_output(
            ids, self.peer.prompt_text(ids), out, err, max_new_tokens, 1.25, self.peer.command("…", max_new_tokens, 221)
        )


class FailingRunner:
    def __init__(self, error: Exception):
        self.error = error

    def generate(self, ids, max_new_tokens, sampling=None):
        raise self.error


def fixture_peer(tmp_path, target, method: str, stem: str) -> Peer:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    bin_dir = tmp_path / "bin" if (tmp_path / "bin").exists() else fake_bin_dir(tmp_path)
    runner = peers.LlamaCppPeer(method, bin_dir, gguf, 1, target.tokenizer, target.eos_ids)
    return Peer(method, peer_label(method), FixtureRunner(runner, stem), 1)


def ar_run(tokenizer, ids: list[int], engine_s: float) -> Run:
    """An AR run producing `ids`, one token per forward, in `engine_s` seconds."""
    run = Run("ar")
    for i, t in enumerate(ids):
        append_step(run, StepEvent(i, [t], 0, None, [], StageTimes()), tokenizer)
    run.engine_s = engine_s
    run.summary = Summary(0, list(ids), len(ids), engine_s, 0.0, StageTimes(), "eos")
    return run


def cells(summary: str, label: str) -> list[str]:
    """The text of the summary row whose first cell is `label`."""
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", summary, re.S):
        tds = [html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        if tds and tds[0] == label:
            return tds
    raise AssertionError(f"no row {label!r} in {summary}")


def test_llamacpp_row_from_real_output(embedded_target, tmp_path):
    """The plain llama.cpp run of the fixtures' prompt, through Engine.run_peer: the same prompt ids as
    the engine's, run on the compute thread; its row counts with llama.cpp's own numbers."""
    peer = fixture_peer(tmp_path, embedded_target, "llamacpp", "completion")
    engine = Engine(embedded_target, {}, max_new_tokens=FIXTURE_MAX_NEW, peers=[peer])
    req = engine.request(FIXTURE_MESSAGES, "ar", FIXTURE_MAX_NEW, 0.0, 1.0, 0)
    r = engine.run_peer(req, "llamacpp")
    ((ids, max_new, sampling, thread),) = peer.runner.calls
    assert ids == embedded_target.encode(FIXTURE_MESSAGES) and max_new == FIXTURE_MAX_NEW and sampling.greedy
    assert thread.startswith("engine")  # the compute thread: never beside an engine step
    assert isinstance(r, PeerResult) and r.done and r.error is None and not r.live
    assert r.label == "llama.cpp (same GGUF)" == engine.label("llamacpp")
    new = COMPLETION_MS["eval_runs"] + 1
    seconds = (COMPLETION_MS["prompt"] + COMPLETION_MS["eval"] + COMPLETION_MS["sampling"]) / 1e3
    assert (r.new_tokens, r.forwards, r.stop_reason) == (new, new, "eos")
    assert r.engine_s == pytest.approx(seconds) and r.tokens_per_s == pytest.approx(new / seconds)
    assert r.text == "The blue cat sat on the red mat." and r.output_ids[-1] in embedded_target.eos_ids

    tok = embedded_target.tokenizer
    ar = ar_run(tok, r.output_ids, engine_s=0.25)  # the same ids as llama.cpp's, 4× its speed
    speedups = [engine.speedup(x, ar) for x in (ar, r)]
    assert speedups[0] is None and speedups[1] == pytest.approx(r.tokens_per_s / ar.tokens_per_s)
    summary = render.summary_html([ar, r], speedups, greedy=True, exact=True)
    row = cells(summary, "llama.cpp (same GGUF)")
    assert row[1:] == [str(new), str(new), "1.00", f"{seconds:.2f} s", f"{new / seconds:.1f}", f"{speedups[1]:.2f}×", "yes*"]
    assert "promises no bit-exactness" in summary and "not a bug" in summary
    other = ar_run(tok, r.output_ids[:-2] + [tok.encode(" dog", add_special_tokens=False)[0], r.output_ids[-1]], 0.25)
    assert cells(render.summary_html([other, r], speedups, greedy=True, exact=True), "llama.cpp (same GGUF)")[-1] == "no*"
    assert "eager path" not in render.summary_html([other, r], speedups, greedy=True, exact=False)  # that note is about our methods
    assert "same text" not in render.summary_html([ar, r], speedups, greedy=False, exact=True)

    panes = render.compare_html([ar, r], speedups, [])
    assert "The blue cat sat on the red mat." in panes and "llama-completion, 1 thread" in panes
    assert f"prefill {COMPLETION_MS['prompt'] / 1e3:.2f} s" in panes and "model load included" in panes
    assert render.stats_text(r, speedups[1]).endswith("stopped: eos")


def test_lookup_row_counts_accepted_drafts(embedded_target, tmp_path):
    """Another peer method by name (llama-lookup): its forwards are its tokens less the drafts it accepted."""
    peer = fixture_peer(tmp_path, embedded_target, "llamacpp-lookup", "lookup")
    engine = Engine(embedded_target, {}, max_new_tokens=FIXTURE_MAX_NEW, peers=[peer])
    r = engine.run_peer(engine.request(FIXTURE_MESSAGES, "ar", FIXTURE_MAX_NEW, 0.0, 1.0, 0), "llamacpp-lookup")
    assert r.label == "llama.cpp lookup (same GGUF)"
    assert r.forwards == r.new_tokens - r.peer.accepted < r.new_tokens and r.tau > 1.0
    row = cells(render.summary_html([r], [None], greedy=True, exact=True), r.label)
    assert row[2:4] == [str(r.forwards), f"{r.tau:.2f}"]
    # at temperature > 0 it gets the same sampling settings, and its pane says whose sampler drew the tokens
    sampled = engine.run_peer(engine.request(FIXTURE_MESSAGES, "ar", FIXTURE_MAX_NEW, 0.7, 0.9, 40), "llamacpp-lookup")
    assert peer.runner.calls[-1][2].temperature == 0.7 and peer.runner.calls[-1][2].top_k == 40 and sampled.sampled
    assert render.PEER_SAMPLED in html.unescape(render.compare_html([sampled], [None], []))
    assert render.PEER_SAMPLED not in html.unescape(render.compare_html([r], [None], []))


def test_a_running_peer_then_a_failed_one_are_shown_not_raised(embedded_target):
    engine = Engine(
        embedded_target,
        {},
        max_new_tokens=8,
        peers=[
            Peer("llamacpp", peer_label("llamacpp"), FailingRunner(peers.PeerError("llama-completion timed out after 180 s")), 1),
            Peer("llamacpp-lookup", peer_label("llamacpp-lookup"), FailingRunner(FileNotFoundError("llama-lookup vanished")), 1),
        ],
    )
    req = engine.request([{"role": "user", "content": "Say hi."}], "ar", 8, 0.0, 1.0, 0)
    running = PeerResult("llamacpp", peer_label="llama.cpp (same GGUF)")
    assert running.live and render.RUNNING_PEER in render.stats_text(running, None)
    assert render.RUNNING_PEER in render.compare_html([running], [None], [])
    for method, why in (("llamacpp", "timed out after 180 s"), ("llamacpp-lookup", "FileNotFoundError: llama-lookup vanished")):
        r = engine.run_peer(req, method)
        assert r.done and r.peer is None and why in r.error and engine.speedup(r) is None
        assert render.stats_text(r, None).endswith("stopped: " + render.PEER_FAILED)
        assert why in render.compare_html([r], [None], []) and 'class="gen peer-error"' in render.compare_html([r], [None], [])
        assert why in cells(render.summary_html([r], [None], greedy=True, exact=True), r.label)[1]


def test_the_header_says_why_there_is_no_llamacpp_row(tmp_path, monkeypatch):
    """--compare-llamacpp with no binaries: the app builds anyway and its header's notes give the reason
    (naming `make peers`); without the flag, a plain line says the same; --no-compare-llamacpp says it is off."""
    import gradio as gr

    from app.launch import build_app, load_peers, parse_args

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(peers.BIN_ENV, str(empty))
    demo, loaded, settings = build_app(parse_args(["--compare-llamacpp", "--no-warmup", "--no-calibration", "--dtype", "float32"]))
    assert not loaded.engine.peers and settings.peers_line is None
    header = " ".join(b.value for b in demo.blocks.values() if isinstance(b, gr.HTML) and isinstance(b.value, str))
    assert "--compare-llamacpp was given, but llama.cpp cannot run here" in header
    assert html.escape(str(empty / "llama-completion")) in header and "make peers" in header
    assert settings.heads_line and "Heads: DART dart-v1 at step " in header  # the embedded head's trained.json

    def line(*argv):
        args, notes = parse_args(list(argv)), []
        found, text = load_peers(args, None, True, notes, lambda _: None)
        assert not found
        return text, notes

    text, notes = line()  # the default: on where it can run; here it cannot, and says so without a warning
    assert not notes and text.startswith("No llama.cpp row in compare mode: llama.cpp cannot run here.") and "make peers" in text
    text, notes = line("--no-compare-llamacpp")
    assert not notes and "--no-compare-llamacpp" in text
    monkeypatch.setenv(peers.BIN_ENV, str(fake_bin_dir(tmp_path)))
    text, notes = line("--compare-llamacpp", "--gguf", str(tmp_path / "missing.gguf"))
    assert text is None and "GGUF file" in notes[0] and "missing.gguf" in notes[0]
    with pytest.raises(SystemExit):
        parse_args(["--llamacpp-methods", "llamacpp,llamacpp-nope"])


def test_gguf_label_names_another_file(tmp_path):
    from app.launch import llamacpp_gguf

    other = tmp_path / "other.Q8_0.gguf"
    assert llamacpp_gguf(Namespace(gguf=other), default_target=False) == (other, "other.Q8_0.gguf")
    assert llamacpp_gguf(Namespace(gguf=None), default_target=False) == (None, "same GGUF")
    assert peer_label("llamacpp-lookup@4", other.name) == "llama.cpp lookup@4 (other.Q8_0.gguf)"


def _llamacpp_reason() -> str | None:
    from dart_core.loading import embedded_gguf_path

    try:
        gguf = embedded_gguf_path()
    except FileNotFoundError as e:
        return str(e)
    return peers.unavailable("llamacpp", peers.resolve_bin_dir(None), gguf)


@pytest.mark.peers
def test_real_compare_turn_with_the_llamacpp_row(embedded_target):
    """End to end where `make peers` has built llama.cpp: a compare turn (AR, then llama.cpp) with the
    embedded model through the app's own handler; the final frame's summary has the llama.cpp row."""
    reason = _llamacpp_reason()
    if reason:
        pytest.skip(reason)
    import torch

    from app.launch import load_peers, parse_args
    from app.ui import DemoApp, Settings

    engine = Engine(embedded_target, {}, max_new_tokens=16)
    found, line = engine.compute.run(load_peers, parse_args([]), embedded_target, True, [], lambda _: None)
    assert [p.method for p in found] == ["llamacpp"] and "on because its binaries are built" in line
    assert found[0].threads == engine.compute.run(torch.get_num_threads)  # the engine's thread count
    engine.peers = {p.method: p for p in found}
    app = DemoApp(engine, Settings("embedded", 16, compare=True, pruner=None, exact=True, peers_line=line))
    app.build()
    turn = app.stops.arm("test")
    frames = list(app.respond(turn, "Name three colours.", [], [], "ar", True, True, 0.0, 1.0, 0, 16))
    assert any(render.RUNNING_PEER in f[app.panes] for f in frames[:-1])  # shown while its subprocess ran
    final = frames[-1]
    ar, peer = final[app.runs]
    assert ar.method == "ar" and isinstance(peer, PeerResult) and peer.error is None, peer.error
    assert 1 <= peer.new_tokens <= 16 and peer.engine_s > 0 and peer.peer.timings.prefill_s > 0
    row = cells(final[app.summary], "llama.cpp (same GGUF)")
    assert row[1] == str(peer.new_tokens) and row[3] == "1.00" and row[-1] in ("yes*", "no*")
    assert peer.text in html.unescape(final[app.panes])
    assert [t.name.split(" ")[0] for t in final[app.speed_plot].data] == ["AR"]  # the plots: the engine's methods only


def test_vllm_rows_are_named_drawn_and_checked(embedded_target, tmp_path, monkeypatch):
    """The app's vLLM rows (--compare-vllm) offline: the flag's methods are checked as the bench's, a
    vLLM run's pane says how vLLM timed it and how many drafts it accepted, its failure names vLLM, and
    the summary's footnote is vLLM's (the real engine: tests/test_vllm.py)."""
    from app.engine import vllm_label
    from app.launch import load_vllm_peers, parse_args
    from dart_core.tools.vllm_peer import VllmRun

    assert vllm_label("vllm-dart@2") == "vLLM DART (plugin)@2 (converted checkpoint, fp32)"
    assert vllm_label("vllm", "bfloat16") == "vLLM (converted checkpoint, bf16)"
    assert parse_args(["--compare-vllm", "vllm, vllm-dart@2"]).compare_vllm == ["vllm", "vllm-dart@2"]
    assert parse_args([]).compare_vllm == [] and load_vllm_peers(parse_args([]), None, None, [], print) == ([], None)
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))  # no vLLM venv there: a note naming `make vllm`, no row, no error
    notes = []
    assert load_vllm_peers(parse_args(["--compare-vllm", "vllm"]), embedded_target, None, notes, print) == ([], None)
    assert len(notes) == 1 and "--compare-vllm was given" in notes[0] and "make vllm" in notes[0]
    monkeypatch.undo()
    for bad in ("vllm@2", "vllm-dart@0", "vllm-medusa", "vllm,vllm"):
        with pytest.raises(SystemExit):
            parse_args(["--compare-vllm", bad])
    run = VllmRun([5, 6, 7], "a b c", "length", 0.25, 0.5, 0.8, 4, 2, 2)
    r = PeerResult("vllm-dart@2", peer_label=vllm_label("vllm-dart@2"), threads=2)
    r.peer, r.text, r.output_ids, r.engine_s = run, run.text, run.output_ids, run.wall_s
    assert r.forwards == 3 and r.stop_reason == "max_new_tokens" and r.tokens_per_s == pytest.approx(4.0)
    pane = render.compare_html([r], [None], [])
    assert "a b c" in pane and "prefill 0.25 s + decode 0.50 s by its request metrics; 2 of 4 drafted tokens accepted" in pane
    assert "running vLLM…" in render.stats_text(PeerResult("vllm"), None)
    failed = PeerResult("vllm", peer_label=vllm_label("vllm"), error="VllmError: no answer in 300 s")
    assert render.stats_text(failed, None).endswith("stopped: vLLM failed")
    ar = ar_run(embedded_target.tokenizer, [5, 6, 7], 0.1)
    summary = render.summary_html([ar, r], [None, None], greedy=True, exact=True)
    assert cells(summary, r.label)[-1] == "yes*" and "vLLM runs the converted checkpoint" in summary and "llama.cpp promises" not in summary
