"""EAGLE3 drafting, the baseline: the same one-layer head run autoregressively to grow a tree.

Per step (EAGLE's defaults: depth 7, top_k 10, 60 tree nodes with the root):
  1. one forward over the newly committed tokens (target hidden states through fc) gives the state
     at the root; its top-k are the depth-1 frontier, scored by log-probability;
  2. `depth` times: the frontier (top_k nodes) is fed back, each with its parent's output state and
     its own embedding, attending to the committed prefix and its own ancestors; every node's top_k
     children are scored (parent score + log-prob) and all are kept in a pool; the best top_k of them
     become the next frontier;
  3. the tree is the best `max_nodes` nodes of the pool (cumulative log-probability, ties
     parent-first), in pool order so parents precede children.
That is 1 + depth head forwards per step, against DART's one. A tree of N nodes is at most N deep
and keeps at most N children of a node or nodes of a level, so the search runs with
min(top_k, N) and min(depth, N - 1): the same tree (up to exact score ties) for less work.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..fixed_shape import Upload
from ..generate import Proposal
from ..model import SpareCache
from ..tree import DraftTree
from .captured import captured_head
from .head import DraftHead, KernelHead, int8_beside, load_head
from .session import HeadSession

ACCEPTANCE_FILE = "acceptance.json"  # beside an EAGLE3 head: its fitted ranking (dart-fit --method eagle3)
ACCEPTANCE_FORMAT = "eagle3-acceptance/1"
# The fitted ranking's features of a pool node: what the head said of it and of its siblings, and its
# parent's fitted value (eagle3_features computes them).
FEATURES = ("bias", "cumulative ln p", "ln p", "rank 0 among siblings", "ln(1 + rank)", "ln p of the top sibling", "parent's fitted ln P")
PARENT_FIT = FEATURES.index("parent's fitted ln P")


@dataclass(frozen=True)
class Eagle3Params:
    depth: int = 7
    top_k: int = 10
    max_nodes: int = 59  # drafted nodes besides the root (EAGLE's total_token = 60 counts the root)
    # The fitted ranking: rows of len(FEATURES) logistic weights, row l for depth l + 1 (the last row
    # for deeper ones); (): the tree keeps the best nodes by cumulative log-probability (EAGLE's rule).
    ranking: tuple = ()

    def __post_init__(self):
        if self.depth < 0 or self.top_k < 1 or self.max_nodes < 0:
            raise ValueError("EAGLE3 needs depth >= 0, top_k >= 1 and max_nodes >= 0")
        if len(self.ranking) % len(FEATURES) or not all(math.isfinite(w) for w in self.ranking):
            raise ValueError(f"an EAGLE3 ranking is rows of {len(FEATURES)} finite weights")


def eagle3_features(scores: list[float], parents: list[int], own: list[float], ranks: list[int], sib_top: list[float]) -> list[list[float]]:
    """The fitted ranking's features of every pool node (the parent's fitted value left 0: it depends on
    the weights). scores: cumulative log-probabilities; own: each node's own log-probability; ranks:
    its place among its parent's top-k children; sib_top: the log-probability of that top child."""
    return [[1.0, scores[i], own[i], 1.0 if ranks[i] == 0 else 0.0, math.log1p(ranks[i]), sib_top[i], 0.0] for i in range(len(scores))]


def fitted_scores(weights: tuple, features: list[list[float]], parents: list[int], depths: list[int]) -> list[float]:
    """ln P(node accepted) of every pool node under the fitted ranking: a logistic regression per depth,
    capped by the parent's value (a node is accepted only if its parent is). Parents precede children."""
    F = len(FEATURES)
    rows = len(weights) // F
    fit: list[float] = []
    for i, x in enumerate(features):
        parent_fit = fit[parents[i]] if parents[i] >= 0 else 0.0
        w = weights[min(depths[i] - 1, rows - 1) * F :][:F]
        z = sum(a * b for a, b in zip(w, x[:PARENT_FIT])) + w[PARENT_FIT] * parent_fit
        own = -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))
        fit.append(min(own, parent_fit))
    return fit


