"""Exact greedy replay: the steps a drafter would take on a prompt, without running the target again.

At temperature 0 speculative decoding outputs what plain greedy decoding outputs (it is lossless),
and on the batch-invariant CPU kernels the hidden states the target returns for a committed token
are the ones its one-token step computed, bit for bit, whatever tree it was verified in. So one
recorded greedy decode (the prompt's and every output token's captured hidden states) replays any
drafter exactly: the drafter does all its real work (head forward, pruning) at each root, the
recorded continuation says which path of its tree the target accepts, and the drafter is told what
was committed, as the generation loop would tell it. The accepted counts equal those of
`generate` with the same drafter (tests/test_replay.py checks it on the embedded heads).

Used to tune tree parameters (dart_core/tools/tuning.py): τ of a setting in seconds of drafting
instead of a bench run. It says nothing about time: a larger tree costs more to verify.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generate import ARSession, Drafter, GenerationParams, cache_capacity, context_limit, generate, step_budget
from ..sampling import SamplingParams
from ..target import Prompt, Target


@dataclass(frozen=True)
class GreedyRecord:
    """One plain greedy decode with the target's captured hidden states, as the drafters receive them."""

    prompt_ids: list[int]
    output_ids: list[int]  # plain greedy decoding's output, as `generate` stops it
    # (len(prompt_ids) + len(output_ids) - 2, 3H): the prompt's, then each output token's but the last
    # two (never committed before the loop stops)
    hidden: torch.Tensor
    limit: int  # the context limit the decode ran with
    max_new_tokens: int


class _RecordingSession(ARSession):
    """Plain decoding's session (root-only trees) that keeps what the loop commits."""

    def __init__(self):
        self.ids: list[int] = []
        self.hidden: list[torch.Tensor] = []

    def extend(self, ids: list[int], hidden: torch.Tensor | None) -> None:
        self.ids += ids
        self.hidden.append(hidden)


class _Recorder:
    """Plain decoding (root-only trees) that asks for the hidden states and keeps what is committed."""

    name = "record"
    needs_hidden = True
    max_nodes = 0

    def __init__(self):
        self.session: _RecordingSession | None = None

    def new_session(self, capacity: int) -> _RecordingSession:
        self.session = _RecordingSession()
        return self.session


def record_greedy(target: Target, prompt: Prompt, max_new_tokens: int, max_length: int | None = None) -> GreedyRecord:
    """Decode `prompt` greedily with the generation loop itself and keep what a drafter would be given."""
    ids = target.encode(prompt)
    recorder = _Recorder()
    summary = None
    for summary in generate(target, ids, recorder, GenerationParams(max_new_tokens, max_length, SamplingParams(temperature=0.0))):
        pass
    s = recorder.session
    assert s is not None and s.ids == ids + summary.output_ids[: max(0, len(summary.output_ids) - 2)]
    return GreedyRecord(ids, summary.output_ids, torch.cat(s.hidden), context_limit(target, max_length), max_new_tokens)


@dataclass(frozen=True)
class Replay:
    accepted: list[int]  # drafted tokens accepted at each step after prefill (as Summary.accepted, but the
    # last step's count ends with the record: the loop may accept drafts past max_new_tokens and drop them)
    tree_sizes: list[int]  # drafted nodes proposed at each step
    new_tokens: int

    @property
    def steps(self) -> int:
        """Target forwards, the prefill included (as Summary.steps)."""
        return len(self.accepted) + 1

    @property
    def tau(self) -> float:
        return self.new_tokens / self.steps


def replay(drafter: Drafter, rec: GreedyRecord, max_nodes: int | None = None) -> Replay:
    """The steps `drafter` takes on the record's prompt at temperature 0: what `generate` would
    accept, step for step, with the drafter's real trees (the same tree cut by cache room too).
    max_nodes: the tree size asked of the drafter each step (as GenerationParams.max_nodes asks it; its
    trees are then those of the drafter built at that size), None the drafter's own."""
    out, P = rec.output_ids, len(rec.prompt_ids)
    size = drafter.max_nodes if max_nodes is None else max_nodes
    if size < 0:
        raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
    capacity = cache_capacity(rec.limit, P, rec.max_new_tokens, size)
    session = drafter.new_session(capacity)
    session.extend(rec.prompt_ids, rec.hidden[:P] if drafter.needs_hidden else None)
    accepted, sizes = [], []
    pos = 0  # out[pos] is the root; out[:pos] is committed
    while pos < len(out) - 1:
        budget = step_budget(size, capacity, P + pos)  # as the loop does, with P + pos tokens cached
        tree = session.propose(out[pos], budget).tree.truncate(budget + 1)
        node, path = 0, [0]
        while pos + len(path) < len(out):
            nxt = tree.child(node, out[pos + len(path)])
            if nxt is None:
                break
            node = nxt
            path.append(node)
        accepted.append(len(path) - 1)
        sizes.append(len(tree) - 1)
        end = pos + len(path)  # out[pos:end] committed, out[end] (if any) the target's next token
        if end >= len(out) - 1:
            break  # the loop stops here (the output is complete), before telling the drafter
        if drafter.needs_hidden:
            session.extend(out[pos:end], rec.hidden[P + pos : P + end])
        else:
            session.extend(out[pos:end], None)
        pos = end
    close = getattr(session, "close", None)  # what the session holds, to the drafter's next one (as the loop does)
    if close is not None:
        close()
    return Replay(accepted, sizes, len(out))
