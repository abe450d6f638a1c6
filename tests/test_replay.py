"""Greedy replay (dart_core/replay.py) takes the same steps as the generation loop with the same drafter."""

from __future__ import annotations

import pytest

from dart_core import GenerationParams, complete
from dart_core.bench import method_drafter, parse_args
from dart_core.replay import record_greedy, replay

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
    args = parse_args(["--methods", f"ar,{method}", "--dataset", "unused.jsonl"])
    drafter = method_drafter(method, embedded_bf16, args)
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
