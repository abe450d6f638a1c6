"""How close a weights path computes to a reference path: teacher-forced top-1 agreement.

Speculative decoding is lossless against plain decoding on the SAME path (tests/test_kernels.py,
the bench's "same ids as ar"); this module measures what a path itself changes against the fp32 copy
of the model: both targets read the same text (a prompt and the reference's greedy continuation), and
at every continuation position we compare the token each would pick next and their logits. Where
greedy texts part is reported too (one early flip changes the rest of a text, so that number says
less than the agreement). `dart-fidelity` runs it on held-out prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels


@dataclass(frozen=True)
class Agreement:
    positions: int  # continuation positions compared
    top1: float  # fraction of them where both targets pick the same next token
    max_rel_logit_error: float  # max over positions of max|l_test - l_ref| / max|l_ref|
    first_disagreement: int | None  # continuation index of the first different pick (None: none)


def _next_token_logits(target, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """(len(continuation), V) fp32 logits: row i predicts continuation[i] (teacher-forced). The
    continuation runs in chunks the kernel path takes (each row gets the bits of a one-token step)."""
    cache = target.new_cache(len(prompt) + len(continuation) + 1)
    rows = [target.prefill(prompt, cache, capture=False).logits[-1].float()]
    cache.commit(len(prompt))
    feed = continuation[:-1]
    for s in range(0, len(feed), kernels.MAX_ROWS):
        chunk = feed[s : s + kernels.MAX_ROWS]
        tokens = torch.tensor(chunk, dtype=torch.long, device=target.device)
        positions = torch.arange(cache.length, cache.length + len(chunk), device=target.device)
        rows.append(target.model(tokens, positions, cache).logits.float())
        cache.commit(len(chunk))
    return torch.cat([r.reshape(-1, r.shape[-1]) for r in rows])


def teacher_forced_agreement(reference, test, prompt: list[int], continuation: list[int]) -> Agreement:
    """Both targets (dart_core.Target) read prompt + continuation; compare their next-token picks."""
    if not continuation:
        raise ValueError("teacher_forced_agreement: an empty continuation has nothing to compare")
    ref, got = _next_token_logits(reference, prompt, continuation), _next_token_logits(test, prompt, continuation)
    same = ref.argmax(-1) == got.argmax(-1)
    rel = ((got - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)).max().item()
    first = None if bool(same.all()) else int((~same).nonzero()[0, 0])
    return Agreement(len(continuation), same.float().mean().item(), rel, first)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two greedy texts part (None: one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None
