"""Tiny random targets and trees, and the steps a verify must equal: what the tests (tests/support.py
hands these on) and the GPU check (dart_core/cuda/check/) build their checks from. A tiny checkpoint is a
random Llama / Qwen2 / Qwen3 of a few layers saved as Hugging Face saves one; steps_depth_first gives
each node of a tree its one-token step, the bits a lossless verify must reproduce."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ..tree import DraftTree

TINY_VOCAB = 96
TINY_LAYERS = 8  # >= 7, so the three captured layers (2, L//2, L-3) are distinct
TINY_EOS = 3


def build_tiny_checkpoint(path: Path, arch: str, seed: int = 0, vocab: int = TINY_VOCAB, logit_scale: float = 8.0) -> Path:
    """Save a tiny random HF model of `arch` to `path`. The LM head is scaled up so that next-token
    distributions are peaked, as in a trained model, rather than near-uniform (where argmax ties
    would make greedy comparisons meaningless)."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=TINY_EOS,
        bos_token_id=1,
        pad_token_id=0,
    )
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    torch.manual_seed(seed)
    model = cls[1](cls[0](**common, **extra)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        if arch == "qwen2":  # random biases, so the bias path is really exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def steps_depth_first(target, cache, tree: DraftTree, capture: bool = True):
    """Each node's one-token step, (node, the step's output), each node stepped once with exactly its
    ancestors committed before it: the nodes in depth-first order, each step after rewinding the cache
    to the node's depth (the entries kept are then its ancestors', the last stepped at each depth). The
    tree's root at the cache's committed length; leaves the cache there."""
    P = cache.length
    depths = tree.depths.tolist()
    stack = [0]
    while stack:  # preorder: a node, then its subtrees in node order
        node = stack.pop()
        stack.extend(reversed(tree.children[node]))
        cache.rewind(P + depths[node])
        step = target.verify(DraftTree.root_only(int(tree.tokens[node])), cache, capture=capture)
        cache.commit(1)
        yield node, step
    cache.rewind(P)


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


TREE_VOCAB = 8  # the vocabulary of the acceptance tests' logits over TREE

# Hand-built tree (node: token), depth order:
#            0:root(7)
#          /     |      \
#       1:(2)  2:(4)   3:(5)
#        |       |   \
#      4:(3)   5:(1)  6:(6)
#                |
#              7:(0)
TREE = DraftTree.from_parents([7, 2, 4, 5, 3, 1, 6, 0], [-1, 0, 0, 0, 1, 2, 2, 5])


def chi_square_p(counts: dict, expected_probs: dict, n: int) -> float:
    """Chi-square goodness of fit, pooling cells with expected count < 5 into one."""
    from scipy.stats import chisquare

    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for key, p in expected_probs.items():
        e = p * n
        if e < 5:
            pool_o += counts.get(key, 0)
            pool_e += e
        else:
            obs.append(counts.get(key, 0))
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    assert sum(counts.get(k, 0) for k in counts if k not in expected_probs) == 0, "impossible outcome sampled"
    if len(obs) == 1:  # one possible outcome, and no impossible one was seen
        return 1.0
    total = sum(exp)
    assert abs(total - n) < 1e-4 * n, "expected probabilities do not sum to 1"
    return float(chisquare(obs, [e * n / total for e in exp]).pvalue)  # fp32 probabilities sum to 1 +- 1e-7
