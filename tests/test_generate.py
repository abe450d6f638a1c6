"""The generation loop: lossless greedy decoding with any tree, stopping rules, and bad input."""

from __future__ import annotations

import itertools

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


@pytest.mark.parametrize("fixed", [False, True], ids=["kernels-or-eager", "fixed-forward"])
def test_generations_reuse_the_last_generations_cache(tiny_llama, fixed):
    """The loop leases the target's cache and gives it back (Target.lease_cache / SpareCache): the next
    generation that fits takes the same cache (on a GPU, with the graph captured on it), a larger one
    gets a new cache that is then kept, generations running at once hold caches of their own, and the
    output is the same as with fresh caches."""
    target = tiny_target(tiny_llama.model_dir)
    if fixed:  # the fixed-shape forward (the path CUDA takes; here with the torch reference attention)
        target.model.use_kernels = False
        target.model.fixed_rows = 16
    fresh = {}
    for i, p in enumerate(PROMPTS):
        fresh[i] = complete(tiny_target(tiny_llama.model_dir) if not fixed else target, p, ARDrafter(), GenerationParams(20)).output_ids
        target.spare = type(target.spare)()  # (forget the cache: each of these from a fresh one)
    drafter = OracleDrafter(fresh[1], TINY_VOCAB, 16, 0)
    first = complete(target, PROMPTS[1], drafter, GenerationParams(20))
    kept = target.spare._idle
    assert kept is not None and first.output_ids == fresh[1]
    again = complete(target, PROMPTS[0], ARDrafter(), GenerationParams(12))  # fits: the same cache
    assert target.spare._idle is kept and again.output_ids == fresh[0][:12]
    if fixed:
        assert getattr(kept, "fixed_runner", None) is not None  # what a GPU captures its graph on, reused with it
    big = complete(target, PROMPTS[2], ARDrafter(), GenerationParams(60))  # larger: a new cache, then kept
    assert target.spare._idle is not kept and target.spare._idle.capacity > kept.capacity
    assert big.output_ids[:20] == fresh[2]
    # two generations at once, interleaved step by step: each its own cache, each its own output
    a = generate(target, PROMPTS[0], ARDrafter(), GenerationParams(20))
    b = generate(target, PROMPTS[1], drafter, GenerationParams(20))
    out_a, out_b = list(next(a).new_tokens), list(next(b).new_tokens)
    for ev_a, ev_b in itertools.zip_longest(a, b):
        for ev, out in ((ev_a, out_a), (ev_b, out_b)):
            if isinstance(ev, StepEvent):
                out += ev.new_tokens
    assert out_a == fresh[0] and out_b == fresh[1]


def test_a_generation_stopped_early_gives_its_cache_back(tiny_llama):
    target = tiny_target(tiny_llama.model_dir)
    gen = generate(target, PROMPTS[1], ARDrafter(), GenerationParams(30))
    next(gen)
    next(gen)
    assert target.spare._idle is None  # leased
    gen.close()  # the consumer stops (the app's stop button)
    back = target.spare._idle
    assert back is not None
    again = generate(target, PROMPTS[0], ARDrafter(), GenerationParams(10))
    next(again)
    assert target.spare._idle is None  # the next generation took it
    assert (
        list(again)[-1].output_ids == complete(tiny_target(tiny_llama.model_dir), PROMPTS[0], ARDrafter(), GenerationParams(10)).output_ids
    )


def test_a_spare_cache_matches_its_device_as_a_target_names_it():
    """A target on "cuda" allocates its caches on "cuda:0" (the current device); torch's == says those
    differ, which would make every generation on a GPU capture again. same_device says they match."""
    from dart_core.model import same_device

    assert same_device(torch.device("cuda", 0), "cuda") and same_device(torch.device("cuda", 0), torch.device("cuda:0"))
    assert not same_device(torch.device("cuda", 1), "cuda:0") and not same_device(torch.device("cpu"), "cuda")
    assert same_device(torch.device("cpu"), "cpu") and torch.device("cuda:0") != torch.device("cuda")


def test_the_accepted_paths_states_are_the_verifys_rows_at_the_path(tiny_llama):
    """Target.rows (what the loop hands the drafter after each verify): a chain's rows as a slice of the
    verify's states (no copy), any other path's rows as indexing gives them."""
    x = torch.randn(7, 5)
    chain = tiny_llama.rows(x, [0, 1, 2])
    assert torch.equal(chain, x[:3]) and chain.data_ptr() == x.data_ptr()
    for nodes in ([0], [0, 2, 5], [0, 1, 4, 6]):
        assert torch.equal(tiny_llama.rows(x, nodes), x[nodes]), nodes


def test_a_cache_for_captured_graphs_is_leased_with_room_to_spare(monkeypatch):
    """Where forwards are captured (fixed_shape.graphs_here), a new cache rounds its capacity up to
    SpareCache.GRAPH_CAPACITY_STEP, so a slightly longer next generation replays the graphs captured
    on it instead of capturing anew; elsewhere it is the size asked for."""
    from dart_core import fixed_shape
    from dart_core.model import SpareCache

    step = SpareCache.GRAPH_CAPACITY_STEP
    assert SpareCache().lease(1, 1, 8, 700, torch.float32, "cpu").capacity == 700
    monkeypatch.setattr(fixed_shape, "graphs_here", lambda device: True)
    spare = SpareCache()
    cache = spare.lease(1, 1, 8, 700, torch.float32, "cpu", scratch=16)
    assert cache.capacity == -(-700 // step) * step and cache.scratch == 16
    spare.give(cache)
    assert spare.lease(1, 1, 8, cache.capacity, torch.float32, "cpu", scratch=16) is cache  # a longer generation, the same cache
