"""Plotly figures: the tree verified at one step, tokens over time, tokens per step, and where the
time went."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from .engine import Run, Step
from .render import CostView

ACCEPTED = "#2b8a3e"
EDGE = "#adb5bd"
ROOT = "#495057"
STAGE_COLOURS = {"prefill": "#868e96", "draft": "#7048e8", "prune": "#f59f00", "verify": "#1c7ed6", "other": "#ced4da"}
METHOD_COLOURS = {"dart": "#e8590c", "eagle3": "#1971c2", "ar": "#495057"}
PATH_COLOURS = ("#e8590c", "#1971c2", "#2b8a3e", "#862e9c")  # weights paths in the verify-cost plot, the running one first
COLOUR_BY = ("draft probability", "tree score")
# Drafters whose tree scores are cumulative log-probabilities, so a node's own draft probability is
# exp(score - parent's score). DART's are beam scores mixing the n-gram, so it reports top-k lists instead.
CUMULATIVE_LOGPROB_SCORES = frozenset({"eagle3"})
LABEL_CHARS = 10
TREE_ROW_PX = 17  # vertical room per leaf
TREE_MIN_PX, TREE_MAX_PX = 340, 900
SMALL = dict(
    margin=dict(l=50, r=10, t=75, b=45),
    height=310,
    template="plotly_white",
    legend=dict(orientation="h", x=0, y=1.0, xanchor="left", yanchor="bottom", font=dict(size=11)),
)


def token_label(tokenizer, token: int) -> str:
    """A token as a short readable label: leading/trailing spaces as ␣, control characters escaped."""
    text = repr(tokenizer.decode([token]))[1:-1].replace(" ", "␣")
    return (text[:LABEL_CHARS] + "…" if len(text) > LABEL_CHARS else text) or "∅"


def tree_layout(parents: list[int], first: callable) -> list[float]:
    """y of each node: leaves one unit apart in depth-first order (children sorted by `first`), each
    parent centred on its children, so edges never cross."""
    children: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[parents[i]].append(i)
    y = [0.0] * len(parents)
    next_leaf = 0
    stack = [(0, False)]
    while stack:
        node, expanded = stack.pop()
        kids = sorted(children[node], key=first)
        if not kids:
            y[node], next_leaf = -next_leaf, next_leaf + 1
        elif expanded:
            y[node] = (y[kids[0]] + y[kids[-1]]) / 2
        else:
            stack.append((node, True))
            stack.extend((k, False) for k in reversed(kids))
    return y


def node_draft_probs(step: Step, method: str) -> list[float | None]:
    """Each node's probability under the draft head (None where the drafter does not tell)."""
    tree = step.tree
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    top_tokens, top_probs = step.info.get("topk_tokens"), step.info.get("topk_probs")
    if top_tokens and top_probs:  # DART: row d-1 holds the candidates for depth d
        rows = [dict(zip(ts, ps)) for ts, ps in zip(top_tokens, top_probs)]
        return [None if i == 0 or depths[i] > len(rows) else rows[depths[i] - 1].get(tokens[i]) for i in range(len(tokens))]
    if method in CUMULATIVE_LOGPROB_SCORES and tree.scores is not None:
        s = tree.scores.tolist()
        return [None if i == 0 else math.exp(s[i] - (s[parents[i]] if parents[i] > 0 else 0.0)) for i in range(len(tokens))]
    return [None] * len(tokens)


# Marker per node provenance (DART's info["sources"]): the head's candidate, one the context n-gram
# also proposed, or the context's alone (a repeat of the conversation the head did not propose).
SOURCE_SYMBOLS = ("circle", "star", "square")
SOURCE_NAMES = ("draft head", "draft head + context", "context n-gram")
PATH_SYMBOLS = ("diamond", "star-diamond", "square")  # the same, on the accepted path


def node_sources(step: Step) -> list[int]:
    """Each node's provenance index into SOURCE_NAMES (0 where the drafter does not tell)."""
    sources = step.info.get("sources")
    n = len(step.tree.tokens)
    return list(sources) if sources is not None and len(sources) == n else [0] * n


