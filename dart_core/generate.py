"""The one generation loop. CLI, benchmark and UI all consume `generate`.

Per step:   propose (draft + prune)  ->  verify (one target forward)  ->  accept  ->  commit
The output so far is every token the target produced; the KV cache holds all of them but the last,
which is the root of the next tree. A step emits the accepted drafts plus the bonus token; the first
event (step 0) is the prefill, which emits the first token. Plain autoregressive decoding is the
drafter that proposes nothing: its tree is the root alone, so each step is a one-token forward.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from .model import ForwardOutput
from .prefix_cache import PrefixHit, PrefixScope
from .sampling import Acceptance, SamplingParams, accept, greedy_token, sample_token, target_probs
from .target import Prompt, Target
from .tree import DraftTree

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_length: int | None = None  # prompt + output; None = the model's context limit
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # the most drafted nodes a tree may have in this generation, below the drafter's own max_nodes
    # (a drafter built at a large size serves smaller trees per request: the same trees as one built
    # at that size); None = the drafter's max_nodes
    max_nodes: int | None = None

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 2):
            raise ValueError(f"max_length must be an integer >= 2, got {self.max_length!r}")
        if self.max_nodes is not None and (isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int) or self.max_nodes < 0):
            raise ValueError(f"max_nodes must be an integer >= 0 or None, got {self.max_nodes!r}")


@dataclass
class StageTimes:
    """Seconds spent per stage of a step."""

    draft: float = 0.0
    prune: float = 0.0
    verify: float = 0.0
    other: float = 0.0

    def __iadd__(self, o: "StageTimes") -> "StageTimes":
        self.draft += o.draft
        self.prune += o.prune
        self.verify += o.verify
        self.other += o.other
        return self


@dataclass(frozen=True)
class Proposal:
    tree: DraftTree
    draft_s: float = 0.0  # draft-model forward(s)
    prune_s: float = 0.0  # turning draft outputs into a tree
    info: dict = field(default_factory=dict)  # drafter-specific extras for display (top-k lists, scores)


class DraftSession(Protocol):
    """Per-generation drafter state (e.g. the draft head's own KV cache). A session may also have
    `close()`, which the loop calls once the generation ends: it gives back what the drafter may hand
    to its next session (DART's head cache, with the forward captured on it)."""

    def extend(self, ids: list[int], hidden: torch.Tensor | None) -> None:
        """Tokens just committed to the target's cache, with their captured hidden states (n, 3H)."""

    def propose(self, root: int, max_nodes: int) -> Proposal:
        """A tree rooted at `root` (the target's latest token) with at most `max_nodes` drafted nodes
        besides it: the loop's budget for the step (step_budget), never above the drafter's max_nodes."""


class Drafter(Protocol):
    name: str
    needs_hidden: bool  # whether the target must return captured hidden states
    max_nodes: int  # the most drafted nodes in a tree, the root not counted (the engine's one tree-size convention)

    def new_session(self, capacity: int) -> DraftSession: ...


class ARSession:
    """Plain decoding's session: it drafts nothing (each tree is the root alone). Public so that tools
    can extend it (dart_core.tools.replay records what the loop commits)."""

    def extend(self, ids, hidden) -> None:
        pass

    def propose(self, root: int, max_nodes: int) -> Proposal:
        return Proposal(DraftTree.root_only(root))


class ARDrafter:
    """Plain autoregressive decoding: no drafts, one target forward per token."""

    name = "ar"
    needs_hidden = False
    max_nodes = 0

    def new_session(self, capacity: int) -> DraftSession:
        return ARSession()


@dataclass
class StepEvent:
    step: int  # 0 = prefill
    new_tokens: list[int]  # tokens this step added to the output
    accepted: int  # drafted tokens accepted (new_tokens = accepted drafts + the target's own token)
    tree: DraftTree | None  # the verified tree (None at prefill)
    path: list[int]  # accepted node indices in `tree`, root first
    times: StageTimes
    info: dict = field(default_factory=dict)


@dataclass
class Summary:
    """One generation's result: what the loop yields last, and what the bench's other engines
    (transformers' generate, llama.cpp) report in the same terms, with None where they report nothing."""

    prompt_tokens: int
    output_ids: list[int]
    steps: int | None  # target forwards, the prefill included
    wall_s: float
    prefill_s: float | None  # the part of wall_s spent on the prompt (it yields the first token)
    times: StageTimes | None  # totals over the steps after prefill
    stop_reason: str | None  # "eos" | "max_new_tokens" | "context"
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted at each step after prefill
    counted_tokens: int | None = None  # the engine's own count of new tokens, where it differs from len(output_ids) (llama.cpp)
    drafted: int | None = None  # drafted and accepted tokens in all, where an engine reports only totals (llama.cpp)
    accepted_drafts: int | None = None
    top2_gaps: list[float] | None = None  # per new token, the engine's top-2 logit gap, where it reports it (vLLM's plain decoding)
    reused_tokens: int = 0  # prompt tokens whose KV rows came from the prefix cache (not prefilled)

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids) if self.counted_tokens is None else self.counted_tokens

    @property
    def tau(self) -> float | None:
        """Mean tokens per target forward (the mean accepted length, bonus included); None where the
        engine does not count its forwards."""
        return None if self.steps is None else self.new_tokens / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


class _Clock:
    """Wall-clock timer that waits for queued GPU work, so stage times are real."""

    def __init__(self, device: torch.device):
        # the target's own device (cuda:N), not whichever is current
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


def _first_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    if params.greedy:
        return greedy_token(logits)
    return sample_token(target_probs(logits, params), gen)


def generate(
    target: Target,
    prompt: Prompt,
    drafter: Drafter | None = None,
    params: GenerationParams = GenerationParams(),
    prefix: PrefixScope | None = None,
) -> Iterator[StepEvent | Summary]:
    """Generate from `prompt`, yielding a StepEvent per target forward and finally a Summary.

    Stops at the first EOS id (kept in the output), at max_new_tokens, or when prompt + output
    reaches max_length; the cache is sized so that no verify can overflow it.

    prefix: a prefix store and its owner (dart_core/prefix_cache.py): the prompt's longest prefix
    held for that owner is copied into this generation's cache instead of prefilled (the first
    event's info says how many tokens: "reused"), and the generation's own rows are kept at its end;
    both only where the target's forwards give every row its one-token step's bits (exact reuse).
    """
    drafter = drafter or ARDrafter()
    ids = target.encode(prompt)
    limit = context_limit(target, params.max_length)
    if len(ids) >= limit:
        raise ValueError(f"the prompt has {len(ids)} tokens, the context limit is {limit}: no room to generate")
    capacity = cache_capacity(limit, len(ids), params.max_new_tokens, tree_size(drafter, params))
    if prefix is not None and not reuse_exact(target, len(ids), tree_size(drafter, params)):
        prefix = None
    return _loop(target, ids, drafter, params, limit, capacity, prefix)


def reuse_exact(target: Target, prompt_len: int, max_nodes: int) -> bool:
    """Whether a generation's KV rows are the same bits however much of its prompt came from a kept
    prefix: a prefill of the whole prompt, and so of any part of it, gives each row its one-token
    step's bits (Target.prefill_exact), and so does a verify of the generation's trees."""
    return target.prefill_exact(prompt_len) and target.exact_verify(max_nodes + 1)


def context_limit(target: Target, max_length: int | None) -> int:
    """The most tokens prompt + output may hold: max_length, capped by the model's context."""
    return min(max_length or target.context_limit, target.context_limit)


def tree_size(drafter: Drafter, params: GenerationParams) -> int:
    """Drafted nodes a tree may have in this generation: the drafter's max_nodes, cut to
    params.max_nodes when that is given."""
    return drafter.max_nodes if params.max_nodes is None else min(drafter.max_nodes, params.max_nodes)


def step_budget(max_nodes: int, capacity: int, cached: int) -> int:
    """Drafted nodes the next tree may have: the generation's tree size (tree_size), cut to the room
    the cache has left after the root. The one place a tree size is clamped: drafters draft exactly to it."""
    return max(0, min(max_nodes, capacity - cached - 1))


def cache_capacity(limit: int, prompt_len: int, max_new_tokens: int, max_nodes: int) -> int:
    """KV cache size for one generation. The cache holds prompt + output minus the pending root; a
    verify writes a tree of up to max_nodes drafted nodes and its root after that."""
    return min(limit, prompt_len + max_new_tokens + max_nodes + 1)


def _loop(target, ids, drafter, params, limit, capacity, prefix) -> Iterator[StepEvent | Summary]:
    # Python's cyclic GC, triggered by the loop's small allocations, traversed every object the process
    # holds (torch, transformers, the app): perf put ~5% of a bench run's CPU samples in it. The objects
    # that exist before the loop are set aside for its duration and handed back at its end (also when
    # the consumer stops early), so collections during the loop see only the loop's own objects.
    # The target's cache and the drafter's session state are leased for the generation and given back
    # at its end (also when the consumer stops early), so the next generation replays what this one
    # captured on them (Target.lease_cache, DraftSession.close).
    # With a prefix store, the context the cache holds (its tokens, their captured hidden states) is
    # followed as the loop commits, and kept in the store when the generation ends (also early).
    cache = target.lease_cache(capacity)
    session = drafter.new_session(capacity)
    ctx = _Context(prefix, drafter.needs_hidden or bool(target.model.capture)) if prefix is not None else None
    hit = prefix.store.lookup(prefix.owner, target, ids, drafter.needs_hidden) if prefix is not None else None
    gc.freeze()
    try:
        yield from _steps(target, ids, drafter, params, limit, capacity, cache, session, hit, ctx)
    finally:
        gc.unfreeze()
        close = getattr(session, "close", None)
        if close is not None:
            close()
        if ctx is not None:
            ctx.keep(target, cache)
        target.return_cache(cache)


class _Context:
    """The tokens whose rows the generation's cache holds, with their captured hidden states, and the
    logits after the prompt: what the prefix store keeps at the end."""

    def __init__(self, scope: PrefixScope, capture: bool):
        self.scope, self.capture = scope, capture
        self.tokens: list[int] = []
        self.hidden: list[torch.Tensor] | None = [] if capture else None
        self.prompt_len = 0
        self.prompt_logits: torch.Tensor | None = None

    def add(self, ids: list[int], hidden: torch.Tensor | None) -> None:
        self.tokens += ids
        if self.hidden is not None:
            if hidden is None:
                self.hidden = None
            else:
                self.hidden.append(hidden.clone())  # (a forward's output buffer may be written again)

    def keep(self, target: Target, cache) -> None:
        if not self.tokens or len(self.tokens) != cache.length:
            return  # a step that failed between its commit and this record: nothing consistent to keep
        hidden = None if not self.hidden else torch.cat(self.hidden)
        if hidden is not None and hidden.shape[0] != len(self.tokens):
            hidden = None
        self.scope.store.put(self.scope.owner, target, self.tokens, cache, hidden, self.prompt_len, self.prompt_logits)


def _steps(target, ids, drafter, params, limit, capacity, cache, session, hit: PrefixHit | None, ctx) -> Iterator[StepEvent | Summary]:
    sp = params.sampling
    gen = None
    if not sp.greedy:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(sp.seed if sp.seed is not None else torch.seed())
    clock = _Clock(target.device)

    capture = drafter.needs_hidden or (ctx is not None and ctx.capture)
    t0 = clock()
    out, reused = _prefill(target, ids, cache, capture, hit)
    root = _first_token(out.logits[-1], sp, gen)
    session.extend(ids, None if out.hidden is None or not drafter.needs_hidden else out.hidden)
    if ctx is not None:
        ctx.add(ids, out.hidden)
        ctx.prompt_len, ctx.prompt_logits = len(ids), out.logits[-1:].clone()
    prefill_s = clock() - t0
    output = [root]
    totals = StageTimes()
    steps = 1
    accepted: list[int] = []
    yield StepEvent(0, [root], 0, None, [], StageTimes(verify=prefill_s), {"reused": reused})
    stop = _stop_reason(output, target.eos_ids, params.max_new_tokens, len(ids), limit)

    size = tree_size(drafter, params)
    while stop is None:
        t_step = clock()
        max_nodes = step_budget(size, capacity, cache.length)
        proposal = session.propose(root, max_nodes)
        tree = proposal.tree.truncate(max_nodes + 1)
        t_verify = clock()
        out = target.verify(tree, cache, capture=capture)
        t_accept = clock()
        acc: Acceptance = accept(tree, out.logits, sp, gen)
        cache.commit_path(acc.path)
        toks = tree.token_list
        committed = [toks[i] for i in acc.path]  # root + accepted drafts
        hidden = None if out.hidden is None else target.rows(out.hidden, acc.path)
        if ctx is not None:
            ctx.add(committed, hidden)
        new = committed[1:] + [acc.bonus]
        kept = _append_until_stop(output, new, target.eos_ids, params.max_new_tokens, len(ids), limit)
        stop = _stop_reason(output, target.eos_ids, params.max_new_tokens, len(ids), limit)
        if stop is None:
            session.extend(committed, hidden if drafter.needs_hidden else None)
        root = acc.bonus
        t_end = clock()
        verify_s = t_accept - t_verify
        times = StageTimes(proposal.draft_s, proposal.prune_s, verify_s)
        times.other = max(0.0, (t_end - t_step) - times.draft - times.prune - verify_s)
        totals += times
        steps += 1
        accepted.append(acc.accepted)
        yield StepEvent(steps - 1, kept, acc.accepted, tree, acc.path, times, proposal.info)

    yield Summary(len(ids), output, steps, clock() - t0, prefill_s, totals, stop, accepted, reused_tokens=reused)


def _prefill(target: Target, ids: list[int], cache, capture: bool, hit: PrefixHit | None) -> tuple[ForwardOutput, int]:
    """The prompt into the cache, committed: its kept prefix copied in (hit) and the rest prefilled,
    or the whole prompt prefilled. Returns the last row's logits and every prompt row's captured
    states (hidden: the kept ones first), and how many tokens were reused."""
    if hit is None:
        out = target.prefill(ids, cache, capture=capture)
        cache.commit(len(ids))
        return out, 0
    hit.load(cache)
    n = hit.tokens
    if hit.logits is not None:  # the whole prompt is kept, with the logits after it
        return ForwardOutput(logits=hit.logits, hidden=hit.hidden() if capture else None), n
    out = target.prefill(ids[n:], cache, capture=capture)
    cache.commit(len(ids) - n)
    kept = hit.hidden()
    hidden = torch.cat((kept, out.hidden)) if capture and kept is not None and out.hidden is not None else None
    return ForwardOutput(logits=out.logits, hidden=hidden), n


def _append_until_stop(output, new, eos_ids, max_new, prompt_len, limit) -> list[int]:
    """Append `new` to `output`, cutting after an EOS or at a length limit; return what was kept."""
    kept = []
    for t in new:
        if len(output) >= max_new or prompt_len + len(output) >= limit:
            break
        output.append(t)
        kept.append(t)
        if t in eos_ids:
            break
    return kept


def _stop_reason(output, eos_ids, max_new, prompt_len, limit) -> str | None:
    if output[-1] in eos_ids:
        return "eos"
    if len(output) >= max_new:
        return "max_new_tokens"
    if prompt_len + len(output) >= limit:
        return "context"
    return None


def complete(target: Target, prompt: Prompt, drafter: Drafter | None = None, params=GenerationParams()) -> Summary:
    """Blocking call: run the loop to the end and return its Summary."""
    summary = None
    for event in generate(target, prompt, drafter, params):
        summary = event
    assert isinstance(summary, Summary)
    return summary
