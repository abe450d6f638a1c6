"""The draft tree that the target verifies in one forward pass.

Node 0 is the root: the token the target itself produced last step, not yet in the KV cache.
Every other node is a drafted token whose parent comes earlier in the arrays (parents[i] < i), so
any prefix of the nodes is itself a valid tree; drafters emit nodes in depth order.

    tokens   (N,)  int64   token id per node
    parents  (N,)  int64   parent node index, -1 for the root
    depths   (N,)  int64   root 0; the rope position of node i is committed_length + depths[i]
    mask     (N, N) bool   mask[i, j] = j is i or an ancestor of i (the tree attention mask; built when read)
    scores   (N,)  float32 optional drafter scores, for display only
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor | None = None

    @classmethod
    def from_parents(cls, tokens, parents, scores=None) -> "DraftTree":
        """Build the depths from tokens and parent indices, validating the shape of the tree. The mask
        and the child lists are built when first read (the exact forwards and the accept walk need
        neither whole: this runs once a step, on the host, while the device waits)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        parents = torch.as_tensor(parents, dtype=torch.long).reshape(-1)
        n = tokens.numel()
        if n == 0 or parents.numel() != n:
            raise ValueError(f"a tree needs a root and one parent per node (got {n} tokens, {parents.numel()} parents)")
        par = parents.tolist()
        if par[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        depths = [0] * n
        for i in range(1, n):
            p = par[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before their children")
            depths[i] = depths[p] + 1
        toks = tokens.tolist()
        if len(set(zip(par, toks))) != n:  # two children of one parent with the same token
            for p, ks in enumerate(_child_lists(par)):
                child_tokens = [toks[k] for k in ks]
                if len(set(child_tokens)) != len(child_tokens):
                    raise ValueError(f"node {p} has two children with the same token")
        if scores is not None:
            scores = torch.as_tensor(scores, dtype=torch.float32).reshape(-1)
        return cls(tokens, parents, torch.from_numpy(np.array(depths, dtype=np.int64)), scores)

    @classmethod
    def from_pruner(cls, tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, scores: np.ndarray) -> "DraftTree":
        """The tree of DART's pruner (ngram_cpp.Pruner.nodes: int64 tokens, parents and depths, float32
        scores), its arrays shared as they are: the pruner builds them valid (root first, parents before
        their children, siblings with distinct tokens, depths from the parents; tests/test_pruner.py
        checks it on every tree it prunes), so from_parents' checks and depth walk are not run again."""
        return cls(torch.from_numpy(tokens), torch.from_numpy(parents), torch.from_numpy(depths), torch.from_numpy(scores))

    @cached_property
    def token_list(self) -> list[int]:
        """The tokens as a Python list (the accept walk and the commit read them a node at a time)."""
        return self.tokens.tolist()

    @cached_property
    def mask(self) -> torch.Tensor:
        """(N, N) bool: row i holds i and its ancestors (the attention mask of the plain eager verify)."""
        par = self.parents.cpu().numpy()
        n = par.size
        mask = np.zeros((n, n), dtype=np.bool_)
        rows = np.arange(n)
        up = rows  # each row's ancestor a level further up each round, rows whose chain ended dropped
        while rows.size:
            mask[rows, up] = True
            up = par[up]
            live = up >= 0
            rows, up = rows[live], up[live]
        return torch.from_numpy(mask)

    @cached_property
    def _child_index(self) -> dict[tuple[int, int], int]:
        return {key: i for i, key in enumerate(zip(self.parents.tolist(), self.token_list))}

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` holding `token` (a tree has at most one), or None: the greedy walks' step."""
        return self._child_index.get((node, token))

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each node's children, in node order."""
        return tuple(tuple(k) for k in _child_lists(self.parents.tolist()))

    @classmethod
    def root_only(cls, root: int) -> "DraftTree":
        return cls.from_parents([root], [-1])

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def truncate(self, n: int) -> "DraftTree":
        """The first n nodes (still a tree, since parents precede children)."""
        if n >= len(self):
            return self
        if n < 1:
            raise ValueError("a tree keeps at least its root")
        scores = None if self.scores is None else self.scores[:n]
        return DraftTree.from_parents(self.tokens[:n], self.parents[:n], scores)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        path = []
        par = self.parents.tolist()
        while node != -1:
            path.append(node)
            node = par[node]
        return path[::-1]

    def leaf_paths(self) -> list[list[int]]:
        """One root-to-leaf node path per leaf, in node order (the 'retrieve indices' without padding)."""
        return [self.path_to(i) for i in range(len(self)) if not self.children[i]]


def _child_lists(par: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in par]
    for i in range(1, len(par)):
        kids[par[i]].append(i)
    return kids