def empty_figure(title: str, height: int = SMALL["height"]) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(**{**SMALL, "height": height}, title=title)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def tree_figure(run: Run | None, step_index: int | None, tokenizer, colour_by: str = COLOUR_BY[0]) -> go.Figure:
    """The tree verified at one step (default: the latest), depth left to right: the accepted path
    in green along the top, other drafted nodes coloured by draft probability or tree score."""
    step = run.tree_step(step_index) if run is not None else None
    if step is None:
        what = "plain decoding drafts no tree" if run is not None and run.method == "ar" else "appears once a drafter proposes one"
        return empty_figure(f"Draft tree ({what})", TREE_MIN_PX)
    tree = step.tree
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    probs = node_draft_probs(step, run.method)
    scores = tree.scores.tolist() if tree.scores is not None else [None] * len(tokens)
    on_path = set(step.path)
    y = tree_layout(parents, lambda i: (i not in on_path, -(probs[i] or 0.0), i))
    labels = [token_label(tokenizer, t) for t in tokens]
    fig = go.Figure()
    _tree_edges(fig, parents, depths, y, on_path)
    values, title = (probs, "draft prob.") if colour_by == COLOUR_BY[0] else (scores, "tree score")
    _tree_nodes(fig, depths, y, labels, probs, scores, values, title, on_path, node_sources(step))
    n_leaves = sum(1 for i in range(len(tokens)) if i not in set(parents))
    fig.update_layout(
        title=f"{run.label} step {step.index}: {len(tokens) - 1} drafted nodes, {step.accepted} accepted (green)",
        template="plotly_white",
        height=max(TREE_MIN_PX, min(TREE_MAX_PX, 110 + TREE_ROW_PX * n_leaves)),
        margin=dict(l=20, r=20, t=60, b=40),
        legend=dict(orientation="h", x=0, y=1.02, yanchor="bottom", xanchor="left"),
        showlegend=False,
    )
    fig.update_xaxes(title="depth (0 = the target's last token)", dtick=1, range=[-0.3, max(depths) + 0.9], zeroline=False)
    fig.update_yaxes(visible=False, range=[min(y) - 0.8, max(y) + 1.0])  # room for the labels above the top row
    return fig


def _tree_edges(fig: go.Figure, parents, depths, y, on_path) -> None:
    rest, path = ([], []), ([], [])
    for i in range(1, len(parents)):
        xs, ys = path if i in on_path else rest
        xs += [depths[parents[i]], depths[i], None]
        ys += [y[parents[i]], y[i], None]
    fig.add_trace(go.Scatter(x=rest[0], y=rest[1], mode="lines", line=dict(color=EDGE, width=1), hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=path[0], y=path[1], mode="lines", line=dict(color=ACCEPTED, width=4), hoverinfo="skip"))


def _tree_nodes(fig: go.Figure, depths, y, labels, probs, scores, values, value_title, on_path, sources) -> None:
    def hover(i):
        p = f"draft prob. {probs[i]:.3f}" if probs[i] is not None else "draft prob. n/a"
        s = f"tree score {scores[i]:.3f}" if scores[i] is not None else ""
        return f"{labels[i]}<br>depth {depths[i]}<br>{p}<br>{s}<br>from the {SOURCE_NAMES[sources[i]]}"

    drafted = [i for i in range(1, len(labels)) if i not in on_path]
    known = [values[i] for i in drafted if values[i] is not None]
    colours = [values[i] if values[i] is not None else (min(known) if known else 0.0) for i in drafted]
    fig.add_trace(
        go.Scatter(
            x=[depths[i] for i in drafted],
            y=[y[i] for i in drafted],
            mode="markers+text",
            text=[labels[i] for i in drafted],
            textposition="middle right",
            textfont=dict(size=11, color="#343a40"),
            marker=dict(
                size=10,
                color=colours,
                colorscale="YlOrRd",
                line=dict(width=0.5, color="#495057"),
                symbol=[SOURCE_SYMBOLS[sources[i]] for i in drafted],
                showscale=bool(known),
                colorbar=dict(title=dict(text=value_title, side="right"), thickness=12, len=0.8),
            ),
            hovertext=[hover(i) for i in drafted],
            hoverinfo="text",
        )
    )
    path = sorted((i for i in on_path if i != 0), key=lambda i: depths[i])
    fig.add_trace(
        go.Scatter(
            x=[depths[i] for i in path],
            y=[y[i] for i in path],
            mode="markers+text",
            text=[f"<b>{labels[i]}</b>" for i in path],
            textposition="top center",
            textfont=dict(size=12, color=ACCEPTED),
            marker=dict(size=14, color=ACCEPTED, symbol=[PATH_SYMBOLS[sources[i]] for i in path]),
            hovertext=[hover(i) for i in path],
            hoverinfo="text",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=[0],
            y=[y[0]],
            mode="markers+text",
            text=[f"<b>{labels[0]}</b>"],
            textposition="top center",
            marker=dict(size=14, color=ROOT, symbol="square"),
            hovertext=[f"{labels[0]}<br>root: the target's last token"],
            hoverinfo="text",
        )
    )


