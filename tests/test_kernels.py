"""The batch-invariant CPU kernels: they compute what the eager ops compute (up to rounding), a row's
result never depends on the rows that run with it (bit for bit), and a tree verify's logits equal
the one-token steps' logits bit for bit in every dtype, on tiny random targets and the embedded model."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dart_core import kernels

from support import TINY_VOCAB, build_tiny_checkpoint, node_logits_equal_steps, on_every_build, random_tree, tiny_target

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="dart_core's CPU kernels were not built")

# Every build this CPU runs (avx512bf16 / avx512 / avx2 / generic): the layer-level tests run on each,
# as DART_CPU_KERNELS=<path> would force it.
PATHS = kernels.runnable_paths()
# Builds with the fp32 contract (16 fma lanes, one pairwise tree): their results are the same bits.
FP32_CONTRACT = [p for p in PATHS if p != "avx512bf16"]


# The build in use (the best this CPU runs) in every run; the other builds in the full suite only
# (marked slow: `make test-fast` leaves them out, `make test` runs them all).
@pytest.fixture(params=[pytest.param(p, marks=() if i == 0 else pytest.mark.slow) for i, p in enumerate(PATHS)])
def kpath(request):
    previous = kernels.use_path(request.param)
    yield request.param
    kernels.use_path(previous)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (activations, KV cache) dtypes the attention takes: the same, or an fp16 cache beside fp32 (the GGUF
# paths with integer activations)
ATT_DTYPES = [(d, d) for d in DTYPES] + [(torch.float32, torch.float16)]
ATT_IDS = [f"{str(a)[6:]}" + ("" if a == c else f"-{str(c)[6:]}-cache") for a, c in ATT_DTYPES]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,N", [(576, 960), (1536, 576), (100, 37), (33, 5)])
def test_linear_matches_torch_and_is_row_invariant(dtype, K, N, kpath):
    torch.manual_seed(K + N)
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    b = torch.randn(N).to(dtype)
    x = torch.randn(20, K).to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    out = kernels.linear(x, w, b)
    assert out.dtype == dtype and out.shape == (20, N)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    rows = torch.cat([kernels.linear(x[i : i + 1], w, b) for i in range(20)])
    for M in range(2, 21):  # every block shape (bf16: 1-5 rows x 4 weights, 6-9 rows x 3 weights, row blocks beyond), the same bits
        assert torch.equal(kernels.linear(x[:M], w, b), rows[:M]), f"rows differ at M={M}"
    assert torch.equal(kernels.linear(x[3:9], w, b), rows[3:9])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype, kpath):
    torch.manual_seed(0)
    gu = (torch.randn(7, 2 * 96) * 4).to(dtype)
    g, u = gu.float().chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gu).float(), F.silu(g) * u, atol=TOL[dtype] * 8, rtol=TOL[dtype] * 2)
    rows = torch.cat([kernels.silu_mul(gu[i : i + 1]) for i in range(7)])
    assert torch.equal(kernels.silu_mul(gu), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_same_bits_on_every_build(dtype):
    """The x86 builds run fp32 and bf16 silu * u eight lanes at a time; each element keeps the scalar
    loop's bits (the generic build's), special values and the tail past the last 8 lanes included."""
    torch.manual_seed(1)
    I = 8 * 13 + 5  # 13 vector steps and a scalar tail
    g = torch.randn(3, I) * torch.tensor([0.01, 3.0, 40.0]).unsqueeze(1)
    specials = [0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 88.5, -88.5, 200.0, -200.0, float("inf"), -float("inf"), float("nan"), 3.4e38]
    g[0, : len(specials)] = torch.tensor(specials)
    g[1, 40 : 40 + len(specials)] = torch.tensor(specials)  # inside the vector steps of another row
    u = torch.randn(3, I)
    gu = torch.cat([g, u], dim=1).to(dtype)
    got = on_every_build(lambda: kernels.silu_mul(gu))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    ref = got[PATHS[-1]]  # generic where it was built: the scalar loop alone
    for path, out in got.items():  # bit for bit, but a NaN is a NaN (its sign is the compiler's operand order)
        nan = out.isnan()
        assert torch.equal(nan, ref.isnan()) and nan.any(), path
        assert torch.equal(out.masked_fill(nan, 0).view(bits), ref.masked_fill(nan, 0).view(bits)), path


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm(dtype, kpath):
    torch.manual_seed(1)
    x, delta = torch.randn(6, 80).to(dtype), torch.randn(6, 80).to(dtype)
    w = (1 + 0.1 * torch.randn(80)).to(dtype)
    x_out, normed = kernels.add_rmsnorm(x, delta, w, 1e-5)
    h = x + delta
    assert torch.equal(x_out, h)  # one rounding of the sum, as torch's add
    ref = w * F.rms_norm(h.float(), (80,), eps=1e-5).to(dtype)
    torch.testing.assert_close(normed.float(), ref.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype] * 2)
    x_only, normed_only = kernels.add_rmsnorm(x, None, w, 1e-5)
    assert torch.equal(x_only, x)
    rows = [kernels.add_rmsnorm(x[i : i + 1], delta[i : i + 1], w, 1e-5)[1] for i in range(6)]
    assert torch.equal(torch.cat(rows), normed)


def _attention_setup(dtype, P=37, nh=6, nkv=2, hd=32, seed=0):
    torch.manual_seed(seed)
    cap = P + 16
    k_cache = torch.randn(nkv, cap, hd).to(dtype)
    v_cache = torch.randn(nkv, cap, hd).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    return k_cache, v_cache, kernels.RopeTable(inv_freq, 1.0), inv_freq


# (query heads, KV heads, head dim): 1 to 8 query heads per KV group (the register paths take up to 4
# at a time), head dims of 1 to 8 lane groups, and one that is not a multiple of 16 (the lane loops);
# head dim 64 with 2, 3 and 6 heads a group (the embedded model's 9 / 3): AVX2's row blocks take
# their query heads 4 at a time for the scores and 6 for the values, with every remainder
HEAD_SHAPES = [(6, 2, 32), (4, 4, 16), (8, 4, 64), (9, 3, 64), (12, 2, 64), (8, 1, 128), (16, 2, 48), (6, 3, 24)]


@pytest.mark.parametrize("dtype,cache_dtype", ATT_DTYPES, ids=ATT_IDS)
@pytest.mark.parametrize("nh,nkv,hd", HEAD_SHAPES)
@pytest.mark.parametrize("P", [37, 600])  # 600: a long softmax, in passes (past ATT_PASSES_FROM)
def test_tree_attention_matches_sdpa(dtype, cache_dtype, nh, nkv, hd, P, kpath):
    """Against eager RoPE + SDPA with the tree mask, in fp32 arithmetic."""
    k_cache, v_cache, rope, inv_freq = _attention_setup(cache_dtype, P, nh, nkv, hd)
    tol = max(TOL[dtype], TOL[cache_dtype])
    tree = random_tree(random.Random(1), 9, 50)
    T = len(tree)
    q, k, v = (torch.randn(T, n * hd).to(dtype) for n in (nh, nkv, nkv))
    pos = tree.depths + P
    ref_k, ref_v = k_cache.float().clone(), v_cache.float().clone()
    out = kernels.tree_attention(q, k, v, rope, pos, k_cache, v_cache, P, tree.parents, nh, nkv)

    freqs = pos[:, None].float() * inv_freq[None]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    def rope_f(x):  # (h, T, hd)
        half = hd // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    qf = rope_f(q.float().view(T, nh, hd).transpose(0, 1))
    kf = rope_f(k.float().view(T, nkv, hd).transpose(0, 1))
    ref_k[:, P : P + T], ref_v[:, P : P + T] = kf, v.float().view(T, nkv, hd).transpose(0, 1)
    torch.testing.assert_close(k_cache[:, P : P + T].float(), ref_k[:, P : P + T], atol=tol * 8, rtol=tol)
    mask = torch.cat((torch.ones(T, P, dtype=torch.bool), tree.mask), 1)
    ref = F.scaled_dot_product_attention(
        qf[None], ref_k[None, :, : P + T], ref_v[None, :, : P + T], attn_mask=mask[None, None], enable_gqa=True
    )[0]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().view(T, nh, hd), ref.transpose(0, 1), atol=tol * 8, rtol=tol * 4)


@pytest.mark.parametrize("dtype,cache_dtype", ATT_DTYPES, ids=ATT_IDS)
@pytest.mark.parametrize("nh,nkv,hd", HEAD_SHAPES)
# 300, 520: the tree and its one-token calls past ATT_PASSES_FROM (256) run in three passes; 253: the
# tree's rows run by (row, KV group) and their one-token calls cross the threshold on the way down;
# 0 and 5: no committed keys, and fewer than one block of 8 (AVX2's row blocks pad it)
@pytest.mark.parametrize("P", [0, 5, 37, 253, 300, 520])
def test_tree_attention_row_equals_one_token_call(dtype, cache_dtype, nh, nkv, hd, P, kpath):
    """A node's output equals the one-token call made once its ancestors sit committed in the cache."""
    _check_rows_equal_one_token_calls(dtype, cache_dtype, nh, nkv, hd, P, random_tree(random.Random(5), 12, 50))


