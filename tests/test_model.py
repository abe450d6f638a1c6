"""The target runner against transformers, and tree verification against running each path alone."""

from __future__ import annotations

import random

import pytest
import torch

from dart_core.tree import DraftTree

from support import random_tree, tiny_target

ATOL = 1e-4


def test_matches_transformers(tiny_ckpt):
    """Logits and captured hidden states equal HF's on the same checkpoint (fp32)."""
    import transformers

    arch, path = tiny_ckpt
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = tiny_target(path)
    ids = list(range(4, 30))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    cache = target.new_cache(64)
    out = target.model(torch.tensor(ids), torch.arange(len(ids)), cache, capture=True)
    torch.testing.assert_close(out.logits, ref.logits[0], atol=ATOL, rtol=0)
    L = target.model.args.n_layers
    expected_hidden = torch.cat([ref.hidden_states[i][0] for i in (2, L // 2, L - 3)], dim=-1)
    torch.testing.assert_close(out.hidden, expected_hidden, atol=ATOL, rtol=0)


@pytest.mark.parametrize("prefix", [0, 7])
def test_long_prefill_matches_transformers(tiny_ckpt, prefix):
    """A prompt longer than the kernels take (the eager path) equals HF's logits, both into an empty
    cache (SDPA's own causal masking) and after a committed prefix (an explicit mask)."""
    import transformers

    from dart_core import kernels

    _, path = tiny_ckpt
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = tiny_target(path)
    n = kernels.MAX_ROWS + 40
    ids = [(7 * i + 3) % 90 + 4 for i in range(prefix + n)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    cache = target.new_cache(len(ids) + 8)
    if prefix:
        target.prefill(ids[:prefix], cache, capture=False)
        cache.commit(prefix)
    out = target.model(torch.tensor(ids[prefix:]), torch.arange(prefix, len(ids)), cache)
    torch.testing.assert_close(out.logits, ref[prefix:], atol=ATOL, rtol=0)


def test_incremental_equals_full(tiny_ckpt):
    """Prefill then one token at a time gives the same logits as one causal pass."""
    _, path = tiny_ckpt
    target = tiny_target(path)
    ids = [5, 9, 17, 33, 2, 40, 41, 7, 8, 60]
    full = target.model(torch.tensor(ids), torch.arange(len(ids)), target.new_cache(32)).logits
    cache = target.new_cache(32)
    out = target.prefill(ids[:4], cache, capture=False)
    cache.commit(4)
    torch.testing.assert_close(out.logits[0], full[3], atol=ATOL, rtol=0)
    for i in range(4, len(ids)):
        step = target.verify(DraftTree.root_only(ids[i]), cache, capture=False)
        cache.commit(1)
        torch.testing.assert_close(step.logits[0], full[i], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_tree_nodes_equal_their_paths(tiny_ckpt, seed):
    """Every node's logits and hidden states in one tree forward equal those of its path run alone."""
    _, path = tiny_ckpt
    target = tiny_target(path)
    rng = random.Random(seed)
    prefix = [rng.randrange(target.vocab_size) for _ in range(rng.randrange(1, 12))]
    tree = random_tree(rng, rng.randrange(1, 25), target.vocab_size)

    cache = target.new_cache(64)
    target.prefill(prefix, cache, capture=False)
    cache.commit(len(prefix))
    out = target.verify(tree, cache, capture=True)

    for node in range(len(tree)):
        node_path = tree.path_to(node)
        seq = prefix + tree.tokens[node_path].tolist()
        alone = target.model(torch.tensor(seq), torch.arange(len(seq)), target.new_cache(64), capture=True)
        torch.testing.assert_close(out.logits[node], alone.logits[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[node], alone.hidden[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_commit_path_equals_fresh_prefill(tiny_llama, seed):
    """After committing an accepted path, the cache equals a fresh prefill of the accepted sequence."""
    target = tiny_llama
    rng = random.Random(100 + seed)
    prefix = [rng.randrange(target.vocab_size) for _ in range(7)]
    tree = random_tree(rng, 20, target.vocab_size)
    leaf = max(range(len(tree)), key=lambda i: (int(tree.depths[i]), i))
    node_path = tree.path_to(leaf)

    cache = target.new_cache(64)
    target.prefill(prefix, cache, capture=False)
    cache.commit(len(prefix))
    target.verify(tree, cache, capture=False)
    cache.commit_path(node_path)

    seq = prefix + tree.tokens[node_path].tolist()
    fresh = target.new_cache(64)
    target.prefill(seq, fresh, capture=False)
    fresh.commit(len(seq))
    assert cache.length == fresh.length == len(seq)
    torch.testing.assert_close(cache.k[:, :, :, : len(seq)], fresh.k[:, :, :, : len(seq)], atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.v[:, :, :, : len(seq)], fresh.v[:, :, :, : len(seq)], atol=ATOL, rtol=0)


def test_cache_overflow_is_an_error(tiny_llama):
    cache = tiny_llama.new_cache(4)
    with pytest.raises(RuntimeError, match="overflow"):
        tiny_llama.prefill([1, 2, 3, 4, 5], cache, capture=False)


def test_checkpoint_with_wrong_tensors_is_refused(tmp_path, tiny_ckpt):
    from safetensors.torch import load_file, save_file

    from dart_core.hf_checkpoint import load_transformer

    _, path = tiny_ckpt
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("model.norm.weight")
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*model.norm.weight"):
        load_transformer(bad, torch.float32, "cpu")
