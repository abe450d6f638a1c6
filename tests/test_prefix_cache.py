"""The prefix cache (dart_core/prefix_cache.py): a conversation's KV rows kept across turns and forked
for the methods compared on one prompt, reused only where it is exact: greedy outputs (and each
step's accepted drafts) the same with and without reuse, for plain decoding, DART and EAGLE3."""

from __future__ import annotations

import random

import pytest
import torch

from dart_core import ARDrafter, GenerationParams, SamplingParams, generate, kernels
from dart_core.drafters.dart import DartDrafter
from dart_core.drafters.eagle3 import Eagle3Drafter, Eagle3Params
from dart_core.prefix_cache import PrefixScope, PrefixStore, common_prefix
from dart_core.tools.training import new_head_from_target

from support import TINY_EOS, build_tiny_checkpoint, random_eagle3_head, tiny_target

NEW = 24  # new tokens a turn


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    t = tiny_target(build_tiny_checkpoint(tmp_path_factory.mktemp("prefix"), "qwen3", seed=3))
    t.model.kernel_prefill = True
    return t


def dart_head(target, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target.vocab_size, generator=g)[:64].sort().values
    head = new_head_from_target(target, ids, 3, seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return head.eval()


@pytest.fixture(scope="module")
def drafters(target):
    return {
        "ar": ARDrafter(),
        "dart": DartDrafter(dart_head(target, seed=2), target, None),
        "eagle3": Eagle3Drafter(random_eagle3_head(target, seed=3), target, Eagle3Params(depth=4, top_k=4, max_nodes=15)),
    }


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 96) for _ in range(n)]  # no EOS among them


def run(target, ids, drafter, scope=None, params=GenerationParams(NEW)):
    s = None
    for s in generate(target, ids, drafter, params, scope):
        pass
    return s


def conversation(target, drafter, scope, turns=3, seed=0):
    """Turns of a chat: each prompt is the last prompt, its answer (its last token dropped now and then,
    as a re-tokenised answer may differ at the seam) and new user tokens. Returns each turn's
    (prompt, summary with the scope, summary without)."""
    rng = random.Random(seed)
    ids, out = words(rng, 2 * kernels.MAX_ROWS + 5), []  # past the kernels' rows: a prompt in chunks
    for turn in range(turns):
        if turn:
            answer = [t for t in out.output_ids if t != TINY_EOS]
            ids = ids + (answer[:-1] if turn % 2 else answer) + words(rng, 9)
        out = run(target, ids, drafter, scope)
        fresh = run(target, ids, drafter)
        yield ids, out, fresh


@pytest.mark.parametrize("method", ["ar", "dart", "eagle3"])
def test_turns_reuse_the_conversation_and_give_the_same_ids(target, drafters, method):
    store = PrefixStore(64 << 20)
    scope = PrefixScope(store, "visitor")
    reused = []
    for ids, out, fresh in conversation(target, drafters[method], scope):
        assert out.output_ids == fresh.output_ids
        assert out.accepted == fresh.accepted  # the drafter's state rebuilt from the prefix: the same trees accepted
        assert fresh.reused_tokens == 0
        reused.append((out.reused_tokens, len(ids)))
    assert reused[0][0] == 0  # nothing kept before the first turn
    for n, total in reused[1:]:
        assert total - 12 <= n < total  # the conversation so far, at least the last token prefilled
    assert store.stats.hits == 2 and store.bytes <= store.max_bytes


def test_compare_methods_prefill_the_prompt_once(target, drafters):
    """Methods run one after another on one prompt: the first prefills it, the others copy its rows
    and its first token's logits (no prefill at all), each decoding in a cache of its own."""
    ids = words(random.Random(5), 90)
    store = PrefixStore(64 << 20)
    scope = PrefixScope(store, "visitor")
    calls = []
    prefill = target.prefill
    target.prefill = lambda ids, *a, **k: calls.append(len(ids)) or prefill(ids, *a, **k)
    try:
        outs = {m: run(target, ids, drafters[m], scope) for m in ("dart", "eagle3", "ar")}
    finally:
        del target.prefill
    assert calls == [len(ids)]
    assert [outs[m].reused_tokens for m in ("dart", "eagle3", "ar")] == [0, len(ids), len(ids)]
    for m, out in outs.items():
        assert out.output_ids == run(target, ids, drafters[m]).output_ids, m
    assert len(store) == 1  # lossless: the greedy answers are the same tokens, whose one entry serves every method


def test_sampling_with_reuse_draws_the_same_tokens(target, drafters):
    params = GenerationParams(NEW, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7))
    scope = PrefixScope(PrefixStore(), "v")
    for seed, m in enumerate(("ar", "dart")):
        ids = words(random.Random(8 + seed), 70)
        run(target, ids, drafters[m], scope, params)  # the prompt kept
        again = run(target, ids + [5, 6], drafters[m], scope, params)
        assert again.reused_tokens == len(ids)
        assert again.output_ids == run(target, ids + [5, 6], drafters[m], None, params).output_ids


