"""The fixed-shape forward (dart_core/fixed_shape.py), the exact path of every forward the CPU kernels do
not run (CUDA, --eager): its sums are fixed trees, and on tiny targets a verified node gets its
one-token step's bits at every row count, in every dtype, where the plain eager path does not."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import ngram_cpp
from dart_core import ARDrafter, GenerationParams, complete, fixed_shape
from dart_core.drafters.eagle3 import Eagle3Drafter, Eagle3Params

from support import TINY_VOCAB, build_tiny_checkpoint, nodes_unlike_their_steps, random_eagle3_head, random_tree_under, tiny_target

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def test_pairwise_sum_is_a_fixed_tree_that_zeros_extend():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 48, generator=g)
    padded = torch.cat((x, torch.zeros(3, 16)), dim=1)  # 64
    longer = torch.cat((padded, torch.zeros(3, 64)), dim=1)  # 128
    assert torch.equal(fixed_shape.pairwise_sum(padded, 1), fixed_shape.pairwise_sum(longer, 1))
    # by halves: ((x0 + x2) + (x1 + x3)) for four values
    v = torch.tensor([1.0, 1e8, -1.0, -1e8])
    assert fixed_shape.pairwise_sum(v, 0) == (v[0] + v[2]) + (v[1] + v[3])
    with pytest.raises(ValueError, match="power-of-two"):
        fixed_shape.pairwise_sum(torch.ones(3), 0)


def test_chunked_sum_ignores_trailing_empty_chunks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5 * fixed_shape.CHUNK, generator=g)
    more = torch.cat((x, torch.zeros(2, 4 * fixed_shape.CHUNK)), dim=1)  # 9 chunks: a tree over 16 instead of 8
    assert torch.equal(fixed_shape.chunked_sum(x, 1), fixed_shape.chunked_sum(more, 1))
    assert torch.allclose(fixed_shape.chunked_sum(x, 1), x.double().sum(1).float(), atol=1e-4)


def test_key_paths():
    paths, longest = fixed_shape.key_paths(torch.tensor([-1, 0, 0, 1, 3]))
    assert paths == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4]] and longest == 4
    with pytest.raises(ValueError, match="parent comes before"):
        fixed_shape.key_paths(torch.tensor([-1, 2, 0]))


def test_fixed_inputs_hold_each_rows_path():
    """FixedInputs.fill's path matrix (ngram_cpp.ancestor_paths) holds key_paths' paths, their lengths
    and (P, T), for trees, chains, forests and the one-token step; bad parents refused."""
    rng = random.Random(4)
    inputs = fixed_shape.FixedInputs(16, torch.device("cpu"))
    trees = [random_tree_under(rng, 3, n, TINY_VOCAB).parents for n in (1, 2, 7, 16)]
    trees += [torch.arange(-1, 15), torch.arange(-1, 4), torch.tensor([-1, 0, -1, 2, 1, -1])]  # chains, a forest
    for parents in trees:
        T = len(parents)
        inputs.fill(torch.arange(T), torch.arange(T) + 9, parents, 9, reference=False)
        paths, _ = fixed_shape.key_paths(parents)
        for r in range(16):
            n = int(inputs.plen[r])
            assert n == (len(paths[r]) if r < T else 0), (parents, r)
            if r < T:
                assert inputs.path[r, :n].tolist() == paths[r] and not inputs.path[r, n:].any(), (parents, r)
        assert inputs.meta.tolist() == [9, T] and inputs.tokens[:T].tolist() == list(range(T)) and not inputs.tokens[T:].any()
    with pytest.raises(ValueError, match="parent comes before"):
        inputs.fill(torch.arange(3), torch.arange(3), torch.tensor([-1, 2, 0]), 0, reference=False)
    with pytest.raises(ValueError, match="1..16 tokens"):
        inputs.fill(torch.arange(17), torch.arange(17), torch.arange(-1, 16), 0, reference=False)


def test_ancestor_paths_in_cpp_and_python_agree():
    """ngram_cpp.ancestor_paths (C++) and its Python reference write the same paths and lengths into
    reused buffers (stale rows overwritten, zeros past each path) and refuse the same bad trees."""
    rng = random.Random(7)
    width = 24
    cases = [random_tree_under(rng, 4, n, TINY_VOCAB).parents.numpy() for n in (1, 2, 9, 24, 24)]
    cases += [np.arange(-1, 23), np.array([-1, 0, -1, 2, 1, -1])]  # a chain, a forest
    for impl in (ngram_cpp.ancestor_paths, ngram_cpp.reference.ancestor_paths_reference):
        paths, lengths = np.full((width, width), 7, np.int32), np.full(width, 7, np.int32)  # stale values
        for parents in cases:
            n = len(parents)
            impl(parents, paths, lengths)
            expected, _ = fixed_shape.key_paths(torch.from_numpy(parents))
            for r in range(n):
                assert lengths[r] == len(expected[r]) and paths[r, : lengths[r]].tolist() == expected[r], (impl, parents, r)
                assert not paths[r, lengths[r] :].any(), (impl, parents, r)
        for parents, match in (([-1, 2, 0], "comes before"), ([-1, -2], "a node or -1"), (list(range(-1, 24)), "longer than 24")):
            with pytest.raises(ValueError, match=match):
                impl(np.array(parents), np.zeros((25, width), np.int32), np.zeros(25, np.int32))


def test_attention_matches_softmax_reference():
    g = torch.Generator().manual_seed(2)
    nkv, G, hd, P, T = 2, 3, 16, 70, 5
    parents = torch.tensor([-1, 0, 0, 1, 2])
    k = torch.randn(nkv, P + T + 3, hd, generator=g)
    v = torch.randn(nkv, P + T + 3, hd, generator=g)
    q = torch.randn(T, nkv * G, hd, generator=g)
    out = fixed_shape.attention(q, k, v, fixed_shape.TreeKeys(parents, P, torch.device("cpu")))
    paths, _ = fixed_shape.key_paths(parents)
    for r, path in enumerate(paths):
        slots = list(range(P)) + [P + n for n in path]
        for h in range(nkv * G):
            kv = h // G
            w = torch.softmax(q[r, h].double() @ k[kv, slots].double().T / hd**0.5, dim=0)
            assert torch.allclose(out[r, h].double(), w @ v[kv, slots].double(), atol=1e-5)


def nodes_unlike_steps(target, prompt, tree) -> list[int]:
    """Nodes whose verify logits or captured states differ (bitwise) from the one-token steps along
    the tree's root-to-leaf paths (each node is on one; every path is stepped once)."""
    cache = target.new_cache(len(prompt) + len(tree) + 80)
    target.prefill(prompt, cache, capture=False)
    cache.commit(len(prompt))
    return nodes_unlike_their_steps(target, cache, tree, target.verify(tree, cache, capture=True))


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixed")
    return {arch: build_tiny_checkpoint(root / arch, arch, seed=1) for arch in ("llama", "qwen2", "qwen3")}