@pytest.mark.parametrize("dtype,cache_dtype", ATT_DTYPES, ids=ATT_IDS)
@pytest.mark.parametrize("nh,nkv,hd", [(9, 3, 64), (12, 2, 64), (8, 4, 64), (6, 2, 32)])
@pytest.mark.parametrize("T", [2, 3, 4, 5])
# past ATT_PASSES_FROM, below the row blocks: the three passes with AVX2's many-row scoring (each
# chunk's keys widened once for every row) and values a lane group at a time; 300 and 517 end in a
# part-filled chunk of 64 keys (517 also in a part-filled block of 4)
@pytest.mark.parametrize("P", [300, 517])
def test_small_trees_in_passes_equal_one_token_calls(dtype, cache_dtype, nh, nkv, hd, T, P, kpath):
    _check_rows_equal_one_token_calls(dtype, cache_dtype, nh, nkv, hd, P, random_tree(random.Random(T), T, 50))


def _check_rows_equal_one_token_calls(dtype, cache_dtype, nh, nkv, hd, P, tree):
    k_cache, v_cache, rope, _ = _attention_setup(cache_dtype, P, nh, nkv, hd, seed=3)
    T = len(tree)
    q, k, v = (torch.randn(T, n * hd).to(dtype) for n in (nh, nkv, nkv))
    pos = tree.depths + P
    out = kernels.tree_attention(q, k, v, rope, pos, k_cache.clone(), v_cache.clone(), P, tree.parents, nh, nkv)
    one = torch.tensor([-1])
    for node in range(T):
        kc, vc = k_cache.clone(), v_cache.clone()
        path = tree.path_to(node)
        for d, a in enumerate(path):  # commit the ancestors one step at a time, then the node itself
            o = kernels.tree_attention(q[a : a + 1], k[a : a + 1], v[a : a + 1], rope, pos[a : a + 1], kc, vc, P + d, one, nh, nkv)
        assert torch.equal(o[0], out[node]), f"node {node} (depth {len(path) - 1}) differs"


@pytest.mark.parametrize("dtype,cache_dtype", ATT_DTYPES, ids=ATT_IDS)
@pytest.mark.parametrize("nh,nkv,hd", [(6, 2, 32), (6, 3, 24)])
# 600: rows on either side of ATT_PASSES_FROM, whose one-token calls run in three passes
@pytest.mark.parametrize("cap,lengths", [(40, [0, 7, 39, 16, 23]), (600, [0, 255, 256, 599, 300])])
def test_rows_attention_is_each_sequence_alone(dtype, cache_dtype, nh, nkv, hd, cap, lengths, kpath):
    """Rows of separate sequences (continuous batching): row b's output and its cache writes are the
    bits of a one-token tree_attention call on sequence b's cache alone, whatever the other rows."""
    torch.manual_seed(7)
    B = 5
    committed = torch.tensor(lengths)
    kc, vc = torch.randn(B, nkv, cap, hd).to(cache_dtype), torch.randn(B, nkv, cap, hd).to(cache_dtype)
    q, k, v = (torch.randn(B, n * hd).to(dtype) for n in (nh, nkv, nkv))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    rope = kernels.RopeTable(inv_freq, 1.0)
    rows_k, rows_v = kc.clone(), vc.clone()
    plan = kernels.RowsAttention(rope, committed, nh, nkv, (B, nkv, cap, hd), dtype, cache_dtype)
    out = plan(q, k, v, rows_k, rows_v)
    root = torch.tensor([-1])
    for b in range(B):
        P = int(committed[b])
        one_k, one_v = kc[b].clone(), vc[b].clone()
        one = kernels.tree_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], rope, committed[b : b + 1], one_k, one_v, P, root, nh, nkv)
        assert torch.equal(one[0], out[b]), f"row {b} differs from its sequence alone"
        assert torch.equal(one_k[:, : P + 1], rows_k[b, :, : P + 1]) and torch.equal(one_v[:, : P + 1], rows_v[b, :, : P + 1])
    with pytest.raises(ValueError, match="free cache slot"):
        kernels.RowsAttention(rope, torch.tensor([0, 7, cap, 16, 23]), nh, nkv, (B, nkv, cap, hd), dtype)  # a full row
    with pytest.raises(ValueError, match="one length per cache row"):
        kernels.RowsAttention(rope, committed[:-1], nh, nkv, (B, nkv, cap, hd), dtype)
    with pytest.raises(ValueError):
        plan(q[:, :-1], k, v, rows_k, rows_v)