def test_owners_are_isolated_and_cleared(target):
    store = PrefixStore()
    ids = words(random.Random(1), 40)
    run(target, ids, ARDrafter(), PrefixScope(store, "a"))
    assert run(target, ids, ARDrafter(), PrefixScope(store, "b")).reused_tokens == 0  # b never reads a's rows
    assert run(target, ids, ARDrafter(), PrefixScope(store, "a")).reused_tokens == len(ids)
    assert store.owners() == {"a", "b"}
    assert store.drop("a") == 1 and store.owners() == {"b"}
    assert run(target, ids, ARDrafter(), PrefixScope(store, "a")).reused_tokens == 0


def test_a_stopped_generation_keeps_what_it_committed(target, drafters):
    """A consumer that stops early (the app's Stop) leaves its rows consistent: the next turn reuses them."""
    ids = words(random.Random(2), 30)
    scope = PrefixScope(PrefixStore(), "v")
    with_drafts = drafters["eagle3"]
    events = generate(target, ids, with_drafts, GenerationParams(NEW), scope)
    output = []
    for e in events:
        output += e.new_tokens
        if len(output) >= 6:
            break
    events.close()
    nxt = ids + output + [7, 8, 9]
    out = run(target, nxt, with_drafts, scope)
    assert len(ids) < out.reused_tokens < len(nxt)
    assert out.output_ids == run(target, nxt, with_drafts).output_ids


def test_the_bound_evicts_the_least_recently_used(target):
    ids = [words(random.Random(s), 40) for s in range(4)]
    probe = PrefixStore()
    run(target, ids[0], ARDrafter(), PrefixScope(probe, "v"))
    one = probe.bytes
    store = PrefixStore(int(2.5 * one))  # room for two answers' entries
    scope = PrefixScope(store, "v")
    run(target, ids[0], ARDrafter(), scope)
    run(target, ids[1], ARDrafter(), scope)
    run(target, ids[0], ARDrafter(), scope)  # a hit: entry 0 is the most recently used now
    run(target, ids[2], ARDrafter(), scope)  # evicts entry 1
    assert store.bytes <= store.max_bytes and len(store) == 2 and store.stats.evicted == 1
    assert run(target, ids[1], ARDrafter(), scope).reused_tokens == 0
    tiny = PrefixStore(one // 2)
    run(target, ids[3], ARDrafter(), PrefixScope(tiny, "v"))
    assert len(tiny) == 0 and tiny.stats.refused == 1 and tiny.bytes == 0


def test_no_reuse_where_a_prefill_is_not_row_exact(target):
    """Without kernel_prefill a long prompt's prefill is one eager forward (its rows unlike its steps'),
    and on the eager path nothing is row-exact: nothing is kept nor reused there."""
    ids = words(random.Random(3), kernels.MAX_ROWS + 10)
    store = PrefixStore()
    target.model.kernel_prefill = False
    try:
        assert not target.prefill_exact(len(ids)) and target.prefill_exact(kernels.MAX_ROWS)
        run(target, ids, ARDrafter(), PrefixScope(store, "v"))
        assert len(store) == 0
    finally:
        target.model.kernel_prefill = True
    target.model.use_kernels = False
    try:
        assert not target.prefill_exact(len(ids))
        run(target, ids, ARDrafter(), PrefixScope(store, "v"))
        assert len(store) == 0
    finally:
        target.model.use_kernels = True
    assert target.prefill_exact(len(ids))


def test_common_prefix():
    assert common_prefix((1, 2, 3), [1, 2, 4, 5]) == 2 and common_prefix((1, 2), [1, 2, 3]) == 2 and common_prefix((), [1]) == 0


@pytest.mark.slow
def test_embedded_chat_turns_reuse_exactly(embedded_on):
    """The embedded model (gguf-int16, its prompts in kernel forwards): a chat's second turn reuses the
    first's rows and answers as a fresh prefill does, plain decoding and DART."""
    from dart_core.drafters.registry import build_drafter

    target = embedded_on("gguf-int16")
    was = target.model.kernel_prefill
    target.model.kernel_prefill = True
    try:
        dart = build_drafter("dart", target)
        scope = PrefixScope(PrefixStore(), "v")
        messages = [{"role": "user", "content": "Explain what a hash table is, in two sentences."}]
        for drafter in (ARDrafter(), dart):
            first = run(target, messages, drafter, scope, GenerationParams(40))
            turn2 = messages + [
                {"role": "assistant", "content": target.decode(first.output_ids)},
                {"role": "user", "content": "And a binary tree?"},
            ]
            out = run(target, turn2, drafter, scope, GenerationParams(40))
            assert out.reused_tokens > first.prompt_tokens
            assert out.output_ids == run(target, turn2, drafter, None, GenerationParams(40)).output_ids
    finally:
        target.model.kernel_prefill = was


@pytest.mark.slow
def test_app_engine_conversations_under_load(embedded_on):
    """The app's engine with a prefix cache: 40 two-turn chats from 8 visitors at once (mixed
    methods, their steps interleaved on the compute thread) each answer as its solo run without the
    cache; a visitor reuses only its own rows; the store stays within its bound; compare mode's second
    method prefills nothing."""
    from concurrent.futures import ThreadPoolExecutor

    from app.engine import Engine
    from dart_core.drafters.registry import build_drafter

    target = embedded_on("gguf-int16")
    was = target.model.kernel_prefill
    try:
        dart = build_drafter("dart", target)
        bound = 24 << 20  # less than the 40 conversations' entries (~1.5 MB each): some are evicted
        engine = Engine(target, {"dart": dart}, 8, prefix=PrefixStore(bound))
        assert target.model.kernel_prefill and engine.prefix_exact
        plain = Engine(target, {"dart": dart}, 8)
        topics = ["the sea", "a cat", "rain", "bread", "a river", "the moon", "a train", "snow", "a clock", "tea"]

        def chat(job):
            visitor, i = job
            method = ("dart", "ar")[(visitor + i) % 2]
            messages = [{"role": "user", "content": f"One sentence about {topics[i]}."}]
            first = engine.complete(engine.request(messages, method, 8, 0.0, 1.0, 0), owner=visitor)
            messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Shorter."}]
            second = engine.complete(engine.request(messages, method, 8, 0.0, 1.0, 0), owner=visitor)
            return job, method, messages, first, second

        jobs = [(v, i) for v in range(8) for i in range(5)]  # (the /generate test in test_app.py serves 80 at once)
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(chat, jobs))
        assert engine.prefix.bytes <= bound and engine.prefix.stats.evicted > 0
        assert engine.prefix.owners() <= set(range(8))
        solo: dict = {}
        for (visitor, i), method, messages, first, second in results:
            key = (i, method)
            if key not in solo:
                solo[key] = plain.complete(plain.request(messages, method, 8, 0.0, 1.0, 0)).output_ids
            assert second.output_ids == solo[key], (visitor, i, method)
            assert second.reused_tokens > 0 and second.first_token_s is not None
        # a visitor's rows are never read for another's prompt
        fresh = engine.complete(engine.request([{"role": "user", "content": "One sentence about tea."}], "ar", 8, 0.0, 1.0, 0), owner="new")
        assert fresh.reused_tokens == 0
        # compare mode: the second method copies the whole prompt, its first token's logits included
        messages = [{"role": "user", "content": "Name two colours."}]
        req = engine.request(messages, "dart", 8, 0.0, 1.0, 0)
        runs = [engine.complete(req.for_method(m), owner="cmp") for m in ("dart", "ar")]
        assert runs[0].reused_tokens == 0 and runs[1].reused_tokens == len(target.encode(messages))
        assert runs[0].output_ids == runs[1].output_ids
        assert engine.forget("cmp") >= 1 and "cmp" not in engine.prefix.owners()
    finally:
        target.model.kernel_prefill = was