def torch_target(path, dtype, rows):
    target = tiny_target(path, dtype)
    target.model.use_kernels = False
    target.model.fixed_rows = rows
    return target


BUCKETS = [(arch, dtype, 16) for arch in ("llama", "qwen2", "qwen3") for dtype in DTYPES]
BUCKETS += [pytest.param(arch, dtype, 64, marks=pytest.mark.slow) for arch in ("llama", "qwen3") for dtype in DTYPES]


@pytest.mark.parametrize(("arch", "dtype", "rows"), BUCKETS, ids=lambda v: str(v).removeprefix("torch."))
def test_verify_equals_steps_at_every_bucket(tiny_paths, arch, dtype, rows):
    target = torch_target(tiny_paths[arch], dtype, rows)
    rng = random.Random(3)
    for n in (1, 5, rows):  # a step, a small tree, the bucket full
        prefix = [rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(3, 90))]
        tree = random_tree_under(rng, prefix[-1], n, TINY_VOCAB)
        assert target.exact_verify(len(tree))
        assert nodes_unlike_steps(target, prefix, tree) == [], (arch, dtype, rows, n)


def test_the_plain_eager_path_is_not_exact(tiny_paths):
    """The same check with the fixed rows off (the plain torch path): it fails in fp32, which is what
    gives the test above its teeth."""
    target = torch_target(tiny_paths["llama"], torch.float32, 0)
    rng = random.Random(3)
    prefix = [rng.randrange(TINY_VOCAB) for _ in range(40)]
    tree = random_tree_under(rng, prefix[-1], 16, TINY_VOCAB)
    assert not target.exact_verify(len(tree))
    assert nodes_unlike_steps(target, prefix, tree) != []


