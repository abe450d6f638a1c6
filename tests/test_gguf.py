"""The embedded default read in its own GGUF blocks (`--dtype gguf`): every weight is exactly the value
of the file's fp32 copy, a forward is bit for bit the fp32 copy's forward on the kernels, a verified tree
equals one-token steps on every kernel build the CPU runs, and bad files are clear errors."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from dart_core import kernels
from dart_core.gguf_checkpoint import load_gguf_transformer
from dart_core.loading import GGUF, GGUF_INT8, GGUF_INT16, embedded_gguf_path, ensure_embedded_model
from dart_core.model import BlockEmbedding, BlockLinear

from support import node_logits_equal_steps, random_tree

pytestmark = [
    pytest.mark.slow,  # the embedded model on its GGUF weights, each path
    pytest.mark.skipif(not kernels.AVAILABLE, reason="GGUF weights run on the CPU kernels, which were not built"),
]

# The fp32-contract builds a full-model test can afford (the generic build is the scalar reference:
# the layer-level tests cover it).
FAST_PATHS = [p for p in kernels.runnable_paths() if p != "generic"]


@pytest.fixture(scope="module")
def gguf_target(embedded_on):
    return embedded_on(GGUF)


@pytest.fixture(scope="module")
def fp32_target(embedded_on):
    return embedded_on("float32")


def test_blocks_are_the_fp32_copy(gguf_target, fp32_target):
    """Every linear, the embedding and the norms: the GGUF blocks (q/k rows un-permuted from llama.cpp's
    rotary layout) dequantize to the fp32 copy transformers made of the same file, bit for bit."""
    g, f = gguf_target.model, fp32_target.model
    n_block = 0
    for name, mod in g.named_modules():
        if isinstance(mod, (BlockLinear, BlockEmbedding)):
            assert torch.equal(mod.weight.dequantize(), f.get_submodule(name).weight), name
            n_block += 1
    assert n_block == 4 * g.args.n_layers + 2  # wqkv, wo, w13, w2 per layer; embedding; output (tied)
    ids = torch.arange(0, g.args.vocab_size, 7)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # a draft head's embeddings: rounded as .to rounds
        assert torch.equal(g.embed(ids, dtype), f.tok_embeddings(ids).to(dtype)) and torch.equal(f.embed(ids, dtype), g.embed(ids, dtype))
    for name, p in g.named_parameters():
        assert torch.equal(p, f.get_parameter(name)), name
    assert gguf_target.weights == "gguf (Q4_1, Q8_0)" and gguf_target.dtype == gguf_target.cache_dtype == torch.float32
    # the exact path's prompt prefill multiplies in fp32 on every CPU (bf16 GEMMs are gguf-int8's)
    assert all(m.gemm_dtype == torch.float32 for m in g.modules() if isinstance(m, BlockLinear)) and g.prefill_dtype is None
    block_bytes = sum(m.weight.nbytes for m in g.modules() if isinstance(m, BlockLinear) and m is not g.output)
    assert block_bytes + g.tok_embeddings.weight.nbytes < 0.4 * sum(t.numel() for t in f.state_dict().values()) * 4


@pytest.mark.parametrize("path", FAST_PATHS)
def test_gguf_forward_is_the_fp32_forward(gguf_target, fp32_target, path):
    """Prefill, steps and a tree verify on the blocks give the fp32 copy's logits and hidden states
    bit for bit (the prefill's fp32 GEMMs; the verify on each fast kernel build)."""
    previous = kernels.use_path(path)
    try:
        prompt = gguf_target.encode("Name three rivers in Europe.")
        tree = random_tree(random.Random(9), 9, gguf_target.vocab_size)
        outs = []
        for t in (gguf_target, fp32_target):
            cache = t.new_cache(len(prompt) + 16)
            t.prefill(prompt, cache, capture=False)
            cache.commit(len(prompt))
            outs.append(t.verify(tree, cache, capture=True))
        assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
        assert node_logits_equal_steps(gguf_target, prompt, tree) == []
    finally:
        kernels.use_path(previous)


def test_gguf_generation_is_lossless(gguf_target):
    """DART and EAGLE3 on the GGUF target: greedy ids equal plain decoding's, and plain decoding's equal
    the fp32 copy's (the same arithmetic)."""
    from dart_core import ARDrafter, GenerationParams, complete
    from dart_core.drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD, DEFAULT_NGRAM
    from dart_core.drafters.dart import load_dart_drafter
    from dart_core.drafters.eagle3 import load_eagle3_drafter

    drafters = [load_dart_drafter(DEFAULT_DART_HEAD, gguf_target, DEFAULT_NGRAM), load_eagle3_drafter(DEFAULT_EAGLE3_HEAD, gguf_target)]
    for prompt in ("List three uses of a paperclip.", "Write a Python function that returns the n-th Fibonacci number."):
        ids = gguf_target.encode(prompt)
        ar = complete(gguf_target, ids, ARDrafter(), GenerationParams(64))
        for d in drafters:
            s = complete(gguf_target, ids, d, GenerationParams(64))
            assert s.output_ids == ar.output_ids, (prompt, type(d).__name__)
            assert sum(s.accepted) > 0


@pytest.fixture(scope="module")
def gguf_int8_target(embedded_on):
    return embedded_on(GGUF_INT8)


@pytest.fixture(scope="module")
def gguf_int16_target(embedded_on):
    return embedded_on(GGUF_INT16)


QUANTIZED = {GGUF_INT8: "gguf_int8_target", GGUF_INT16: "gguf_int16_target"}


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("path", FAST_PATHS)
def test_gguf_quantized_verify_equals_steps(dtype, path, request):
    """With int8 or int16 activations the forward is no longer the fp32 copy's, but every node of a
    verified tree still gets the bits of the one-token steps along its path (on each fast kernel build)."""
    t = request.getfixturevalue(QUANTIZED[dtype])
    previous = kernels.use_path(path)
    try:
        prompt = t.encode("Name three rivers in Europe.")
        tree = random_tree(random.Random(5), 9, t.vocab_size)
        assert node_logits_equal_steps(t, prompt, tree) == []
    finally:
        kernels.use_path(previous)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_gguf_quantized_generation_is_lossless(dtype, fp32_target, request):
    """DART's and EAGLE3's greedy ids equal plain decoding's on the int8- and int16-activation paths,
    and plain decoding stays close to the fp32 copy's (teacher-forced top-1 on its greedy text; int16
    closer: its logits within 1e-3 of the fp32 copy's on the continuation)."""
    from dart_core import ARDrafter, GenerationParams, complete
    from dart_core.drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD, DEFAULT_NGRAM
    from dart_core.drafters.dart import load_dart_drafter
    from dart_core.drafters.eagle3 import load_eagle3_drafter
    from dart_core.tools.fidelity import teacher_forced_agreement

    t = request.getfixturevalue(QUANTIZED[dtype])
    act = dtype.removeprefix("gguf-")
    assert t.weights == f"{dtype} (Q4_1, Q8_0; {act} activations; fp16 KV cache)"
    assert t.cache_dtype == torch.float16 and t.new_cache(8).k.dtype == torch.float16
    assert all(m.weight.activations == act and m.weight.layout == "x16" for m in t.model.modules() if isinstance(m, BlockLinear))
    # its prompt prefill multiplies in bf16 exactly where the CPU has bf16 arithmetic
    assert t.model.prefill_dtype == (torch.bfloat16 if kernels.PATH == "avx512bf16" else None)
    # the prompt runs in kernel forwards (exact) where they beat the eager prefill's fp32 GEMMs
    assert t.model.kernel_prefill == (not kernels.bf16_arithmetic() if dtype == GGUF_INT8 else kernels.PATH == "avx2")
    drafters = [load_dart_drafter(DEFAULT_DART_HEAD, t, DEFAULT_NGRAM), load_eagle3_drafter(DEFAULT_EAGLE3_HEAD, t)]
    ids = t.encode("List three uses of a paperclip.")
    ar = complete(t, ids, ARDrafter(), GenerationParams(64))
    for d in drafters:
        s = complete(t, ids, d, GenerationParams(64))
        assert s.output_ids == ar.output_ids, type(d).__name__
        assert sum(s.accepted) > 0
    ref = complete(fp32_target, ids, ARDrafter(), GenerationParams(64)).output_ids
    agree = teacher_forced_agreement(fp32_target, t, ids, ref)
    assert agree.positions == len(ref) and agree.top1 >= 0.95
    if dtype == GGUF_INT16:  # 16-bit activations: ~100x closer than int8's ~5e-2 (the prefill's bf16 GEMMs dominate)
        assert agree.max_rel_logit_error < (2e-2 if t.model.prefill_dtype == torch.bfloat16 else 1e-3)


def test_int8_path_with_some_fp32_inputs(gguf_target, gguf_int8_target):
    """--float-inputs' diagnostic path: the named linears read the gguf path's fp32 inputs (the same
    bits as there on the same input), the others stay int8, and a verified tree still equals steps."""
    from dart_core import load_target
    from dart_core.target import weights_spec

    t = load_target("default", "cpu", GGUF_INT8, float_inputs=("w2", "head"))
    assert t.weights == "gguf-int8 (Q4_1, Q8_0; int8 activations (fp32 inputs to w2, head); fp16 KV cache)"
    layer, exact, int8 = t.model.layers[3], gguf_target.model.layers[3], gguf_int8_target.model.layers[3]
    assert layer.feed_forward.w2.weight.activations == "float" and t.model.output.weight.activations == "float"
    assert layer.attention.wqkv.weight.activations == "int8" and layer.attention.wqkv.weight.layout == "x16"
    x = torch.randn(3, exact.feed_forward.w2.weight.shape[1], generator=torch.Generator().manual_seed(0))
    same = kernels.linear(x, layer.feed_forward.w2.weight)
    assert torch.equal(same, kernels.linear(x, exact.feed_forward.w2.weight))
    assert not torch.equal(same, kernels.linear(x, int8.feed_forward.w2.weight))
    prompt = t.encode("Name three rivers in Europe.")
    assert node_logits_equal_steps(t, prompt, random_tree(random.Random(6), 7, t.vocab_size)) == []
    with pytest.raises(ValueError, match="int8-activations path"):
        load_target("default", "cpu", GGUF_INT8, float_inputs=("lm_head",))
    with pytest.raises(ValueError, match="apply to --dtype gguf-int8"):
        load_target("default", "cpu", GGUF, float_inputs=("w2",))
    # the diagnostics' names for such paths (dart-kernels --time, fidelity --float-inputs)
    assert weights_spec("gguf-int8+fp32:w2+head") == (GGUF_INT8, ("w2", "head")) and weights_spec("bfloat16") == ("bfloat16", ())
    for bad in ("gguf+fp32:w2", "gguf-int8+fp32:", "gguf-int8+fp32:lm_head", "int4"):
        with pytest.raises(ValueError, match="weights path"):
            weights_spec(bad)


def test_bad_gguf_files_are_clear_errors(tmp_path):
    from dart_core import load_target

    src = embedded_gguf_path()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: 4 << 20])  # the header and metadata, not all the tensor data
    with pytest.raises(Exception) as e:
        load_gguf_transformer(cut, ensure_embedded_model())
    assert e.type is not AttributeError, e.value  # a reader error about the file, not a crash of ours
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(Exception):
        load_gguf_transformer(junk, ensure_embedded_model())
    # a config that does not match the file's tensors
    other = tmp_path / "other"
    shutil.copytree(ensure_embedded_model(), other)
    cfg = (other / "config.json").read_text().replace('"intermediate_size": 1536', '"intermediate_size": 1024')
    (other / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="config implies"):
        load_gguf_transformer(src, other)
    with pytest.raises(ValueError, match="embedded default"):
        load_target(str(other), "cpu", GGUF)
