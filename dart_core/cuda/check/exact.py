"""The exact stage: tiny random Llama / Qwen2 / Qwen3 targets in bf16 / fp16 / fp32 with random DART and
EAGLE3 heads: greedy ids of dart and eagle3 against plain decoding, and every node of random trees
verified in one forward against the one-token steps along its path (bitwise), on each forward path."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

import ngram_cpp

from ... import ARDrafter, GenerationParams, complete
from ...drafters.dart import DartDrafter, DartParams
from ...drafters.eagle3 import Eagle3Drafter, Eagle3Params
from ...hf_checkpoint import load_transformer
from ...target import Target
from ...tools.toys import TINY_EOS, TINY_VOCAB, build_tiny_checkpoint, random_tree_under
from .common import (
    DTYPES,
    Report,
    fault,
    forward_engine,
    random_head,
    recorded_failure,
    target_from_transformer,
    use_path,
    verify_against_steps,
)


def tiny_checkpoints(tmp: Path) -> dict[str, Path]:
    return {arch: build_tiny_checkpoint(tmp / arch, arch, seed=1) for arch in ("llama", "qwen2", "qwen3")}


def stage_exact(dev: torch.device, small: bool, rep: Report, opts) -> dict:
    """Greedy ids of dart / eagle3 against plain decoding, and verify == steps node by node, on the
    forward paths asked for (use_path: "fixed", the default off the CPU kernels, "fixed-attn",
    "fixed-torch", "eager")."""
    results = []
    prompts = [[5, 6, 7], [60], [11, 40, 12, 90, 4, 4, 4, 17], [2, 30, 31, 32, 33, 34]]
    new_tokens = opts.exact_tokens
    with tempfile.TemporaryDirectory() as tmp:
        for arch, path in tiny_checkpoints(Path(tmp)).items():
            for dname, dtype in DTYPES.items():
                model = load_transformer(path, dtype, dev)
                model.use_kernels = False  # the torch paths only (a CUDA device has no other; a CPU run tests the same)
                target = target_from_transformer(model, f"tiny-{arch}", dev, dtype, TINY_EOS)
                for fpath in opts.paths.split(","):
                    use_path(model, fpath, opts)
                    row = {
                        "arch": arch,
                        "dtype": dname,
                        "path": fpath,
                        "engine": forward_engine(model, dev),
                        "fixed_rows": model.fixed_row_count(dev),
                    }
                    with recorded_failure(rep, f"exact ({arch} {dname} {fpath})", row, dev):
                        exact_row(target, row, prompts, new_tokens)
                        rep.log(f"exact: {row}")
                    results.append(row)
                    rep.save("exact", {"rows": results})
    return {"rows": results}


def exact_row(target: Target, row: dict, prompts: list[list[int]], new_tokens: int) -> None:
    """One exact-stage row (a target on one forward path): greedy ids and verify == steps."""
    fault(row["path"])
    if new_tokens:
        dart = DartDrafter(
            random_head(target, 5, 3, 64),
            target,
            None,
            DartParams(ngram_cpp.PruneParams(top_k=8, beam_width=4, max_nodes=12)),
        )
        eagle = Eagle3Drafter(random_head(target, 6, None, 64), target, Eagle3Params(depth=4, top_k=4, max_nodes=15))
        ar_out = [complete(target, p, ARDrafter(), GenerationParams(new_tokens)).output_ids for p in prompts]
        for name, drafter in (("dart", dart), ("eagle3", eagle)):
            outs = [complete(target, p, drafter, GenerationParams(new_tokens)) for p in prompts]
            row[f"{name}_ids_equal"] = sum(o.output_ids == a for o, a in zip(outs, ar_out))
            row[f"{name}_tau"] = round(sum(o.new_tokens for o in outs) / sum(o.steps for o in outs), 3)
        row["prompts"] = len(prompts)
    rng = random.Random(7)
    checks = []
    for n in (4, 16, 33):
        prefix = [rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(3, 40))]
        checks.append(verify_against_steps(target, prefix, random_tree_under(rng, prefix[-1], n, TINY_VOCAB)))
    row["verify_nodes"] = sum(c["nodes"] for c in checks)
    row["verify_bitwise_equal"] = sum(c["bitwise_equal"] for c in checks)
    row["verify_argmax_equal"] = sum(c["argmax_equal"] for c in checks)
    row["verify_max_abs_diff"] = max(c["max_abs_diff"] for c in checks)
