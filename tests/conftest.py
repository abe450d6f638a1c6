"""Shared fixtures: tiny random Llama / Qwen2 / Qwen3 targets built in the test, and the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dart_core.model import load_transformer
from dart_core.target import Target, interleave_for_this_cpu

TINY_VOCAB = 96
TINY_LAYERS = 8  # >= 7, so the three captured layers (2, L//2, L-3) are distinct
TINY_EOS = 3


def fake_bin_dir(tmp_path: Path) -> Path:
    """Executable stand-ins for llama.cpp's binaries (they exit 1 and are never run), so that a
    dart_core.tools.peers.LlamaCppPeer can be built to read captured output."""
    d = tmp_path / "bin"
    d.mkdir()
    for name in ("llama-completion", "llama-lookup", "llama-speculative-simple"):
        (d / name).write_text("#!/bin/sh\nexit 1\n")
        (d / name).chmod(0o755)
    return d


def build_tiny_checkpoint(path: Path, arch: str, seed: int = 0, vocab: int = TINY_VOCAB, logit_scale: float = 8.0) -> Path:
    """Save a tiny random HF model of `arch` to `path`. The LM head is scaled up so that next-token
    distributions are peaked, as in a trained model, rather than near-uniform (where argmax ties
    would make greedy comparisons meaningless)."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=TINY_EOS,
        bos_token_id=1,
        pad_token_id=0,
    )
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    torch.manual_seed(seed)
    model = cls[1](cls[0](**common, **extra)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        if arch == "qwen2":  # random biases, so the bias path is really exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def tiny_target(path: Path, dtype=torch.float32) -> Target:
    """A tiny checkpoint as load_target would give it: in bf16 on kernels without bf16 arithmetic
    its linears read 16-row interleaved weights (target.interleave_for_this_cpu)."""
    model = load_transformer(path, dtype, "cpu")
    interleave_for_this_cpu(model)
    return Target(f"tiny:{path.name}", path, model, None, frozenset({TINY_EOS}), torch.device("cpu"), dtype)


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_ckpt(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, build_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Target:
    return tiny_target(build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.fixture(scope="session")
def embedded_target() -> Target:
    from dart_core import load_target

    return load_target("default", "cpu", "float32")


@pytest.fixture(scope="session")
def embedded_bf16() -> Target:
    from dart_core import load_target

    return load_target("default", "cpu", "bfloat16")


EMBEDDED_DART_HEAD = Path(__file__).resolve().parent.parent / "assets" / "dart"
EMBEDDED_EAGLE3_HEAD = EMBEDDED_DART_HEAD.parent / "eagle3"


def eagle3_fixture_head(out: Path) -> Path:
    """The DART head's weights as an EAGLE3 checkpoint (drop the mask embedding and draft_length)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(EMBEDDED_DART_HEAD / "model.safetensors"))
    state.pop("midlayer.mask_rep")
    cfg = json.loads((EMBEDDED_DART_HEAD / "config.json").read_text())
    for key in ("draft_length", "dart_double_norm"):
        cfg.pop(key, None)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out
