"""Helpers shared by the test modules: tiny random targets (those the GPU check shares from dart_core/tools/toys.py), the committed
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
from dart_core.tools.toys import (  # noqa: F401  (handed on: the tiny targets, trees and steps the GPU check shares)
    TINY_EOS,
    TINY_LAYERS,
    TINY_VOCAB,
    TREE,
    TREE_VOCAB,
    build_tiny_checkpoint,
    chi_square_p,
    random_tree_under,
    steps_depth_first,
)
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


def tiny_target(path: Path, dtype=torch.float32) -> Target:
    """A tiny checkpoint as load_target would give it: in bf16 on kernels without bf16 arithmetic
    its linears read 16-row interleaved weights (target.interleave_for_this_cpu)."""
    model = load_transformer(path, dtype, "cpu")
    interleave_for_this_cpu(model)
    return Target(f"tiny:{path.name}", path, model, None, frozenset({TINY_EOS}), torch.device("cpu"), dtype)


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


def assert_same_nodes(nodes, tree):
    """ngram_cpp.Pruner.nodes' arrays are prune's `tree`'s, and the DraftTree taken from them as they are
    (DraftTree.from_pruner) is the one from_parents builds and checks."""
    fields = ("tokens", "parents", "positions", "scores", "sources")
    for got, field in zip(nodes, fields, strict=True):
        want = getattr(tree, field)
        assert got.dtype == want.dtype and np.array_equal(got, want), field
    fast, checked = DraftTree.from_pruner(*nodes[:4]), DraftTree.from_parents(tree.tokens, tree.parents, tree.scores)
    for field in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(fast, field), getattr(checked, field)), field


def check_invariants(t, params, d):
    """The tree invariants the verifier relies on, for a pruned tree over d rows."""
    n = len(t.tokens)
    assert n - 1 <= params.max_nodes
    assert t.parents[0] == -1 and all(0 <= t.parents[i] < i for i in range(1, n))
    assert all(t.positions[i] == t.positions[t.parents[i]] + 1 for i in range(1, n))
    assert np.all(np.diff(t.positions) >= 0) and t.positions.max() <= d
    for i in range(1, n):  # scores never increase along a path
        assert t.scores[i] <= t.scores[t.parents[i]] + 1e-6
    assert len(set(zip(t.parents.tolist(), t.tokens.tolist()))) == n  # siblings hold distinct tokens
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