def _random_blocks(fmt: str, N: int, K: int, seed: int) -> kernels.BlockWeight:
    """Random GGUF blocks with sane fp16 scales (d in [1e-3, 1.1e-2], Q4_1 minimum in [-0.05, 0.05])."""
    g = torch.Generator().manual_seed(seed)
    per = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[fmt]
    nb = K // 32
    data = torch.randint(0, 256, (N, nb, per), dtype=torch.uint8, generator=g)
    data[:, :, 0:2] = (torch.rand(N, nb, generator=g) * 0.01 + 0.001).half().view(torch.uint8).view(N, nb, 2)
    if fmt == "Q4_1":
        data[:, :, 2:4] = ((torch.rand(N, nb, generator=g) - 0.5) * 0.1).half().view(torch.uint8).view(N, nb, 2)
    return kernels.BlockWeight(fmt, N, K, data.reshape(N, nb * per).contiguous())


@pytest.mark.parametrize("fmt", kernels.BLOCK_FORMATS)
def test_blocks_dequantize_as_gguf_does(fmt):
    """Our dequantization equals gguf-py's own (the reference every GGUF reader follows), bit for bit."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    w = _random_blocks(fmt, 7, 96, seed=3)
    ref = quants.dequantize(w.data.numpy(), GGMLQuantizationType[fmt]).reshape(7, 96)
    assert torch.equal(w.dequantize(), torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
    rows = torch.tensor([5, 0, 5])
    assert torch.equal(w.dequantize(rows), w.dequantize()[rows])
    for dt in (torch.bfloat16, torch.float16):  # rounded once from the exact values, in one pass
        assert torch.equal(w.dequantize(dtype=dt), w.dequantize().to(dt))


@pytest.mark.parametrize("fmt", kernels.BLOCK_FORMATS)
@pytest.mark.parametrize("K,N", [(576, 963), (1536, 64), (32, 5)])
def test_block_linear_is_the_fp32_linear_of_its_values(fmt, K, N, kpath):
    """A block weight multiplies exactly as its dequantized fp32 copy does (same bits, any row count)."""
    w = _random_blocks(fmt, N, K, seed=K + N)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(1))
    out = kernels.linear(x, w)
    assert torch.equal(out, kernels.linear(x, w.dequantize()))
    torch.testing.assert_close(out, x @ w.dequantize().T, atol=1e-4, rtol=1e-4)
    rows = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(20)])
    for M in range(2, 21):
        assert torch.equal(kernels.linear(x[:M], w), rows[:M]), f"rows differ at M={M}"
    assert kernels.linear(x.bfloat16(), w).dtype == torch.bfloat16


def _q8_reference(x: torch.Tensor, w: kernels.BlockWeight, qmax: int = 127) -> torch.Tensor:
    """x against w's exact values after x's block quantization (amax / qmax per block of 32, ties to
    even), in float64: what the int8-activation linear computes (qmax 127) up to its fp32 sums."""
    xb = x.double().view(x.shape[0], -1, 32)
    d = (xb.abs().amax(-1, keepdim=True).float() / qmax).double()
    inv = torch.where(d > 0, (1 / d.float()).double(), torch.zeros_like(d))
    q = torch.round((xb.float() * inv.float()).double()).clamp(-qmax, qmax)
    return (q * d).view_as(x.double()) @ w.dequantize().double().T


@pytest.mark.parametrize("fmt", kernels.BLOCK_FORMATS)
@pytest.mark.parametrize("K,N", [(576, 963), (1536, 64), (96, 5), (32, 7)])
def test_int8_activations_are_row_invariant_and_quantize_as_described(fmt, K, N, kpath):
    """Block weights against int8 activations: a row's bits never depend on the other rows (1..20 rows,
    every row-block shape), the result is the product of the quantized activations with the weights'
    exact values (up to fp32 sums), and within int8 rounding of the exact fp32 linear."""
    w = _random_blocks(fmt, N, K, seed=K + N + 1).with_activations("int8")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, K, generator=g)
    x[3, : K // 2] *= 40  # an outlier block: its scale must not leak into the other blocks
    x[5] = 0  # all-zero blocks have scale 0
    out = kernels.linear(x, w)
    rows = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(20)])
    for M in range(1, 21):
        assert torch.equal(kernels.linear(x[:M], w), rows[:M]), f"rows differ at M={M}"
    assert torch.equal(out, rows) and torch.equal(out[5], torch.zeros(N))
    ref = _q8_reference(x, w)
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    exact = x.double() @ w.dequantize().double().T
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.05  # 8-bit activations: ~1% typical
    assert kernels.linear(x.bfloat16(), w).dtype == torch.bfloat16


@pytest.mark.skipif(len(PATHS) < 2, reason="one build on this CPU: nothing to compare")
@pytest.mark.parametrize("fmt", kernels.BLOCK_FORMATS)
def test_int8_activations_give_the_same_bits_on_every_build(fmt):
    """The integer sums are exact and land in the same lanes on every build (VNNI or not), so every
    build, avx512bf16 included, gives the same bits for int8 activations."""
    w = _random_blocks(fmt, 70, 1536 + 32, seed=8).with_activations("int8")  # 49 blocks: an odd tail
    x = torch.randn(11, w.cols, generator=torch.Generator().manual_seed(3))
    results = on_every_build(lambda: kernels.linear(x, w))
    for p in PATHS[1:]:
        assert torch.equal(results[p], results[PATHS[0]]), f"{p} != {PATHS[0]}"


def test_quantize_q8_0_is_ggufs_quantizer():
    """kernels.quantize_q8_0 writes the bytes gguf-py's own Q8_0 quantizer writes (an all-zero block
    included), and bad shapes are errors."""
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(5))
    w[3, :32] = 0
    w[7, 40] = 1e4  # one large element: its block's scale
    q = kernels.quantize_q8_0(w)
    assert (q.fmt, q.shape, q.activations) == ("Q8_0", (48, 96), "int8")
    assert np.array_equal(q.data.numpy(), quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    assert kernels.quantize_q8_0(w, activations="float").activations == "float"
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.quantize_q8_0(torch.randn(4, 40))


@pytest.mark.skipif(len(PATHS) < 2, reason="one build on this CPU: nothing to compare")
@pytest.mark.parametrize("act", ["int8", "int16"])
def test_activation_quantization_edge_values_on_every_build(act):
    """The vector builds quantize a block in registers, the generic build element by element: the
    same codes and scales (int16: and digits) for rounding ties, subnormals, infinities and NaN (a
    NaN is skipped by the maximum and quantizes to 0)."""
    w = _random_blocks("Q8_0", 32, 128, seed=9).with_activations(act)
    w = w.interleaved() if act == "int16" else w
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4))
    x[0, :32] = torch.arange(32) - 15.5  # amax 15.5: codes at exact .5 ties after scaling
    x[0, 31] = 127.0
    x[0, :31] = torch.arange(31) + 0.5  # with amax 127 the scale is 1: every element a tie
    x[1, 32:64] = torch.full((32,), 1e-40)  # subnormal block
    x[2, 64:96] = float("inf")
    x[3, 96:] = float("nan")
    x[4, 0] = float("nan")  # a NaN among finite values: skipped by the block's maximum
    x[5, 40] = -float("inf")
    results = on_every_build(lambda: kernels.linear(x, w))
    for p in PATHS[1:]:
        torch.testing.assert_close(results[p], results[PATHS[0]], rtol=0, atol=0, equal_nan=True, msg=f"{p} != {PATHS[0]}")


@pytest.mark.parametrize("fmt", kernels.X16_FORMATS)
@pytest.mark.parametrize("K,N", [(576, 48), (1536, 32), (96, 16)])
def test_interleaved_rows_are_the_same_weights(fmt, K, N, kpath):
    """Rows interleaved in 16s ("x16"): the same values (dequantized bit for bit), a row's bits never
    depend on the other rows (1..19 rows: every row-block shape), and the product equals the stored
    layout's against the same int8 activations up to fp32 summation order."""
    w = _random_blocks(fmt, N, K, seed=N + K).with_activations("int8")
    wx = w.interleaved()
    assert wx.nbytes == w.nbytes and wx.layout == "x16"
    assert torch.equal(wx.dequantize(), w.dequantize())
    rows = torch.tensor([17 % N, 0, N - 1])
    assert torch.equal(wx.dequantize(rows, torch.bfloat16), w.dequantize(rows).bfloat16())
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(4))
    x[2] = 0
    out = kernels.linear(x, wx)
    for M in range(1, 20):
        assert torch.equal(kernels.linear(x[:M], wx), out[:M]), f"rows differ at M={M}"
    torch.testing.assert_close(out, kernels.linear(x, w), atol=1e-5 * out.abs().max().item(), rtol=1e-5)
    ref = _q8_reference(x, w)
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


