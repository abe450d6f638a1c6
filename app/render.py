"""HTML for the chat and compare panes. Everything user- or model-generated is escaped here."""

from __future__ import annotations

import html

from .engine import Run

PREVIEW_CANDIDATES = 5  # candidates per depth shown in the step details
CURSOR = '<span class="cursor">▍</span>'
GENERATING = "generating…"
STOPPED = "stopped by you"


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
        title = f"step {s.index}: " + (f"{s.accepted} drafted token(s) accepted + 1 from the target" if s.accepted else "1 token from the target")
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
    parts = [f"{run.label}", f"{run.new_tokens} tokens", f"{run.tokens_per_s:.1f} tok/s", f"τ {run.tau:.2f}"]
    if speedup is not None:
        parts.append(f"{speedup:.2f}× vs AR")
    parts.append(f"stopped: {run.summary.stop_reason}" if run.done else STOPPED if run.stopped else GENERATING)
    return " · ".join(parts)


def stats_html(runs: list[Run], speedups: list[float | None]) -> str:
    rows = "".join(f'<div class="stat m-{r.method}">{html.escape(stats_text(r, s))}</div>' for r, s in zip(runs, speedups))
    return f'<div class="stats">{rows}</div>' if runs else ""


def notice_html(text: str) -> str:
    """A one-line notice in the stats bar (e.g. a queued turn that was stopped)."""
    return f'<div class="stats"><div class="stat">{html.escape(text)}</div></div>'


def compare_html(runs: list[Run], speedups: list[float | None], pending: list[str], stopped: bool = False) -> str:
    """One pane per method, side by side, each streaming its own text; methods still waiting for
    their turn (or, once the user stopped the turn, never run) get an empty pane so the layout does
    not jump."""
    panes = [
        f'<div class="pane m-{r.method}"><div class="pane-title">{html.escape(stats_text(r, s))}</div>{render_chunks(r)}</div>'
        for r, s in zip(runs, speedups)
    ]
    why = "not run: " + STOPPED if stopped else "waiting for its turn"
    panes += [f'<div class="pane waiting"><div class="pane-title">{html.escape(m)} · {why}</div></div>' for m in pending]
    return f'<div class="panes">{"".join(panes)}</div>'


def summary_html(runs: list[Run], speedups: list[float | None], greedy: bool, exact: bool) -> str:
    """The comparison in one table. At temperature 0 every method must produce AR's text (lossless);
    the last column shows it. On the CPU kernel path a tree verify computes bit for bit what a one-token
    step computes, in every dtype, so a difference is a bug; on the eager path (no C++ kernels, CUDA)
    reduced precision can round a near-tie differently now and then."""
    ar = next((r for r in runs if r.method == "ar" and r.done), None)
    head = ["method", "tokens", "target forwards", "τ", "engine time", "tok/s", "speed-up vs AR"]
    if ar is not None and greedy:
        head.append("same text as AR")
    rows = []
    for r, s in zip(runs, speedups):
        cells = [
            r.label,
            str(r.new_tokens),
            str(len(r.steps)),
            f"{r.tau:.2f}",
            f"{r.engine_s:.2f} s",
            f"{r.tokens_per_s:.1f}",
            "1.00×" if r.method == "ar" else (f"{s:.2f}×" if s is not None else "–"),
        ]
        if ar is not None and greedy:
            cells.append("–" if r is ar else ("yes" if r.output_ids == ar.output_ids else "no"))
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    note = ""
    if ar is not None and greedy and not exact and any(r.output_ids != ar.output_ids for r in runs):
        note = '<p class="note">This target runs the eager path in reduced precision: a tree verify may round a near-tie differently from a one-token step. The CPU kernel path (built by make setup) or --dtype float32 gives identical texts.</p>'
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
            cands = ", ".join(f"<code>{html.escape(repr(tokenizer.decode([t]))[1:-1])}</code> {p:.2f}" for t, p in list(zip(ts, ps))[:PREVIEW_CANDIDATES])
            rows.append(f"<tr><td>depth {depth}</td><td>{cands}</td></tr>")
        lines.append(f'<table class="topk"><thead><tr><th colspan="2">head candidates (top {PREVIEW_CANDIDATES} of each row, probability within the top-k)</th></tr></thead>{"".join(rows)}</table>')
    return f'<div class="details">{"".join(lines)}</div>'

