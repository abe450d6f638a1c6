"""The sampling stage: the one-step chi-square test of speculative sampling (tests/test_acceptance.py's)
on the device's logits. Needs scipy (the test extra)."""

from __future__ import annotations

import time

import torch

from ...sampling import SamplingParams, accept_sampling, target_probs
from ...tools.toys import TREE, chi_square_p
from ...tools.toys import TREE_VOCAB as V
from .common import Report


def stage_sampling(dev: torch.device, small: bool, rep: Report) -> dict:
    out = []
    n = 4000 if small else 20000
    for params in (SamplingParams(1.0), SamplingParams(0.7, top_p=0.95), SamplingParams(1.3, top_k=4)):
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(len(TREE), V, generator=gen) * 1.5
        logits[0, [2, 4]] += 2.0
        logits = logits.to(dev)
        probs = target_probs(logits, params).cpu()
        first: dict = {}
        t0 = time.perf_counter()
        for _ in range(n):
            acc = accept_sampling(TREE, logits, params, gen)
            tok = (TREE.tokens[acc.path[1:]].tolist() + [acc.bonus])[0]
            first[tok] = first.get(tok, 0) + 1
        p = chi_square_p(first, {t: float(probs[0, t]) for t in range(V) if probs[0, t] > 0}, n)
        row = {
            "params": repr(params),
            "draws": n,
            "p_value": p,
            "passed": p > 1e-3,
            "us_per_accept": round((time.perf_counter() - t0) / n * 1e6, 1),
        }
        rep.log(f"sampling: {row}")
        out.append(row)
    return {"rows": out}