@pytest.mark.skipif(len(PATHS) < 2, reason="one build on this CPU: nothing to compare")
@pytest.mark.parametrize("act", ["int8", "int16"])
@pytest.mark.parametrize("fmt", kernels.X16_FORMATS)
def test_interleaved_rows_give_the_same_bits_on_every_build(fmt, act):
    wx = _random_blocks(fmt, 64, 1536 + 32, seed=9).with_activations(act).interleaved()
    x = torch.randn(13, wx.cols, generator=torch.Generator().manual_seed(5))
    results = on_every_build(lambda: kernels.linear(x, wx))
    for p in PATHS[1:]:
        assert torch.equal(results[p], results[PATHS[0]]), f"{p} != {PATHS[0]}"


@pytest.mark.parametrize("fmt", kernels.X16_FORMATS)
@pytest.mark.parametrize("K,N", [(576, 48), (1536, 32), (96, 16)])
def test_int16_activations_are_row_invariant_and_quantize_as_described(fmt, K, N, kpath):
    """Interleaved block weights against 16-bit activations (two int8 digits): a row's bits never depend
    on the other rows (1..20 rows: every row-block shape), the result is the 16-bit codes' product with
    the weights' exact values up to fp32 sums, and two orders of magnitude nearer the exact linear
    than int8 activations."""
    w = _random_blocks(fmt, N, K, seed=N + K + 3).with_activations("int16").interleaved()
    assert (w.activations, w.layout) == ("int16", "x16")
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(6))
    x[3, : K // 2] *= 40  # an outlier block
    x[5] = 0
    x[7, :32] = torch.linspace(-1, 1, 32) * 32512 / 7  # codes near digit boundaries (+-127 * 255 + r)
    out = kernels.linear(x, w)
    for M in range(1, 21):
        assert torch.equal(kernels.linear(x[:M], w), out[:M]), f"rows differ at M={M}"
    assert torch.equal(out[5], torch.zeros(N))
    many = torch.cat((torch.randn(50, K, generator=torch.Generator().manual_seed(7)), x))  # 70 rows: past a pass of 64
    assert torch.equal(kernels.linear(many, w)[50:], out)
    ref = _q8_reference(x, w, qmax=32512)  # the 16-bit codes (the two int8 digits split them exactly)
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    exact = x.double() @ w.dequantize().double().T
    err16 = ((out.double() - exact).norm() / exact.norm()).item()
    err8 = ((kernels.linear(x, w.with_activations("int8")).double() - exact).norm() / exact.norm()).item()
    assert err16 < 1e-4 and err16 < err8 / 50, (err16, err8)
    assert kernels.linear(x.bfloat16(), w).dtype == torch.bfloat16


def test_interleaving_is_checked():
    with pytest.raises(ValueError, match="groups of 16"):
        _random_blocks("Q4_1", 20, 64, seed=1).interleaved()
    with pytest.raises(ValueError, match="groups of 16"):
        _random_blocks("Q8_0", 24, 64, seed=1).interleaved()
    with pytest.raises(ValueError, match="as stored"):
        _random_blocks("Q8_0", 16, 64, seed=1).interleaved().interleaved()
    wx = _random_blocks("Q4_0", 16, 64, seed=1).interleaved()
    with pytest.raises(ValueError, match="before interleaving"):
        wx.select_rows(torch.tensor([0]))
    with pytest.raises(ValueError, match="int8 or int16 activations"):
        wx.with_activations("float")
    with pytest.raises(ValueError, match="interleaved"):  # int16 runs on the interleaved layout only
        kernels.linear(torch.randn(1, 64), _random_blocks("Q4_1", 16, 64, seed=1).with_activations("int16"))


def _chain_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The BF16X16 contract in fp64: per output acc = fma(x_k, w_k, acc) in k order, each step rounded
    once to fp32 (bf16 x bf16 products are exact in fp64, and so is their sum with an fp32 acc at
    these magnitudes), then + bias in fp32 and one rounding to x's dtype."""
    xd, wd = x.double(), w.double()
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for k in range(x.shape[1]):
        acc = (acc + xd[:, k, None] * wd[None, :, k]).float().double()
    out = acc.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@pytest.mark.parametrize("K,N", [(576, 48), (1536, 32), (100, 16), (7, 64)])
def test_interleaved_bf16_is_the_chain_of_its_weight_and_row_invariant(K, N, kpath):
    """BF16X16 (16 rows interleaved element by element, for CPUs without bf16 arithmetic): the same
    values (dequantized exactly), every output the documented fma chain over k in order (so no
    build's vector width shows in it), a row's bits never depend on the other rows (1..26 rows: every
    row block of AVX2's 6 and AVX-512's 12), with and without a bias, for bf16 and fp32 inputs."""
    g = torch.Generator().manual_seed(K + N)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16()
    wx = kernels.InterleavedBF16.from_tensor(w)
    assert wx.nbytes == w.numel() * 2 and wx.shape == (N, K) and wx.dtype == kernels.BF16X16
    assert torch.equal(wx.dequantize(dtype=torch.bfloat16), w) and torch.equal(wx.dequantize(), w.float())
    rows = torch.tensor([N - 1, 0, 9, 9])
    assert torch.equal(wx.dequantize(rows, torch.bfloat16), w[rows])
    assert torch.equal(wx.dequantize(rows, torch.float16), w[rows].half())
    x = torch.randn(26, K, generator=g).bfloat16()
    x[4] = 0
    for b in (None, bias):
        out = kernels.linear(x, wx, b)
        assert torch.equal(out, _chain_reference(x, w, b)), "not the fma chain"
        for M in range(1, 27):
            assert torch.equal(kernels.linear(x[:M], wx, b), out[:M]), f"rows differ at M={M}"
        assert torch.equal(kernels.linear(x[5:12], wx, b), out[5:12])
    xf = x.float()
    assert torch.equal(kernels.linear(xf, wx), _chain_reference(xf, w, None))


@pytest.mark.skipif(len(PATHS) < 2, reason="one build on this CPU: nothing to compare")
def test_interleaved_bf16_gives_the_same_bits_on_every_build():
    """One fma chain per output: avx512bf16 (whose bf16 weights as stored take vdpbf16ps), avx512,
    avx2 and generic all give the same bits for this format, at every row count."""
    g = torch.Generator().manual_seed(3)
    wx = kernels.InterleavedBF16.from_tensor((torch.randn(96, 1536 + 8, generator=g) / 40).bfloat16())
    x = torch.randn(19, wx.cols, generator=g).bfloat16()
    results = on_every_build(lambda: [kernels.linear(x[:m].contiguous(), wx) for m in (1, 2, 3, 6, 7, 12, 13, 19)])
    for p in PATHS[1:]:
        for a, b in zip(results[p], results[PATHS[0]]):
            assert torch.equal(a, b), f"{a.shape[0]} rows: {p} != {PATHS[0]}"


def test_interleaved_bf16_is_checked():
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.InterleavedBF16.from_tensor(torch.randn(24, 32))
    with pytest.raises(ValueError, match="groups of 16"):
        kernels.InterleavedBF16(20, 32, torch.zeros(20, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous uint8"):
        kernels.InterleavedBF16(16, 32, torch.zeros(16, 32, dtype=torch.uint8))
    wx = kernels.InterleavedBF16.from_tensor(torch.randn(16, 32))
    with pytest.raises(ValueError, match="width"):
        kernels.linear(torch.randn(2, 31), wx)
    with pytest.raises(ValueError, match="out of range"):
        wx.dequantize(torch.tensor([16]))


def test_bf16_models_interleave_where_the_kernels_lack_bf16_arithmetic(tmp_path):
    """load_target's rule (target.interleave_for_this_cpu), as the tests' tiny targets follow it: a bf16
    model's bias-free linears and LM head read BF16X16 copies on every build without bf16 arithmetic,
    never on avx512bf16 nor in fp32; the tied embedding keeps its tensor; the converted model's logits
    are the bf16 model's up to summation order."""
    from dart_core.model import BlockLinear

    path = build_tiny_checkpoint(tmp_path / "qwen2", "qwen2")  # q|k|v biases: that linear stays as it is
    tokens = torch.tensor([5, 9, 11, 40])
    logits = {}
    for p in PATHS:
        previous = kernels.use_path(p)
        try:
            for dt in (torch.bfloat16, torch.float32):
                t = tiny_target(path, dt)
                m = t.model
                lin = (m.layers[0].attention.wo, m.layers[0].feed_forward.w13, m.layers[-1].feed_forward.w2, m.output)
                converted = dt == torch.bfloat16 and not kernels.bf16_arithmetic()
                assert all(isinstance(x, BlockLinear) == converted for x in lin), (p, dt)
                assert isinstance(m.layers[0].attention.wqkv, torch.nn.Linear)
                assert isinstance(m.tok_embeddings.weight, torch.Tensor)
                cache = t.new_cache(8)
                logits[(p, dt)] = m(tokens, torch.arange(4), cache).logits
        finally:
            kernels.use_path(previous)
    for p in PATHS:
        torch.testing.assert_close(logits[(p, torch.bfloat16)], logits[(p, torch.float32)], atol=0.25, rtol=0.05)


def test_int8_activations_reject_float_weights_and_bad_modes():
    with pytest.raises(ValueError, match="activations"):
        _random_blocks("Q4_1", 4, 64, seed=1).with_activations("int4")
    with pytest.raises(ValueError, match="activation mode"):
        kernels.BlockWeight.cat([_random_blocks("Q4_1", 4, 64, seed=1), _random_blocks("Q4_1", 4, 64, seed=2).with_activations("int8")])


@pytest.mark.skipif(len(FP32_CONTRACT) < 2, reason="one fp32-contract build on this CPU: nothing to compare")
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "float16", *kernels.BLOCK_FORMATS])
def test_builds_give_the_same_bits(weights):
    """generic, avx2 and avx512 follow one arithmetic contract: the same linear and attention bits."""
    g = torch.Generator().manual_seed(11)
    K, N = 576, 130
    if weights in kernels.BLOCK_FORMATS:
        w, x = _random_blocks(weights, N, K, seed=5), torch.randn(9, K, generator=g)
    else:
        dt = getattr(torch, weights)
        w, x = (torch.randn(N, K, generator=g) / 24).to(dt), torch.randn(9, K, generator=g).to(dt)
    dt = x.dtype
    k_cache, v_cache, rope, _ = _attention_setup(dt, 300, 9, 3, 64)
    tree = random_tree(random.Random(4), 7, 50)
    q, k, v = (torch.randn(len(tree), n * 64, generator=g).to(dt) for n in (9, 3, 3))
    # fp32 activations also over an fp16 cache (the GGUF paths with integer activations)
    caches = [(k_cache, v_cache)] + ([(k_cache.half(), v_cache.half())] if dt == torch.float32 else [])

    def run():
        att = [
            kernels.tree_attention(q, k, v, rope, tree.depths + P, kc.clone(), vc.clone(), P, tree.parents, 9, 3)
            for kc, vc in caches
            for P in (37, 300)  # the one-pass attention, and the three passes past ATT_PASSES_FROM
        ]
        # every row count has its own register blocking on some build (1, 2, 3-6 and more rows)
        return [kernels.linear(x[:m].contiguous(), w) for m in (1, 2, 3, 4, 5, 6, 9)], att

    results = on_every_build(run, FP32_CONTRACT)
    first = FP32_CONTRACT[0]
    for p in FP32_CONTRACT[1:]:
        for a, b in zip(results[p][0], results[first][0]):
            assert torch.equal(a, b), f"linear of {a.shape[0]} rows: {p} != {first}"
        for a, b in zip(results[p][1], results[first][1]):
            assert torch.equal(a, b), f"attention ({a.dtype} activations): {p} != {first}"


def test_forced_path_is_reported_and_checked(monkeypatch):
    """DART_CPU_KERNELS picks the build in a fresh process; an unknown or unrunnable one is an error."""
    import subprocess
    import sys

    code = "from dart_core import kernels; print(kernels.PATH, kernels.describe())"
    for p in PATHS:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DART_CPU_KERNELS": p}, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == p and "forced" in out.stdout
    bad = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DART_CPU_KERNELS": "sse9"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "DART_CPU_KERNELS='sse9'" in bad.stderr
    with pytest.raises(ValueError):
        kernels.use_path("sse9")


def test_bad_kernel_inputs_are_errors():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError):
        kernels.linear(torch.randn(2, 15), w)
    with pytest.raises(TypeError):
        kernels.linear(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError):
        kernels.linear(torch.randn(2, 16), w.to(torch.bfloat16))
    with pytest.raises(ValueError):  # a block weight of another width
        kernels.linear(torch.randn(2, 64), _random_blocks("Q4_1", 3, 32, seed=0))
    with pytest.raises(ValueError):  # bytes that do not make whole rows of blocks
        kernels.BlockWeight("Q4_1", 3, 32, torch.zeros(3, 19, dtype=torch.uint8))
    with pytest.raises(ValueError):
        kernels.BlockWeight("Q5_K", 3, 32, torch.zeros(3, 20, dtype=torch.uint8))
    k_cache, v_cache, rope, _ = _attention_setup(torch.float32)
    q, k, v = torch.randn(2, 6 * 32), torch.randn(2, 2 * 32), torch.randn(2, 2 * 32)
    with pytest.raises(ValueError):  # a parent after its child
        kernels.tree_attention(q, k, v, rope, torch.tensor([37, 38]), k_cache, v_cache, 37, torch.tensor([-1, 1]), 6, 2)
    with pytest.raises(ValueError):  # past the cache
        kernels.tree_attention(q, k, v, rope, torch.tensor([52, 53]), k_cache, v_cache, 52, torch.tensor([-1, 0]), 6, 2)
    for cache in (torch.bfloat16, torch.float64):  # fp32 activations take an fp32 or fp16 cache only
        with pytest.raises(TypeError, match="KV cache"):
            kernels.tree_attention(
                q, k, v, rope, torch.tensor([37, 38]), k_cache.to(cache), v_cache.to(cache), 37, torch.tensor([-1, 0]), 6, 2
            )
    with pytest.raises(TypeError, match="caches must be"):  # the k and v caches of two dtypes
        kernels.tree_attention(q, k, v, rope, torch.tensor([37, 38]), k_cache.half(), v_cache, 37, torch.tensor([-1, 0]), 6, 2)
    with pytest.raises(TypeError, match="KV cache"):  # an fp32 cache beside fp16 activations
        kernels.tree_attention(
            q.half(), k.half(), v.half(), rope, torch.tensor([37, 38]), k_cache, v_cache, 37, torch.tensor([-1, 0]), 6, 2
        )


