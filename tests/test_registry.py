"""Drafter configs and the flags that make them: one declaration of each drafter's flags serves the
bench and the app (with the upstream app's names as aliases); the configs check their values (a flag
out of range is refused by its name), presets and n-gram resolution."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from dart_core.cli.options import add_drafter_flags, drafter_configs
from dart_core.drafters import DEFAULT_NGRAM
from dart_core.drafters.config import ConfigError, DartConfig, Eagle3Config, default_max_nodes
from dart_core.drafters.registry import prune_params, resolve_ngram

from support import committed_asset


def parse(*argv):
    p = argparse.ArgumentParser()
    add_drafter_flags(p)
    return p.parse_args(list(argv))


def configs(*argv, default_target=True):
    return drafter_configs(parse(*argv), default_target)


def test_upstream_names_are_aliases_of_ours():
    a = parse("--dart-model-name-or-path", "x", "--eagle3-model-name-or-path", "y", "--ngram-model-name-or-path", "z")
    b = parse("--dart-model", "x", "--eagle3-model", "y", "--ngram-model", "z")
    assert vars(a) == vars(b) and a.dart_model == "x" and a.eagle3_model == "y"
    c = drafter_configs(a, False)
    assert (c.dart.head, c.dart.ngram, c.eagle3.head) == ("x", "z", "y")


def test_the_app_and_the_bench_take_the_same_drafter_flags():
    from app.launch import parse_args as app_args
    from dart_core.cli.bench import parse_args as bench_args

    flags = ["--dart-model", "h", "--max-nodes", "5", "--context-weight", "0.3", "--eagle3-max-nodes", "7", "--no-context-ngram"]
    app, bench = app_args(flags), bench_args(["--dataset", "q.jsonl", *flags])
    keys = vars(parse())
    assert {k: getattr(app, k) for k in keys} == {k: getattr(bench, k) for k in keys}
    assert drafter_configs(app, True) == drafter_configs(bench, True)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--context-weight", "1.2"], "context-weight"),
        (["--context-extend", "-1"], "context-extend"),
        (["--max-nodes", "-1"], "max-nodes"),
        (["--eagle3-max-nodes", "-2"], "eagle3-max-nodes"),
        (["--tree-top-k", "0"], "tree-top-k"),
        (["--draft-depth", "0"], "draft-depth"),
        (["--tree-min-score", "0.5"], "tree-min-score"),
        (["--tree-min-score", "-2", "--tree-min-nodes", "-1"], "tree-min-nodes"),
        (["--context-candidates", "-1"], "context-candidates"),
        (["--logit-decay", "nan"], "logit-decay"),
        (["--level-exponent", "inf"], "level-exponent"),
        (["--beam-width", "0"], "beam-width"),
        (["--eagle3-top-k", "0"], "eagle3-top-k"),
        (["--eagle3-depth", "-1"], "eagle3-depth"),
        (["--context-order", "0"], "context-order"),
    ],
)
def test_out_of_range_flags_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        configs(*argv)
    configs()  # the defaults pass


def test_configs_check_their_values():
    """The library's own check: a config out of range raises ConfigError naming its field."""
    for bad, field in (
        (dict(max_nodes=-1), "max_nodes"),
        (dict(depth=0), "depth"),
        (dict(min_score=0.5), "min_score"),
        (dict(ranking="best"), "ranking"),
        (dict(context_order=0), "context_order"),
    ):
        with pytest.raises(ConfigError, match=field) as e:
            DartConfig(**bad)
        assert e.value.field == field
    with pytest.raises(ConfigError, match="context_weight"):
        DartConfig.embedded(weights=replace(DartConfig().weights, context_weight=2.0))
    with pytest.raises(ConfigError, match="top_k"):
        Eagle3Config(top_k=0)
    with pytest.raises(ConfigError, match="max_nodes"):
        replace(Eagle3Config(), max_nodes=-3)


def test_method_at_n_is_a_replaced_tree_size():
    c = DartConfig.embedded()
    assert c.tree_size("cpu") == default_max_nodes("cpu") and replace(c, max_nodes=16).tree_size("cpu") == 16
    e = configs("--max-nodes", "9").eagle3
    assert e.tree_size("cpu") == 9  # EAGLE3 follows DART's --max-nodes unless given its own
    assert configs("--max-nodes", "9", "--eagle3-max-nodes", "4").eagle3.tree_size("cuda") == 4


def test_score_floor_flags_reach_the_pruner():
    assert prune_params(configs().dart, "cpu", True).min_score == float("-inf")
    p = prune_params(configs("--tree-min-score", "-1.5", "--tree-min-nodes", "3", "--max-nodes", "12").dart, "cpu", True)
    assert (p.min_score, p.min_nodes, p.max_nodes) == (-1.5, 3, 12)