def test_trees_beyond_the_rows_take_the_eager_path_and_say_so(tiny_paths):
    target = torch_target(tiny_paths["qwen2"], torch.float32, 16)
    assert target.exact_verify(16) and not target.exact_verify(17)
    rng = random.Random(5)
    prefix = [rng.randrange(TINY_VOCAB) for _ in range(20)]
    tree = random_tree_under(rng, prefix[-1], 24, TINY_VOCAB)
    cache = target.new_cache(64)
    target.prefill(prefix, cache, capture=False)
    cache.commit(len(prefix))
    assert target.verify(tree, cache, capture=False).logits.shape == (24, TINY_VOCAB)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunked_prefill_gives_each_row_its_one_token_steps_bits(tiny_paths, dtype):
    """A prompt of three 16-row chunks through the fixed forward (model.fixed_prefill_chunks): the last
    logits, every captured state and every cache entry are bit for bit those of feeding the prompt a
    token at a time, left pending as any forward's; with fewer chunks allowed than the prompt needs it
    runs one eager forward; drafting after a chunked prefill stays lossless."""
    target = torch_target(tiny_paths["qwen3"], dtype, 16)
    rng = random.Random(8)
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(40)]
    steps = target.new_cache(64)
    step_hidden = []
    for t in prompt:
        out = target.model(torch.tensor([t]), torch.tensor([steps.length]), steps, capture=True)
        step_hidden.append(out.hidden)
        steps.commit(1)
    last_logits = out.logits

    def prefilled(chunks: int):
        target.model.fixed_prefill_chunks = chunks
        cache = target.new_cache(64)
        out = target.prefill(prompt, cache, capture=True)
        assert cache.length == 0 and out.logits.shape == (1, TINY_VOCAB) and out.hidden.shape[0] == 40
        return out, cache

    try:
        out, cache = prefilled(3)
        assert torch.equal(out.logits, last_logits)
        assert torch.equal(out.hidden, torch.cat(step_hidden))
        assert torch.equal(cache.k[:, :, :, :40], steps.k[:, :, :, :40]) and torch.equal(cache.v[:, :, :, :40], steps.v[:, :, :, :40])
        _, eager_cache = prefilled(2)  # three chunks needed, two allowed: one eager forward
        assert getattr(eager_cache, "fixed_runner", None) is None and cache.fixed_runner is not None
        target.model.fixed_prefill_chunks = 3
        drafter = Eagle3Drafter(random_eagle3_head(target, seed=4), target, Eagle3Params(depth=4, top_k=4, max_nodes=15))
        ar = complete(target, prompt, ARDrafter(), GenerationParams(16)).output_ids
        assert complete(target, prompt, drafter, GenerationParams(16)).output_ids == ar
    finally:
        target.model.fixed_prefill_chunks = None


