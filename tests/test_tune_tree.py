"""dart_core/tools/tuning.py's tree sizes (dart-tune tree): the cut of a logged tree by size
and score floor, the acceptance it implies (checked against real steps of the embedded model), and the
CLI end to end."""

from __future__ import annotations

import json

import pytest

from support import EMBEDDED_DART_HEAD, EMBEDDED_NGRAM, committed_asset


@pytest.fixture(scope="module")
def tune():
    from dart_core.tools import tuning

    return tuning


def test_cut_and_acceptance_by_hand(tune):
    # root 0; 1 (-0.5) and 2 (-0.9) under the root, 3 (-0.7) under 1, 4 (-2.0) under 3
    scores, parents = [0.0, -0.5, -0.9, -0.7, -2.0], [-1, 0, 0, 1, 3]
    ranked = tune.rank_nodes(scores, parents)
    assert ranked == [1, 3, 2, 4]
    step = tune.LoggedStep(ranked, scores, [1, 3, 4], 0.001)
    assert [tune.accepted(step, k) for k in range(5)] == [0, 1, 2, 2, 3]  # node 2 (third) adds nothing to the path
    assert tune.kept_nodes(step, 4) == 4 and tune.kept_nodes(step, 2) == 2
    assert tune.kept_nodes(step, 4, min_score=-0.8) == 2  # 1 and 3 reach the floor
    assert tune.kept_nodes(step, 4, min_score=-0.8, min_nodes=3) == 3
    assert tune.kept_nodes(step, 4, min_score=-0.1) == 0
    verify = tune.VerifyTimes({100: {n: 0.010 + 0.001 * n for n in range(1, 6)}})
    tps, tau = tune.simulate([step], verify, max_nodes=2)
    assert tau == 3.0 and tps == pytest.approx(3 / (0.001 + 0.013))


def test_verify_time_follows_the_cache_length(tune):
    verify = tune.VerifyTimes({100: {1: 0.010, 2: 0.012}, 1100: {1: 0.020, 2: 0.030}})
    assert verify(2, 50) == 0.012 and verify(2, 5000) == 0.030  # clamped outside the timed lengths
    assert verify(1, 600) == pytest.approx(0.015) and verify(2, 350) == pytest.approx(0.0165)  # linear in between
    step = tune.LoggedStep([1], [0.0, -0.1], [1], 0.002, "sum", cached=1100)
    assert tune.simulate([step], verify, max_nodes=1) == (pytest.approx(2 / 0.032), 2.0)


@pytest.mark.slow
def test_a_smaller_tree_accepts_what_the_logged_cut_predicts(tune, embedded_target):
    """First steps of real generations: the tree of N nodes accepts exactly the prefix of the big
    tree's accepted path that lies in the big tree's best N nodes (greedy, fp32)."""
    import ngram_cpp
    from dart_core import GenerationParams, StepEvent, generate
    from dart_core.drafters.dart import DartParams, load_dart_drafter

    big = load_dart_drafter(
        committed_asset(EMBEDDED_DART_HEAD / "config.json").parent,
        embedded_target,
        committed_asset(EMBEDDED_NGRAM),
        DartParams(ngram_cpp.PruneParams(max_nodes=12)),
    )
    seen = 0
    for text in ("List three uses of a paperclip.", "Write the numbers from one to ten.", "What is the capital of France?"):
        ids = embedded_target.encode([{"role": "user", "content": text}])
        logged = tune.log_steps(embedded_target, big, [("q", ids)], 12)[0]
        assert logged.cached == len(ids) and logged.dataset == "q"
        for n in (1, 3, 6):
            small = big.with_params(DartParams(ngram_cpp.PruneParams(max_nodes=n)))
            first = next(
                ev
                for ev in generate(embedded_target, ids, small, GenerationParams(12))
                if isinstance(ev, StepEvent) and ev.tree is not None
            )
            assert first.accepted == tune.accepted(logged, tune.kept_nodes(logged, n)), (text, n)
            seen += first.accepted
    assert seen > 0  # the comparison covered accepted drafts, not only empty paths


@pytest.mark.slow
def test_cli_end_to_end(tmp_path, capsys):
    from dart_core.cli.tune import tree_main

    committed_asset(EMBEDDED_DART_HEAD / "config.json")  # the command's default head
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(["skip me", "Name two colours."])))
    out = tmp_path / "tune.json"
    assert (
        tree_main(
            [
                "--dataset",
                str(q),
                "--skip",
                "1",
                "--limit",
                "1",
                "--cap",
                "2",
                "--max-new-tokens",
                "8",
                "--dtype",
                "float32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["cap"] == 2 and result["steps"] >= 1
    assert [set(by_size) for by_size in result["verify_ms"].values()] == [{"1", "2", "3"}]  # one prompt: one cache length
    assert all(set(r["tau_per_set"]) == {"q"} for r in result["settings"])
    assert {tuple(sorted(r["setting"])) for r in result["settings"]} >= {("max_nodes",), ("max_nodes", "min_nodes", "min_score")}
    assert "--max-nodes 2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tree_main(["--dataset", str(q), "--skip", "5"])