def test_score_weights_per_target_and_flags():
    """The embedded target gets the weights tuned for its head, another target upstream's; a flag given
    overrides either, and the weights reach the pruner."""
    from dart_core.cli.options import score_weights, weight_flag_args
    from dart_core.drafters.dart import EMBEDDED_WEIGHTS, UPSTREAM_WEIGHTS

    assert score_weights(parse(), True) == EMBEDDED_WEIGHTS and score_weights(parse(), False) == UPSTREAM_WEIGHTS
    assert DartConfig.embedded().weights == EMBEDDED_WEIGHTS and DartConfig.upstream().weights == UPSTREAM_WEIGHTS
    assert EMBEDDED_WEIGHTS != UPSTREAM_WEIGHTS
    w = score_weights(parse("--tree-top-k", "7", "--ngram-first-level", "off", "--context-weight", "0.3", "--logit-decay", "0.5"), True)
    assert (w.top_k, w.ngram_on_first_level, w.context_weight, w.logit_decay) == (7, False, 0.3, 0.5)
    assert w.level_exponent == EMBEDDED_WEIGHTS.level_exponent
    p = prune_params(configs("--ngram-first-level", "on", "--context-candidates", "3", default_target=False).dart, "cpu", True)
    assert (p.top_k, p.level_exponent, p.ngram_on_first_level, p.context_max_candidates) == (
        UPSTREAM_WEIGHTS.top_k,
        UPSTREAM_WEIGHTS.level_exponent,
        True,
        3,
    )
    assert p.context_weight == UPSTREAM_WEIGHTS.context_weight
    for w in (EMBEDDED_WEIGHTS, UPSTREAM_WEIGHTS):  # the flags that name a preset give it back on the other target
        assert score_weights(parse(*weight_flag_args(w)), w is UPSTREAM_WEIGHTS) == w
    off = prune_params(configs("--no-context-ngram").dart, "cpu", True)
    assert (off.context_weight, off.context_extend, off.top_k) == (0.0, 0, EMBEDDED_WEIGHTS.top_k)


def test_tree_size_and_ngram_resolution(tmp_path):
    assert configs().dart.tree_size("cpu") == default_max_nodes("cpu") and configs("--max-nodes", "3").dart.tree_size("cuda") == 3
    assert resolve_ngram(configs("--no-ngram").dart) is None
    assert resolve_ngram(configs(default_target=False).dart) is None  # another target: the embedded trie does not fit it
    assert resolve_ngram(configs().dart) == committed_asset(DEFAULT_NGRAM)  # the embedded trie, committed in assets/ngram
    (tmp_path / "full.trie").write_bytes(b"x")
    (tmp_path / "small.trie").write_bytes(b"x")
    assert resolve_ngram(configs("--ngram-model", str(tmp_path)).dart) == tmp_path / "full.trie"
    assert resolve_ngram(configs("--ngram-model", str(tmp_path), "--use-small-ngram").dart) == tmp_path / "small.trie"
    with pytest.raises(FileNotFoundError, match="no n-gram file"):
        resolve_ngram(configs("--ngram-model", str(tmp_path / "missing.ngram")).dart)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="full.trie"):
        resolve_ngram(configs("--ngram-model", str(tmp_path / "empty")).dart)


def test_build_drafter_takes_configs_only():
    """The library builds drafters from typed configs; flags become configs at the edge only."""
    from dart_core.drafters.registry import build_drafter

    with pytest.raises(TypeError, match="expected a DartConfig"):
        build_drafter("dart", None, Eagle3Config())
    with pytest.raises(ValueError, match="unknown drafter"):
        build_drafter("medusa", None)


def test_trained_record_reads_a_heads_training_step_and_refuses_a_bad_file(tmp_path):
    from dart_core.drafters.head import trained_record

    assert trained_record(None) is None and trained_record(tmp_path) is None  # no trained.json
    assert trained_record("someone/some-head") is None  # a hub id: nothing local to read
    (tmp_path / "trained.json").write_text('{"run": "r", "step": 7, "elapsed_s": 3.5, "other": 1}')
    assert trained_record(tmp_path) == {"run": "r", "step": 7, "elapsed_s": 3.5}
    for bad in ("not json", "[1, 2]", '{"step": true}', '{"run": "r"}'):
        (tmp_path / "trained.json").write_text(bad)
        with pytest.raises(ValueError, match="trained.json"):
            trained_record(tmp_path)
