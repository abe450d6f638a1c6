"""HTML for the chat and compare panes. Everything user- or model-generated is escaped here."""

from __future__ import annotations

import html
from dataclasses import dataclass

from dart_core.tools.vllm_peer import VllmRun

from .engine import PeerResult, Run

PREVIEW_CANDIDATES = 5  # candidates per depth shown in the step details
CURSOR = '<span class="cursor">▍</span>'
GENERATING = "generating…"
STOPPED = "stopped by you"
RUNNING_PEER = "running llama.cpp…"  # running(run) and failed(run) name each peer's engine; these are llama.cpp's
PEER_FAILED = "llama.cpp failed"
PEER_FOOTNOTE = (
    "* llama.cpp promises no bit-exactness with this engine: it computes otherwise (the activations quantized to Q8 "
    "for its quantized matrix products, its own kernels and summation order), so a \"no\" in its row is not a bug. "
    "Its text is re-tokenized with the target's tokenizer; its time is its own timers' prefill + decode (process "
    "start and model load not counted); it ran after the engine's methods, with the engine's thread count."
)
PEER_SAMPLED = (
    "sampled by llama.cpp's own sampler chain and random numbers (same temperature, top-p and top-k): "
    "its text is not expected to match ours"
)
VLLM_FOOTNOTE = (
    "* vLLM runs the converted checkpoint (the GGUF's weights dequantized) with its own kernels, and verifies drafts with "
    "other matrix shapes than it decodes with, so a near-tie can round either way: a \"no\" in its rows is not a bug of this "
    "engine. Its ids are its own; its time is its request metrics' prefill + decode (engine start not counted); it ran "
    "after the engine's methods, with the engine's thread count."
)
VLLM_SAMPLED = (
    "sampled by vLLM's own sampler and random numbers (same temperature, top-p and top-k; its rejection sampler for "
    "the drafts): its text is not expected to match ours"
)


def running(run: PeerResult) -> str:
    """ "running llama.cpp…" or "running vLLM…" while a peer's run is under way."""
    return f"running {run.engine_name}…"


def failed(run: PeerResult) -> str:
    return f"{run.engine_name} failed"


def render_chunks(run: Run) -> str:
    """The output with each target forward's tokens as one shaded chunk (two alternating shades); in a
    step that accepted drafts, the target's own last token (the bonus) is underlined. The text was
    decoded as a whole, so a chunk boundary never splits a multi-byte character."""
    out, end = [], 0
    for i, s in enumerate(run.steps):
        start, mid, stop = s.span
        if stop <= start:
            continue
        shade = f"chunk c{i % 2}"
        title = f"step {s.index}: " + (
            f"{s.accepted} drafted token(s) accepted + 1 from the target" if s.accepted else "1 token from the target"
        )
        inner = html.escape(run.text[start:mid])
        if mid < stop:
            bonus_cls = "bonus" if s.accepted else "own"
            inner += f'<span class="{bonus_cls}">{html.escape(run.text[mid:stop])}</span>'
        out.append(f'<span class="{shade}" title="{title}">{inner}</span>')
        end = stop
    out.append(html.escape(run.text[end:]))
    return f'<div class="gen">{"".join(out)}{CURSOR if run.live else ""}</div>'


def plain(text: str) -> str:
    """A user message or an earlier plain-text turn, escaped, newlines kept."""
    return f'<div class="gen">{html.escape(text)}</div>'


def stats_text(run: Run, speedup: float | None) -> str:
    """One line: tokens, tokens/s, τ, speed-up, and why it stopped (plain text, escape before use)."""
    if isinstance(run, PeerResult) and not (run.done and run.peer is not None):
        # nothing to count yet (it prints its text when it ends), or it failed: say which
        state = f"stopped: {failed(run)}" if run.done else STOPPED if run.stopped else running(run)
        return f"{run.label} · {state}"
    parts = [f"{run.label}", f"{run.new_tokens} tokens", f"{run.tokens_per_s:.1f} tok/s", f"τ {run.tau:.2f}"]
    if speedup is not None:
        parts.append(f"{speedup:.2f}× vs AR")
    if run.first_token_s is not None:  # the engine's runs: time to first token, and what it reused
        parts.append(f"first token {run.first_token_s:.2f} s" + (f" ({run.reused_tokens} tokens reused)" if run.reused_tokens else ""))
    parts.append(f"stopped: {run.stop_reason}" if run.done else STOPPED if run.stopped else GENERATING)
    return " · ".join(parts)


def stats_html(runs: list[Run], speedups: list[float | None]) -> str:
    rows = "".join(f'<div class="stat m-{r.method}">{html.escape(stats_text(r, s))}</div>' for r, s in zip(runs, speedups))
    return f'<div class="stats">{rows}</div>' if runs else ""


