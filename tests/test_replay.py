"""Greedy replay (dart_core/tools/replay.py) takes the same steps as the generation loop with the same drafter."""

from __future__ import annotations

import pytest

from dart_core import GenerationParams, complete
from dart_core.drafters.config import DartConfig, DrafterConfigs
from dart_core.tools.bench import method_drafter
from dart_core.tools.replay import record_greedy, replay

pytestmark = pytest.mark.slow  # the embedded model in bf16, records and real runs of each method

PROMPTS = [
    "Write a short poem about a lighthouse keeper.",
    "Repeat after me exactly: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def records(embedded_bf16):
    return [record_greedy(embedded_bf16, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("method", ["dart", "dart-noctx", "dart@12", "eagle3"])
def test_replay_takes_the_steps_of_the_loop(embedded_bf16, records, method):
    drafter = method_drafter(method, embedded_bf16, DrafterConfigs())  # the bench's defaults on the embedded target
    for prompt, rec in zip(PROMPTS, records):
        real = complete(embedded_bf16, prompt, drafter, GenerationParams(NEW_TOKENS))
        assert real.output_ids == rec.output_ids  # lossless, and the record is plain decoding's
        rep = replay(drafter, rec)
        assert rep.steps == real.steps, (method, prompt)
        assert rep.accepted[:-1] == real.accepted[:-1], (method, prompt)
        assert rep.accepted[-1] <= real.accepted[-1]
        assert rep.tau == pytest.approx(real.tau)
    assert sum(sum(replay(drafter, r).accepted) for r in records) > 0  # the heads do get tokens accepted


def test_record_is_plain_decoding(embedded_bf16, records):
    from dart_core import ARDrafter

    for prompt, rec in zip(PROMPTS, records):
        assert complete(embedded_bf16, prompt, ARDrafter(), GenerationParams(NEW_TOKENS)).output_ids == rec.output_ids
        assert rec.hidden.shape[0] == len(rec.prompt_ids) + len(rec.output_ids) - 2


def test_tune_scoring_searches_by_replay(tmp_path, embedded_bf16):
    """dart-tune scoring: records once (then reads its cache), every setting's τ is a
    replay, the search keeps the best, and --sizes replays both weights at each size."""
    import json
    from pathlib import Path

    from dart_core.cli.tune import scoring_main
    from dart_core.tools.tuning import load_records

    root = Path(__file__).resolve().parent.parent
    argv = [
        "--dataset",
        str(root / "assets" / "eval_prompts.jsonl"),
        "--skip",
        "0",
        "--limit",
        "2",
        "--max-new-tokens",
        "24",
        "--params",
        "ngram_weight",
        "level_exponent",
        "--rounds",
        "1",
        "--sizes",
        "3,8",
        "--records",
        str(tmp_path / "rec.pt"),
        "--out",
        str(tmp_path / "out.json"),
    ]
    assert scoring_main(argv) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    taus = [s["tau"] for s in out["settings"]]
    assert taus == sorted(taus, reverse=True) and len(taus) >= 5
    start = next(s for s in out["settings"] if s["setting"] == out["start"])
    rec = load_records(tmp_path / "rec.pt")
    # the script tunes the score's weights, so it replays the score's ranking (the bench's default is the fitted one)
    drafter = method_drafter("dart", embedded_bf16, DrafterConfigs(dart=DartConfig.embedded(ranking="score")))
    steps = sum(replay(drafter, r).steps for _, r in rec)
    assert start["tau"] == pytest.approx(sum(len(r.output_ids) for _, r in rec) / steps)
    sizes = {(s["weights"], s["max_nodes"]) for s in out["by_size"]}
    assert {("the flags'", 3), ("the flags'", 8)} <= sizes
    assert scoring_main(argv[:-2] + ["--rounds", "0"]) == 0  # the cached records are read back
    with pytest.raises(SystemExit, match="--sizes"):
        scoring_main(argv[:-2] + ["--sizes", "5,x"])
