"""The generation loop: lossless greedy decoding with any tree, stopping rules, and bad input."""

from __future__ import annotations

import pytest
import torch

from dart_core import ARDrafter, GenerationParams, SamplingParams, StepEvent, Summary, complete, generate

from support import TINY_VOCAB, OracleDrafter, RandomTreeDrafter, tiny_target

PROMPTS = [[5, 6, 7], [11, 40, 12, 90, 4, 4, 4, 17], [60]]


def run(target, prompt, drafter, **kw) -> tuple[list[StepEvent], Summary]:
    items = list(generate(target, prompt, drafter, GenerationParams(**kw)))
    return items[:-1], items[-1]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_trees_equals_ar(tiny_ckpt, prompt):
    _, path = tiny_ckpt
    target = tiny_target(path)
    ar = complete(target, prompt, ARDrafter(), GenerationParams(max_new_tokens=40))
    for seed in range(3):
        for drafter in (RandomTreeDrafter(TINY_VOCAB, 12, seed), OracleDrafter(ar.output_ids, TINY_VOCAB, 16, seed)):
            events, summary = run(target, prompt, drafter, max_new_tokens=40)
            assert summary.output_ids == ar.output_ids, f"{drafter.name} seed {seed}"
            assert sum((e.new_tokens for e in events), []) == summary.output_ids
            assert summary.steps == len(events)
    # the oracle really accepts multi-token chunks, so compaction along tree paths is exercised
    _, summary = run(target, prompt, OracleDrafter(ar.output_ids, TINY_VOCAB, 16, 0), max_new_tokens=40)
    assert summary.tau > 1.5


def test_ar_summary(tiny_llama):
    events, summary = run(tiny_llama, PROMPTS[1], ARDrafter(), max_new_tokens=12)
    assert summary.tau == 1.0 and summary.new_tokens == 12 and summary.stop_reason == "max_new_tokens"
    assert [e.step for e in events] == list(range(13 - 1 + 0))[: len(events)]
    assert all(len(e.new_tokens) == 1 and e.accepted == 0 for e in events)


def test_stops_at_eos_inside_an_accepted_chunk(tiny_llama):
    prompt = PROMPTS[2]  # its greedy continuation is not a single repeated token
    ar = complete(tiny_llama, prompt, ARDrafter(), GenerationParams(max_new_tokens=30)).output_ids
    cut = next(i for i in range(3, len(ar)) if ar[i] not in ar[:i])  # first occurrence of a fresh token
    target = tiny_target(tiny_llama.model_dir)
    target.eos_ids = frozenset({ar[cut]})
    for seed in range(3):
        _, summary = run(target, prompt, OracleDrafter(ar, TINY_VOCAB, 16, seed), max_new_tokens=30)
        assert summary.output_ids == ar[: cut + 1]
        assert summary.stop_reason == "eos"


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_is_exact(tiny_llama, max_new):
    ar = complete(tiny_llama, PROMPTS[0], ARDrafter(), GenerationParams(max_new_tokens=30)).output_ids
    _, summary = run(tiny_llama, PROMPTS[0], OracleDrafter(ar, TINY_VOCAB, 16, 1), max_new_tokens=max_new)
    assert summary.output_ids == ar[:max_new]


def test_context_limit_never_overflows(tiny_llama):
    """A big tree close to the context limit is cut to what the cache can hold."""
    prompt = PROMPTS[1]
    ar = complete(tiny_llama, prompt, ARDrafter(), GenerationParams(max_new_tokens=30)).output_ids
    limit = len(prompt) + 9
    drafter = OracleDrafter(ar, TINY_VOCAB, max_nodes=39, seed=3)
    _, summary = run(tiny_llama, prompt, drafter, max_new_tokens=100, max_length=limit)
    assert summary.stop_reason == "context"
    assert summary.output_ids == ar[:9]


def test_the_loop_clamps_the_tree_size(tiny_llama):
    """The one clamp of a tree's size: each step's budget is the drafter's max_nodes, cut to the room
    the cache has left; drafters draft to it as given."""
    from dart_core.generate import cache_capacity, step_budget

    budgets = []

    class Recording(RandomTreeDrafter):
        def new_session(self, capacity):
            inner = super().new_session(capacity)

            class Session:
                def extend(self, ids, hidden):
                    inner.extend(ids, hidden)

                def propose(self, root, max_nodes):
                    budgets.append(max_nodes)
                    return inner.propose(root, max_nodes)

            return Session()

    prompt = PROMPTS[1]
    run(tiny_llama, prompt, Recording(TINY_VOCAB, 6, 0), max_new_tokens=20)
    assert budgets and set(budgets) == {6}  # room enough: the drafter's own size
    budgets.clear()
    limit = len(prompt) + 9
    run(tiny_llama, prompt, Recording(TINY_VOCAB, 6, 0), max_new_tokens=100, max_length=limit)
    assert budgets[0] == 6 and min(budgets) < 6  # near the context limit: what the cache still holds
    budgets.clear()
    run(tiny_llama, prompt, Recording(TINY_VOCAB, 6, 0), max_new_tokens=20, max_nodes=2)
    assert budgets and set(budgets) == {2}  # the request's size, below the drafter's
    budgets.clear()
    run(tiny_llama, prompt, Recording(TINY_VOCAB, 6, 0), max_new_tokens=20, max_nodes=9)
    assert budgets and set(budgets) == {6}  # never above the drafter's own
    capacity = cache_capacity(limit, len(prompt), 100, 6)
    assert (
        step_budget(Recording(TINY_VOCAB, 6).max_nodes, capacity, capacity - 1) == 0
        and step_budget(ARDrafter().max_nodes, capacity, 0) == 0
    )


@pytest.mark.parametrize("bad", [-1, 2.0, True, "4"])
def test_generation_params_reject_a_bad_tree_size(bad):
    with pytest.raises(ValueError, match="max_nodes"):
        GenerationParams(max_nodes=bad)


def test_sampling_is_reproducible_with_a_seed(tiny_llama):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=123)
    a = complete(tiny_llama, PROMPTS[0], RandomTreeDrafter(TINY_VOCAB), GenerationParams(20, sampling=sp))
    b = complete(tiny_llama, PROMPTS[0], RandomTreeDrafter(TINY_VOCAB), GenerationParams(20, sampling=sp))
    assert a.output_ids == b.output_ids


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(top_k=2.5), "top_k"),
    ],
)
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("max_new", [0, -5, 2.5, True])
def test_invalid_max_new_tokens(max_new):
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationParams(max_new_tokens=max_new)


def test_bad_prompts(tiny_llama):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_llama, [], None, GenerationParams())
    with pytest.raises(ValueError, match="out of range"):
        generate(tiny_llama, [1, 10**6], None, GenerationParams())
    with pytest.raises(TypeError, match="prompt"):
        generate(tiny_llama, 3.5, None, GenerationParams())
    with pytest.raises(ValueError, match="context limit"):
        generate(tiny_llama, [5] * 300, None, GenerationParams())
    with pytest.raises(ValueError, match="context limit"):
        generate(tiny_llama, [5] * 20, None, GenerationParams(max_length=20))


def test_unknown_model_path():
    from dart_core import load_target

    with pytest.raises(FileNotFoundError, match="neither a local directory nor a hub id"):
        load_target("./no/such/model")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target("/tmp")


def test_rejects_bad_dtype_and_device():
    from dart_core import load_target

    with pytest.raises(ValueError, match="dtype"):
        load_target("default", dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            load_target("default", device="cuda")