def notice_html(text: str) -> str:
    """A one-line notice in the stats bar (e.g. a queued turn that was stopped)."""
    return f'<div class="stats"><div class="stat">{html.escape(text)}</div></div>'


def peer_body(run: PeerResult) -> str:
    """A peer's pane body: "running llama.cpp…" (or vLLM) while it runs, then its text (one block: it
    gives no per-forward chunks) and how it ran, or why it failed."""
    if run.error is not None:
        return f'<div class="gen peer-error">{html.escape(failed(run))}: {html.escape(run.error)}</div>'
    if run.peer is None:
        what = STOPPED if run.stopped else running(run) + " (another process: its text appears when it ends)"
        return f'<div class="gen peer-running">{html.escape(what)}</div>'
    p = run.peer
    threads = f"{run.threads} thread{'s' if run.threads != 1 else ''}"
    if isinstance(p, VllmRun):
        drafts = f"; {p.accepted} of {p.drafted} drafted tokens accepted" if p.drafted else ""
        how = f"vLLM's engine, {threads}: prefill {p.prefill_s:.2f} s + decode {p.decode_s:.2f} s by its request metrics{drafts}"
        notes = [how] + ([VLLM_SAMPLED] if run.sampled else [])
        return f'<div class="gen">{html.escape(run.text)}</div>' + "".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)
    exe = p.command[0].rsplit("/", 1)[-1] if p.command else "llama.cpp"
    how = (
        f"{exe}, {threads}: prefill {p.timings.prefill_s:.2f} s + decode "
        f"{p.timings.decode_s:.2f} s by its own timers (the whole process took {p.process_s:.2f} s, model load included)"
    )
    notes = [how] + ([PEER_SAMPLED] if run.sampled else [])
    return f'<div class="gen">{html.escape(run.text)}</div>' + "".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)


def compare_html(runs: list[Run], speedups: list[float | None], pending: list[str], stopped: bool = False) -> str:
    """One pane per method, side by side, each streaming its own text; methods still waiting for
    their turn (or, once the user stopped the turn, never run) get an empty pane so the layout does
    not jump. A peer's pane (llama.cpp) shows its text when its run ends."""
    panes = [
        f'<div class="pane m-{html.escape(r.method.partition("@")[0])}"><div class="pane-title">{html.escape(stats_text(r, s))}</div>'
        f"{peer_body(r) if isinstance(r, PeerResult) else render_chunks(r)}</div>"
        for r, s in zip(runs, speedups)
    ]
    why = "not run: " + STOPPED if stopped else "waiting for its turn"
    panes += [f'<div class="pane waiting"><div class="pane-title">{html.escape(m)} · {why}</div></div>' for m in pending]
    return f'<div class="panes">{"".join(panes)}</div>'


