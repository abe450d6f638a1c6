"""The Gradio Blocks over an already-loaded Engine: chat, compare panes, plots and the /generate API.

Nothing here loads a model; `dart-app` (app/launch.py) does, once, then calls `build_demo`.
Every generation event shares one concurrency group of size 1, so requests queue for the one target.
"""

from __future__ import annotations

import html
import itertools
import threading
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import gradio as gr

from dart_core import kernels

from . import plots, render
from .engine import Engine, PeerResult, RequestError, Run, method_label

CSS_PATH = Path(__file__).with_name("style.css")
ENGINE_QUEUE = "engine"  # the one concurrency group every generation joins
TEXT_EVERY_S = 0.08  # stream text at most this often (the engine keeps running between frames)
QUEUED_STOP = "stopped by you while it waited for the engine: it will not run"
PLOTS_EVERY_S = 1.0  # redraw the plots at most this often while streaming; always at the end
EXAMPLES = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in three sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for a job interview.",
]
INTRO = (
    "A small draft head guesses several future tokens in **one** forward pass; an n-gram guided beam search turns the "
    "guesses into a tree; the target model checks the whole tree in **one** forward and keeps the longest branch it "
    "agrees with. The output is exactly the target's own (lossless), with fewer target forwards. "
    "Each shaded chunk below is one target forward."
)
LEGEND = (
    '<div class="legend">'
    '<div><span class="chunk c0">one forward</span><span class="chunk c1">the next</span> each shaded chunk is one target forward</div>'
    '<div><span class="chunk c0">accepted drafts<span class="bonus"> own</span></span> underlined: '
    "the target's own token after the drafts it accepted</div>"
    "<div>τ = tokens per target forward; speeds count engine time only</div>"
    "<div>draft tree: ● the head's guess, ★ a guess the conversation's own text also suggested, ■ a repeat of the "
    "conversation proposed by the context n-gram alone (green: accepted)</div>"
    "</div>"
)


@dataclass(frozen=True)
class Settings:
    """What the UI needs to know beyond the engine."""

    target_label: str  # how the header names the target model
    default_new_tokens: int
    compare: bool  # compare mode on at start (--compare-eagle3)
    pruner: str | None  # "C++" or "pure Python" (None: no DART head loaded)
    exact: bool  # greedy texts must match AR's bit for bit (the CPU kernel path, or float32)
    notes: tuple[str, ...] = ()  # shown under the header: missing heads, fallbacks, ignored flags
    threads: int | None = None  # the engine's torch CPU threads (None: not set, e.g. on a GPU)
    peers_line: str | None = None  # the header's line on the llama.cpp row: what runs, or why none does
    tree_line: str | None = None  # the header's line on the tree sizes calibrated on this machine
    weights_line: str | None = None  # the header's line on the weights path: chosen on this machine (--dtype auto), or given
    costs: render.CostView | None = None  # the "why" view: forward cost by rows per weights path, from the calibration
    costs_note: str = ""  # what the "why" view shows, or why it has no table
    heads_line: str | None = None  # the header's line on the heads' training steps (app/launch.py heads_line)


