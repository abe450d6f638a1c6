"""A Transformer (dart_core/model.py) from a Hugging Face checkpoint directory: config.json and
*.safetensors, every tensor name and shape checked, q|k|v and gate|up fused as they load; RoPE's
inverse frequencies from transformers' own initialisers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .model import ModelArgs, Transformer, default_prefill_dtype


def _hf_to_ours(args: ModelArgs) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensors concatenated (on dim 0) to build it."""
    m: dict[str, list[str]] = {
        "tok_embeddings.weight": ["model.embed_tokens.weight"],
        "norm.weight": ["model.norm.weight"],
        "output.weight": ["model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"],
    }
    for i in range(args.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        m[ours + "attention.wqkv.weight"] = [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if args.qkv_bias:
            m[ours + "attention.wqkv.bias"] = [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
        m[ours + "attention.wo.weight"] = [hf + "self_attn.o_proj.weight"]
        if args.qk_norm:
            m[ours + "attention.q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
            m[ours + "attention.k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
        m[ours + "feed_forward.w13.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        m[ours + "feed_forward.w2.weight"] = [hf + "mlp.down_proj.weight"]
        m[ours + "attention_norm.weight"] = [hf + "input_layernorm.weight"]
        m[ours + "ffn_norm.weight"] = [hf + "post_attention_layernorm.weight"]
    return m


# HF checkpoints may carry these; they are recomputed, not loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, on CPU."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                tensors[key] = fh.get_tensor(key)
    return tensors


def rope_parameters(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, computed by transformers' own RoPE initialisers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE type {rope_type!r} (supported: default, linear, llama3, yarn)")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq, float(scale)


def load_transformer(model_dir: Path, dtype: torch.dtype, device: torch.device | str) -> Transformer:
    """Build a Transformer from an HF checkpoint directory, checking every tensor name and shape."""
    from transformers import AutoConfig

    cfg = json.loads((model_dir / "config.json").read_text())
    args = ModelArgs.from_hf_config(cfg)
    inv_freq, rope_scale = rope_parameters(AutoConfig.from_pretrained(str(model_dir)))
    hf = read_safetensors(model_dir)
    with torch.device("meta"):
        model = Transformer(args, torch.empty(args.head_dim // 2), rope_scale)
    mapping = _hf_to_ours(args)
    used: set[str] = set()
    state: dict[str, torch.Tensor] = {}
    for ours, sources in mapping.items():
        missing = [s for s in sources if s not in hf]
        if missing:
            raise ValueError(f"checkpoint {model_dir} is missing tensors {missing}")
        used.update(sources)
        state[ours] = torch.cat([hf[s] for s in sources], dim=0) if len(sources) > 1 else hf[sources[0]]
    unexpected = sorted(k for k in hf if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"checkpoint {model_dir} has unexpected tensors, e.g. {unexpected[:5]}")
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for k, t in state.items():
        if tuple(t.shape) != tuple(expected[k]):
            raise ValueError(f"tensor {k} has shape {tuple(t.shape)}, config implies {tuple(expected[k])}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight  # one tensor, as in the checkpoint
    model.inv_freq = inv_freq.float()
    model = model.to(device).eval()
    if dtype == torch.bfloat16 and model.inv_freq.device.type == "cpu" and default_prefill_dtype() == torch.float32:
        # without bf16 arithmetic torch's bf16 GEMMs are emulated (a 769-token prompt took 5.3 s on
        # AVX2 against ~1.1 s for fp32 GEMMs): the prompt runs in fp32, converting each weight per call
        model.prefill_dtype = torch.float32
    return model