def speed_figure(runs: list[Run]) -> go.Figure:
    """Tokens/s so far against engine time, one line per method; a line ends when its method finished,
    so the faster method's line is both higher and shorter."""
    if not runs:
        return empty_figure("Tokens/s as it runs")
    fig = go.Figure()
    for run in runs:
        xs, ys, counts, n = [], [], [], 0
        for s in run.steps:
            n += len(s.tokens)
            if s.t > 0:
                xs.append(s.t)
                ys.append(n / s.t)
                counts.append(n)
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                customdata=counts,
                mode="lines",
                name=f"{run.label} {run.tokens_per_s:.1f} tok/s",
                line=dict(color=METHOD_COLOURS.get(run.method), width=2.5),
                hovertemplate="%{y:.1f} tok/s after %{x:.2f} s (%{customdata} tokens)<extra></extra>",
            )
        )
    fig.update_layout(title="Tokens/s as it runs", xaxis_title="engine seconds", yaxis_title="tokens/s", **SMALL)
    fig.update_yaxes(rangemode="tozero")
    return fig


def accepted_figure(runs: list[Run]) -> go.Figure:
    """Tokens each target forward produced (accepted drafts + the bonus); their mean is τ."""
    if not runs:
        return empty_figure("Tokens per target forward")
    fig = go.Figure()
    for run in runs:
        steps = run.steps[1:]  # step 0 is the prefill
        fig.add_trace(
            go.Bar(
                x=[s.index for s in steps],
                y=[len(s.tokens) for s in steps],
                name=f"{run.label} τ {run.tau:.2f}",
                marker_color=METHOD_COLOURS.get(run.method),
            )
        )
    fig.update_layout(title="Tokens per target forward", xaxis_title="step", yaxis_title="tokens", barmode="group", bargap=0.1, **SMALL)
    return fig


def time_split_figure(runs: list[Run]) -> go.Figure:
    """Engine seconds per method, stacked by stage: the shortest bar finished first."""
    if not runs:
        return empty_figure("Where the time went")
    fig = go.Figure()
    names = [r.label for r in runs]
    for stage, colour in STAGE_COLOURS.items():
        totals = [_stage_seconds(r, stage) for r in runs]
        per_step = [1000 * t / max(1, len(r.steps) - 1) for t, r in zip(totals, runs)]
        fig.add_trace(
            go.Bar(
                x=names,
                y=totals,
                name=stage,
                marker_color=colour,
                customdata=per_step,
                hovertemplate=f"{stage}: %{{y:.2f}} s (%{{customdata:.1f}} ms/step)<extra></extra>",
            )
        )
    fig.update_layout(title="Where the time went", yaxis_title="engine seconds", barmode="stack", **SMALL)
    return fig


def _stage_seconds(run: Run, stage: str) -> float:
    if stage == "prefill":
        return run.steps[0].times["verify"] if run.steps else 0.0
    return sum(s.times[stage] for s in run.steps[1:])


def verify_cost_figure(view: CostView | None) -> go.Figure:
    """Forward ms by rows on this machine, one line per weights path (the running one solid), with the
    verify of the tree DART runs on each path marked: the curve the tree size was chosen from."""
    if view is None or not view.paths:
        return empty_figure("Verify cost by rows (not measured here)")
    fig = go.Figure()
    paths = sorted(view.paths, key=lambda p: not p.chosen)
    for colour, p in zip(PATH_COLOURS, paths):
        rows = sorted(p.ms)
        fig.add_trace(
            go.Scatter(
                x=rows,
                y=[p.ms[k] for k in rows],
                customdata=[p.ms[k] / p.ms[1] for k in rows],
                mode="lines+markers",
                name=p.weights + (" (runs)" if p.chosen else ""),
                line=dict(color=colour, width=2.5 if p.chosen else 1.5, dash=None if p.chosen else "dot"),
                marker=dict(size=5),
                hovertemplate="%{x} rows: %{y:.1f} ms (%{customdata:.2f}x one row)<extra></extra>",
            )
        )
        if p.nodes is not None and p.nodes + 1 in p.ms:
            k = p.nodes + 1
            fig.add_trace(
                go.Scatter(
                    x=[k],
                    y=[p.ms[k]],
                    mode="markers+text",
                    text=[f"DART {p.nodes} node{'s' if p.nodes != 1 else ''}"],
                    textposition="top center",
                    marker=dict(size=13, color=colour, symbol="star"),
                    showlegend=False,
                    hovertemplate=f"DART's tree on {p.weights}: {p.nodes} drafted nodes, a {k}-row verify: %{{y:.1f}} ms<extra></extra>",
                )
            )
    fig.update_layout(
        title="Forward cost by rows on this machine",
        xaxis_title="rows in one forward (a tree of n nodes: n + 1)",
        yaxis_title="ms",
        **SMALL,
    )
    fig.update_xaxes(dtick=2)
    fig.update_yaxes(rangemode="tozero")
    return fig
