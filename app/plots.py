"""Plotly figures: the verified draft tree of a step, tokens/s over time, accepted length per step,
and where each step's time went."""

from __future__ import annotations

import plotly.graph_objects as go

from .engine import Run

ACCEPTED = "#2e7d32"
REJECTED = "#b0bec5"
STAGE_COLOURS = {"draft": "#7e57c2", "prune": "#ffa726", "verify": "#42a5f5", "other": "#bdbdbd"}
METHOD_COLOURS = {"dart": "#e65100", "eagle3": "#1565c0", "ar": "#616161"}
LAYOUT = dict(margin=dict(l=40, r=10, t=40, b=30), height=300, template="plotly_white")


def _label(tokenizer, tok: int) -> str:
    text = tokenizer.decode([tok])
    return repr(text)[1:-1][:12] or "␣"


def tree_figure(run: Run | None, step_index: int | None, tokenizer) -> go.Figure:
    """The tree verified at one step (default: the last): depth left to right, the accepted path in green,
    other nodes coloured by the drafter's score where it gives one."""
    fig = go.Figure()
    steps = [s for s in (run.steps if run else []) if s.tree is not None and len(s.tree) > 1]
    if not steps:
        fig.update_layout(title="Draft tree (appears when a drafter proposes one)", **LAYOUT)
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        return fig
    step = steps[-1] if step_index is None else min(steps, key=lambda s: abs(s.index - step_index))
    tree = step.tree
    depths = tree.depths.tolist()
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    # y: order of nodes within their depth, centred
    per_depth: dict[int, list[int]] = {}
    for i, d in enumerate(depths):
        per_depth.setdefault(d, []).append(i)
    y = [0.0] * len(tokens)
    for d, nodes in per_depth.items():
        for rank, i in enumerate(nodes):
            y[i] = rank - (len(nodes) - 1) / 2
    accepted = set(step.path)
    ex, ey, ax, ay = [], [], [], []
    for i in range(1, len(tokens)):
        p = parents[i]
        xs, ys = (ax, ay) if i in accepted and p in accepted else (ex, ey)
        xs += [depths[p], depths[i], None]
        ys += [y[p], y[i], None]
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color=REJECTED, width=1), hoverinfo="skip", showlegend=False))
    fig.add_trace(go.Scatter(x=ax, y=ay, mode="lines", line=dict(color=ACCEPTED, width=3), hoverinfo="skip", name="accepted path"))
    scores = tree.scores.tolist() if tree.scores is not None else [0.0] * len(tokens)
    colours = [ACCEPTED if i in accepted else scores[i] for i in range(len(tokens))]
    labels = [_label(tokenizer, t) for t in tokens]
    others = [i for i in range(len(tokens)) if i not in accepted]
    fig.add_trace(
        go.Scatter(
            x=[depths[i] for i in others],
            y=[y[i] for i in others],
            mode="markers+text",
            text=[labels[i] for i in others],
            textposition="middle right",
            marker=dict(size=9, color=[colours[i] for i in others], colorscale="Oranges", cmin=min(scores), cmax=0, showscale=tree.scores is not None, colorbar=dict(title="score", thickness=10)),
            hovertext=[f"{labels[i]} (score {scores[i]:.2f})" for i in others],
            hoverinfo="text",
            name="drafted",
        )
    )
    acc_nodes = sorted(accepted, key=lambda i: depths[i])
    fig.add_trace(
        go.Scatter(
            x=[depths[i] for i in acc_nodes],
            y=[y[i] for i in acc_nodes],
            mode="markers+text",
            text=[labels[i] for i in acc_nodes],
            textposition="top center",
            marker=dict(size=13, color=ACCEPTED, symbol="diamond"),
            hoverinfo="text",
            hovertext=[labels[i] for i in acc_nodes],
            name="accepted",
        )
    )
    fig.update_layout(title=f"{run.method} step {step.index}: {len(tokens) - 1} drafted nodes, {step.accepted} accepted", **{**LAYOUT, "height": 360})
    fig.update_xaxes(title="depth", dtick=1)
    fig.update_yaxes(visible=False)
    return fig


def speed_figure(runs: list[Run]) -> go.Figure:
    """Tokens generated against time, one line per method: the steeper, the faster."""
    fig = go.Figure()
    for run in runs:
        xs, ys, n = [0.0], [0], 0
        for s in run.steps:
            n += len(s.tokens)
            xs.append(s.t)
            ys.append(n)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"{run.method} ({run.tokens_per_s:.1f} tok/s)", line=dict(color=METHOD_COLOURS.get(run.method))))
    fig.update_layout(title="Tokens over time", xaxis_title="seconds", yaxis_title="tokens", **LAYOUT)
    return fig


def accepted_figure(runs: list[Run]) -> go.Figure:
    """Tokens produced per target forward (accepted drafts + 1); its mean is τ."""
    fig = go.Figure()
    for run in runs:
        steps = run.steps[1:]  # step 0 is the prefill
        fig.add_trace(go.Bar(x=[s.index for s in steps], y=[s.accepted + 1 for s in steps], name=f"{run.method} (τ {run.tau:.2f})", marker_color=METHOD_COLOURS.get(run.method)))
    fig.update_layout(title="Tokens per step", xaxis_title="step", yaxis_title="tokens", barmode="group", **LAYOUT)
    return fig


def time_split_figure(runs: list[Run]) -> go.Figure:
    """Mean milliseconds per step in each stage, one stacked bar per method."""
    fig = go.Figure()
    names = [r.method for r in runs]
    for stage, colour in STAGE_COLOURS.items():
        vals = []
        for r in runs:
            steps = r.steps[1:]
            vals.append(1000 * sum(s.times[stage] for s in steps) / max(1, len(steps)))
        fig.add_trace(go.Bar(x=names, y=vals, name=stage, marker_color=colour))
    fig.update_layout(title="Time per step (ms)", barmode="stack", **LAYOUT)
    return fig
