"""The Gradio Blocks: chat, compare panes, plots, and the /generate API, over an already-loaded Engine."""

from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr
import torch

from . import plots
from .engine import Engine, Run, sampling_params

EXAMPLES = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in three sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for a job interview.",
]
ENGINE_QUEUE = "engine"  # one concurrency group: every generation shares the one target

CSS = """
.chunk0 { background: #fff3e0; border-radius: 3px; }
.chunk1 { background: #e3f2fd; border-radius: 3px; }
.bonus { text-decoration: underline dotted #555; }
.pane { font-family: ui-monospace, monospace; white-space: pre-wrap; min-height: 8em; max-height: 24em; overflow-y: auto;
        border: 1px solid #ddd; border-radius: 6px; padding: 8px; font-size: 0.9em; }
.pane-title { font-weight: 600; margin-bottom: 4px; }
"""


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int
    max_length: int | None
    compare: bool
    pruner: str  # "C++" or "pure Python"
    notes: tuple[str, ...] = ()


def render_chunks(run: Run) -> str:
    """The output as HTML: each step's tokens one shaded chunk (alternating), the target's own token of a
    multi-token step underlined. Everything is escaped; the text is decoded as a whole (multi-byte safe)."""
    out, end = [], 0
    for i, s in enumerate(run.steps):
        accepted_txt = run.text[s.text_start : s.text_mid]
        bonus_txt = run.text[s.text_mid : s.text_end]
        cls = f"chunk{i % 2}"
        if accepted_txt:
            out.append(f'<span class="{cls}">{html.escape(accepted_txt)}</span>')
        if bonus_txt:
            extra = " bonus" if s.accepted else ""
            out.append(f'<span class="{cls}{extra}">{html.escape(bonus_txt)}</span>')
        end = s.text_end
    out.append(html.escape(run.text[end:]))
    return "".join(out).replace("\n", "<br>")


def stats_line(run: Run, ar_tps: float | None) -> str:
    speedup = f", **{run.tokens_per_s / ar_tps:.2f}x** vs AR" if ar_tps and run.method != "ar" else ""
    done = f" — stopped: {run.summary.stop_reason}" if run.summary else ""
    return f"**{run.method}**: {run.new_tokens} tokens, **{run.tokens_per_s:.1f} tok/s**, τ = {run.tau:.2f}{speedup}{done}"


