"""DART's draft head as a vLLM model: vLLM's EAGLE3 Llama draft layer with DART's mask slots.

vLLM runs an EAGLE3 draft with parallel drafting as one forward over the request's new tokens
followed by k-1 slots holding a mask token id; it hands the head the target's three auxiliary hidden
states through `combine_hidden_states` (the head's fc). DART's head (the upstream format: fc,
midlayer.*, midlayer.mask_rep, norm, lm_head, d2t) differs from vLLM's EAGLE3 layer in one place: a
mask slot's attention input is the learned 2H vector mask_rep and its residual mask_rep[:H], with
neither norm applied (dart_core/drafters/head.py does the same). The mask slots are found by their
token id: the plugin gives DART heads a mask id one past the target's vocabulary, which no real token
has. Upstream heads apply the final norm twice (`dart_double_norm`, default on for DART heads, as in
dart_core.drafters.head.HeadConfig).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

IGNORED = ("embed_tokens", "t2d")  # the embedding is always the target's (vLLM shares it); t2d is unused


class DartDraftForCausalLM(Eagle3LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        spec = vllm_config.speculative_config
        config = spec.draft_model_config.hf_config
        depth = getattr(config, "draft_length", None)
        if depth is None:
            raise ValueError("a DART head's config.json names its draft_length (the mask slots it was trained with)")
        if not spec.parallel_drafting:
            raise ValueError(
                "DART drafts every depth in one forward: pass parallel_drafting=True in the speculative config "
                "(dart_vllm.speculative_config builds it)"
            )
        if not 1 <= spec.num_speculative_tokens <= depth + 1:
            raise ValueError(
                f"this DART head drafts at most {depth + 1} tokens (draft_length {depth} + 1); "
                f"got num_speculative_tokens={spec.num_speculative_tokens}"
            )
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        H = config.hidden_size
        self.mask_token_id = int(config.mask_token_id)
        self.double_norm = bool(getattr(config, "dart_double_norm", True))
        self.head_dir = spec.draft_model_config.model
        self.mask_rep = nn.Parameter(torch.zeros(2 * H, dtype=vllm_config.model_config.dtype), requires_grad=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ):
        m = self.model
        layer = m.layers[0]
        is_mask = (input_ids == self.mask_token_id)[:, None]
        if inputs_embeds is None:
            inputs_embeds = m.embed_input_ids(input_ids.masked_fill(is_mask[:, 0], 0))
        H = hidden_states.shape[-1]
        u = torch.cat((layer.input_layernorm(inputs_embeds), layer.hidden_norm(hidden_states)), dim=-1)
        u = torch.where(is_mask, self.mask_rep, u)  # mask slots bypass both norms
        residual = torch.where(is_mask, self.mask_rep[:H], hidden_states)
        h = layer.self_attn(positions=positions, hidden_states=u)
        h, residual = layer.post_attention_layernorm(h, residual)  # residual += attention; h = norm(residual)
        h = layer.mlp(h)
        h, prenorm = m.norm(h, residual)
        if self.double_norm:
            h = m.norm(h)
        return h, prenorm

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, H) normed states -> (N, Vd) logits over the draft vocabulary."""
        return self.logits_processor(self.lm_head, hidden_states)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.draft_id_to_target_id is None:
            return draft_ids
        return draft_ids + self.draft_id_to_target_id[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        own: dict[str, torch.Tensor] = {}
        seen_mask = False
        for name, w in weights:
            if any(k in name for k in IGNORED):
                continue
            if name.endswith("mask_rep"):
                self.mask_rep.data.copy_(w.view(-1))
                seen_mask = True
                continue
            if name == "d2t":
                name = "draft_id_to_target_id"
            elif "lm_head" not in name:
                name = "model." + name
            own[name] = w
        if not seen_mask:
            raise ValueError(f"{self.head_dir}: no midlayer.mask_rep in the weights (not a DART head)")
        if "lm_head.weight" in own:
            self.has_own_lm_head = True
        self.has_own_embed_tokens = False
        drop = {"mask_hidden": None, "input_norm.": None}  # vLLM EAGLE3 extras a DART head has not
        if self.draft_id_to_target_id is not None and "draft_id_to_target_id" not in own:
            raise ValueError(f"{self.head_dir}: draft vocabulary smaller than the target's but no d2t in the weights")
        loaded = AutoWeightsLoader(self).load_weights(own.items(), mapper=WeightsMapper(orig_to_new_substr=drop))
        return set(loaded) | {"mask_rep"}