def test_prompts_run_in_chunks_by_default_on_cuda_only(tiny_paths):
    """model.fixed_prefill_chunks None takes the device's rule (CUDA: prompts of up to two fixed-shape
    chunks, as the H200 measured, and as many more as read PREFILL_CHUNK_READ_BYTES of the model's
    weights: 2 at the 8B shape's 16.4 GB, 122 for the embedded model's 0.27 GB; a CPU: always one eager
    forward); a setting is taken as given. On the CPU the default leaves a long prompt to the eager forward."""
    from dart_core.model import FIXED_PREFILL_CHUNKS, PREFILL_CHUNK_READ_BYTES

    target = torch_target(tiny_paths["qwen3"], torch.float32, 16)
    model = target.model
    assert model.fixed_prefill_chunks is None and FIXED_PREFILL_CHUNKS == {"cuda": 2, "cpu": 0}
    params = sum(p.numel() for p in model.parameters()) * 4
    assert params <= model.weight_bytes() < 2 * params  # fp32 parameters (and the small buffers)
    assert model.prefill_chunk_limit(torch.device("cuda", 1)) == PREFILL_CHUNK_READ_BYTES // model.weight_bytes() > 2
    assert model.prefill_chunk_limit(torch.device("cpu")) == 0
    for weights, chunks in ((16.4e9, 2), (0.27e9, 122), (100e9, 2)):  # the 8B shape in bf16, the embedded model, a bigger one
        model._weight_bytes = int(weights)
        assert model.prefill_chunk_limit(torch.device("cuda")) == chunks, weights
    model._weight_bytes = None
    cache = target.new_cache(64)
    target.prefill(list(range(1, 21)), cache, capture=False)  # 20 tokens: two 16-row chunks, allowed none here
    assert getattr(cache, "fixed_runner", None) is None
    model.fixed_prefill_chunks = 3
    try:
        assert model.prefill_chunk_limit(torch.device("cuda")) == 3 == model.prefill_chunk_limit(torch.device("cpu"))
        cache = target.new_cache(64)
        target.prefill(list(range(1, 21)), cache, capture=False)
        assert cache.fixed_runner is not None
    finally:
        model.fixed_prefill_chunks = None


def test_fixed_forward_refuses_a_mask_without_parents(tiny_paths):
    target = torch_target(tiny_paths["llama"], torch.float32, 16)
    cache = target.new_cache(16)
    mask = torch.ones(2, 2, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="parent links"):
        target.model(torch.tensor([4, 5]), torch.tensor([0, 1]), cache, mask)


def test_positions_beyond_the_table_are_an_error():
    table = fixed_shape.RopeTable(torch.ones(4), 1.0, 10)
    with pytest.raises(ValueError, match="beyond the model's 10 positions"):
        table.check(10)
    table.check(9)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow), pytest.param(torch.float16, marks=pytest.mark.slow)]
)
def test_greedy_eagle3_equals_plain_decoding_on_the_torch_path(tiny_paths, dtype):
    target = torch_target(tiny_paths["qwen3"], dtype, 16)
    drafter = Eagle3Drafter(random_eagle3_head(target, seed=4), target, Eagle3Params(depth=4, top_k=4, max_nodes=15))
    for prompt in ([5, 6, 7], [11, 40, 12, 90, 4, 4, 4, 17]):
        ar = complete(target, prompt, ARDrafter(), GenerationParams(24)).output_ids
        assert complete(target, prompt, drafter, GenerationParams(24)).output_ids == ar


def test_upload_copies_through_its_staging_buffer_and_grows():
    up = fixed_shape.Upload(torch.long, torch.device("cpu"), size=4)
    a = up(torch.tensor([3, 1, 4]))
    assert a.tolist() == [3, 1, 4]
    b = up(torch.arange(10))  # past the staging size: the buffers grow
    assert b.tolist() == list(range(10)) and up.host.numel() >= 10
    out = torch.full((2,), -1)
    assert up(torch.tensor([7, 8]), out) is out and out.tolist() == [7, 8]
    # a list or a numpy array of any shape goes up flat, in the Upload's dtype
    assert up([5, 9, 2]).tolist() == [5, 9, 2] and up(np.array([[1, 2], [3, 4]], dtype=np.int32)).tolist() == [1, 2, 3, 4]
    masks = fixed_shape.Upload(torch.bool, torch.device("cpu"), size=2)
    assert masks(torch.tensor([[True, False], [False, True]])).tolist() == [True, False, False, True]