@pytest.mark.parametrize("dtype,cache_dtype", ATT_DTYPES, ids=ATT_IDS)
def test_tree_verify_is_bit_identical_to_steps(tiny_ckpt, dtype, cache_dtype, kpath):
    """Layer-level exactness on tiny Llama / Qwen2 / Qwen3 (GQA, biases, q/k norm): every node's
    logits and captured hidden states equal the one-token steps' bit for bit, trees up to 64 rows
    (also over an fp16 cache beside fp32 activations, as the GGUF paths with integer ones run)."""
    _, path = tiny_ckpt
    target = tiny_target(path, dtype)
    target.cache_dtype = cache_dtype
    assert target.model.kernel_path(1, torch.device("cpu")) and target.new_cache(4).k.dtype == cache_dtype
    rng = random.Random(7)
    for n in (2, 9, 17, kernels.MAX_ROWS):
        tree = random_tree(rng, n, 96)
        prompt = [rng.randrange(4, 96) for _ in range(11)]
        assert node_logits_equal_steps(target, prompt, tree) == [], f"{n}-node tree"


@pytest.mark.parametrize("dtype,cache_dtype", ATT_DTYPES, ids=ATT_IDS)
def test_kernel_prefill_gives_each_prompt_row_its_one_token_step(tiny_ckpt, dtype, cache_dtype, kpath):
    """A prompt of more than the kernels' rows prefilled in kernel forwards of MAX_ROWS rows
    (model.kernel_prefill): the keys and values it writes, every row's captured hidden states and the
    last row's logits are the one-token steps' bit for bit (a chunk boundary and a partial last chunk
    included); without kernel_prefill the prompt runs one eager forward."""
    _, path = tiny_ckpt
    target = tiny_target(path, dtype)
    target.cache_dtype = cache_dtype
    rng = random.Random(11)
    prompt = [rng.randrange(4, 96) for _ in range(2 * kernels.MAX_ROWS + 9)]
    n = len(prompt)
    target.model.kernel_prefill = True
    chunked = target.new_cache(n + 4)
    out = target.prefill(prompt, chunked, capture=True)
    assert chunked.length == 0  # left pending, as any prefill
    steps = target.new_cache(n + 4)
    hidden = []
    for i, tok in enumerate(prompt):
        step = target.model(torch.tensor([tok]), torch.tensor([i]), steps, None, capture=True)
        hidden.append(step.hidden)
        steps.commit(1)
    assert torch.equal(out.logits[0], step.logits[0])
    assert torch.equal(out.hidden, torch.cat(hidden))
    assert torch.equal(chunked.k[:, :, :, :n], steps.k[:, :, :, :n]) and torch.equal(chunked.v[:, :, :, :n], steps.v[:, :, :, :n])
    calls = []
    forward = target.model.forward
    target.model.forward = lambda tokens, *a, **k: calls.append(len(tokens)) or forward(tokens, *a, **k)
    try:
        target.prefill(prompt, target.new_cache(n + 4), capture=False)
        target.model.kernel_prefill = False
        target.prefill(prompt, target.new_cache(n + 4), capture=False)
    finally:
        del target.model.forward
    assert calls == [kernels.MAX_ROWS, kernels.MAX_ROWS, 9, n]


