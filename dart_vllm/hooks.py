"""Where the plugin meets vLLM 0.32's speculative decoding (installed by dart_vllm.register).

vLLM's speculative methods are a fixed list, so DART comes in as an `eagle3` draft with parallel
drafting, and these wrappers change what vLLM does only when the draft is a DART head:
- EAGLEConfig: a head config with `draft_length` gets the DART architecture and a mask token id one
  past the target's vocabulary (parallel drafting needs one; no real token has it);
- the proposer's prepare_next_token_ids_* (called each step with the batch): remembers the batch's
  request ids and states;
- the proposer's propose: records each request's new committed tokens (the target's input at its
  positions, less the rejected drafts) and its root (the token the target just produced);
- the proposer's _sample_draft_tokens: instead of each row's argmax, the head's per-row top-k go to
  DART's pruner, which picks each request's chain (dart_vllm.chains). The drafts are returned
  without draft probabilities, so vLLM's rejection sampler treats them as fixed proposals (as it does
  n-gram drafts): greedy output is the target's, sampling keeps the target's distribution.
"""

from __future__ import annotations

import functools
import inspect
import json

import numpy as np
import torch

ARCHITECTURE = "DartDraftForCausalLM"
CHECKPOINT_ARCHITECTURE = "LlamaForCausalLMDart"  # dart_core.drafters.head.HeadConfig.to_dict
_installed = False


def _unwrapped(model):
    unwrap = getattr(model, "unwrap", None)  # vLLM's CUDA-graph wrapper
    return unwrap() if callable(unwrap) else model


def _is_dart(model) -> bool:
    from .model import DartDraftForCausalLM

    return isinstance(_unwrapped(model), DartDraftForCausalLM)


def install() -> None:
    global _installed
    if _installed:
        return
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    eagle_init = EAGLEConfig.__init__

    @functools.wraps(eagle_init)
    def init(self, *args, **kwargs):
        eagle_init(self, *args, **kwargs)
        if kwargs.get("method") == "eagle3" and getattr(self, "draft_length", None) is not None:
            self.architectures = [ARCHITECTURE]
            if getattr(self, "mask_token_id", None) is None:
                self.mask_token_id = int(self.vocab_size)

    EAGLEConfig.__init__ = init

    for name in ("prepare_next_token_ids_padded", "prepare_next_token_ids_cpu"):
        setattr(SpecDecodeBaseProposer, name, _remember_batch(getattr(SpecDecodeBaseProposer, name)))
    SpecDecodeBaseProposer.propose = _record_step(SpecDecodeBaseProposer.propose)
    SpecDecodeBaseProposer._sample_draft_tokens = _dart_sample(SpecDecodeBaseProposer._sample_draft_tokens)
    _installed = True


def _remember_batch(fn):
    @functools.wraps(fn)
    def wrapper(self, sampled_token_ids, requests, input_batch, *args, **kwargs):
        self._dart_batch = (list(input_batch.req_ids), requests)
        return fn(self, sampled_token_ids, requests, input_batch, *args, **kwargs)

    return wrapper


def _record_step(fn):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if _is_dart(self.model):
            a = signature.bind(self, *args, **kwargs).arguments
            rejected = a.get("num_rejected_tokens_gpu")
            self._dart_step = (
                a["target_token_ids"].tolist(),
                a["target_positions"].tolist(),
                a["common_attn_metadata"].query_start_loc_cpu.tolist(),
                None if rejected is None else rejected.tolist(),
                a["next_token_ids"].tolist(),
            )
        return fn(self, *args, **kwargs)

    return wrapper


def _picker(self):
    picker = getattr(self, "_dart_picker", None)
    if picker is None:
        from .chains import ChainPicker, ChainSettings

        model = _unwrapped(self.model)
        settings = ChainSettings.from_env(model.head_dir)
        tokenizer_eos = getattr(self.vllm_config.model_config.hf_config, "eos_token_id", None)
        eos = tokenizer_eos[0] if isinstance(tokenizer_eos, list) else tokenizer_eos
        picker = self._dart_picker = ChainPicker(
            settings, -1 if eos is None else int(eos), vocab_size=self.vllm_config.model_config.get_vocab_size()
        )
    return picker


def _dart_sample(fn):
    @functools.wraps(fn)
    def wrapper(self, hidden_states, sampling_metadata):
        if not _is_dart(self.model):
            return fn(self, hidden_states, sampling_metadata)
        model = _unwrapped(self.model)
        picker = _picker(self)
        k = self.num_speculative_tokens
        logits = model.draft_logits(hidden_states).float()
        top_k = min(picker.settings.params.prune.top_k, logits.shape[-1])
        vals, idx = logits.topk(top_k, dim=-1)
        probs = vals.softmax(-1).cpu().numpy().reshape(-1, k, top_k)
        tokens = model.to_target_ids(idx).cpu().numpy().reshape(-1, k, top_k)
        ids, positions, starts, rejected, roots = self._dart_step
        req_ids, requests = self._dart_batch
        batch = len(roots)
        if tokens.shape[0] != batch or len(req_ids) < batch:
            raise RuntimeError(f"DART: {tokens.shape[0]} requests' rows for a batch of {batch} ({len(req_ids)} request ids)")
        contexts = picker.contexts
        contexts.keep(req_ids[:batch])
        chains = np.empty((batch, k), dtype=np.int64)
        for i, req in enumerate(req_ids[:batch]):
            end = starts[i + 1] - (rejected[i] if rejected is not None else 0)
            state = requests.get(req)

            def known(n, state=state):
                return ((state.prompt_token_ids or []) + list(state.output_token_ids))[:n]

            contexts.update(req, positions[starts[i]], ids[starts[i] : end], known)
            chains[i] = picker.chain(req, roots[i], tokens[i], probs[i])
            if picker.trace is not None:  # DART_VLLM_TRACE: one JSON line a request and step
                picker.trace.write(
                    json.dumps({"req": req, "root": roots[i], "chain": chains[i].tolist(), "rows_top": tokens[i, :, :4].tolist()}) + "\n"
                )
        return torch.from_numpy(chains).to(hidden_states.device), None

    return wrapper
