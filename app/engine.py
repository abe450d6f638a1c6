"""The app's engine: one loaded target, its drafters, and a lock, consuming the one generation loop.

Generation is not re-entrant (one target, CPU-bound), so every request takes the lock; Gradio's
queue (concurrency limit 1) already serialises requests, the lock makes it hold for any caller.
Each request gets its own KV caches from `generate`, so no request ever sees another's state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from dart_core import ARDrafter, Drafter, GenerationParams, SamplingParams, StepEvent, Summary, generate
from dart_core.target import Target

MAX_PROMPT_CHARS = 20_000  # far beyond any context we serve; rejects pasted novels before tokenizing


@dataclass
class Step:
    """What the UI shows of one target forward."""

    index: int
    tokens: list[int]  # tokens this step added
    accepted: int  # drafted tokens accepted (the last token of a step is the target's own)
    text_start: int  # character span of this step's text in the decoded output:
    text_mid: int  # [start, mid) the accepted drafts, [mid, end) the target's own (bonus) token
    text_end: int
    tree: object | None  # DraftTree
    path: list[int]
    times: dict
    info: dict
    t: float  # seconds since the request started


@dataclass
class Run:
    """The state of one streaming generation, updated after every step."""

    method: str
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    summary: Summary | None = None
    error: str | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tau(self) -> float:
        return self.new_tokens / max(1, len(self.steps))

    @property
    def tokens_per_s(self) -> float:
        if self.summary is not None:
            return self.summary.tokens_per_s
        elapsed = (self.steps[-1].t if self.steps else 0.0) or 1e-9
        return self.new_tokens / elapsed


def decode_stable(tokenizer, ids: list[int]) -> str:
    """Decode, holding back a trailing incomplete UTF-8 character (shown as U+FFFD) until it completes."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return text.rstrip("\ufffd")


class Engine:
    def __init__(self, target: Target, drafters: dict[str, Drafter]):
        self.target = target
        self.drafters = {**drafters, "ar": ARDrafter()}
        self.lock = threading.Lock()
        self.ar_tokens_per_s: float | None = None  # the latest plain-decoding speed, for speed-ups

    @property
    def methods(self) -> list[str]:
        return list(self.drafters)

    def check(self, message: str, method: str, params: GenerationParams) -> None:
        """Validate a request before it queues; raises ValueError with a message for the user."""
        if method not in self.drafters:
            raise ValueError(f"unknown method {method!r}: available are {', '.join(self.drafters)}")
        if not isinstance(message, str) or not message.strip():
            raise ValueError("the prompt is empty")
        if len(message) > MAX_PROMPT_CHARS:
            raise ValueError(f"the prompt has {len(message)} characters; the limit is {MAX_PROMPT_CHARS}")

    def stream(self, messages: list[dict], method: str, params: GenerationParams) -> Iterator[Run]:
        """Run one generation, yielding the updated Run after each step. Holds the lock throughout,
        and releases it when the consumer stops iterating (a cancelled request)."""
        drafter = self.drafters[method]
        run = Run(method)
        tok = self.target.tokenizer
        with self.lock:
            run.started = time.perf_counter()
            for event in generate(self.target, messages, drafter, params):
                if isinstance(event, Summary):
                    run.summary = event
                    run.text = tok.decode(run.output_ids, skip_special_tokens=True)  # final: nothing held back
                    if method == "ar":
                        self.ar_tokens_per_s = event.tokens_per_s
                    yield run
                    return
                self._add_step(run, event)
                yield run

    def _add_step(self, run: Run, e: StepEvent) -> None:
        start = len(run.text)
        run.output_ids.extend(e.new_tokens)
        mid = len(decode_stable(self.target.tokenizer, run.output_ids[:-1])) if e.accepted else start
        run.text = decode_stable(self.target.tokenizer, run.output_ids)
        times = {"draft": e.times.draft, "prune": e.times.prune, "verify": e.times.verify, "other": e.times.other}
        run.steps.append(
            Step(
                e.step, list(e.new_tokens), e.accepted, min(start, len(run.text)), min(max(mid, start), len(run.text)), len(run.text),
                e.tree, e.path, times, e.info, time.perf_counter() - run.started,
            )
        )


def sampling_params(temperature: float, top_p: float, top_k: int, max_new_tokens: int, max_length: int | None) -> GenerationParams:
    """Build and validate generation parameters from UI values (raises ValueError with the field name)."""
    try:
        top_k = int(top_k)
        max_new_tokens = int(max_new_tokens)
    except (TypeError, ValueError):
        raise ValueError("top_k and max_new_tokens must be integers") from None
    return GenerationParams(max_new_tokens=max_new_tokens, max_length=max_length, sampling=SamplingParams(float(temperature), float(top_p), top_k))