@pytest.mark.slow
def test_embedded_bf16_tree_verify_is_bit_identical(embedded_bf16):
    tree = random_tree(random.Random(2), 9, 49152)
    prompt = embedded_bf16.encode("Name three rivers in Europe.")
    assert node_logits_equal_steps(embedded_bf16, prompt, tree) == []


@pytest.fixture(scope="module")
def embedded_bf16_other_layout(embedded_bf16, embedded_on):
    """The embedded model in bf16 loaded on the avx2 build, as an AVX2 CPU loads it (BF16X16 linears),
    for machines whose best build multiplies bf16 in hardware: their embedded_bf16 reads the weights
    as stored, and this one tests the AVX2 machines' model there. Elsewhere embedded_bf16 already is
    this model (skipped)."""
    if not kernels.bf16_arithmetic() or "avx2" not in PATHS:
        pytest.skip("the embedded bf16 fixture already reads BF16X16 here (no bf16 arithmetic)")
    previous = kernels.use_path("avx2")
    try:
        target = embedded_on("bfloat16")
    finally:
        kernels.use_path(previous)
    assert kernels.BF16X16 in target.weights
    return target


@pytest.mark.slow
@pytest.mark.parametrize("path", ["avx2", "avx512bf16"])
def test_embedded_bf16x16_is_lossless_on_every_build(embedded_bf16_other_layout, path):
    """The embedded model's BF16X16 copy (what AVX2 CPUs run): verifies equal the one-token steps bit
    for bit, and DART's greedy output equals plain decoding's, on the avx2 build and on avx512bf16."""
    from dart_core import ARDrafter, GenerationParams, complete
    from dart_core.drafters import DEFAULT_DART_HEAD, DEFAULT_NGRAM
    from dart_core.drafters.dart import load_dart_drafter

    if path not in PATHS:
        pytest.skip(f"no {path} build runs here")
    target = embedded_bf16_other_layout
    previous = kernels.use_path(path)
    try:
        tree = random_tree(random.Random(5), 9, 49152)
        assert node_logits_equal_steps(target, target.encode("Name three rivers in Europe."), tree) == []
        drafter = load_dart_drafter(DEFAULT_DART_HEAD, target, DEFAULT_NGRAM)
        for prompt in EXACT_PROMPTS[:2]:
            ids = target.encode(prompt)
            ar = complete(target, ids, ARDrafter(), GenerationParams(64))
            s = complete(target, ids, drafter, GenerationParams(64))
            assert s.output_ids == ar.output_ids, prompt
            assert sum(s.accepted) > 0
    finally:
        kernels.use_path(previous)


