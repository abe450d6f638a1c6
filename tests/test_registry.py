"""The drafter registry: one declaration of each drafter's flags serves the bench and the app (with
the upstream app's names as aliases), its checks, and n-gram resolution."""

from __future__ import annotations

import argparse

import pytest

from dart_core.drafters import DEFAULT_NGRAM, default_max_nodes
from dart_core.drafters.registry import DRAFTERS, add_drafter_flags, check_drafter_flags, max_nodes, resolve_ngram


def parse(*argv):
    p = argparse.ArgumentParser()
    add_drafter_flags(p)
    return p.parse_args(list(argv))


def test_upstream_names_are_aliases_of_ours():
    a = parse("--dart-model-name-or-path", "x", "--eagle3-model-name-or-path", "y", "--ngram-model-name-or-path", "z")
    b = parse("--dart-model", "x", "--eagle3-model", "y", "--ngram-model", "z")
    assert vars(a) == vars(b) and a.dart_model == "x" and a.eagle3_model == "y"
    assert set(DRAFTERS) == {"dart", "eagle3"}


def test_the_app_and_the_bench_take_the_same_drafter_flags():
    from app.__main__ import parse_args as app_args
    from dart_core.bench import parse_args as bench_args

    flags = ["--dart-model", "h", "--max-nodes", "5", "--context-weight", "0.3", "--eagle3-max-nodes", "7", "--no-context-ngram"]
    app, bench = app_args(flags), bench_args(["--dataset", "q.jsonl", *flags])
    keys = vars(parse())
    assert {k: getattr(app, k) for k in keys} == {k: getattr(bench, k) for k in keys}


@pytest.mark.parametrize("argv, match", [
    (["--context-weight", "1.2"], "context-weight"), (["--context-extend", "-1"], "context-extend"),
    (["--max-nodes", "-1"], "max-nodes"), (["--eagle3-max-nodes", "-2"], "eagle3-max-nodes"),
    (["--tree-top-k", "0"], "tree-top-k"), (["--draft-depth", "0"], "draft-depth"),
    (["--tree-min-score", "0.5"], "tree-min-score"), (["--tree-min-score", "-2", "--tree-min-nodes", "-1"], "tree-min-nodes"),
    (["--context-candidates", "-1"], "context-candidates"), (["--logit-decay", "nan"], "logit-decay"),
    (["--level-exponent", "inf"], "level-exponent"),
])
def test_out_of_range_flags_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        check_drafter_flags(parse(*argv))
    check_drafter_flags(parse())  # the defaults pass


def test_score_floor_flags_reach_the_pruner():
    from dart_core.drafters.registry import tree_params

    assert tree_params(parse(), "cpu", True).min_score == float("-inf")
    p = tree_params(parse("--tree-min-score", "-1.5", "--tree-min-nodes", "3", "--max-nodes", "12"), "cpu", True)
    assert (p.min_score, p.min_nodes, p.max_nodes) == (-1.5, 3, 12)


def test_score_weights_per_target_and_flags():
    """The embedded target gets the weights tuned for its head, another target upstream's; a flag given
    overrides either, and the weights reach the pruner."""
    from dart_core.drafters.dart import EMBEDDED_WEIGHTS, UPSTREAM_WEIGHTS
    from dart_core.drafters.registry import score_weights, tree_params

    assert score_weights(parse(), True) == EMBEDDED_WEIGHTS and score_weights(parse(), False) == UPSTREAM_WEIGHTS
    assert EMBEDDED_WEIGHTS != UPSTREAM_WEIGHTS
    w = score_weights(parse("--tree-top-k", "7", "--ngram-first-level", "off", "--context-weight", "0.3", "--logit-decay", "0.5"), True)
    assert (w.top_k, w.ngram_on_first_level, w.context_weight, w.logit_decay) == (7, False, 0.3, 0.5)
    assert w.level_exponent == EMBEDDED_WEIGHTS.level_exponent
    p = tree_params(parse("--ngram-first-level", "on", "--context-candidates", "3"), "cpu", True, default_target=False)
    assert (p.top_k, p.level_exponent, p.ngram_on_first_level, p.context_max_candidates) == (UPSTREAM_WEIGHTS.top_k, UPSTREAM_WEIGHTS.level_exponent, True, 3)
    assert p.context_weight == UPSTREAM_WEIGHTS.context_weight
    from dart_core.drafters.registry import weight_flag_args

    for w in (EMBEDDED_WEIGHTS, UPSTREAM_WEIGHTS):  # the flags that name a preset give it back on the other target
        assert score_weights(parse(*weight_flag_args(w)), w is UPSTREAM_WEIGHTS) == w
    off = tree_params(parse("--no-context-ngram"), "cpu", True, default_target=True)
    assert (off.context_weight, off.context_extend, off.top_k) == (0.0, 0, EMBEDDED_WEIGHTS.top_k)


def test_tree_size_and_ngram_resolution(tmp_path):
    assert max_nodes(parse(), "cpu") == default_max_nodes("cpu") and max_nodes(parse("--max-nodes", "3"), "cuda") == 3
    assert resolve_ngram(parse("--no-ngram"), True) is None
    assert resolve_ngram(parse(), False) is None  # another target: the embedded trie does not fit it
    if DEFAULT_NGRAM.exists():
        assert resolve_ngram(parse(), True) == DEFAULT_NGRAM
    (tmp_path / "full.trie").write_bytes(b"x")
    (tmp_path / "small.trie").write_bytes(b"x")
    assert resolve_ngram(parse("--ngram-model", str(tmp_path)), True) == tmp_path / "full.trie"
    assert resolve_ngram(parse("--ngram-model", str(tmp_path), "--use-small-ngram"), True) == tmp_path / "small.trie"
    with pytest.raises(FileNotFoundError, match="no n-gram file"):
        resolve_ngram(parse("--ngram-model", str(tmp_path / "missing.ngram")), True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="full.trie"):
        resolve_ngram(parse("--ngram-model", str(tmp_path / "empty")), True)