def load_fitted_ranking(head_dir: str | os.PathLike | None) -> tuple | None:
    """The head's fitted ranking weights (ACCEPTANCE_FILE beside its config.json), or None where it has
    none; an unreadable file is an error (it would silently change the trees)."""
    if head_dir is None or not (Path(head_dir) / ACCEPTANCE_FILE).is_file():
        return None
    path = Path(head_dir) / ACCEPTANCE_FILE
    try:
        data = json.loads(path.read_text())
        if data.get("format") != ACCEPTANCE_FORMAT or list(data.get("features") or []) != list(FEATURES):
            raise ValueError(f"format {data.get('format')!r}, expected {ACCEPTANCE_FORMAT} with the features {FEATURES}")
        if not data["weights"] or any(len(row) != len(FEATURES) for row in data["weights"]):
            raise ValueError("weights must be rows of one weight per feature")
        return tuple(float(w) for row in data["weights"] for w in row)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a fitted EAGLE3 ranking ({e}); refit it with dart-fit --method eagle3") from None


class Eagle3Drafter:
    name = "eagle3"
    needs_hidden = True

    def __init__(self, head: DraftHead, target, params: Eagle3Params = Eagle3Params(), use_kernels: bool = True):
        if head.config.is_dart:
            raise ValueError("Eagle3Drafter needs an EAGLE3 head (no draft_length / mask_rep)")
        self.head, self.target, self.params = head, target, params
        self.max_nodes = params.max_nodes
        # the whole step on the CPU kernels where they run (the eager module's bf16 matmuls are
        # emulated on CPUs without bf16 arithmetic); elsewhere the eager module
        self.fast = KernelHead(head, int8=int8_beside(target)) if use_kernels and KernelHead.supports(head) else None
        # the expansion captured as a CUDA graph (dart_core/cuda/expand_graph.py): None where it runs (CUDA with Triton,
        # no CPU kernels), False never, True demanded (on a CPU: Triton's interpreter, uncaptured)
        self.expand_graph: bool | None = None
        # the step's first forward (extend_root) captured too (dart_core/cuda/head_graph.py, as DART's draft forward):
        # the same values
        self.head_graph: bool | None = None
        # the last session's head cache (with its captured expansion), for the next session (SpareCache)
        self.spare = SpareCache()

    def new_session(self, capacity: int) -> "_Eagle3Session":
        return _Eagle3Session(self, capacity)


@dataclass
class _Pool:
    """The search's drafted nodes, in the order drafted (a parent before its children)."""

    tokens: list[int]  # target ids
    parents: list[int]  # pool index of each node's parent (-1: the root)
    scores: torch.Tensor  # cumulative log-probability
    own: list[float]  # the node's own log-probability
    ranks: list[int]  # its place among its parent's top-k children
    sib_top: list[float]  # the log-probability of that parent's top child

    @classmethod
    def of_root(cls, ids: list[float], logp: list[float], scores: torch.Tensor) -> "_Pool":
        """The root's top-k children (target ids, log-probabilities; scores: the same as a tensor)."""
        k = len(ids)
        return cls([int(t) for t in ids], [-1] * k, scores, list(logp), list(range(k)), [logp[0]] * k)

    def add_level(self, frontier: list[int], child_ids: list[float], own: list[float], cand: torch.Tensor, best, k: int) -> list[int]:
        """A level's children joined to the pool (k a frontier node, row-major: target ids, own
        log-probabilities, cumulative scores); returns the next frontier (best: indices among them)."""
        base, n = len(self.tokens), len(frontier)
        self.tokens += [int(t) for t in child_ids]
        self.parents += [f for f in frontier for _ in range(k)]
        self.scores = torch.cat((self.scores, cand))
        self.own += own
        self.ranks += list(range(k)) * n
        self.sib_top += [own[r * k] for r in range(n) for _ in range(k)]
        return [base + int(b) for b in best]