EXACT_PROMPTS = [
    "List three uses of a paperclip.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell in all?",
    "Summarize in two sentences: The city council voted on Tuesday to extend the bus network to the airport.",
]


@pytest.fixture(scope="module")
def embedded_bf16_plain(embedded_bf16):
    """Plain decoding's output ids of each EXACT_PROMPTS prompt on the embedded bf16 target (96 new
    tokens), decoded once for both heads' checks (the same computation either way)."""
    from dart_core import ARDrafter, GenerationParams, complete

    return {p: complete(embedded_bf16, embedded_bf16.encode(p), ARDrafter(), GenerationParams(96)).output_ids for p in EXACT_PROMPTS}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dart", "eagle3"])
def test_embedded_heads_are_bitwise_lossless_in_bf16(embedded_bf16, embedded_bf16_plain, method):
    """The committed heads in bf16: greedy output ids equal plain decoding's on every prompt."""
    from dart_core import GenerationParams, complete
    from dart_core.drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD, DEFAULT_NGRAM
    from dart_core.drafters.dart import load_dart_drafter
    from dart_core.drafters.eagle3 import load_eagle3_drafter

    if method == "dart":
        drafter = load_dart_drafter(DEFAULT_DART_HEAD, embedded_bf16, DEFAULT_NGRAM)
    else:
        drafter = load_eagle3_drafter(DEFAULT_EAGLE3_HEAD, embedded_bf16)
    for prompt in EXACT_PROMPTS:
        s = complete(embedded_bf16, embedded_bf16.encode(prompt), drafter, GenerationParams(96))
        assert s.output_ids == embedded_bf16_plain[prompt], prompt
        assert sum(s.accepted) > 0  # the heads really drafted


ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT.parent / "shared" / "data" / "bench"
BENCH_SETS = ["mt_bench", "humaneval", "gsm8k", "alpaca", "qa", "sum"]
# the six bench sets where this checkout sits beside them, else the project's own 20 held-out prompts
EXACT_FILES = [BENCH_DIR / f"{s}.jsonl" for s in BENCH_SETS] if BENCH_DIR.is_dir() else [ROOT / "assets" / "eval_prompts.jsonl"]
# 4 prompts a set in the suite (24 prompts x 3 methods x 128 tokens, ~3 of CI's minutes); the bench runs
# of docs/benchmarks.md check the first 10 of each set in every run ("same ids as ar")
EXACT_PER_FILE = 4 if BENCH_DIR.is_dir() else 20
EXACT_NEW_TOKENS = 128


@pytest.fixture(scope="module")
def embedded_int16(embedded_on):
    """The embedded model on the weights path `--dtype auto` has chosen on both CPU kinds measured
    (gguf-int16). Fixed rather than calibrated, so the test does not depend on the machine's timings;
    the bf16 path keeps its own end-to-end test above. On an AVX2-only CPU its one-row step costs half
    of bf16's, which took this check (60 prompts x 3 methods x 128 tokens) from 545 to 361 s there."""
    from dart_core.loading import GGUF_INT16

    return embedded_on(GGUF_INT16)


@pytest.fixture(scope="module")
def embedded_drafters(embedded_int16):
    """DART and EAGLE3 built as the bench builds them by default (embedded heads, CPU tree size)."""
    from dart_core.cli.bench import parse_args
    from dart_core.cli.options import drafter_configs
    from dart_core.drafters.registry import build_drafter

    configs = drafter_configs(parse_args(["--methods", "ar,dart,eagle3", "--dataset", *map(str, EXACT_FILES)]), default_target=True)
    return {m: build_drafter(m, embedded_int16, configs[m]) for m in ("dart", "eagle3")}


@pytest.mark.slow
@pytest.mark.parametrize("path", EXACT_FILES, ids=[p.stem for p in EXACT_FILES])
def test_embedded_heads_match_ar_on_bench_prompts(embedded_int16, embedded_drafters, path):
    """The bench's own check as a test: first turns, 128 new tokens, greedy, the bench's default
    weights path, heads and tree size; DART's and EAGLE3's output ids equal plain decoding's on every
    prompt."""
    from dart_core import ARDrafter, GenerationParams, complete
    from dart_core.tools.bench import read_questions

    params = GenerationParams(EXACT_NEW_TOKENS)
    for q in read_questions(path, EXACT_PER_FILE):
        ids = embedded_int16.encode([{"role": "user", "content": q["turns"][0]}])
        ar = complete(embedded_int16, ids, ARDrafter(), params).output_ids
        for method, drafter in embedded_drafters.items():
            assert complete(embedded_int16, ids, drafter, params).output_ids == ar, (path.stem, q["question_id"], method)


