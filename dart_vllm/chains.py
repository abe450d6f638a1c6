"""DART's pruner choosing the chain vLLM verifies (no vLLM import: tested in the project's own venv).

vLLM 0.32 verifies one chain of k drafts per request (its tree attention is gone). DART's head gives
k rows of logits in one forward (row 0 at the root, rows 1.. at the mask slots); the C++ beam search
(ngram_cpp.prune: the head's top-k per row, the 3-gram trie, the conversation's own n-grams) builds
the same draft tree our engine verifies, and `best_chain` keeps its root-to-node path with the most
expected accepted tokens: the sum over the path of exp(node score) (a node's score is its path's
log-likelihood under the pruner's score, or the fitted ranking's log P(accepted)). Rows the tree
does not reach are filled with the head's own top token, so vLLM always gets k drafts.

`Contexts` keeps each request's committed tokens (and its context n-gram index), rebuilt from what
the proposer sees each step: the target's input tokens at their positions, less the rejected ones.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

import ngram_cpp
from dart_core.drafters import DEFAULT_DART_HEAD, DEFAULT_NGRAM
from dart_core.drafters.dart import CONTEXT_ORDER, CONTEXT_TAIL, EMBEDDED_WEIGHTS, UPSTREAM_WEIGHTS, DartParams, ranked_params, weighted

TREE_NODES = 60  # the tree the chain is chosen from (drafted nodes besides the root)


@dataclass(frozen=True)
class ChainSettings:
    """How the plugin prunes: the tree parameters, the trie (None: the head's rows and the context
    n-gram only) and the context n-gram's order."""

    params: DartParams
    ngram: str | None

    @classmethod
    def for_head(
        cls,
        head_dir: str | os.PathLike,
        ngram: str | None = None,
        preset: str | None = None,
        tree_nodes: int = TREE_NODES,
        default_trie: bool = True,
    ) -> "ChainSettings":
        """The settings our engine's DART row uses for this head: the embedded head gets its tuned
        weights, its trie (unless default_trie is False) and its fitted ranking (fitted with that trie);
        any other head upstream's weights and the trie given (none by default). preset "embedded" /
        "upstream" overrides the choice of weights."""
        embedded = Path(head_dir).resolve() == DEFAULT_DART_HEAD.resolve()
        if preset is None:
            preset = "embedded" if embedded else "upstream"
        if preset not in ("embedded", "upstream"):
            raise ValueError(f"unknown DART preset {preset!r}: choose embedded or upstream")
        if tree_nodes < 1:
            raise ValueError(f"the tree the chain is chosen from needs >= 1 node, got {tree_nodes}")
        if ngram is None and embedded and default_trie:
            ngram = str(DEFAULT_NGRAM)
        weights = EMBEDDED_WEIGHTS if preset == "embedded" else UPSTREAM_WEIGHTS
        prune = weighted(replace(ngram_cpp.PruneParams(), max_nodes=tree_nodes, use_ngram=ngram is not None), weights)
        params = ranked_params(DartParams(prune=prune), None, head_dir, ngram)
        return cls(params, ngram)

    @classmethod
    def from_env(cls, head_dir: str | os.PathLike) -> "ChainSettings":
        """for_head with the plugin's environment: DART_VLLM_NGRAM (a trie file; "none": no trie),
        DART_VLLM_PRESET (embedded / upstream), DART_VLLM_TREE_NODES."""
        ngram = os.environ.get("DART_VLLM_NGRAM") or None
        nodes = os.environ.get("DART_VLLM_TREE_NODES", str(TREE_NODES))
        try:
            tree_nodes = int(nodes)
        except ValueError:
            raise ValueError(f"DART_VLLM_TREE_NODES must be a whole number, got {nodes!r}") from None
        none = ngram == "none"
        return cls.for_head(
            head_dir, None if none else ngram, os.environ.get("DART_VLLM_PRESET") or None, tree_nodes, default_trie=not none
        )


