"""DART speculative decoding engine: target runner, draft trees, lossless acceptance, one generation loop."""

from .generate import (
    ARDrafter,
    Drafter,
    DraftSession,
    GenerationParams,
    Proposal,
    StageTimes,
    StepEvent,
    Summary,
    complete,
    generate,
)
from .loading import DEFAULT_MODEL, load_tokenizer, resolve_model_dir
from .sampling import SamplingParams
from .target import Target, load_target
from .tree import DraftTree

__all__ = [
    "ARDrafter",
    "DEFAULT_MODEL",
    "Drafter",
    "DraftSession",
    "DraftTree",
    "GenerationParams",
    "Proposal",
    "SamplingParams",
    "StageTimes",
    "StepEvent",
    "Summary",
    "Target",
    "complete",
    "generate",
    "load_target",
    "load_tokenizer",
    "resolve_model_dir",
]
