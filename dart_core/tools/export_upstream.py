"""Export a DART head trained here so that upstream's loader (fvliang/DART) runs it right.

    dart-export-upstream --head assets/dart --out dart-upstream [--dtype float32]

Upstream's draft path applies the final RMSNorm twice (`LlamaForCausalLMDart.forward` in
dart/model/llama3_dart.py, then `compute_logits`), and its config has no switch for that. Heads trained here apply it once (their
config says `dart_double_norm: false`), so upstream's code would compute other logits from them.

No weights make upstream's norm(norm(h)) equal our norm(h) exactly. Along any direction d of h
(h = t·d, mean(d²) = 1, a = t / sqrt(t² + ε) < 1) our normed state is linear in a, a·(w ⊙ d), while
a second norm maps it to a / sqrt(a²·c + ε) with c > 0 fixed by the weights: never linear in a. So
the export folds the final norm's weight w into lm_head (lm_head' = lm_head · diag(w), norm' = 1),
after which upstream's logits are ours times one positive factor per row,
s = (m / (m + ε) + ε)^(-1/2), m = mean(h²): 1 - s is about ε/2 · (1 - 1/m), a few ε unless m is
far below 1 (the embedded head's exported logits: within 1.2e-5 relative of ours, ε = 1e-5). A
per-row factor keeps every row's order, so the top-k candidates are ours; the softmax within the
top-k is ours at temperature 1/s.
The folded lm_head is computed in float32 and written in `--dtype` (float32 by default: bfloat16
would round the product; upstream casts the head to its target's dtype when it loads it anyway).

A head that already applies the norm twice (a published upstream head, or an export) is written
unchanged. The output is what upstream's `DartModel` reads (dart/model/dart_configs.py): config.json with the Llama
fields, draft_vocab_size, draft_length, target_hidden_size, head_dim, rope_theta, and
model.safetensors with upstream's key names; `embed_tokens.weight` is left out (upstream copies the
target's embedding into the head at load). Our loader reads the export too (`dart_double_norm: true`).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..drafters.head import IGNORED_KEYS, HeadConfig, expected_shapes, read_state, resolve_head_dir
from ..loading import parse_dtype

EXPORT_KEY = "dart_export"  # config.json: where the export came from and whether it folded the norm


def export_upstream(head: str | os.PathLike, out: str | os.PathLike, dtype: str | torch.dtype = torch.float32) -> bool:
    """Write the DART head `head` (directory or hub id) to `out` for upstream's loader. Returns
    whether the final norm was folded into lm_head (False: the head applied it twice already).
    Raises ValueError for an EAGLE3 head or a checkpoint whose tensors do not fit its config."""
    dtype = parse_dtype(dtype)
    src = resolve_head_dir(head)
    cfg = json.loads((src / "config.json").read_text())
    if "draft_length" not in cfg:
        raise ValueError(
            f"{src}: config.json has no draft_length: not a DART head (EAGLE3 heads apply the final norm once, "
            "here and upstream, and need no export)"
        )
    c = HeadConfig.from_dict(cfg, dart=True)
    state = read_state(src)
    for k in IGNORED_KEYS:
        state.pop(k, None)
    if c.draft_vocab_size == c.vocab_size and "d2t" not in state and "t2d" not in state:
        # written out explicitly: upstream's zeros are the identity only because Vd == V
        state["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    shapes = expected_shapes(c)
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"{src}: not a DART head checkpoint: missing {missing}, unexpected {unexpected}")
    for k, shape in shapes.items():
        if tuple(state[k].shape) != shape:
            raise ValueError(f"{src}: tensor {k} has shape {tuple(state[k].shape)}, expected {shape}")
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    fold = not c.double_norm
    if fold:
        state["lm_head.weight"] = state["lm_head.weight"] * state["norm.weight"][None, :]
        state["norm.weight"] = torch.ones_like(state["norm.weight"])
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = replace(c, double_norm=True).to_dict()
    config[EXPORT_KEY] = {"source": str(head), "folded_final_norm": fold}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return fold