def read_back(*tensors: torch.Tensor) -> list[list[float]]:
    """1-D tensors' values as Python lists in one copy to the host (float64 holds every fp32 value
    and every integer below 2**53 exactly): one wait for a GPU instead of one a tensor."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    out, i = [], 0
    for t in tensors:
        out.append(flat[i : i + t.numel()])
        i += t.numel()
    return out


class _Eagle3Session(HeadSession):
    needs = "EAGLE3"

    def __init__(self, drafter: Eagle3Drafter, capacity: int):
        super().__init__(drafter)
        c, p = drafter.head.config, drafter.params
        self.collect = False  # keep last_pool (dart_core/tools/fitting.py sets it)
        scratch = p.top_k * p.depth
        dev = drafter.target.device
        first = captured_head(drafter, "head_graph")  # dart_core.cuda.head_graph where it runs
        expand = captured_head(drafter, "expand_graph") is not None and p.depth >= 1
        rows = first.graph_rows(0) if first else 0
        size, dtype = capacity + scratch + 1, drafter.head.fc.weight.dtype
        # with its captured forwards (a graph holds the cache's addresses, so they are kept on it)
        self.cache = drafter.spare.lease(1, c.num_key_value_heads, c.head_dim, size, dtype, dev, rows)
        self.head_graph = first.kept_on(self.cache, drafter.head, drafter.target, rows) if first else None
        self.graph = None
        if expand:
            from ..cuda import expand_graph

            kept = getattr(self.cache, "expand_graph", None)
            if kept is None or (kept.k, kept.depth) != (p.top_k, p.depth):
                self.cache.expand_graph = expand_graph.ExpandGraph(drafter.head, drafter.target, self.cache, p.top_k, p.depth)
            self.graph = self.cache.expand_graph
            self.graph.calls = 0
        # a GPU: the frontier's ids and ancestor masks go up from pinned memory, the host not waiting
        self._uploads = (Upload(torch.long, dev), Upload(torch.bool, dev)) if dev.type == "cuda" else None
        # the last search's pool (tokens, parents, depths, features), for fitting a ranking
        self.last_pool: tuple | None = None

    def _forward(self, u, residual, positions, mask) -> torch.Tensor:
        head = self.d.head
        cos, sin = head.rope(positions, u.dtype)
        h = residual + head.midlayer.attention(u, cos, sin, mask[None, None], self.cache)
        return head.midlayer.mlp_block(h)

    @torch.inference_mode()
    def propose(self, root: int, max_nodes: int) -> Proposal:
        """The step's three stages, named as SGLang's EAGLE names them: extend (the committed tokens
        through the head: the state at the root), expand (the tree search) and rank (the best
        `max_nodes` nodes of the pool, as a tree)."""
        t0 = time.perf_counter()
        h = self.extend_root(root)
        pool = self.expand(h, max_nodes)
        t1 = time.perf_counter()
        tree = self.rank(root, pool, max_nodes)
        return Proposal(tree, t1 - t0, time.perf_counter() - t1, {})

    def extend_root(self, root: int) -> torch.Tensor:
        """1. One forward over the tokens committed since the last step (the target's hidden states,
        the embeddings shifted by one, the root's last) into the head's cache: the state at the root (1, H)."""
        head, target = self.d.head, self.d.target
        dev = target.device
        S = len(self.pending_ids)
        if self.head_graph is not None and self.head_graph.takes(S):  # the captured forward (a GPU), a prompt in chunks
            h, last = self.head_graph.chunked(self.pending_ids[1:] + [root], torch.cat(self.pending_aux), 0)
            self.cache.commit(last)
            self.pending_ids, self.pending_aux = [], []
            return h
        emb = target.model.tok_embeddings(torch.tensor(self.pending_ids[1:] + [root], device=dev)).to(head.fc.weight.dtype)
        fast = self.d.fast
        if fast is not None:
            u, residual = fast.inputs(torch.cat(self.pending_aux), emb)
            h = fast.layer(u, residual, self.cache, keep=1)  # the state at the root
        else:
            u, residual = head.inputs(torch.cat(self.pending_aux), None, emb)
            P = self.cache.length
            causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril_()
            mask = torch.cat((torch.ones(S, P, dtype=torch.bool, device=dev), causal), dim=1)
            h = self._forward(u, residual, torch.arange(P, P + S, device=dev), mask)[-1:]  # the state at the root
        self.cache.commit(S)
        self.pending_ids, self.pending_aux = [], []
        return h

    def expand(self, h: torch.Tensor, keep: int) -> _Pool:
        """2. The search a tree of `keep` nodes can use: the root's top-k are the first frontier; then
        `depth` times the frontier is fed back (each node with its parent's output state and its own
        embedding, attending to the committed prefix and its own ancestors), every node's top-k
        children join the pool, and the best top-k of them are the next frontier. Every kept node's
        parent is among the best `keep` of its level and among the kept nodes' ancestors, so a search
        wider than top_k = min(top_k, keep) or deeper than keep - 1 is wasted. The frontier's entries
        in the head's cache are scratch, rewound at the end."""
        head, target, p = self.d.head, self.d.target, self.d.params
        dev = target.device
        committed = self.cache.length
        top_k, depth = max(1, min(p.top_k, keep)), min(p.depth, max(0, keep - 1))
        if self.graph is not None and self.graph.fits(top_k, depth, committed):
            return self._expand_captured(h)
        fast = self.d.fast  # the kernels where they run (Eagle3Drafter.__init__)
        logits = fast.logits if fast is not None else head.logits
        logp = logits(h).float().log_softmax(-1)[0]
        top = logp.topk(top_k)
        frontier = list(range(top_k))  # pool indices
        ids0, vals0 = read_back(head.to_target_ids(top.indices), top.values)
        pool = _Pool.of_root(ids0, vals0, top.values)
        frontier_h = h.expand(top_k, -1)  # the parent state each frontier node is fed with
        fed: list[int] = []  # pool index of each scratch cache entry, in order
        fed_positions: list[int] = []
        prior = None  # the kernel path's q|k|v rows of the fed entries (KernelHead.tree_layer)
        for level in range(depth):
            n = len(frontier)
            ids = self._to_device(torch.tensor([pool.tokens[i] for i in frontier]), 0)
            emb = target.model.tok_embeddings(ids).to(frontier_h.dtype)
            # each frontier node sees the committed prefix, its fed ancestors and itself
            if fast is not None:  # the tree in the kernels' attention: fed entries first, then the frontier
                rows = fed + frontier
                where = {node: j for j, node in enumerate(rows)}
                parents = torch.tensor([where.get(pool.parents[node], -1) for node in rows])
                fed_positions += [committed + level] * n
                u, residual = fast.inputs_from_hidden(frontier_h, emb)
                out, qkv = fast.tree_layer(u, residual, self.cache, committed, torch.tensor(fed_positions), parents, prior)
                prior = qkv if prior is None else torch.cat((prior, qkv))
            else:
                u, residual = head.inputs(None, frontier_h, emb)
                # the ancestor mask built on the host and copied once (element by element on a GPU it
                # cost a launch and a synchronization each)
                anc = torch.zeros(n, len(fed) + n, dtype=torch.bool)
                where = {node: j for j, node in enumerate(fed)}
                for r, node in enumerate(frontier):
                    a = pool.parents[node]
                    while a >= 0:
                        anc[r, where[a]] = True
                        a = pool.parents[a]
                    anc[r, len(fed) + r] = True
                mask = torch.cat(
                    (torch.ones(n, committed, dtype=torch.bool, device=dev), self._to_device(anc.reshape(-1), 1).view(anc.shape)), dim=1
                )
                positions = torch.full((n,), committed + level, device=dev)
                out = self._forward(u, residual, positions, mask)
                self.cache.commit(n)  # scratch: rewound below
            fed += frontier
            child_logp = logits(out.contiguous()).float().log_softmax(-1)
            top = child_logp.topk(top_k, dim=-1)
            cand = (pool.scores[frontier][:, None] + top.values).reshape(-1)  # (n*k,)
            best = cand.topk(min(top_k, cand.numel())).indices.sort().values
            # the level's children and the next frontier read back in one copy (one wait for a GPU)
            child_ids, own, best_list = read_back(head.to_target_ids(top.indices.reshape(-1)), top.values.reshape(-1), best)
            frontier = pool.add_level(frontier, child_ids, own, cand, best_list, top_k)
            frontier_h = out[best // top_k]
        self.cache.rewind(committed)
        return pool

    def _expand_captured(self, h: torch.Tensor) -> _Pool:
        """`expand` through the captured search (dart_core/cuda/expand_graph.py): the same pool, built from its one read-back."""
        ids0, vals0, levels = self.graph(h)
        k = self.graph.k
        pool = _Pool.of_root(ids0, vals0, torch.tensor(vals0, dtype=torch.float64))  # fp32 values, exactly
        frontier = list(range(k))
        for child_ids, own, cand, best in levels:
            frontier = pool.add_level(frontier, child_ids, own, torch.tensor(cand, dtype=torch.float64), best, k)
        return pool

    def _to_device(self, values: torch.Tensor, which: int) -> torch.Tensor:
        """values (a host tensor) on the target's device: on a GPU through a pinned buffer (which: 0 ids,
        1 masks), the view valid until the next call for the same kind."""
        if self._uploads is None:
            return values.to(self.d.target.device)
        return self._uploads[which](values)

    def rank(self, root: int, pool: _Pool, keep: int) -> DraftTree:
        """3. The tree: the pool's best `keep` nodes by cumulative log-probability (EAGLE's rule) or by
        the fitted ln P(accepted), ties parent-first, in pool order so parents precede children."""
        p = self.d.params
        tokens, parents = pool.tokens, pool.parents
        sc = pool.scores.tolist()
        depth = [0] * len(tokens)
        for i, par in enumerate(parents):
            depth[i] = 1 if par < 0 else depth[par] + 1
        if p.ranking or self.collect:
            feats = eagle3_features(sc, parents, pool.own, pool.ranks, pool.sib_top)
            if self.collect:
                self.last_pool = (list(tokens), list(parents), list(depth), feats)
            if p.ranking:  # rank by the fitted ln P(accepted) (never above the parent's: the kept set stays closed)
                sc = fitted_scores(p.ranking, feats, parents, depth)
        # by (score descending, depth, pool order): np.lexsort's last key first, stable; in numpy, as a
        # Python sort of the ~700 nodes of a 60-node search took ~0.3 ms of the host's time a step
        n = len(tokens)
        ranked = np.lexsort((np.arange(n), np.asarray(depth), -np.asarray(sc, dtype=np.float64)))[:keep].tolist()
        chosen = set()
        for i in ranked:  # parent-first by construction of the ranking; checked anyway
            if parents[i] < 0 or parents[i] in chosen:
                chosen.add(i)
        kept = sorted(chosen)
        index = {node: j + 1 for j, node in enumerate(kept)}
        return DraftTree.from_parents(
            [root] + [tokens[i] for i in kept],
            [-1] + [index.get(parents[i], 0) for i in kept],
            [0.0] + [sc[i] for i in kept],
        )


RANKINGS = ("fitted", "score")
# How EAGLE3 ranks its pool when the caller does not say (docs/drafters.md has the measurements).
DEFAULT_RANKING = "score"


def load_eagle3_drafter(
    head_path: str | os.PathLike, target, params: Eagle3Params = Eagle3Params(), ranking: str | None = "score"
) -> Eagle3Drafter:
    """ranking: "score" EAGLE's cumulative log-probability (`params` as given), "fitted" the head's
    fitted ranking (ValueError where it has none), None: DEFAULT_RANKING where the head has one."""
    from .head import resolve_head_dir

    if ranking not in (None, *RANKINGS):
        raise ValueError(f"unknown ranking {ranking!r}: choose from {', '.join(RANKINGS)}")
    if ranking == "fitted" or (ranking is None and DEFAULT_RANKING == "fitted"):
        weights = load_fitted_ranking(resolve_head_dir(head_path))
        if weights is None and ranking == "fitted":
            raise ValueError(f"the EAGLE3 head {head_path} has no fitted ranking ({ACCEPTANCE_FILE})")
        if weights is not None:
            params = replace(params, ranking=weights)
    return Eagle3Drafter(load_head(head_path, dart=False, target=target), target, params)