class StopSignals:
    """The Stop button's reach: every turn a browser session has queued or running.

    A turn is armed the moment Send is clicked (before it waits in the engine queue) and gets an id;
    Stop sets the flag of every armed turn of its session; the turn itself checks its flag before each
    frame and ends with a frame saying it was stopped (at once if it is running; when its place in the
    queue comes if it is waiting). The stop is cooperative on purpose: cancelling the Gradio event
    instead lets frames still in flight arrive after the stop was shown."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._turns: dict[int, _Turn] = {}

    def arm(self, session: str) -> int:
        with self._lock:
            # turns of this session already stopped are over or about to be: an unknown id reads as stopped
            for turn in [t for t, x in self._turns.items() if x.session == session and x.flag.is_set()]:
                del self._turns[turn]
            turn = next(self._ids)
            self._turns[turn] = _Turn(session)
            return turn

    def start(self, turn: int) -> None:
        """The turn left the queue and runs."""
        with self._lock:
            if turn in self._turns:
                self._turns[turn].started = True

    def stop(self, session: str) -> tuple[int, int]:
        """Flag every armed turn of `session`; returns how many of them (were running, were queued)."""
        with self._lock:
            turns = [x for x in self._turns.values() if x.session == session]
        for x in turns:
            x.flag.set()
        running = sum(x.started for x in turns)
        return running, len(turns) - running

    def stopped(self, turn: int) -> bool:
        with self._lock:
            x = self._turns.get(turn)
        return x is None or x.flag.is_set()

    def disarm(self, turn: int) -> None:
        with self._lock:
            self._turns.pop(turn, None)

    def session_of(self, turn: int) -> str | None:
        """The browser session that armed `turn` (whose kept conversation it may reuse); None if unknown."""
        with self._lock:
            x = self._turns.get(turn)
            return None if x is None else x.session

    def __len__(self) -> int:
        with self._lock:
            return len(self._turns)


@dataclass
class _Turn:
    session: str
    flag: threading.Event = field(default_factory=threading.Event)
    started: bool = False


class DemoApp:
    """Builds the Blocks and holds the components its handlers write to."""

    def __init__(self, engine: Engine, settings: Settings):
        self.engine, self.settings = engine, settings
        self.stops = StopSignals()
        self.tok = engine.target.tokenizer
        self.drafted = [m for m in engine.methods if m != "ar"]
        self.default_method = self.drafted[0] if self.drafted else "ar"

    def build(self) -> gr.Blocks:
        with gr.Blocks(title="DART speculative decoding") as demo:
            self._header()
            with gr.Row(equal_height=False):
                with gr.Column(scale=1, min_width=270):
                    self._controls()
                with gr.Column(scale=3):
                    self._chat()
            self._compare_area()
            self._analysis()
            self._wire()
            self._api()
            demo.load(
                self._blank_plots, None, [self.tree_plot, self.speed_plot, self.accepted_plot, self.split_plot], api_visibility="private"
            )
            demo.unload(self.leave)
        return demo

    def leave(self, request: gr.Request) -> None:
        """A browser session closed: what the prefix cache kept for it goes."""
        self.engine.forget(request.session_hash)

    # ---- layout -------------------------------------------------------------------------------

    def _header(self) -> None:
        e, s = self.engine, self.settings
        target = e.target
        badges = [
            f"target <code>{html.escape(s.target_label)}</code>",
            f"{html.escape(str(target.device))} · weights {html.escape(target.weights or str(target.dtype).removeprefix('torch.'))}"
            + (f" · {html.escape(kernels.describe())}" if target.device.type == "cpu" else "")
            + (f" · {s.threads} engine thread{'s' if s.threads != 1 else ''}" if s.threads else ""),
            "methods "
            + ", ".join(method_label(m) for m in e.methods)
            + "".join(f" · compare mode adds {html.escape(p.label)}" for p in e.peers.values()),
        ]
        if s.pruner:
            badges.append(f"tree pruner: {html.escape(s.pruner)}")
        gr.HTML(f"<h1>DART speculative decoding</h1><p>{_md_bold(INTRO)}</p><p class='badges'>{' · '.join(badges)}</p>")
        if s.weights_line:  # the weights path, chosen on this machine or given, and why (app/launch.py load_weights)
            gr.HTML(f"<p class='peers'>{html.escape(s.weights_line)}</p>", elem_id="weights-choice")
        if s.tree_line:  # the tree sizes chosen on this machine, and why (app/launch.py calibrate_sizes)
            gr.HTML(f"<p class='peers'>{html.escape(s.tree_line)}</p>", elem_id="tree-sizes")
        if s.heads_line:  # how long each head trained, and whether DART and EAGLE3 had equal steps
            gr.HTML(f"<p class='peers'>{html.escape(s.heads_line)}</p>", elem_id="heads")
        # whether a conversation's KV cache is kept between its turns (app/engine.py, dart_core/prefix_cache.py)
        gr.HTML(f"<p class='peers'>{html.escape(e.prefix_line())}</p>", elem_id="prefix-cache")
        if s.peers_line:  # what the llama.cpp row runs, or why there is none (app/launch.py load_peers)
            gr.HTML(f"<p class='peers'>{html.escape(s.peers_line)}</p>", elem_id="llamacpp-status")
        if s.notes:
            gr.HTML('<div class="notes">' + "".join(f"<p>⚠ {html.escape(n)}</p>" for n in s.notes) + "</div>", elem_id="notes")

    def _controls(self) -> None:
        methods = self.engine.methods
        self.method = gr.Radio([(method_label(m), m) for m in methods], value=self.default_method, label="Method", elem_id="method")
        can_compare = len(methods) + len(self.engine.peers) > 1
        self.compare = gr.Checkbox(
            self.settings.compare and can_compare, label="Compare methods (one after another)", visible=can_compare, elem_id="compare"
        )
        self.include_ar = gr.Checkbox(
            True, label="…including plain decoding (AR)", visible=self.settings.compare and can_compare and bool(self.drafted)
        )
        with gr.Accordion("Sampling", open=True):
            self.temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)")
            self.top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p (with temperature > 0)")
            self.top_k = gr.Slider(0, 200, value=0, step=1, label="Top-k (0 = off)")
            self.max_new = gr.Slider(
                1, self.engine.max_new_tokens, value=self.settings.default_new_tokens, step=1, label="Max new tokens", elem_id="max-new"
            )
        self.sizes = []  # one slider per drafting method, in self.drafted's order
        if self.drafted:
            with gr.Accordion("Tree size (drafted nodes per step)", open=True, elem_id="tree-size"):
                for m in self.drafted:
                    size = self.engine.tree_sizes[m]
                    self.sizes.append(
                        gr.Slider(
                            0,  # no drafted node: plain decoding's steps, for comparison
                            size.maximum,
                            value=size.default,
                            step=1,
                            label=method_label(m),
                            info=f"default {size.default}: the size chosen at start; wider trees verify more rows a step",
                            elem_id=f"tree-size-{m}",
                        )
                    )
        gr.HTML(LEGEND)

    def _chat(self) -> None:
        self.chat = gr.Chatbot(
            label="Chat",
            height=420,
            sanitize_html=False,
            render_markdown=False,
            feedback_options=None,
            buttons=[],
            elem_id="chat",
            placeholder="Ask something, or pick an example. The answer arrives one target forward at a time.",
        )
        with gr.Row():
            self.box = gr.Textbox(placeholder="Ask something…", show_label=False, scale=6, lines=1, max_lines=6, elem_id="prompt")
            self.send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send")
            self.stop = gr.Button("Stop", variant="stop", scale=1, min_width=80, elem_id="stop")
            self.retry = gr.Button("Retry", scale=1, min_width=80)
            self.clear = gr.Button("Clear", scale=1, min_width=80)
        gr.Examples(EXAMPLES, inputs=self.box)
        self.stats = gr.HTML(elem_id="stats")
        self.history = gr.State([])  # plain-text messages for the model
        self.display = gr.State([])  # rendered messages for the Chatbot
        self.runs = gr.State([])  # the last request's runs (for scrubbing)
        self.turn = gr.State(0)  # the id StopSignals gave the turn just sent

    def _compare_area(self) -> None:
        with gr.Column(visible=self.settings.compare, elem_id="compare-area") as self.compare_group:
            self.panes = gr.HTML(elem_id="panes")
            self.summary = gr.HTML(elem_id="summary")

    def _analysis(self) -> None:
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                self.tree_plot = gr.Plot(label="Draft tree", elem_id="tree-plot")
            with gr.Column(scale=1, min_width=260):
                self.step = gr.Slider(0, 1, value=0, step=1, label="Step (scrub through the verified trees)", elem_id="step")
                self.tree_of = gr.Radio(
                    [(method_label(m), m) for m in self.drafted],
                    value=self.default_method if self.drafted else None,
                    label="Tree of",
                    visible=len(self.drafted) > 1,
                    elem_id="tree-of",
                )
                self.colour_by = gr.Radio(
                    list(plots.COLOUR_BY),
                    value=plots.COLOUR_BY[0],
                    label="Colour nodes by",
                    info="tree score: DART's pruner score (draft + n-gram), EAGLE3's cumulative log-probability",
                )
                self.details = gr.HTML(elem_id="details")
        with gr.Row():
            self.speed_plot = gr.Plot(label="Speed", elem_id="speed-plot")
            self.accepted_plot = gr.Plot(label="Tokens per forward")
            self.split_plot = gr.Plot(label="Time split")
        # Why this configuration: the forward cost by rows the tree size (and, with --dtype auto, the
        # weights path) was chosen from, as measured on this machine at start (static for the session)
        with gr.Row(equal_height=False, elem_id="why"):
            if self.settings.costs is not None:
                with gr.Column(scale=3):
                    gr.Plot(plots.verify_cost_figure(self.settings.costs), label="Verify cost by rows", elem_id="verify-cost-plot")
            with gr.Column(scale=2):
                gr.HTML(render.verify_cost_html(self.settings.costs, self.settings.costs_note), elem_id="verify-cost")

    # ---- events -------------------------------------------------------------------------------

    def _wire(self) -> None:
        inputs = [
            self.turn,
            self.box,
            self.history,
            self.display,
            self.method,
            self.compare,
            self.include_ar,
            self.temperature,
            self.top_p,
            self.top_k,
            self.max_new,
            *self.sizes,
        ]
        queued = dict(concurrency_limit=1, concurrency_id=ENGINE_QUEUE, api_visibility="private", show_progress="hidden")
        arm = dict(fn=self.arm, inputs=None, outputs=self.turn, queue=False, api_visibility="private", show_progress="hidden")
        events = [
            self.send.click(**arm).then(self.respond, inputs, self.outputs, **queued),
            self.box.submit(**arm).then(self.respond, inputs, self.outputs, **queued),
            self.retry.click(**arm).then(self.retry_last, inputs, self.outputs, **queued),
        ]
        # A turn's first frame locks the prompt box and the Send/Retry buttons; they unlock only once the
        # browser has seen the turn end (finished, failed or stopped: Gradio fires .then in every case).
        # A click while a turn's event is still pending would be dropped (trigger mode "once"), and a
        # prompt typed before its last frame arrived would be wiped by it.
        for event in events:
            event.then(self.ready, None, self.turn_inputs, api_visibility="private", show_progress="hidden")
        self.stop.click(self.request_stop, None, self.stats, queue=False, api_visibility="private", show_progress="hidden")
        self.clear.click(self.reset, None, self.outputs, api_visibility="private")
        self.compare.change(
            lambda c: (gr.update(visible=c and bool(self.drafted)), gr.update(interactive=not c), gr.update(visible=c)),
            self.compare,
            [self.include_ar, self.method, self.compare_group],
            api_visibility="private",
        )
        view = [self.runs, self.tree_of, self.step, self.colour_by]
        for trigger in (self.step.input, self.tree_of.input, self.colour_by.input):  # user input only, not our own updates
            trigger(
                self.scrub,
                view,
                [self.tree_plot, self.details],
                api_visibility="private",
                show_progress="hidden",
                trigger_mode="always_last",
            )

    @property
    def turn_inputs(self) -> list:
        """What starts a turn: locked while one runs."""
        return [self.box, self.send, self.retry]

    @property
    def outputs(self) -> list:
        return [
            self.chat,
            self.history,
            self.display,
            self.runs,
            self.stats,
            self.panes,
            self.summary,
            self.compare_group,
            self.tree_plot,
            self.details,
            self.step,
            self.tree_of,
            self.speed_plot,
            self.accepted_plot,
            self.split_plot,
            *self.turn_inputs,
        ]

    def ready(self) -> dict:
        """After a turn: the prompt box and the buttons take input again."""
        return {c: gr.update(interactive=True) for c in self.turn_inputs}

    def arm(self, request: gr.Request) -> int:
        """On Send, before the turn queues: from now on Stop reaches it."""
        return self.stops.arm(request.session_hash)

    def request_stop(self, request: gr.Request):
        """Stop this session's turns. A running turn says so in its own last frame (writing the stats
        here could race its frames); a turn still queued says so here, and ends when its place comes."""
        running, queued = self.stops.stop(request.session_hash)
        if queued and not running:
            return render.notice_html(QUEUED_STOP)
        return gr.update()

    def locked(self) -> dict:
        """A turn's first frame: the prompt leaves the box, which stays locked until the turn ends (see _wire)."""
        return {**{c: gr.update(interactive=False) for c in self.turn_inputs}, self.box: gr.update(value="", interactive=False)}

    def respond(
        self, turn, message, history, display, method, compare, include_ar, temperature, top_p, top_k, max_new, *sizes
    ) -> Iterator[dict]:
        """Stream one chat turn through one method, or through each method in turn (compare mode).
        `sizes`: the tree size sliders, one per drafting method (self.drafted's order). A Stop (see
        StopSignals) ends it after the current step, with a last frame that says so; the partial answer
        stays in the chat and in the history."""
        self.stops.start(turn)
        try:
            sizes = dict(zip(self.drafted, sizes, strict=True))
            yield from self._respond(
                turn, message, history, display, method, compare, include_ar, temperature, top_p, top_k, max_new, sizes
            )
        finally:
            self.stops.disarm(turn)

    def _respond(
        self, turn, message, history, display, method, compare, include_ar, temperature, top_p, top_k, max_new, sizes
    ) -> Iterator[dict]:
        messages = history + [{"role": "user", "content": message}]
        order = self._order(method, compare, include_ar)
        try:
            req = self.engine.request(messages, order[0], max_new, temperature, top_p, top_k, sizes)
        except RequestError as e:
            raise gr.Error(str(e)) from None
        greedy = req.params.sampling.greedy
        owner = self.stops.session_of(turn)  # this browser session's kept conversation, never another's
        shown = display + [{"role": "user", "content": render.plain(message)}]
        runs: list[Run] = []
        first_frame = True
        for m in order:
            if self.stops.stopped(turn):
                break
            last_text = last_plots = 0.0
            run = Run(m)
            if m in self.engine.peers:  # llama.cpp or vLLM: another process, on the compute thread; its text when it ends
                frame = self._frame(
                    runs + [PeerResult(m, peer_label=self.engine.label(m))], order, messages, shown, greedy, with_plots=False, final=False
                )
                yield {**frame, **self.locked()} if first_frame else frame
                first_frame = False
                runs.append(self.engine.run_peer(req, m))
                continue
            with closing(self.engine.stream(req.for_method(m), owner)) as stream:
                for run in stream:
                    if self.stops.stopped(turn) and not run.done:
                        run.stopped = True
                        break
                    now = time.perf_counter()
                    if not run.done and now - last_text < TEXT_EVERY_S:
                        continue
                    live = runs + [run]
                    with_plots = run.done or now - last_plots >= PLOTS_EVERY_S
                    last_text, last_plots = now, (now if with_plots else last_plots)
                    frame = self._frame(live, order, messages, shown, greedy, with_plots, final=False)
                    yield {**frame, **self.locked()} if first_frame else frame
                    first_frame = False
            runs.append(run)
        if not runs:  # stopped while it waited in the queue: nothing ran
            runs = [Run(order[0], stopped=True)]
        stopped = runs[-1].stopped or len(runs) < len(order)
        frame = self._frame(runs, order, messages, shown, greedy, with_plots=True, final=True, stopped=stopped)
        yield {**frame, **self.locked()} if first_frame else frame

    def retry_last(self, turn, _message, history, display, *rest) -> Iterator[dict]:
        """Re-run the last user turn (e.g. with other settings or another method)."""
        if len(history) < 2:
            self.stops.disarm(turn)
            raise gr.Error("nothing to retry yet")
        yield from self.respond(turn, history[-2]["content"], history[:-2], display[:-2], *rest)

    def reset(self, request: gr.Request) -> dict:
        """Clear: the chat, the panes and plots, and what the prefix cache kept of this session's conversation."""
        self.engine.forget(request.session_hash)
        blank = self._blank_plots()
        return {
            self.chat: [],
            self.history: [],
            self.display: [],
            self.runs: [],
            self.stats: "",
            self.panes: "",
            self.summary: "",
            self.tree_plot: blank[0],
            self.details: "",
            self.step: gr.update(value=0, maximum=1),
            self.speed_plot: blank[1],
            self.accepted_plot: blank[2],
            self.split_plot: blank[3],
        }

    def scrub(self, runs: list[Run], tree_of: str | None, step: float, colour_by: str):
        run = self._tree_run(runs, tree_of)
        index = int(step) if step is not None else None
        return plots.tree_figure(run, index, self.tok, colour_by), render.step_details_html(run, index, self.tok)

    # ---- helpers ------------------------------------------------------------------------------

    def _order(self, method: str, compare: bool, include_ar: bool) -> list[str]:
        if not compare:
            return [method]
        ours = [m for m in self.engine.methods if m != "ar" or include_ar or not self.drafted]
        return ours + list(self.engine.peers)  # the peers last: after every engine method, never beside one

    def _frame(
        self, runs: list[Run], order: list[str], messages, shown, greedy: bool, with_plots: bool, final: bool, stopped: bool = False
    ) -> dict:
        """The outputs after a step: the chat and the panes every frame, the plots when `with_plots`."""
        ar = next((r for r in runs if r.method == "ar" and r.done), None)
        speedups = [self.engine.speedup(r, ar) for r in runs]
        first = runs[0]
        assistant = {"role": "assistant", "content": render.render_chunks(first)}
        out = {
            self.chat: shown + [assistant],
            self.history: messages + [{"role": "assistant", "content": first.text}],
            self.display: shown + [assistant],
            self.runs: runs,
            self.stats: render.stats_html(runs, speedups) + (self._memory_html() if final else ""),
        }
        if len(order) > 1:
            pending = [self.engine.label(m) for m in order[len(runs) :]]
            out[self.panes] = render.compare_html(runs, speedups, pending, stopped)
            out[self.summary] = render.summary_html(
                [r for r in runs if r.done], [s for r, s in zip(runs, speedups) if r.done], greedy, self.settings.exact
            )
        out[self.compare_group] = gr.update(visible=len(order) > 1)
        if with_plots:
            # A peer (llama.cpp) gives no per-step data, only its totals: the plots show the engine's
            # methods, the summary table has the peer's row.
            runs = [r for r in runs if not isinstance(r, PeerResult)]
            tree_run = self._tree_run(runs, None if final or not runs else runs[-1].method)  # streaming: the live run's, if it drafts
            last = tree_run.steps[-1].index if tree_run and tree_run.steps else 0
            out.update(
                {
                    self.tree_plot: plots.tree_figure(tree_run, None, self.tok),
                    self.details: render.step_details_html(tree_run, None, self.tok),
                    self.step: gr.update(maximum=max(1, last), value=last),
                    self.speed_plot: plots.speed_figure(runs),
                    self.accepted_plot: plots.accepted_figure(runs),
                    self.split_plot: plots.time_split_figure(runs),
                }
            )
            if final and tree_run is not None:
                out[self.tree_of] = gr.update(value=tree_run.method)
        return out

    def _memory_html(self) -> str:
        """After a turn: what the prefix cache holds (entries, tokens, memory against its bound)."""
        return render.notice_html(self.engine.prefix.report()) if self.engine.prefix is not None else ""

    @staticmethod
    def _tree_run(runs: list[Run], method: str | None) -> Run | None:
        """The run whose tree to show: `method`'s if it ran, else the first run with trees, else the first."""
        with_trees = [r for r in runs if r.tree_steps]
        return next((r for r in with_trees if r.method == method), with_trees[0] if with_trees else (runs[0] if runs else None))

    def _blank_plots(self):
        return (plots.tree_figure(None, None, self.tok), plots.speed_figure([]), plots.accepted_figure([]), plots.time_split_figure([]))

    def _api(self) -> None:
        engine, default_method, default_new = self.engine, self.default_method, self.settings.default_new_tokens

        def generate(
            message: str,
            method: str = default_method,
            max_new_tokens: int = default_new,
            temperature: float = 0.0,
            top_p: float = 1.0,
            top_k: int = 0,
            tree_size: int | None = None,
            request: gr.Request = None,
        ) -> Iterator[dict]:
            """Generate a reply to one user message with method dart, eagle3 or ar. Streams dicts
            {text, new_tokens, tau, tokens_per_s, speedup_vs_ar, tree_size, first_token_s, reused_tokens, done}, at most one every
            TEXT_EVERY_S and always the last; `predict` returns the last one. tree_size: the most drafted
            nodes a tree may have (dart, eagle3; null: the app's default for the method).
            speedup_vs_ar is null until plain decoding has been measured; first_token_s: engine seconds to
            the first token; reused_tokens: prompt tokens this client's earlier requests had left in the
            prefix cache (a client's cache is its own). Bad input raises with the reason."""
            try:
                sizes = None if tree_size is None else {method: tree_size}
                req = engine.request([{"role": "user", "content": message}], method, max_new_tokens, temperature, top_p, top_k, sizes)
            except RequestError as e:
                raise gr.Error(str(e)) from None
            last = 0.0
            for run in engine.stream(req, None if request is None else request.session_hash):
                now = time.perf_counter()
                if not run.done and now - last < TEXT_EVERY_S:
                    continue  # at most one dict per TEXT_EVERY_S, and always the last
                last = now
                yield {
                    "text": run.text,
                    "new_tokens": run.new_tokens,
                    "tau": run.tau,
                    "tokens_per_s": run.tokens_per_s,
                    "speedup_vs_ar": engine.speedup(run) if run.method != "ar" else 1.0,
                    "tree_size": run.tree_size,
                    "first_token_s": run.first_token_s,
                    "reused_tokens": run.reused_tokens,
                    "done": run.done,
                }

        gr.api(generate, api_name="generate", concurrency_limit=1, concurrency_id=ENGINE_QUEUE)


def _md_bold(text: str) -> str:
    """The intro's **bold** as <b>, the rest escaped."""
    parts = html.escape(text).split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


def build_demo(engine: Engine, settings: Settings) -> gr.Blocks:
    return DemoApp(engine, settings).build()
