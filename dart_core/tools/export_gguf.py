"""Export an EAGLE3 head as a GGUF draft model for llama.cpp (`--spec-type draft-eagle3 -md FILE`).

The file is what llama.cpp's own converter (`convert_hf_to_gguf.py HEAD --target-model-dir TARGET`)
writes for a SpecForge `LlamaForCausalLMEagle3` checkpoint, written here with the `gguf` package:

    general.architecture "eagle3"; eagle3.{block_count, context_length, embedding_length,
    feed_forward_length, attention.*, rope.*, vocab_size}; eagle3.target_layers (INT32 array, HF
    hidden_states indices = the three layers whose *input* our capture_layers() reads);
    eagle3.target_hidden_size; eagle3.norm_before_residual / norm_before_fc (false: our head feeds
    the raw fc output to the residual and applies no norm before fc); the target's tokenizer.* KV.
    Tensors (GGUF shapes innermost first): fc.weight [3Ht, H]; blk.0.attn_norm (the embedding's norm,
    our input_layernorm), blk.0.attn_norm_2 (the hidden stream's norm, our hidden_norm),
    blk.0.attn_{q,k,v,output}, blk.0.ffn_{norm,gate,up,down}, output_norm, output [H, Vd] (draft
    vocabulary); d2t I64 [Vd]. No token_embd: llama.cpp takes the target's, as our engine does.

Two things differ from our checkpoint beyond names (see `_rope_rows_interleaved` and `_target_ids`):
q/k rows are permuted for llama.cpp's RoPE layout, and d2t holds absolute target ids, not offsets.

The DART head is not exported: llama.cpp has no loader for it (no mask_rep, no parallel drafting).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from ..drafters.head import IGNORED_KEYS, HeadConfig, expected_shapes, read_state, resolve_head_dir
from ..loading import DEFAULT_MODEL, embedded_gguf_path, resolve_model_dir

ARCH = "eagle3"  # llama.cpp's LLM_ARCH_EAGLE3; PyPI gguf 0.19.0 does not name it, so the keys are spelled out here
GGML_QUANT_VERSION = 2  # general.quantization_version, as llama.cpp's writers set it

# our checkpoint key -> llama.cpp's eagle3 tensor name (src/models/eagle3.cpp, gguf-py TENSOR_NAMES)
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",  # norm of the token embedding
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",  # norm of the fc output / previous state
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
D2T = "d2t"
ROPE_PERMUTED = {"midlayer.self_attn.q_proj.weight": "num_attention_heads", "midlayer.self_attn.k_proj.weight": "num_key_value_heads"}

# --outtype -> (ggml type of the 2-D weights, general.file_type); 1-D tensors (norms) are always F32
OUTTYPES = {
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
}


@dataclass(frozen=True)
class TargetInfo:
    """What the export needs from the target: its shape and its tokenizer metadata as GGUF KV fields."""

    source: str
    n_layers: int
    hidden_size: int
    vocab_size: int  # the target's vocabulary (the head's t2d length)
    n_tokens: int  # tokens in the tokenizer metadata (llama.cpp's vocab size for the draft)
    tokenizer: list[tuple[str, object, GGUFValueType, GGUFValueType | None]]  # (key, value, type, array element type)

    @property
    def target_layers(self) -> list[int]:
        """The three HF hidden_states indices our engine feeds the head: 2, L//2, L-3 (ModelArgs.capture_layers).
        llama.cpp extracts the *input* of target layer i for each, which is HF hidden_states[i]."""
        layers = [2, self.n_layers // 2, self.n_layers - 3]
        if len(set(layers)) != 3 or min(layers) < 1:
            raise ValueError(f"{self.source}: an EAGLE3 target needs at least 7 layers, it has {self.n_layers}")
        return layers


def _field_value(field) -> tuple[object, GGUFValueType, GGUFValueType | None]:
    """A GGUFReader field as (value, type, element type) for GGUFWriter.add_key_value; strings stay raw bytes."""
    vtype = GGUFValueType(field.types[0])
    if vtype == GGUFValueType.ARRAY:
        sub = GGUFValueType(field.types[1])
        if len(field.types) > 2:
            raise ValueError(f"{field.name}: nested GGUF arrays are not supported")
        if sub == GGUFValueType.STRING:
            return [field.parts[i].tobytes() for i in field.data], vtype, sub
        return [field.parts[i].tolist()[0] for i in field.data], vtype, sub
    if vtype == GGUFValueType.STRING:
        return field.parts[field.data[0]].tobytes(), vtype, None
    return field.parts[field.data[0]].tolist()[0], vtype, None


def read_gguf_target(path: str | os.PathLike) -> TargetInfo:
    """Shape and tokenizer metadata of a target GGUF (the file llama.cpp runs as -m)."""
    reader = GGUFReader(str(path))
    fields = reader.fields

    def scalar(key: str):
        if key not in fields:
            raise ValueError(f"{path}: GGUF has no {key!r}")
        return _field_value(fields[key])[0]

    arch = scalar("general.architecture").decode()
    tokenizer = [(k, *_field_value(f)) for k, f in fields.items() if k.startswith("tokenizer.")]
    tokens = next((v for k, v, _, _ in tokenizer if k == "tokenizer.ggml.tokens"), None)
    if tokens is None:
        raise ValueError(f"{path}: GGUF has no tokenizer (tokenizer.ggml.tokens); llama.cpp needs one in the draft file")
    vocab = scalar(f"{arch}.vocab_size") if f"{arch}.vocab_size" in fields else len(tokens)
    return TargetInfo(
        str(path), int(scalar(f"{arch}.block_count")), int(scalar(f"{arch}.embedding_length")), int(vocab), len(tokens), tokenizer
    )


def resolve_target(target: str | os.PathLike, tokenizer_gguf: str | os.PathLike | None = None) -> TargetInfo:
    """`target`: "default" (the embedded GGUF), a .gguf file, or an HF checkpoint dir / hub id.

    The tokenizer metadata is copied from a GGUF of the target. An HF tokenizer is not converted:
    llama.cpp names a BPE pre-tokenizer (tokenizer.ggml.pre) by hashing test tokenizations against a
    table of its own, which we cannot reproduce faithfully; pass a GGUF of the same model instead."""
    if tokenizer_gguf is not None and (str(target) == DEFAULT_MODEL or str(target).endswith(".gguf")):
        raise ValueError("a tokenizer GGUF is only for a Hugging Face target; a GGUF target brings its own tokenizer")
    if str(target) == DEFAULT_MODEL:
        info = read_gguf_target(embedded_gguf_path())
    elif str(target).endswith(".gguf"):
        if not Path(target).is_file():
            raise FileNotFoundError(f"target GGUF {str(target)!r} does not exist")
        info = read_gguf_target(target)
    else:
        cfg = json.loads((resolve_model_dir(target) / "config.json").read_text())
        cfg = {**cfg, **cfg.get("text_config", {})}
        if tokenizer_gguf is None:
            raise ValueError(
                f"target {str(target)!r} is a Hugging Face checkpoint: its tokenizer cannot be written as llama.cpp's "
                "tokenizer metadata faithfully here; pass a GGUF of the same model (--tokenizer-gguf FILE, or give that "
                "GGUF as --model)"
            )
        tok = read_gguf_target(tokenizer_gguf)
        info = TargetInfo(
            str(target), int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["vocab_size"]), tok.n_tokens, tok.tokenizer
        )
    return info


@dataclass(frozen=True)
class Eagle3Checkpoint:
    config: HeadConfig
    raw_config: dict
    state: dict[str, torch.Tensor]
    path: Path


def read_eagle3_head(head_dir: str | os.PathLike) -> Eagle3Checkpoint:
    """An EAGLE3 checkpoint's config and tensors, checked as load_head checks them (without a target)."""
    path = resolve_head_dir(head_dir)
    raw = json.loads((path / "config.json").read_text())
    if "draft_length" in raw:
        raise ValueError(
            f"{path} is a DART head (config.json has draft_length): llama.cpp has no loader for DART heads, "
            "only EAGLE3 heads can be exported"
        )
    c = HeadConfig.from_dict(raw, dart=False)
    if c.double_norm:
        raise ValueError(f"{path}: dart_double_norm (final norm applied twice) has no llama.cpp equivalent")
    for key in ("norm_before_residual", "norm_before_fc"):
        if raw.get(key):
            raise ValueError(f"{path}: {key} is set, which our engine does not implement; refusing to export a head it never ran")
    state = read_state(path)
    for k in IGNORED_KEYS:
        state.pop(k, None)
    shapes = expected_shapes(c)
    if "d2t" not in state and "t2d" not in state and c.draft_vocab_size == c.vocab_size:
        shapes = {k: v for k, v in shapes.items() if k not in ("d2t", "t2d")}  # full vocabulary, identity mapping
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"{path}: not an EAGLE3 head checkpoint: missing {missing}, unexpected {unexpected}")
    for k, shape in shapes.items():
        if tuple(state[k].shape) != shape:
            raise ValueError(f"{path}: tensor {k} has shape {tuple(state[k].shape)}, expected {shape}")
    return Eagle3Checkpoint(c, raw, state, path)


