"""A Transformer (dart_core/model.py) whose linears and embedding read a GGUF file's blocks as they
are (the embedded default's own weights: Q4_1 and Q8_0), config and RoPE from the HF directory
converted from the same file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from . import kernels
from .hf_checkpoint import rope_parameters
from .model import BlockEmbedding, BlockLinear, ModelArgs, Transformer, default_prefill_dtype


def _gguf_rows(t, name: str) -> kernels.BlockWeight | torch.Tensor:
    """One GGUF tensor as a BlockWeight (block formats) or an fp32 tensor (F32/F16/BF16), rows = outputs."""
    import numpy as np

    fmt = t.tensor_type.name
    cols = int(t.shape[0])  # GGUF shapes list the innermost (contiguous) dimension first
    rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    data = torch.from_numpy(np.array(t.data, copy=True))
    if fmt in kernels.BLOCK_FORMATS:
        return kernels.BlockWeight(fmt, rows, cols, data.reshape(rows, -1).contiguous())
    if fmt in ("F32", "F16", "BF16"):
        if fmt == "BF16":
            data = data.view(torch.int16).view(torch.bfloat16)
        return data.float().reshape(*reversed([int(s) for s in t.shape]))
    raise ValueError(f"{name}: GGUF type {fmt} is not supported (block formats: {', '.join(kernels.BLOCK_FORMATS)}; F32/F16/BF16)")


def _unpermute_rope_rows(n_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's converter permutation of q/k (pairs interleaved per head for
    its rotary layout) back to the HF rotate-half order: HF row (h, j, i) is GGUF row h*hd + 2i + j."""
    return torch.arange(n_heads * head_dim).view(n_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


# The linears whose inputs can be kept in fp32 on an int8-activations path (load_gguf_transformer's
# float_inputs): each layer's q|k|v, o, gate|up and down projections, and the LM head.
FLOAT_INPUT_LINEARS = ("wqkv", "wo", "w13", "w2", "head")


def load_gguf_transformer(
    gguf_path: Path,
    model_dir: Path,
    prefill_dtype: torch.dtype | None = None,
    activations: str = "float",
    float_inputs: tuple[str, ...] = (),
) -> Transformer:
    """A Transformer whose linears and embedding read the GGUF's blocks as they are (no unpacked copy)
    and whose norms are its F32 tensors; config and RoPE from the HF directory `model_dir` that was
    converted from the same file. Activations and the KV cache are fp32, so every forward on the
    kernels is bit-identical to the same forward on the file's dequantized fp32 copy; with
    activations="int8" or "int16" the kernels' linears quantize their inputs per block
    (kernels.ACTIVATIONS) and are no longer exact, still batch-invariant; the linears named in float_inputs
    (FLOAT_INPUT_LINEARS) keep fp32 inputs there (a diagnostic of where int8 costs fidelity:
    dart_core/cli/fidelity.py --float-inputs). Prefill's GEMMs are prefill_dtype's (default:
    default_prefill_dtype()), whatever the activations."""
    import gguf
    from transformers import AutoConfig

    if not kernels.AVAILABLE:
        raise RuntimeError("GGUF weights run on the CPU kernels, which are not built here (pip install -e . builds them)")
    cfg = json.loads((model_dir / "config.json").read_text())
    args = ModelArgs.from_hf_config(cfg)
    if args.arch != "llama" or args.qkv_bias or args.qk_norm:
        raise ValueError(f"GGUF weights are read for llama-architecture targets, not {args.arch}")
    inv_freq, rope_scale = rope_parameters(AutoConfig.from_pretrained(str(model_dir)))
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    used: set[str] = set()
    gemm = prefill_dtype or default_prefill_dtype()

    def get(name: str):
        if name not in tensors:
            raise ValueError(f"{gguf_path.name} has no tensor {name}")
        used.add(name)
        return _gguf_rows(tensors[name], name)

    if activations not in kernels.ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: choose one of {', '.join(kernels.ACTIVATIONS)}")
    unknown = sorted(set(float_inputs) - set(FLOAT_INPUT_LINEARS))
    if unknown or (float_inputs and activations != "int8"):
        raise ValueError(
            f"float_inputs names linears of an int8-activations path ({', '.join(FLOAT_INPUT_LINEARS)}), got {list(float_inputs)}"
        )

    def block(name: str, role: str, perm: torch.Tensor | None = None) -> kernels.BlockWeight:
        w = get(name)
        if not isinstance(w, kernels.BlockWeight):
            raise ValueError(f"{name}: expected a block format, got {tensors[name].tensor_type.name}")
        return (w if perm is None else w.select_rows(perm)).with_activations("float" if role in float_inputs else activations)

    def layer_weight(w: kernels.BlockWeight) -> kernels.BlockWeight:
        # quantized activations: rows interleaved in 16s (the same bytes), one integer lane a row
        # (int16 runs on that layout only; BlockWeight.interleaved says what it takes)
        if w.activations == "int16" or (w.activations == "int8" and w.fmt in kernels.X16_FORMATS and w.rows % 16 == 0):
            return w.interleaved()
        return w

    with torch.device("meta"):
        model = Transformer(args, torch.empty(args.head_dim // 2), rope_scale)
    H, hd = args.hidden_size, args.head_dim
    embed = block("token_embd.weight", "head")
    if embed.shape != (args.vocab_size, H):
        raise ValueError(f"token_embd.weight is {embed.shape}, the config implies {(args.vocab_size, H)}")
    if "output.weight" in tensors:
        model.tok_embeddings = BlockEmbedding(embed)
        model.output = BlockLinear(layer_weight(block("output.weight", "head")), gemm)
    else:  # tied: one copy, interleaved where the LM head wants it (the lookup reads either layout)
        embed = layer_weight(embed)
        model.tok_embeddings, model.output = BlockEmbedding(embed), BlockLinear(embed, gemm)
    model.norm.weight = nn.Parameter(get("output_norm.weight"), requires_grad=False)
    q_perm, k_perm = _unpermute_rope_rows(args.n_heads, hd), _unpermute_rope_rows(args.n_kv_heads, hd)
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        wqkv = kernels.BlockWeight.cat(
            [block(p + "attn_q.weight", "wqkv", q_perm), block(p + "attn_k.weight", "wqkv", k_perm), block(p + "attn_v.weight", "wqkv")]
        )
        layer.attention.wqkv = BlockLinear(layer_weight(wqkv), gemm)
        layer.attention.wo = BlockLinear(layer_weight(block(p + "attn_output.weight", "wo")), gemm)
        w13 = kernels.BlockWeight.cat([block(p + "ffn_gate.weight", "w13"), block(p + "ffn_up.weight", "w13")])
        layer.feed_forward.w13 = BlockLinear(layer_weight(w13), gemm)
        layer.feed_forward.w2 = BlockLinear(layer_weight(block(p + "ffn_down.weight", "w2")), gemm)
        layer.attention_norm.weight = nn.Parameter(get(p + "attn_norm.weight"), requires_grad=False)
        layer.ffn_norm.weight = nn.Parameter(get(p + "ffn_norm.weight"), requires_grad=False)
        expect = {
            "wqkv": ((args.n_heads + 2 * args.n_kv_heads) * hd, H),
            "wo": (H, args.n_heads * hd),
            "w13": (2 * args.intermediate_size, H),
            "w2": (H, args.intermediate_size),
        }
        got = {
            "wqkv": wqkv.shape,
            "wo": layer.attention.wo.weight.shape,
            "w13": layer.feed_forward.w13.weight.shape,
            "w2": layer.feed_forward.w2.weight.shape,
        }
        for k, v in expect.items():
            if tuple(got[k]) != v:
                raise ValueError(f"layer {i} {k}: GGUF gives {tuple(got[k])}, the config implies {v}")
    unexpected = sorted(set(tensors) - used - {"rope_freqs.weight"})
    if unexpected:
        raise ValueError(f"{gguf_path.name} has tensors this loader does not place, e.g. {unexpected[:5]}")
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise ValueError(f"no GGUF tensor for {leftover[:5]}")
    model.inv_freq = inv_freq.float()
    model.prefill_dtype = gemm if gemm != torch.float32 else None
    return model.eval()
