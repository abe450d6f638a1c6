"""Test drafters: they propose trees without a trained head, to exercise verification and acceptance."""

from __future__ import annotations

import random

from dart_core.generate import Proposal
from dart_core.tree import DraftTree


def random_tree_under(rng: random.Random, root: int, n: int, vocab: int, spine: list[int] = ()) -> DraftTree:
    """A tree of up to n nodes rooted at `root`: optionally a chain `spine` below the root (e.g. the
    true continuation), then random nodes hung anywhere, siblings always distinct."""
    tokens, parents = [root], [-1]
    kids: list[set[int]] = [set()]
    for tok in spine[: n - 1]:
        kids[-1].add(tok)
        tokens.append(tok)
        parents.append(len(tokens) - 2)
        kids.append(set())
    while len(tokens) < n:
        p = rng.randrange(len(tokens))
        free = [t for t in range(vocab) if t not in kids[p]]
        if not free:
            continue
        tok = rng.choice(free)
        kids[p].add(tok)
        tokens.append(tok)
        parents.append(p)
        kids.append(set())
    # depth order is not required by the loop; a prefix of the arrays stays a tree either way
    return DraftTree.from_parents(tokens, parents)


class RandomTreeDrafter:
    """Random trees: mostly rejected, sometimes accepted by luck (small vocabularies)."""

    name = "random-tree"
    needs_hidden = True

    def __init__(self, vocab: int, max_nodes: int = 11, seed: int = 0):
        self.vocab, self.max_nodes, self.seed = vocab, max_nodes, seed

    def new_session(self, capacity: int):
        drafter, rng = self, random.Random(self.seed)

        class Session:
            def extend(self, ids, hidden):
                assert hidden is not None and hidden.shape[0] == len(ids)

            def propose(self, root, max_nodes):
                n = rng.randrange(1, drafter.max_nodes + 2)  # nodes with the root
                return Proposal(random_tree_under(rng, root, n, drafter.vocab))

        return Session()


class OracleDrafter:
    """Knows a reference continuation (e.g. the AR output) and hangs a random-length piece of it,
    sometimes corrupted, under the root among random distractors, so steps accept several tokens
    along non-contiguous node paths."""

    name = "oracle"
    needs_hidden = False

    def __init__(self, reference: list[int], vocab: int, max_nodes: int = 15, seed: int = 0):
        self.reference, self.vocab, self.max_nodes, self.seed = reference, vocab, max_nodes, seed

    def new_session(self, capacity: int):
        drafter, rng = self, random.Random(self.seed)

        class Session:
            prompt_len = None
            committed = 0  # tokens in the target cache

            def extend(self, ids, hidden):
                if self.prompt_len is None:
                    self.prompt_len = len(ids)
                self.committed += len(ids)

            def propose(self, root, max_nodes):
                produced = self.committed - self.prompt_len + 1  # output so far, root included
                spine = list(drafter.reference[produced : produced + rng.randrange(0, 7)])
                if spine and rng.random() < 0.3:
                    spine[rng.randrange(len(spine))] = rng.randrange(drafter.vocab)
                n = max(rng.randrange(1, drafter.max_nodes + 2), len(spine) + 1)  # nodes with the root
                return Proposal(random_tree_under(rng, root, n, drafter.vocab, spine))

        return Session()
