"""EAGLE3 drafter: lossless greedy decoding with a random head, tree shape, and head-type checks."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_target
from dart_core import ARDrafter, GenerationParams, complete
from dart_core.drafters.dart import DartDrafter
from dart_core.drafters.eagle3 import Eagle3Drafter, Eagle3Params
from dart_core.drafters.head import load_head
from dart_core.training import new_head_from_target


def random_eagle3_head(target, seed=0, vd=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target.vocab_size, generator=g)[:vd].sort().values
    head = new_head_from_target(target, ids, None, seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return head.eval()


def test_eagle3_greedy_equals_ar(tiny_ckpt):
    _, path = tiny_ckpt
    target = tiny_target(path)
    drafter = Eagle3Drafter(random_eagle3_head(target), target, Eagle3Params(depth=4, top_k=4, total_tokens=16))
    for prompt in ([5, 6, 7], [60], [11, 40, 12, 90, 4, 4, 4, 17]):
        ar = complete(target, prompt, ARDrafter(), GenerationParams(30))
        s = complete(target, prompt, drafter, GenerationParams(30))
        assert s.output_ids == ar.output_ids


def test_eagle3_tree_shape(tiny_llama):
    drafter = Eagle3Drafter(random_eagle3_head(tiny_llama, seed=2), tiny_llama, Eagle3Params(depth=3, top_k=5, total_tokens=20))
    ids = [5, 6, 7, 8]
    out = tiny_llama.prefill(ids, tiny_llama.new_cache(64), capture=True)

    def propose(budget):
        session = drafter.new_session(64)
        session.extend(ids, out.hidden)
        return session.propose(9, budget).tree

    tree = propose(64)
    assert len(tree) == 20 and tree.max_depth <= 4
    scores = tree.scores.tolist()
    assert all(scores[i] <= scores[int(tree.parents[i])] + 1e-6 for i in range(1, len(tree)))
    assert len(propose(5)) == 5  # the budget caps the tree


def test_head_types_are_not_mixed(tiny_llama, tmp_path):
    head = random_eagle3_head(tiny_llama)
    head.save(tmp_path / "e3")
    assert load_head(tmp_path / "e3", dart=False, target=tiny_llama).config.draft_length is None
    with pytest.raises(ValueError, match="not a DART head"):
        load_head(tmp_path / "e3", dart=True, target=tiny_llama)
    with pytest.raises(ValueError, match="DART head"):
        DartDrafter(head, tiny_llama, None)