def _stack_and_per_op(target, tree, prompt):
    """The same verify through kernels.LayerStack and through the per-op loop: (logits, hidden,
    final, the tree's cache entries) of each."""
    outs = []
    for stack in (True, False):
        target.model.use_layer_stack = stack
        try:
            cache = target.new_cache(len(prompt) + len(tree) + 4)
            target.prefill(prompt, cache, capture=False)
            cache.commit(len(prompt))
            P = cache.length
            tokens, positions = tree.tokens, tree.depths + P
            r = target.model(tokens, positions, cache, capture=True, final=True, parents=tree.parents)
            outs.append(
                (r.logits, r.hidden, r.final, cache.k[:, :, :, P : P + len(tree)].clone(), cache.v[:, :, :, P : P + len(tree)].clone())
            )
        finally:
            target.model.use_layer_stack = True
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_stack_is_the_per_op_loop(tiny_ckpt, dtype, kpath):
    """The decoder layers as one C++ call give the per-op loop's bits: logits, captured and final
    hidden states, and the keys/values written (tiny Llama and Qwen2 with q|k|v biases; Qwen3's q/k
    norms keep the per-op loop, so both sides are that loop there)."""
    arch, path = tiny_ckpt
    target = tiny_target(path, dtype)
    rng = random.Random(11)
    for n in (1, 6, 17):
        tree, prompt = random_tree(rng, n, 96), [rng.randrange(4, 96) for _ in range(9)]
        (a, b) = _stack_and_per_op(target, tree, prompt)
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y), f"{arch} {dtype} {n} nodes"
    assert (target.model._stack is None) == (arch == "qwen3")


def _decode_rows_against_alone(target, prompts, steps: int, capacity: int = 40):
    """Decode `steps` tokens for every prompt at once with Transformer.decode_rows, and each prompt
    alone with one-token steps; yields (row, batched output, alone output, row's cache, alone cache)."""
    from dart_core.model import RowCache

    model, a = target.model, target.model.args
    rows = RowCache(a.n_layers, a.n_kv_heads, a.head_dim, len(prompts), capacity, target.cache_dtype, "cpu")
    alone = []
    for b, p in enumerate(prompts):
        cache = target.new_cache(capacity)
        target.prefill(p, cache, capture=False)
        cache.commit(len(p))
        rows.load(b, cache)
        alone.append(cache)
    tokens = torch.tensor([p[-1] for p in prompts])
    for _ in range(steps):
        out = model.decode_rows(tokens, rows, capture=True, final=True)
        for b, cache in enumerate(alone):
            one = model(tokens[b : b + 1], torch.tensor([cache.length]), cache, capture=True, final=True, parents=torch.tensor([-1]))
            yield b, out, one, rows, cache
            cache.commit(1)
        rows.commit()
        tokens = out.logits.argmax(-1)


@pytest.mark.parametrize("dtype,cache_dtype", ATT_DTYPES, ids=ATT_IDS)
def test_decode_rows_are_one_sequence_steps(tiny_ckpt, dtype, cache_dtype, kpath):
    """Continuous batching's forward (Transformer.decode_rows: the corpus generator's): each row of
    separate sequences of different lengths gets the bits of plain decoding's one-token step of that
    sequence alone (logits, final states, the keys and values written), on the layer stack (Llama,
    Qwen2) and the per-op loop (Qwen3's q/k norms)."""
    arch, path = tiny_ckpt
    target = tiny_target(path, dtype)
    target.cache_dtype = cache_dtype
    rng = random.Random(13)
    prompts = [[rng.randrange(4, 96) for _ in range(n)] for n in (3, 9, 1, 14)]
    for b, out, one, rows, cache in _decode_rows_against_alone(target, prompts, steps=4):
        n = cache.length
        assert torch.equal(out.logits[b], one.logits[0]) and torch.equal(out.final[b], one.final[0]), f"{arch} {dtype} row {b}"
        assert torch.equal(rows.k[:, b, :, : n + 1], cache.k[:, 0, :, : n + 1]) and torch.equal(
            rows.v[:, b, :, : n + 1], cache.v[:, 0, :, : n + 1]
        )


def test_decode_rows_eager_path_agrees(tiny_ckpt):
    """Without the kernels (use_kernels off: another device, no compiler) decode_rows pads every row
    to the longest and masks: the same next tokens, logits within fp32 rounding."""
    _, path = tiny_ckpt
    target = tiny_target(path)
    target.model.use_kernels = False
    rng = random.Random(17)
    prompts = [[rng.randrange(4, 96) for _ in range(n)] for n in (5, 2, 11)]
    for b, out, one, _, _ in _decode_rows_against_alone(target, prompts, steps=3):
        torch.testing.assert_close(out.logits[b], one.logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["gguf", "gguf-int16"])  # an fp32 KV cache, and fp16 beside int16 activations
def test_layer_stack_on_the_embedded_gguf_with_capture(weights, kpath, embedded_on):
    """The embedded target on its GGUF blocks (Q4_1 layers), the three captured layers included (loaded
    as on this build: embedded_on)."""
    target = embedded_on(weights)
    assert target.model.capture, "the embedded target captures three layers"
    rng = random.Random(5)
    tree, prompt = random_tree(rng, 9, 49152), [rng.randrange(49152) for _ in range(40)]
    a, b = _stack_and_per_op(target, tree, prompt)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_layer_stack_follows_a_dtype_change(tmp_path):
    """`model.to()` moves every weight: the plan of raw pointers is rebuilt, not reused."""
    from dart_core.model import KVCache

    target = tiny_target(build_tiny_checkpoint(tmp_path, "llama"))
    model, args = target.model, target.model.args
    tree = random_tree(random.Random(3), 5, 96)
    model(tree.tokens, tree.depths, target.new_cache(32), parents=tree.parents)
    first = model._stack
    assert first is not None and not first.stale()
    model.to(torch.bfloat16)
    assert first.stale()
    cache = KVCache(args.n_layers, args.n_kv_heads, args.head_dim, 32, torch.bfloat16, "cpu")
    out = model(tree.tokens, tree.depths, cache, parents=tree.parents)
    assert model._stack is not first and model._stack.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()


def test_bf16_prompt_prefill_in_fp32(tiny_ckpt):
    """Where the CPU has no bf16 arithmetic a bf16 model's prompt runs in fp32 (weights converted per
    call, keys and values stored in the bf16 cache): close to the bf16 prefill, and verifies after it
    still equal the one-token steps bit for bit."""
    from dart_core.model import default_prefill_dtype

    _, path = tiny_ckpt
    target = tiny_target(path, torch.bfloat16)
    want = torch.float32 if default_prefill_dtype() == torch.float32 else None
    assert target.model.prefill_dtype == want
    prompt = [(7 * i + 3) % (TINY_VOCAB - 5) + 5 for i in range(kernels.MAX_ROWS + 40)]  # past the kernels' rows: the eager prefill
    outs = {}
    for pdt in (None, torch.float32):
        target.model.prefill_dtype = pdt
        cache = target.new_cache(len(prompt) + 4)
        out = target.prefill(prompt, cache, capture=True)
        assert cache.k.dtype == torch.bfloat16 and out.logits.dtype == torch.float32 and out.hidden.dtype == torch.bfloat16
        outs[pdt] = out.logits
    torch.testing.assert_close(outs[torch.float32], outs[None], atol=0.15, rtol=0.05)
    tree = random_tree(random.Random(3), 7, TINY_VOCAB)
    assert node_logits_equal_steps(target, prompt, tree) == []