def best_chain(tree: ngram_cpp.PrunedTree, depth: int) -> list[int]:
    """The tree's root-to-node path of at most `depth` drafted tokens with the largest sum of
    exp(score) over its nodes (ties: the earlier node, i.e. the better-ranked one), root excluded."""
    n = len(tree.tokens)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[int(tree.parents[i])].append(i)
    best = [0.0] * n  # best sum over paths starting at node i (i included) within the depth
    nxt = [-1] * n
    for i in range(n - 1, 0, -1):  # depth order: children come after their parents
        gain = 0.0
        if tree.positions[i] < depth:
            for c in children[i]:
                if best[c] > gain:
                    gain, nxt[i] = best[c], c
        best[i] = math.exp(float(tree.scores[i])) + gain
    chain, node, top = [], -1, 0.0
    for c in children[0]:
        if best[c] > top:
            top, node = best[c], c
    while node != -1:
        chain.append(int(tree.tokens[node]))
        node = nxt[node]
    return chain


class Contexts:
    """Each request's committed tokens and context n-gram index, keyed by vLLM's request id."""

    def __init__(self, context_order: int = CONTEXT_ORDER, use_index: bool = True):
        self.order, self.use_index = context_order, use_index
        self.tokens: dict[str, list[int]] = {}
        self.index: dict[str, ngram_cpp.ContextIndex] = {}

    def update(self, req_id: str, first_position: int, tokens: list[int], known: Callable[[int], list[int]]) -> None:
        """The target just ran `tokens` at positions first_position.. for this request (the ones it
        kept: rejected drafts left out). known(n): the request's first n tokens, asked only where the
        positions before first_position were never seen here (a prefix-cache hit)."""
        have = self.tokens.get(req_id)
        if have is None or len(have) < first_position:
            have = list(known(first_position))
            if len(have) != first_position:
                raise ValueError(f"request {req_id}: {len(have)} known tokens where {first_position} were asked")
            self._rebuild(req_id, have)
        elif len(have) > first_position:  # recomputed (preempted, or the drafts of a rejected step): cut back
            del have[first_position:]
            self._rebuild(req_id, have)
        have.extend(tokens)
        if self.use_index:
            self.index[req_id].extend(tokens)

    def _rebuild(self, req_id: str, tokens: list[int]) -> None:
        self.tokens[req_id] = tokens
        if self.use_index:
            self.index[req_id] = ngram_cpp.ContextIndex(self.order, tokens)

    def keep(self, req_ids) -> None:
        """Forget the requests not in req_ids (finished or aborted)."""
        live = set(req_ids)
        for r in [r for r in self.tokens if r not in live]:
            self.tokens.pop(r, None)
            self.index.pop(r, None)


class ChainPicker:
    """Per step: the head's per-row top-k for each request -> its k drafts."""

    def __init__(self, settings: ChainSettings, eos_id: int, fingerprint: str | None = None, vocab_size: int | None = None):
        self.settings, self.eos_id = settings, eos_id
        self.ngram = (
            None
            if settings.ngram is None
            else ngram_cpp.load(settings.ngram, expected_fingerprint=fingerprint, expected_vocab_size=vocab_size)
        )
        self.contexts = Contexts(settings.params.context_order, settings.params.prune.context_weight > 0)
        trace = os.environ.get("DART_VLLM_TRACE")
        self.trace = open(trace, "a", buffering=1) if trace else None  # each step's drafts, for debugging (docs/vllm.md)

    def chain(self, req_id: str, root: int, tokens: np.ndarray, probs: np.ndarray) -> list[int]:
        """tokens, probs (k, top_k): row j's candidates (target ids) for depth j + 1, softmaxed
        within the row -> k drafts."""
        history = self.contexts.tokens[req_id]
        index = self.contexts.index.get(req_id)
        tree = ngram_cpp.prune(tokens, probs, root, history[-CONTEXT_TAIL:], self.ngram, self.settings.params.prune, self.eos_id, index)
        k = tokens.shape[0]
        chain = best_chain(tree, k)
        return chain + [int(t) for t in tokens[len(chain) :, 0]]