def summary_html(runs: list[Run], speedups: list[float | None], greedy: bool, exact: bool) -> str:
    """The comparison in one table. At temperature 0 every method must produce AR's text (lossless);
    the last column shows it. On the CPU kernel path a tree verify computes bit for bit what a one-token
    step computes, in every dtype, so a difference is a bug; on the eager path (no C++ kernels, CUDA)
    reduced precision can round a near-tie differently now and then.

    A peer's row (llama.cpp, after the engine's methods) counts with llama.cpp's own numbers: its new
    tokens, target forwards (plain decoding: one per token) and timers. Its "same text" is computed on
    ids like the others', but marked: llama.cpp computes otherwise and promises no bit-exactness."""
    ar = next((r for r in runs if r.method == "ar" and r.done), None)
    same_col = ar is not None and greedy
    head = ["method", "tokens", "target forwards", "τ", "engine time", "tok/s", "speed-up vs AR"]
    if same_col:
        head.append("same text as AR")
    rows = []
    for r, s in zip(runs, speedups):
        peer = isinstance(r, PeerResult)
        if peer and r.peer is None:  # failed: its pane has the whole message
            first = (r.error or "").strip().splitlines()[0] if (r.error or "").strip() else "no reason given"
            rows.append(
                f'<tr class="peer-failed"><td>{html.escape(r.label)}</td><td colspan="{len(head) - 1}">{html.escape(failed(r))}: '
                f'{html.escape(first)}</td></tr>'
            )
            continue
        cells = [
            r.label,
            str(r.new_tokens),
            str(r.forwards),
            f"{r.tau:.2f}",
            f"{r.engine_s:.2f} s",
            f"{r.tokens_per_s:.1f}",
            "1.00×" if r.method == "ar" else (f"{s:.2f}×" if s is not None else "–"),
        ]
        if same_col:
            same = "–" if r is ar else ("yes" if r.output_ids == ar.output_ids else "no")
            cells.append(same + ("*" if peer else ""))
        tr = '<tr class="peer">' if peer else "<tr>"
        rows.append(tr + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    note = ""
    ours = [r for r in runs if not isinstance(r, PeerResult)]
    if same_col and not exact and any(r.output_ids != ar.output_ids for r in ours):
        note = (
            '<p class="note">This target runs the eager path in reduced precision: a tree verify may round a near-tie '
            "differently from a one-token step. The CPU kernel path (built by make setup) or --dtype float32 gives identical texts.</p>"
        )
    peers = [r for r in runs if isinstance(r, PeerResult)]
    if same_col and any(r.engine_name == "llama.cpp" for r in peers):
        note += f'<p class="note peer-note">{html.escape(PEER_FOOTNOTE)}</p>'
    if same_col and any(r.engine_name == "vLLM" for r in peers):
        note += f'<p class="note peer-note">{html.escape(VLLM_FOOTNOTE)}</p>'
    return f'<table class="summary"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>{note}'


def step_details_html(run: Run | None, step_index: int | None, tokenizer) -> str:
    """What one verify step did: the tokens it accepted, and (DART) the head's top candidates per
    depth, which the pruner combined into the tree."""
    step = run.tree_step(step_index) if run is not None else None
    if step is None:
        return ""
    accepted = "".join(html.escape(tokenizer.decode([t])) for t in step.tokens)
    lines = [
        f"<b>{html.escape(run.label)} step {step.index}</b>: "
        f"{len(step.tree) - 1 if step.tree is not None else 0} drafted nodes, {step.accepted} accepted, "
        f"emitted <code>{accepted or '∅'}</code>"
    ]
    tokens, probs = step.info.get("topk_tokens"), step.info.get("topk_probs")
    if tokens and probs:
        rows = []
        for depth, (ts, ps) in enumerate(zip(tokens, probs), start=1):
            cands = ", ".join(
                f"<code>{html.escape(repr(tokenizer.decode([t]))[1:-1])}</code> {p:.2f}" for t, p in list(zip(ts, ps))[:PREVIEW_CANDIDATES]
            )
            rows.append(f"<tr><td>depth {depth}</td><td>{cands}</td></tr>")
        lines.append(
            f'<table class="topk"><thead><tr><th colspan="2">head candidates (top {PREVIEW_CANDIDATES} of each row, probability within '
            f'the top-k)</th></tr></thead>{"".join(rows)}</table>'
        )
    return f'<div class="details">{"".join(lines)}</div>'


@dataclass(frozen=True)
class CostPath:
    """One weights path's forward cost by rows on this machine: the calibration's cached table
    (dart_core/tools/calibrate/), and the DART tree size it led to on that path."""

    weights: str  # as the target names them: "gguf (Q4_1, Q8_0)", "bfloat16"
    ms: dict[int, float]  # rows in one forward -> median wall ms
    nodes: int | None = None  # DART's drafted nodes on this path (None: not calibrated)
    expected_tps: float | None = None  # DART's expected tokens/s at `nodes`
    chosen: bool = False  # the path the app runs


@dataclass(frozen=True)
class CostView:
    """The "why" view's data: the paths measured (one, or each candidate of --dtype auto), and a line
    saying where the numbers come from."""

    paths: tuple[CostPath, ...]
    caption: str


def verify_cost_html(view: CostView | None, note: str) -> str:
    """The "why" table: per weights path the one-row step (plain decoding), the verify of the tree
    DART runs there (rows = nodes + 1) against it, the widest verify measured, and DART's expected
    speed. `note` says what was chosen and why (or why there is no table)."""
    head = f'<p class="note">{html.escape(note)}</p>'
    if view is None or not view.paths:
        return f'<div class="costs">{head}</div>'
    rows = []
    for p in view.paths:
        one, widest = p.ms[1], max(p.ms)
        cells = [p.weights + (" (runs)" if p.chosen else ""), f"{one:.1f} ms"]
        if p.nodes is not None and p.nodes + 1 in p.ms:
            k = p.nodes + 1
            cells += [f"{p.nodes}", f"{k} rows: {p.ms[k]:.1f} ms ({p.ms[k] / one:.2f}×)"]
        else:
            cells += ["–", "–"]
        cells += [f"{p.ms[widest]:.1f} ms ({p.ms[widest] / one:.2f}×)", "–" if p.expected_tps is None else f"{p.expected_tps:.0f} tok/s"]
        tr = '<tr class="chosen">' if p.chosen else "<tr>"
        rows.append(tr + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    widest = max(max(p.ms) for p in view.paths)
    th = "".join(
        f"<th>{html.escape(h)}</th>"
        for h in ("weights", "1 row (plain step)", "DART nodes", "its verify", f"{widest} rows", "DART expected")
    )
    return (
        f'<div class="costs">{head}<table class="summary"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
        f'<p class="note">{html.escape(view.caption)}</p></div>'
    )
