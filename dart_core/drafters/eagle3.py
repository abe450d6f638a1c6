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

import os
import time
from dataclasses import dataclass

import torch

from ..generate import Proposal
from ..model import KVCache
from ..tree import DraftTree
from .head import DraftHead, KernelHead, load_head


@dataclass(frozen=True)
class Eagle3Params:
    depth: int = 7
    top_k: int = 10
    max_nodes: int = 59  # drafted nodes besides the root (EAGLE's total_token = 60 counts the root)

    def __post_init__(self):
        if self.depth < 0 or self.top_k < 1 or self.max_nodes < 0:
            raise ValueError("EAGLE3 needs depth >= 0, top_k >= 1 and max_nodes >= 0")


class Eagle3Drafter:
    name = "eagle3"
    needs_hidden = True

    def __init__(self, head: DraftHead, target, params: Eagle3Params = Eagle3Params(), use_kernels: bool = True):
        if head.config.is_dart:
            raise ValueError("Eagle3Drafter needs an EAGLE3 head (no draft_length / mask_rep)")
        self.head, self.target, self.params = head, target, params
        self.max_nodes = params.max_nodes
        # the first forward of a step (causal over the committed tokens) on the CPU kernels where they
        # run; the expansions attend to scattered ancestors and stay on the eager module
        self.fast = KernelHead(head) if use_kernels and KernelHead.supports(head) else None

    def new_session(self, capacity: int) -> "_Eagle3Session":
        return _Eagle3Session(self, capacity)


class _Eagle3Session:
    def __init__(self, drafter: Eagle3Drafter, capacity: int):
        self.d = drafter
        c, p = drafter.head.config, drafter.params
        scratch = p.top_k * p.depth
        self.cache = KVCache(1, c.num_key_value_heads, c.head_dim, capacity + scratch + 1, drafter.head.fc.weight.dtype, drafter.target.device)
        self.pending_ids: list[int] = []
        self.pending_aux: list[torch.Tensor] = []

    def extend(self, ids: list[int], hidden: torch.Tensor | None) -> None:
        if hidden is None or hidden.shape[0] != len(ids):
            raise ValueError("EAGLE3 needs the target's captured hidden states for every committed token")
        self.pending_ids += ids
        self.pending_aux.append(hidden.to(self.d.head.fc.weight.dtype))

    def _forward(self, u, residual, positions, mask) -> torch.Tensor:
        head = self.d.head
        cos, sin = head.rope(positions, u.dtype)
        h = residual + head.midlayer.attention(u, cos, sin, mask[None, None], self.cache)
        return head.midlayer.mlp_block(h)

    @torch.inference_mode()
    def propose(self, root: int, max_nodes: int) -> Proposal:
        head, target, p = self.d.head, self.d.target, self.d.params
        dev = target.device
        t0 = time.perf_counter()
        # 1. the committed tokens: hidden states of the target, embeddings shifted by one
        S = len(self.pending_ids)
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
        committed = self.cache.length

        # the search a tree of `keep` nodes can use: every kept node's parent is among the best
        # `keep` of its level and among the kept nodes' ancestors, so wider or deeper is wasted
        keep = max(0, min(p.max_nodes, max_nodes))
        top_k, depth = max(1, min(p.top_k, keep)), min(p.depth, max(0, keep - 1))
        # pool of drafted nodes: token (target id), parent pool index (-1 = root), cumulative log-prob
        tokens: list[int] = []
        parents: list[int] = []
        scores = torch.empty(0, device=dev)
        logp = head.logits(h).float().log_softmax(-1)[0]
        top = logp.topk(top_k)
        frontier = list(range(top_k))  # pool indices
        tokens += head.to_target_ids(top.indices).tolist()
        parents += [-1] * top_k
        scores = top.values
        frontier_h = h.expand(top_k, -1)  # the parent state each frontier node is fed with
        fed: list[int] = []  # pool index of each scratch cache entry, in order
        for level in range(depth):
            n = len(frontier)
            ids = torch.tensor([tokens[i] for i in frontier], device=dev)
            u, residual = head.inputs(None, frontier_h, target.model.tok_embeddings(ids).to(frontier_h.dtype))
            # each frontier node sees the committed prefix, its fed ancestors and itself
            anc = torch.zeros(n, len(fed) + n, dtype=torch.bool, device=dev)
            where = {pool: j for j, pool in enumerate(fed)}
            for r, node in enumerate(frontier):
                a = parents[node]
                while a >= 0:
                    anc[r, where[a]] = True
                    a = parents[a]
                anc[r, len(fed) + r] = True
            mask = torch.cat((torch.ones(n, committed, dtype=torch.bool, device=dev), anc), dim=1)
            positions = torch.full((n,), committed + level, device=dev)
            out = self._forward(u, residual, positions, mask)
            self.cache.commit(n)  # scratch: rewound below
            fed += frontier
            child_logp = head.logits(out).float().log_softmax(-1)
            top = child_logp.topk(top_k, dim=-1)
            cand = (scores[frontier][:, None] + top.values).reshape(-1)  # (n*k,)
            base = len(tokens)
            tokens += head.to_target_ids(top.indices.reshape(-1)).tolist()
            parents += [f for f in frontier for _ in range(top_k)]
            scores = torch.cat((scores, cand))
            best = cand.topk(min(top_k, cand.numel())).indices.sort().values
            frontier = (base + best).tolist()
            frontier_h = out[best // top_k]
        self.cache.rewind(committed)
        t1 = time.perf_counter()

        sc = scores.tolist()
        depth = [0] * len(tokens)
        for i, par in enumerate(parents):
            depth[i] = 1 if par < 0 else depth[par] + 1
        ranked = sorted(range(len(tokens)), key=lambda i: (-sc[i], depth[i], i))[:keep]
        chosen = set()
        for i in ranked:  # parent-first by construction of the ranking; checked anyway
            if parents[i] < 0 or parents[i] in chosen:
                chosen.add(i)
        kept = sorted(chosen)
        index = {pool: j + 1 for j, pool in enumerate(kept)}
        tree = DraftTree.from_parents(
            [root] + [tokens[i] for i in kept],
            [-1] + [index.get(parents[i], 0) for i in kept],
            [0.0] + [sc[i] for i in kept],
        )
        t2 = time.perf_counter()
        return Proposal(tree, t1 - t0, t2 - t1, {})


def load_eagle3_drafter(head_path: str | os.PathLike, target, params: Eagle3Params = Eagle3Params()) -> Eagle3Drafter:
    return Eagle3Drafter(load_head(head_path, dart=False, target=target), target, params)
