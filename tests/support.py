"""Helpers shared by the test modules (and scripts/gpu_check.py): tiny random targets, the committed
assets, test drafters, random trees, the pruner's random cases, the acceptance tests' hand-built
tree, the word-level tokenizer of the trainer tests, and kernel helpers. conftest.py holds the
fixtures only; no test module imports another."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

import ngram_cpp
from dart_core import kernels
from dart_core.generate import Proposal
from dart_core.hf_checkpoint import load_transformer
from dart_core.target import Target, interleave_for_this_cpu
from dart_core.tree import DraftTree
from ngram_cpp.reference import PruneParams, PyNGramModel

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------ committed assets

EMBEDDED_DART_HEAD = ROOT / "assets" / "dart"
EMBEDDED_EAGLE3_HEAD = ROOT / "assets" / "eagle3"
EMBEDDED_NGRAM = ROOT / "assets" / "ngram" / "smollm2-3gram.ngram.xz"


def committed_asset(path: Path) -> Path:
    """`path` (a file under assets/, committed in the repository), failing the test when it is missing:
    a lost asset is a broken checkout, not a reason to skip the tests that read it."""
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: it is committed in the repository (assets/); restore it with git"
    return path


# ------------------------------------------------------------------------------- tiny random targets

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


def tiny_target(path: Path, dtype=torch.float32) -> Target:
    """A tiny checkpoint as load_target would give it: in bf16 on kernels without bf16 arithmetic
    its linears read 16-row interleaved weights (target.interleave_for_this_cpu)."""
    model = load_transformer(path, dtype, "cpu")
    interleave_for_this_cpu(model)
    return Target(f"tiny:{path.name}", path, model, None, frozenset({TINY_EOS}), torch.device("cpu"), dtype)


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


def nodes_unlike_their_steps(target, cache, tree: DraftTree, out) -> list[int]:
    """Nodes whose verify outputs `out` (logits and captured states, the tree verified at the cache's
    committed length) differ bitwise from their one-token steps (steps_depth_first)."""
    bad = []
    for node, step in steps_depth_first(target, cache, tree):
        if not (torch.equal(step.logits[0], out.logits[node]) and torch.equal(step.hidden[0], out.hidden[node])):
            bad.append(node)
    return sorted(bad)


# ------------------------------------------------------------------------------------------- heads


def random_eagle3_head(target, seed=0, vd=64):
    """A random EAGLE3 head for `target` (draft vocabulary of `vd` tokens), its weights perturbed."""
    from dart_core.tools.training import new_head_from_target

    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target.vocab_size, generator=g)[:vd].sort().values
    head = new_head_from_target(target, ids, None, seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return head.eval()


def eagle3_fixture_head(out: Path) -> Path:
    """The DART head's weights as an EAGLE3 checkpoint (drop the mask embedding and draft_length)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(committed_asset(EMBEDDED_DART_HEAD / "model.safetensors")))
    state.pop("midlayer.mask_rep")
    cfg = json.loads(committed_asset(EMBEDDED_DART_HEAD / "config.json").read_text())
    for key in ("draft_length", "dart_double_norm"):
        cfg.pop(key, None)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# ----------------------------------------------------------------------------------- llama.cpp stand-ins


def fake_bin_dir(tmp_path: Path) -> Path:
    """Executable stand-ins for llama.cpp's binaries (they exit 1 and are never run), so that a
    dart_core.tools.peers.LlamaCppPeer can be built to read captured output."""
    d = tmp_path / "bin"
    d.mkdir()
    for name in ("llama-completion", "llama-lookup", "llama-speculative-simple"):
        (d / name).write_text("#!/bin/sh\nexit 1\n")
        (d / name).chmod(0o755)
    return d


# ------------------------------------------------------------------------------------- random trees


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    """A random tree of n nodes in depth order, distinct tokens among siblings."""
    tokens, parents = [rng.randrange(vocab)], [-1]
    child_tokens: dict[int, set[int]] = {0: set()}
    for i in range(1, n):
        p = rng.randrange(i)
        tok = rng.randrange(vocab)
        while tok in child_tokens[p]:
            tok = rng.randrange(vocab)
        child_tokens[p].add(tok)
        child_tokens[i] = set()
        tokens.append(tok)
        parents.append(p)
    return DraftTree.from_parents(tokens, parents)


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


# ------------------------------------------------------------------------------------ test drafters
# They propose trees without a trained head, to exercise verification and acceptance.


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


# ---------------------------------------------------------------------- kernels: builds and exactness


def on_every_build(fn, paths=None) -> dict:
    """fn() run on each build in `paths` (default: every build this CPU runs) in turn, the build in
    use restored after: {path: result}."""
    previous = kernels.PATH
    results = {}
    try:
        for p in kernels.runnable_paths() if paths is None else paths:
            kernels.use_path(p)
            results[p] = fn()
    finally:
        kernels.use_path(previous)
    return results


