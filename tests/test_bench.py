"""The benchmark CLI end to end on the embedded target (fp32, two prompts, a few tokens): every
loop method's output equals plain decoding's, the JSON has the fields the report reads, and bad
arguments are refused."""

from __future__ import annotations

import json

import pytest

from dart_core.cli import bench
from dart_core.tools import bench as bench_lib

from support import EMBEDDED_DART_HEAD, committed_asset, eagle3_fixture_head


@pytest.fixture(scope="module", autouse=True)
def embedded_dart_head():
    """The bench's default DART head (committed in assets/dart): a test fails without it."""
    return committed_asset(EMBEDDED_DART_HEAD / "config.json")


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "questions.jsonl"
    rows = [{"question_id": 1, "turns": ["Name three colours."]}, {"question_id": 2, "turns": ["Count from one to five."]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_bench_cli_json_and_losslessness(questions, tmp_path, capsys):
    e3 = eagle3_fixture_head(tmp_path / "e3")
    out = tmp_path / "r.json"
    repeats = tmp_path / "repeats.jsonl"  # text the answer copies: the context n-gram has matches to use
    repeats.write_text(json.dumps({"question_id": 7, "turns": ["Repeat exactly, three times: the blue cat sat on the red mat."]}) + "\n")
    rc = bench.main(
        [
            "--methods",
            "ar,dart,dart-noctx,eagle3",
            "--dataset",
            str(questions),
            str(repeats),
            "--max-new-tokens",
            "24",
            "--dtype",
            "float32",
            "--eagle3-model",
            str(e3),
            "--max-nodes",
            "8",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| dart |" in printed and "| repeats |" in printed
    result = json.loads(out.read_text())
    assert set(result["methods"]) == {"ar", "dart", "dart-noctx", "eagle3"}
    assert set(result["datasets"]) == {"questions", "repeats"}
    assert (
        result["datasets"]["repeats"]["ar"]["new_tokens"] + result["datasets"]["questions"]["ar"]["new_tokens"]
        == result["methods"]["ar"]["new_tokens"]
    )
    # each prompt starts with the next method in turn (one-time costs of a new prompt rotate too)
    firsts = [s["method"] for i, s in enumerate(result["samples"]) if i % 4 == 0]
    assert firsts == ["ar", "dart", "dart-noctx"], firsts
    by = {}
    for s in result["samples"]:
        by.setdefault(s["question_id"], {})[s["method"]] = s["output_ids"]
    for qid, outs in by.items():
        assert outs["dart"] == outs["ar"] and outs["dart-noctx"] == outs["ar"] and outs["eagle3"] == outs["ar"], qid
    for m in ("dart", "dart-noctx", "eagle3"):
        r = result["methods"][m]
        assert r["tau"] >= 1.0 and r["new_tokens"] == result["methods"]["ar"]["new_tokens"]
        assert sum(r["accept_hist"]) > 0 and r["verify_ms"] > 0 and r["draft_ms"] > 0
    assert result["env"]["dtype"] == "float32" and result["env"]["max_new_tokens"] == 24
    memory = result["env"]["memory"]  # the step's memory limit: the bytes a step streams over the bandwidth
    # the embedded target's linears, norms and tied LM head in fp32: 134,515,008 values (269,030,016 bytes in bf16)
    assert memory["step_weight_bytes"] == 4 * 134_515_008 and memory["read_gb_s"] > 0
    assert memory["streaming_limit_ms"] == pytest.approx(
        memory["step_weight_bytes"] / memory["read_gb_s"] / 1e6, rel=0.01
    )  # read_gb_s is rounded
    # --dtype given: the run says so, and measured no other path
    weights = result["env"]["weights_choice"]
    assert (
        weights["dtype"] == "float32"
        and "given: --dtype float32" in weights["reason"]
        and not weights["calibrated"]
        and not weights["paths"]
    )
    # --max-nodes given: DART not calibrated; the fixture EAGLE3 head has no τ table: the default, and why
    assert "dart" not in result["env"]["tree_sizes"] and not result["env"]["tree_sizes"]["eagle3"]["calibrated"]
    assert "no tree_sizes.json" in result["env"]["tree_sizes"]["eagle3"]["reason"]
    # which heads were compared, at which training step: the embedded DART head's trained.json; the
    # fixture EAGLE3 head has none, so only its directory
    trained = json.loads((EMBEDDED_DART_HEAD / "trained.json").read_text())
    assert result["env"]["heads"] == {"dart": {"head": "assets/dart", **trained}, "eagle3": {"head": str(e3)}}


def test_bench_refuses_a_malformed_trained_json_before_running(questions, tmp_path):
    e3 = eagle3_fixture_head(tmp_path / "e3")
    (e3 / "trained.json").write_text('{"run": "x", "step": "many"}')
    with pytest.raises(SystemExit, match="trained.json: expected"):
        bench.main(["--methods", "ar,eagle3", "--dataset", str(questions), "--max-new-tokens", "4", "--dtype", "float32",
                    "--eagle3-model", str(e3), "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert not (tmp_path / "r.json").exists()


def test_bench_refuses_unknown_methods(questions):
    with pytest.raises(SystemExit, match="unknown method"):
        bench.main(["--methods", "ar,medusa", "--dataset", str(questions)])
    with pytest.raises(SystemExit, match="context-weight"):
        bench.main(["--methods", "ar,dart", "--dataset", str(questions), "--context-weight", "1.5"])


@pytest.mark.slow
def test_bench_sweeps_tree_sizes_in_one_run(questions, tmp_path):
    out = tmp_path / "sweep.json"
    assert (
        bench.main(
            [
                "--methods",
                "ar,dart@2,dart@12,dart-adaptive@8",
                "--dataset",
                str(questions),
                "--max-new-tokens",
                "24",
                "--dtype",
                "float32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert list(result["methods"]) == ["ar", "dart@2", "dart@12", "dart-adaptive@8"]
    small, large = result["methods"]["dart@2"], result["methods"]["dart@12"]
    assert sum(small["accept_hist"][3:]) == 0  # two drafted nodes: at most two accepted per step
    assert small["tau"] <= large["tau"]
    # the adaptive tree: a size chosen per step, never past its cap of 8 (its ids: the loop below)
    assert sum(result["methods"]["dart-adaptive@8"]["accept_hist"][9:]) == 0
    for s in result["samples"]:
        assert s["output_ids"] == next(
            x["output_ids"] for x in result["samples"] if x["method"] == "ar" and x["question_id"] == s["question_id"]
        )
    for bad, why in (
        ("ar@4", "take a tree size"),
        ("dart@0", "positive integer"),
        ("dart@x", "positive integer"),
        ("dart,dart", "twice"),
        ("medusa@4", "unknown method"),
    ):
        with pytest.raises(SystemExit, match=why):
            bench.main(["--methods", bad, "--dataset", str(questions)])


def test_method_order_rotates():
    methods = ["ar", "eagle3", "dart"]
    orders = [bench_lib.method_order(methods, i) for i in range(4)]
    assert orders == [methods, ["eagle3", "dart", "ar"], ["dart", "ar", "eagle3"], methods]
    # peers (other processes) run a prompt first, ours rotate after them
    with_peer = ["ar", "llamacpp", "dart"]
    assert [bench_lib.method_order(with_peer, i, frozenset({"llamacpp"})) for i in range(3)] == [
        ["llamacpp", "ar", "dart"],
        ["llamacpp", "dart", "ar"],
        ["llamacpp", "ar", "dart"],
    ]