def _rope_rows_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k projection rows reordered from HF's RoPE layout to llama.cpp's (out = n_heads·hd rows).

    Our head (like HF Llama) rotates with rotate_half: within a head, dimension j pairs with j + hd/2
    at frequency theta^(-2j/hd). llama.cpp runs the eagle3 graph with LLAMA_ROPE_TYPE_NORM, which
    pairs adjacent dimensions 2j, 2j+1 at that same frequency. So row j of a head must move to 2j and
    row j + hd/2 to 2j+1, in both q and k (k with its own head count under GQA). Attention scores
    are dot products over a head's dimensions, invariant to one permutation applied to both q and k,
    so the draft computes the same function; v and o are not rotated and keep their order. This is
    the permutation llama.cpp's converter applies to every Llama-family q/k (and its eagle3 path too)."""
    out, inp = w.shape
    hd = out // n_heads
    return w.reshape(n_heads, 2, hd // 2, inp).transpose(1, 2).reshape(out, inp)


def _target_ids(d2t: torch.Tensor, n_tokens: int) -> np.ndarray:
    """The GGUF d2t: the *absolute* target id of every draft id (our d2t holds offsets: i + d2t[i]).
    llama.cpp scatters the draft logits into a target-vocabulary row with ggml_set_rows(d2t), so the
    ids must be in range and distinct (a duplicate would make two draft logits race for one slot)."""
    ids = (torch.arange(d2t.numel()) + d2t.long()).numpy().astype(np.int64)
    if ids.min() < 0 or ids.max() >= n_tokens:
        raise ValueError(f"d2t maps draft ids outside the target's {n_tokens} tokens")
    if np.unique(ids).size != ids.size:
        raise ValueError("d2t maps two draft ids to one target id")
    return ids


def _weight_array(t: torch.Tensor, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """A 2-D weight as the array GGUFWriter.add_tensor stores for ggml_type (BF16: raw uint16 bits,
    rounded to nearest even by torch when the source is wider; a bf16 source is copied bit for bit)."""
    if ggml_type == GGMLQuantizationType.BF16:
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    a = t.float().numpy() if ggml_type == GGMLQuantizationType.F32 else t.float().numpy().astype(np.float16)
    if not np.isfinite(a).all() and torch.isfinite(t.float()).all():
        raise ValueError("a weight overflows float16; export with --outtype bf16 or f32")
    return a


def export_eagle3_gguf(
    head_dir: str | os.PathLike,
    target: str | os.PathLike,
    out_path: str | os.PathLike,
    dtype: str = "bf16",
    tokenizer_gguf: str | os.PathLike | None = None,
) -> Path:
    """Write the EAGLE3 head at `head_dir`, trained for `target`, as a llama.cpp eagle3 GGUF at `out_path`.

    `target`: "default" (the embedded SmolLM2 GGUF: llama.cpp runs that file as -m), a target .gguf,
    or an HF checkpoint dir / hub id together with `tokenizer_gguf` (a GGUF of the same model).
    `dtype`: bf16 | f16 | f32 for the 2-D weights. Returns the written path."""
    if dtype not in OUTTYPES:
        raise ValueError(f"unknown outtype {dtype!r}: choose one of {sorted(OUTTYPES)}")
    head = read_eagle3_head(head_dir)
    tgt = resolve_target(target, tokenizer_gguf)
    c, raw = head.config, head.raw_config
    if c.target_hidden_size != tgt.hidden_size:
        raise ValueError(f"{head.path}: head expects target hidden size {c.target_hidden_size}, {tgt.source} has {tgt.hidden_size}")
    if c.hidden_size != tgt.hidden_size:
        raise ValueError(
            f"{head.path}: head hidden size {c.hidden_size} differs from the target's {tgt.hidden_size} (the embedding is shared)"
        )
    if c.vocab_size != tgt.vocab_size:
        raise ValueError(f"{head.path}: head was trained for a vocabulary of {c.vocab_size}, {tgt.source} has {tgt.vocab_size}")
    layers = tgt.target_layers
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if aux and list(aux) != layers:
        raise ValueError(f"{head.path}: config names target layers {aux}, our engine feeds the head layers {layers}")

    weight_type, file_type = OUTTYPES[dtype]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", dir=out_path.parent)
    os.close(fd)
    try:
        w = GGUFWriter(tmp, ARCH)  # writes general.architecture = "eagle3" first
        w.add_type("model")
        w.add_name(f"{head.path.name} EAGLE3 draft")
        w.add_uint32(f"{ARCH}.block_count", 1)
        w.add_uint32(f"{ARCH}.context_length", c.max_position_embeddings)
        w.add_uint32(f"{ARCH}.embedding_length", c.hidden_size)
        w.add_uint32(f"{ARCH}.feed_forward_length", c.intermediate_size)
        w.add_uint32(f"{ARCH}.attention.head_count", c.num_attention_heads)
        w.add_uint32(f"{ARCH}.attention.head_count_kv", c.num_key_value_heads)
        w.add_float32(f"{ARCH}.rope.freq_base", c.rope_theta)
        w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
        w.add_uint32(f"{ARCH}.attention.key_length", c.head_dim)
        w.add_uint32(f"{ARCH}.attention.value_length", c.head_dim)
        w.add_uint32(f"{ARCH}.vocab_size", c.vocab_size)
        w.add_uint32(f"{ARCH}.rope.dimension_count", c.head_dim)
        w.add_key_value(f"{ARCH}.target_layers", layers, GGUFValueType.ARRAY, GGUFValueType.INT32)
        w.add_uint32(f"{ARCH}.target_hidden_size", c.target_hidden_size)
        w.add_bool(f"{ARCH}.norm_before_residual", False)
        w.add_bool(f"{ARCH}.norm_before_fc", False)
        w.add_uint32("general.file_type", file_type)
        w.add_uint32("general.quantization_version", GGML_QUANT_VERSION)
        for key, value, vtype, sub in tgt.tokenizer:
            w.add_key_value(key, value, vtype, sub)

        for key, name in TENSOR_NAMES.items():
            t = head.state[key]
            if key in ROPE_PERMUTED:
                t = _rope_rows_interleaved(t, getattr(c, ROPE_PERMUTED[key]))
            if t.dim() == 1:
                w.add_tensor(name, t.float().numpy())
            else:
                w.add_tensor(name, _weight_array(t, weight_type), raw_dtype=weight_type)
        if "d2t" in head.state:
            w.add_tensor(D2T, _target_ids(head.state["d2t"], tgt.n_tokens))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_path


def cached_eagle3_gguf(head_dir: str | os.PathLike, target_gguf: str | os.PathLike, dtype: str = "bf16") -> Path:
    """The export of `head_dir` for the target GGUF `target_gguf`, written once into the cache
    (~/.cache/dart-demo/gguf/) and reused: what the bench's llamacpp-eagle3 method hands llama.cpp as -md.
    The file name carries a hash of the head's files, the target GGUF (path, size, mtime) and `dtype`,
    so a retrained head or another target gets its own export."""
    from hashlib import sha256

    from ..loading import cache_root

    path, target = resolve_head_dir(head_dir), Path(target_gguf)
    if not target.is_file():
        raise FileNotFoundError(f"target GGUF {str(target)!r} does not exist")
    h = sha256(f"{dtype}|{target.resolve()}|{target.stat().st_size}|{target.stat().st_mtime_ns}".encode())
    for name in ("config.json", "model.safetensors"):
        f = path / name
        if f.is_file():
            h.update(f.read_bytes())
    out = cache_root() / "gguf" / f"eagle3-{path.name}-{h.hexdigest()[:16]}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        export_eagle3_gguf(path, target, out, dtype)
    return out
