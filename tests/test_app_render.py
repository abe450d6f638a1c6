"""The app's text and figure building, without a server: streaming decode of multi-byte characters,
HTML escaping and chunk spans, the bonus mark, and the tree layout."""

from __future__ import annotations

import html
import random
import re

import pytest

from app import plots, render
from app.engine import INCOMPLETE_CHAR, Run, Step, append_step
from dart_core import DraftTree, StageTimes, StepEvent

MULTIBYTE = "héllo 🌊 wörld — 日本語 <b>&amp;</b>"


@pytest.fixture(scope="module")
def tokenizer():
    from dart_core import load_tokenizer

    return load_tokenizer("default")


def run_from_steps(tokenizer, token_groups: list[list[int]], accepted: list[int]) -> Run:
    run = Run("dart")
    for i, (tokens, acc) in enumerate(zip(token_groups, accepted)):
        append_step(run, StepEvent(i, tokens, acc, None, [], StageTimes()), tokenizer)
    return run


def visible_text(chunks_html: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", chunks_html)).removesuffix("▍")


def test_streamed_text_never_shows_a_broken_character(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert any(INCOMPLETE_CHAR in tokenizer.decode([t]) for t in ids)  # the sample does split characters
    run = Run("ar")
    seen = []
    for i, t in enumerate(ids):
        append_step(run, StepEvent(i, [t], 0, None, [], StageTimes()), tokenizer)
        seen.append(run.text)
    assert seen[-1] == MULTIBYTE
    for text in seen:
        assert INCOMPLETE_CHAR not in text and MULTIBYTE.startswith(text)


def test_chunks_are_escaped_and_cover_the_text_once(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    rng = random.Random(0)
    groups, accepted, i = [], [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        groups.append(ids[i : i + n])
        accepted.append(len(groups[-1]) - 1)
        i += n
    run = run_from_steps(tokenizer, groups, accepted)
    out = render.render_chunks(run)
    assert "<b>" not in out.replace('<span class="bonus">', "")  # the model's "<b>" is text, escaped
    assert visible_text(out) == MULTIBYTE
    spans = [s.span for s in run.steps]
    assert all(a[2] <= b[0] for a, b in zip(spans, spans[1:]))  # chunks never overlap


def test_the_bonus_is_marked_only_after_accepted_drafts(tokenizer):
    a, b, c, d = (tokenizer.encode(w, add_special_tokens=False)[0] for w in (" one", " two", " three", " four"))
    run = run_from_steps(tokenizer, [[a], [b, c], [d]], [0, 1, 0])
    out = render.render_chunks(run)
    assert out.count('class="bonus"') == 1
    assert re.search(r'<span class="bonus"> three</span>', out)
    assert [s.has_bonus for s in run.steps] == [True, True, True]
    cut = run_from_steps(tokenizer, [[a], [b, c]], [0, 2])  # a stop cut the step before its bonus
    assert 'class="bonus"' not in render.render_chunks(cut) and not cut.steps[1].has_bonus


def random_tree(rng: random.Random, n: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return DraftTree.from_parents(list(range(100, 100 + n)), parents)


@pytest.mark.parametrize("seed", range(20))
def test_tree_layout_never_crosses_edges(seed):
    tree = random_tree(random.Random(seed), 40)
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    y = plots.tree_layout(parents, lambda i: i)
    for d in range(1, max(depths) + 1):
        level = sorted((i for i in range(len(parents)) if depths[i] == d), key=lambda i: -y[i])
        parent_y = [y[parents[i]] for i in level]
        assert parent_y == sorted(parent_y, reverse=True)  # top-to-bottom order of children follows their parents'
        assert len({y[i] for i in level}) == len(level)  # no two nodes of a level overlap


def fake_step(tree: DraftTree, path: list[int], info: dict) -> Step:
    times = {"draft": 0.01, "prune": 0.002, "verify": 0.05, "other": 0.001}
    return Step(1, [0] * len(path), len(path) - 1, (0, 0, 0), tree, path, times, info, 0.1)


def test_tree_figure_colours_by_draft_probability_when_known(tokenizer):
    tree = DraftTree.from_parents([5, 6, 7, 8, 9], [-1, 0, 0, 1, 1], [0.0, -0.1, -2.0, -0.3, -1.5])
    info = {"topk_tokens": [[6, 7, 11], [8, 9, 12]], "topk_probs": [[0.7, 0.2, 0.1], [0.6, 0.3, 0.1]]}
    run = Run("dart", steps=[fake_step(DraftTree.root_only(4), [0], {}), fake_step(tree, [0, 1, 3], info)])
    assert plots.node_draft_probs(run.steps[1], "dart") == [None, 0.7, 0.2, 0.6, 0.3]
    fig = plots.tree_figure(run, None, tokenizer)
    assert "2 accepted" in fig.layout.title.text
    no_scores = Run("other", steps=[fake_step(DraftTree.from_parents([5, 6, 7], [-1, 0, 1]), [0], {})])
    assert plots.node_draft_probs(no_scores.steps[0], "other") == [None, None, None]
    plots.tree_figure(no_scores, 0, tokenizer, plots.COLOUR_BY[1])  # no scores, no top-k: still drawn
    eagle = Run("eagle3", steps=[fake_step(tree, [0], {})])
    probs = plots.node_draft_probs(eagle.steps[0], "eagle3")
    assert probs[3] == pytest.approx(2.718281828 ** (-0.3 + 0.1))  # cumulative log-probs: own = exp(child - parent)


@pytest.mark.slow
def test_an_abandoned_stream_does_not_hold_the_engine(embedded_target):
    """A cancelled request's generator may be dropped without being closed (its thread abandoned
    mid-run); the next request must still run to the end."""
    import threading

    from app.engine import Engine

    engine = Engine(embedded_target, {}, max_new_tokens=8)
    req = engine.request([{"role": "user", "content": "Say hello."}], "ar", 8, 0.0, 1.0, 0)
    abandoned = engine.stream(req)
    first = next(abandoned)  # mid-run, kept alive, never closed
    assert not first.done
    done = {}
    worker = threading.Thread(target=lambda: done.setdefault("run", engine.complete(req)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the second request is blocked behind the abandoned one"
    assert done["run"].done and done["run"].new_tokens >= 1


def test_tree_figure_marks_nodes_from_the_context(tokenizer):
    # nodes 1 and 3 are accepted; 2 came from the context alone, 3 from head and context
    tree = DraftTree.from_parents([5, 6, 7, 8], [-1, 0, 0, 1], [0.0, -0.1, -0.5, -0.3])
    info = {"topk_tokens": [[6, 11]], "topk_probs": [[0.7, 0.3]], "sources": [0, 0, 2, 1]}
    run = Run("dart", steps=[fake_step(tree, [0, 1, 3], info)])
    assert plots.node_sources(run.steps[0]) == [0, 0, 2, 1]
    fig = plots.tree_figure(run, None, tokenizer)
    symbols = {tuple(t.marker.symbol) for t in fig.data if t.mode == "markers+text" and isinstance(t.marker.symbol, tuple)}
    assert ("square",) in symbols  # the drafted, not accepted node 2: the context's alone
    assert ("diamond", "star-diamond") in symbols  # the accepted path: a head node, then one the context supported
    assert any("from the context n-gram" in h for t in fig.data if t.hovertext for h in t.hovertext)
    no_info = Run("dart", steps=[fake_step(tree, [0], {"sources": [0, 1]})])  # a wrong length is ignored, not trusted
    assert plots.node_sources(no_info.steps[0]) == [0, 0, 0, 0]


def test_a_stopped_run_says_so_and_loses_its_cursor():
    run = Run("dart", text="partial")
    assert render.CURSOR in render.render_chunks(run) and render.GENERATING in render.stats_text(run, None)
    run.stopped = True
    assert render.CURSOR not in render.render_chunks(run)
    assert render.stats_text(run, None).endswith(render.STOPPED)
    panes = render.compare_html([run], [None], ["EAGLE3"], stopped=True)
    assert "not run: " + render.STOPPED in panes and "waiting for" not in panes


def test_stop_signals_reach_only_their_session_and_forget_finished_turns():
    from app.ui import StopSignals

    stops = StopSignals()
    a1, b1 = stops.arm("a"), stops.arm("b")
    a2 = stops.arm("a")  # a second turn of session a, queued behind the first
    assert not any(stops.stopped(t) for t in (a1, a2, b1))
    stops.start(a1)
    assert stops.stop("a") == (1, 1)  # one running, one queued
    assert stops.stopped(a1) and stops.stopped(a2) and not stops.stopped(b1)
    stops.disarm(a1)
    a3 = stops.arm("a")  # a new turn starts clean; a2, stopped but not yet run, still reads as stopped
    assert not stops.stopped(a3) and stops.stopped(a2)
    assert stops.stop("nobody") == (0, 0)
    for t in (a2, a3, b1):
        stops.disarm(t)
    assert len(stops) == 0 and stops.stopped(a3)  # an unknown (finished) turn reads as stopped


@pytest.mark.slow
def test_every_step_runs_on_the_compute_thread(embedded_target, monkeypatch):
    """Whichever thread consumes a stream (Gradio advances a handler from a pool of worker threads),
    each step of the loop runs on the engine's one compute thread."""
    import threading

    from app import engine as engine_module
    from app.engine import ComputeThread, Engine

    seen = []
    loop = engine_module.generate

    def recording(*args, **kwargs):
        for event in loop(*args, **kwargs):
            seen.append(threading.current_thread().name)
            yield event

    monkeypatch.setattr(engine_module, "generate", recording)
    compute = ComputeThread()
    engine = Engine(embedded_target, {}, max_new_tokens=6, compute=compute)
    req = engine.request([{"role": "user", "content": "Say hello."}], "ar", 6, 0.0, 1.0, 0)
    stream = engine.stream(req)
    first_done = next(stream).done  # a step from this thread (the Run is updated in place), the rest from another
    rest = []
    worker = threading.Thread(target=lambda: rest.extend(stream), name="gradio-worker")
    worker.start()
    worker.join(timeout=120)
    assert rest and rest[-1].done and not first_done
    names = set(seen)
    assert len(seen) >= 3 and len(names) == 1 and names.pop().startswith("engine")
    assert compute.run(threading.current_thread) is not threading.current_thread()


def test_the_why_view_shows_the_verify_cost_by_rows_per_weights_path():
    gguf = {k: 10.0 + 2.0 * (k - 1) for k in range(1, 18)}
    bf16 = {k: 15.0 + 1.0 * (k - 1) for k in range(1, 18)}
    view = render.CostView(
        (render.CostPath("gguf (Q4_1, Q8_0)", gguf, 3, 120.0, True), render.CostPath("bfloat16", bf16, 4, 95.0)), "measured <here>"
    )
    out = render.verify_cost_html(view, "why <this>")
    assert "gguf (Q4_1, Q8_0) (runs)" in out and "4 rows: 16.0 ms (1.60×)" in out and "5 rows: 19.0 ms (1.27×)" in out
    assert "120 tok/s" in out and "95 tok/s" in out and "17 rows" in out
    assert "&lt;here&gt;" in out and "&lt;this&gt;" in out and "<here>" not in out  # escaped
    fig = plots.verify_cost_figure(view)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["gguf (Q4_1, Q8_0) (runs)", "bfloat16"] and list(lines[0].x) == list(range(1, 18))
    stars = [t for t in fig.data if t.mode == "markers+text"]  # each path's DART tree, at its verify's row count
    assert [(t.x[0], t.text[0]) for t in stars] == [(4, "DART 3 nodes"), (5, "DART 4 nodes")]
    assert "not measured" in plots.verify_cost_figure(None).layout.title.text
    assert "not on the CPU kernels" in render.verify_cost_html(None, "not on the CPU kernels")


def test_the_why_view_of_an_auto_choice():
    from app.launch import cost_view
    from dart_core.tools import calibrate

    def path(dtype, weights, ms, best, tps):
        table = [{"nodes": n, "tokens_per_s": t} for n, t in tps.items()]
        return {
            "dtype": dtype,
            "weights": weights,
            "forward_ms": {str(k): v for k, v in ms.items()},
            "measured_at": "then",
            "plain_tokens_per_s": 1e3 / ms[1],
            "dart": {"max_nodes": best, "table": table},
            "tokens_per_s": max(tps.values()),
        }

    choice = calibrate.WeightsChoice(
        "gguf",
        "gguf (Q4_1, Q8_0): faster",
        calibrated=True,
        rule="dart",
        paths=[
            path("gguf", "gguf (Q4_1, Q8_0)", {1: 10.0, 2: 11.0, 3: 12.0}, 2, {1: 100.0, 2: 110.0}),
            path("bfloat16", "bfloat16", {1: 15.0, 2: 15.5, 3: 16.0}, 2, {1: 80.0, 2: 95.0}),
        ],
    )
    # DART runs 1 node here (e.g. --max-nodes 1): the chosen path shows that size, the other its own best
    view, note = cost_view(None, choice, 1, None)
    assert "gguf (Q4_1, Q8_0): faster" in note and "--dtype auto" in note
    assert [(p.weights, p.nodes, p.expected_tps, p.chosen) for p in view.paths] == [
        ("gguf (Q4_1, Q8_0)", 1, 100.0, True),
        ("bfloat16", 2, 95.0, False),
    ]
    assert view.paths[0].ms == {1: 10.0, 2: 11.0, 3: 12.0}


def test_the_header_says_whether_the_heads_had_equal_training(tmp_path):
    """The heads line names each loaded head's run and step (its trained.json) and says whether DART
    and EAGLE3 trained the same number of steps; a head without the file says its training is unknown;
    a malformed file is a note, and the app still starts."""
    from app.launch import heads_line

    dart, eagle3 = tmp_path / "dart", tmp_path / "eagle3"
    dart.mkdir(), eagle3.mkdir()
    (dart / "trained.json").write_text('{"run": "dart-v1", "step": 50473, "elapsed_s": 28800}')
    (eagle3 / "trained.json").write_text('{"run": "eagle3-v1", "step": 50473, "elapsed_s": 90000}')
    notes = []
    line = heads_line({"dart": dart, "eagle3": eagle3}, notes)
    assert line == (
        "Heads: DART dart-v1 at step 50,473, 8.0 training hours; EAGLE3 eagle3-v1 at step 50,473, 25.0 training hours: "
        "the same number of training steps, on the same corpus."
    )
    (eagle3 / "trained.json").write_text('{"run": "eagle3-v1", "step": 12188}')
    assert heads_line({"dart": dart, "eagle3": eagle3}, notes).endswith(
        "EAGLE3 eagle3-v1 at step 12,188: unequal training, so compare mode does not show an equal-budget comparison."
    )
    (eagle3 / "trained.json").unlink()
    assert heads_line({"eagle3": eagle3}, notes) == f"Heads: EAGLE3 {eagle3} (no trained.json: its training is unknown)."
    (eagle3 / "trained.json").write_text("{broken")
    assert heads_line({"eagle3": eagle3}, notes) is None and "EAGLE3 head's training record is unreadable" in notes[0]
    assert not heads_line({}, [])