def build_demo(engine: Engine, settings: Settings) -> gr.Blocks:
    methods = [m for m in engine.methods]
    default_method = "dart" if "dart" in methods else "ar"
    tok = engine.target.tokenizer

    with gr.Blocks(title="DART speculative decoding") as demo:
        gr.Markdown(
            "# DART speculative decoding\n"
            "A one-layer draft head guesses several future tokens in **one** forward pass; an n-gram guided beam search "
            "turns the guesses into a tree; the target model checks the whole tree in one forward and keeps the longest "
            "correct branch. Same output as plain decoding, fewer target forwards. Each shaded chunk below is one target "
            "forward; the underlined token is the target's own, the rest were drafted and accepted.\n\n"
            f"Target: `{engine.target.name}` on {engine.target.device} ({str(engine.target.dtype).removeprefix('torch.')}) · "
            f"methods: {', '.join(methods)} · pruner: {settings.pruner}"
            + (
                "\n\n> In bfloat16/float16 a tree verify rounds differently from a one-token step, so a greedy output may "
                "leave plain decoding's at a near-tie; in float32 they are identical token for token (`--dtype float32`)."
                if engine.target.dtype != torch.float32
                else ""
            )
            + "".join(f"\n\n> {n}" for n in settings.notes)
        )
        history = gr.State([])  # plain-text chat history for the model
        runs_state = gr.State([])
        with gr.Row():
            with gr.Column(scale=1, min_width=260):
                method = gr.Radio(methods, value=default_method, label="Method")
                compare = gr.Checkbox(value=settings.compare, label="Compare all methods (one after another)")
                temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
                top_k = gr.Slider(0, 200, value=0, step=1, label="Top-k (0 = off)")
                max_new = gr.Slider(1, max(settings.max_new_tokens, 1), value=min(128, settings.max_new_tokens), step=1, label="Max new tokens")
            with gr.Column(scale=3):
                chat = gr.Chatbot(label="Chat", height=380, sanitize_html=False, render_markdown=False, feedback_options=None)
                with gr.Row():
                    box = gr.Textbox(placeholder="Ask something…", show_label=False, scale=5, lines=1, elem_id="prompt")
                    send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                    stop = gr.Button("Stop", scale=1)
                    clear = gr.Button("Clear", scale=1)
                gr.Examples(EXAMPLES, inputs=box)
                stats = gr.Markdown(elem_id="stats")
        compare_html = gr.HTML()
        with gr.Row():
            tree_plot = gr.Plot(label="Draft tree", elem_id="tree-plot")
        step_slider = gr.Slider(0, 1, value=0, step=1, label="Step (scrub through the verified trees)", interactive=True)
        with gr.Row():
            speed_plot = gr.Plot(label="Speed")
            accepted_plot = gr.Plot(label="Tokens per step")
            split_plot = gr.Plot(label="Time split")

        def figures(runs: list[Run], step: int | None = None):
            main = runs[0] if runs else None
            return (
                plots.tree_figure(main, step, tok),
                plots.speed_figure(runs),
                plots.accepted_figure(runs),
                plots.time_split_figure(runs),
            )

        def compare_panes(runs: list[Run]) -> str:
            if len(runs) < 2:
                return ""
            cells = "".join(
                f'<div style="flex:1;min-width:0"><div class="pane-title">{html.escape(stats_line(r, engine.ar_tokens_per_s).replace("**", ""))}</div>'
                f'<div class="pane">{render_chunks(r)}</div></div>'
                for r in runs
            )
            return f'<div style="display:flex;gap:10px">{cells}</div>'

        def respond(message, hist, method_v, compare_v, temp_v, top_p_v, top_k_v, max_new_v):
            try:
                params = sampling_params(temp_v, top_p_v, top_k_v, max_new_v, settings.max_length)
                engine.check(message, method_v, params)
            except ValueError as e:
                raise gr.Error(str(e)) from None
            order = [method_v] + ([m for m in methods if m != method_v] if compare_v else [])
            messages = hist + [{"role": "user", "content": message}]
            display = [{"role": m["role"], "content": html.escape(m["content"]).replace("\n", "<br>")} for m in hist]
            display.append({"role": "user", "content": html.escape(message)})
            runs: list[Run] = []
            try:
                for m in order:
                    for run in engine.stream(messages, m, params):
                        current = runs + [run]
                        chat_value = display + [{"role": "assistant", "content": render_chunks(current[0])}]
                        yield (
                            chat_value, hist, " · ".join(stats_line(r, engine.ar_tokens_per_s) for r in current), compare_panes(current),
                            *figures(current), gr.update(maximum=max(1, len(current[0].steps) - 1), value=len(current[0].steps) - 1), current, "",
                        )
                    runs.append(run)
            except ValueError as e:  # e.g. the prompt no longer fits the context
                raise gr.Error(str(e)) from None
            new_hist = messages + [{"role": "assistant", "content": runs[0].text}]
            yield (
                display + [{"role": "assistant", "content": render_chunks(runs[0])}], new_hist,
                " · ".join(stats_line(r, engine.ar_tokens_per_s) for r in runs), compare_panes(runs), *figures(runs),
                gr.update(maximum=max(1, len(runs[0].steps) - 1), value=len(runs[0].steps) - 1), runs, "",
            )

        outputs = [chat, history, stats, compare_html, tree_plot, speed_plot, accepted_plot, split_plot, step_slider, runs_state, box]
        inputs = [box, history, method, compare, temperature, top_p, top_k, max_new]
        ev1 = send.click(respond, inputs, outputs, concurrency_limit=1, concurrency_id=ENGINE_QUEUE, api_visibility="private")
        ev2 = box.submit(respond, inputs, outputs, concurrency_limit=1, concurrency_id=ENGINE_QUEUE, api_visibility="private")
        stop.click(None, None, None, cancels=[ev1, ev2])
        clear.click(
            lambda: ([], [], "", "", *figures([]), []), None,
            [chat, history, stats, compare_html, tree_plot, speed_plot, accepted_plot, split_plot, runs_state], api_visibility="private",
        )
        step_slider.release(
            lambda runs, s: plots.tree_figure(runs[0] if runs else None, int(s), tok), [runs_state, step_slider], tree_plot, api_visibility="private"
        )

        def generate_api(message: str, method: str = default_method, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> dict:
            """Generate a reply to one user message. Returns text, new_tokens, tau, tokens_per_s and speedup_vs_ar (null until an AR run was measured)."""
            try:
                params = sampling_params(temperature, top_p, top_k, max_new_tokens, settings.max_length)
                engine.check(message, method, params)
                run = None
                for run in engine.stream([{"role": "user", "content": message}], method, params):
                    pass
            except (ValueError, TypeError) as e:
                raise gr.Error(str(e)) from None
            tps = run.summary.tokens_per_s
            return {
                "text": run.text,
                "new_tokens": run.new_tokens,
                "tau": run.summary.tau,
                "tokens_per_s": tps,
                "speedup_vs_ar": tps / engine.ar_tokens_per_s if engine.ar_tokens_per_s else None,
            }

        gr.api(generate_api, api_name="generate", concurrency_limit=1, concurrency_id=ENGINE_QUEUE)
        demo.load(lambda: figures([]), None, [tree_plot, speed_plot, accepted_plot, split_plot], api_visibility="private")
    return demo