@pytest.mark.slow
def test_bench_multi_turn_mode(embedded_on, tmp_path):
    """dart-bench --multi-turn's run: two-turn chats, each method fresh and with reuse, the same ids."""
    from dart_core.drafters.registry import build_drafter
    from dart_core.tools.bench import multi_turn_table, run_multi_turn

    target = embedded_on("gguf-int16")
    loaded = target.model.kernel_prefill
    target.model.kernel_prefill = was = False  # as gguf-int16 loads on the AVX-512 builds: eager GEMM prefill
    questions = [
        ("set", {"question_id": 1, "turns": ["Name a large city in Europe.", "Name another."]}),
        ("set", {"question_id": 2, "turns": ["What is two plus two?"]}),  # one turn: left out
        ("set", {"question_id": 3, "turns": ["Write a haiku about tea.", "Now one about coffee.", "And water?"]}),
    ]
    drafters = {"ar": ARDrafter(), "dart": build_drafter("dart", target)}
    try:
        out = run_multi_turn(target, drafters, questions, 12, SamplingParams(seed=0), lambda _: None)
        assert target.model.kernel_prefill == was  # restored
    finally:
        target.model.kernel_prefill = loaded
    for m in ("ar", "dart"):
        r = out["methods"][m]
        assert r["turns"] == 3 and r["same_ids"] == "3/3" and r["reused_tokens"] > 10
        assert r["ttft_reuse_s"] > 0 and r["ttft_fresh_s"] > 0
    assert "| dart | 3 |" in multi_turn_table(out) and out["methods"]["ar"]["ttft_gemm_s"] > 0  # the GEMM prefill's third mode
    with pytest.raises(ValueError, match="second turn"):
        run_multi_turn(target, drafters, questions[1:2], 12, SamplingParams(), lambda _: None)