def node_logits_equal_steps(target, prompt, tree) -> list[int]:
    """Nodes whose verify logits differ (bitwise) from the one-token steps along their paths."""
    cache = target.new_cache(len(prompt) + 2 * len(tree) + 4)
    target.prefill(prompt, cache, capture=False)
    cache.commit(len(prompt))
    P = cache.length
    out = target.verify(tree, cache, capture=True)
    bad = []
    for node in range(len(tree)):
        cache.rewind(P)
        for a in tree.path_to(node):
            step = target.verify(DraftTree.root_only(int(tree.tokens[a])), cache, capture=True)
            cache.commit(1)
        if not (torch.equal(step.logits[0], out.logits[node]) and torch.equal(step.hidden[0], out.hidden[node])):
            bad.append(node)
    return bad


# ----------------------------------------------------------------- acceptance: the hand-built tree

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


# ---------------------------------------------------------------------- the pruner's random cases

PRUNER_VOCAB = 30  # the vocabulary of the pruner tests' random cases and corpora


def random_case(rng: random.Random, seed: int):
    """A random pruner input: (tokens, probs, root, context, params, eos)."""
    V = PRUNER_VOCAB
    d, k = rng.randrange(1, 9), rng.randrange(1, 14)
    tokens = np.array([rng.sample(range(V), k) for _ in range(d)])
    alpha = rng.choice([0.1, 0.5, 2.0])
    probs = np.random.default_rng(seed).dirichlet(np.full(k, alpha), size=d).astype(np.float32)
    params = PruneParams(
        top_k=rng.randrange(1, 15),
        beam_width=rng.randrange(1, 9),
        max_nodes=rng.randrange(0, 70),
        use_ngram=rng.random() < 0.8,
        ngram_on_first_level=rng.random() < 0.3,
        min_score=rng.choice([float("-inf"), -0.5, -2.0, -6.0]),
        min_nodes=rng.randrange(0, 6),
    )
    root = rng.randrange(V)
    context = [rng.randrange(V) for _ in range(rng.randrange(0, 5))]
    return tokens, probs, root, context, params, rng.choice([-1, 3, tokens[0, 0]])


def corpus_tries(order: int):
    """The same random corpus as a C++ trie and as the Python reference trie."""
    V = PRUNER_VOCAB
    rng = random.Random(order)
    seqs = [[rng.randrange(V) for _ in range(rng.randrange(2, 40))] for _ in range(150)]
    ref = PyNGramModel(order, V)
    for s in seqs:
        ref.add(s)
    return ngram_cpp.build(seqs, V, order), ref


def assert_same_tree(a, b):
    for field in ("tokens", "parents", "positions", "mask", "retrieve"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    np.testing.assert_allclose(a.scores, b.scores, atol=1e-5)


def check_invariants(t, params, d):
    """The tree invariants the verifier relies on, for a pruned tree over d rows."""
    n = len(t.tokens)
    assert n - 1 <= params.max_nodes
    assert t.parents[0] == -1 and all(0 <= t.parents[i] < i for i in range(1, n))
    assert all(t.positions[i] == t.positions[t.parents[i]] + 1 for i in range(1, n))
    assert np.all(np.diff(t.positions) >= 0) and t.positions.max() <= d
    for i in range(1, n):  # scores never increase along a path
        assert t.scores[i] <= t.scores[t.parents[i]] + 1e-6
    leaves = [i for i in range(n) if i not in set(t.parents.tolist())]
    assert t.retrieve.shape == (len(leaves), t.positions.max() + 1)
    assert sorted(int(r[r >= 0][-1]) for r in t.retrieve) == sorted(leaves)


# ------------------------------------------------------- trainer tests: a word-level tokenizer and text

SPECIAL = ["<pad>", "<bos>", "<a>", "</s>", "<u>", "<sys>"]  # ids 0..5; </s> is TINY_EOS
WORDS = [f"w{i}" for i in range(len(SPECIAL), TINY_VOCAB)]
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<u>{% elif m['role'] == 'assistant' %}<a>{% else %}<sys>{% endif %}"
    " {{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<a> {% endif %}"
)


def save_word_tokenizer(path) -> None:
    """A word-level tokenizer over the tiny vocabulary, with a chat template, saved beside the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    assert vocab["</s>"] == TINY_EOS


def sentence(g: torch.Generator, n: int) -> str:
    """Words with a learnable structure: mostly a fixed successor, sometimes a random jump."""
    i = int(torch.randint(len(WORDS), (1,), generator=g))
    out = []
    for _ in range(n):
        out.append(WORDS[i])
        i = (i * 7 + 3) % len(WORDS) if torch.rand(1, generator=g) < 0.8 else int(torch.randint(len(WORDS), (1,), generator=g))
    return " ".join(out)
