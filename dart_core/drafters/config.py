"""What a drafter is built from: typed settings, checked when made.

    config = DartConfig.embedded(max_nodes=8)        # the embedded target's tuned score and trie
    drafter = build_drafter("dart", target, config)  # dart_core.drafters.registry
    bigger = replace(config, max_nodes=16)           # the bench's dart@16

The presets are constructors: `DartConfig.embedded()` for the embedded default target (the score
weights tuned for its head, its own trie), `DartConfig.upstream()` for any other target (upstream's
weights and n-gram rule). A setting out of range raises `ConfigError`, which names the field, so a
command line can name its own flag for it (dart_core/cli/options.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .dart import CONTEXT_EXTEND, CONTEXT_ORDER, EMBEDDED_WEIGHTS, RANKINGS, UPSTREAM_WEIGHTS, ScoreWeights
from .eagle3 import RANKINGS as EAGLE3_RANKINGS

# Draft tree size (drafted nodes besides the root) per device, where nothing better is known: on the
# CPU kernels a head with a tree_sizes.json gets the size calibrated on the machine instead
# (dart_core/tools/calibrate/). CPU 5: the size that gave the best end-to-end speed in an interleaved
# bf16 sweep of sizes (docs/changelog.md, "Heads trained on the self-distilled corpus"), past which τ
# grew more slowly than the verify's cost. CUDA 60: on a GPU a 60-node verify is meant to cost about
# one token (the paper; docs/gpu.md says what the eager path measures today).
DEFAULT_MAX_NODES = {"cpu": 5, "cuda": 60}
FALLBACK_MAX_NODES = 60  # other devices


def default_max_nodes(device_type: str) -> int:
    return DEFAULT_MAX_NODES.get(device_type, FALLBACK_MAX_NODES)


DEFAULT_BEAM_WIDTH = 20  # the pruner's beam (upstream's value)
EAGLE3_DEPTH = 7  # EAGLE3's defaults: expansion steps after the root's, and children per node
EAGLE3_TOP_K = 10


class ConfigError(ValueError):
    """A drafter setting out of range. `field` is the config field (for a score weight, the
    ScoreWeights field), `rule` what it must be."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field} {rule}")
        self.field, self.rule = field, rule


def check_weights(w: ScoreWeights) -> None:
    """Raise ConfigError naming the first ScoreWeights field out of range."""
    if w.top_k < 1:
        raise ConfigError("top_k", "must be >= 1")
    for name in ("level_exponent", "logit_decay", "ngram_weight"):
        if not math.isfinite(getattr(w, name)):
            raise ConfigError(name, "must be a finite number")
    if not 0.0 <= w.context_weight <= 1.0:
        raise ConfigError("context_weight", "must be in [0, 1]")
    if w.context_max_candidates < 0:
        raise ConfigError("context_max_candidates", "must be >= 0")


def _check_size(max_nodes: int | None) -> None:
    if max_nodes is not None and max_nodes < 0:
        raise ConfigError("max_nodes", "must be >= 0")


def _check_ranking(ranking: str | None, choices: tuple[str, ...]) -> None:
    if ranking not in (None, *choices):
        raise ConfigError("ranking", f"must be one of {', '.join(choices)} (or None: the default)")


@dataclass(frozen=True)
class DartConfig:
    """A DART drafter: its head, the n-gram it prunes with and the tree it keeps."""

    head: str | None = None  # head dir or hub id; None: the embedded head
    weights: ScoreWeights = EMBEDDED_WEIGHTS  # the tree score's weights
    # The target is the embedded default: unnamed, the n-gram is its own trie; else upstream's rule
    # (upstream's Qwen3 trie for a Qwen3 target with a named head, else none; registry.ngram_choice).
    embedded_target: bool = True
    ngram: str | None = None  # n-gram file (.ngram / .trie), a directory or a hub id; None: the default above
    small_ngram: bool = False  # in a directory or hub repo, small.trie instead of full.trie
    use_ngram: bool = True
    max_nodes: int | None = None  # drafted nodes besides the root; None: the device default
    beam_width: int = DEFAULT_BEAM_WIDTH
    depth: int | None = None  # use only the head's first rows (tree depth <= depth); None: all D+1
    min_score: float | None = None  # score floor past min_nodes (scores are <= 0); None: every tree has max_nodes
    min_nodes: int = 0
    context: bool = True  # the context n-gram (the conversation's own repeats)
    context_extend: int = CONTEXT_EXTEND
    context_order: int = CONTEXT_ORDER
    ranking: str | None = None  # "fitted", "score", or None: fitted where the head has one for this trie
    adaptive: bool = False  # per-step tree size from the fitted ranking and this machine's step cost
    # With adaptive: ms of a step verifying r rows at [r - 1], the target's forward plus drafting, measured
    # on this machine by the caller before building (dart_core.tools.calibrate.with_row_costs).
    row_costs: tuple[float, ...] = ()

    def __post_init__(self):
        check_weights(self.weights)
        _check_size(self.max_nodes)
        if self.beam_width < 1:
            raise ConfigError("beam_width", "must be >= 1")
        if self.depth is not None and self.depth < 1:
            raise ConfigError("depth", "must be >= 1")
        if self.min_nodes < 0:
            raise ConfigError("min_nodes", "must be >= 0")
        if self.min_score is not None and not self.min_score <= 0.0:  # `not <=` also refuses NaN
            raise ConfigError("min_score", "must be <= 0 (tree scores are never positive)")
        if self.context_extend < 0:
            raise ConfigError("context_extend", "must be >= 0")
        if self.context_order < 1:
            raise ConfigError("context_order", "must be >= 1")
        _check_ranking(self.ranking, RANKINGS)
        if any(not (math.isfinite(c) and c > 0) for c in self.row_costs):
            raise ConfigError("row_costs", "must be positive, finite milliseconds")

    @classmethod
    def embedded(cls, **fields) -> "DartConfig":
        """For the embedded default target: the weights tuned for its head, its own trie."""
        return cls(weights=fields.pop("weights", EMBEDDED_WEIGHTS), embedded_target=True, **fields)

    @classmethod
    def upstream(cls, **fields) -> "DartConfig":
        """For any other target: upstream's weights (its heads were made with them) and n-gram rule."""
        return cls(weights=fields.pop("weights", UPSTREAM_WEIGHTS), embedded_target=False, **fields)

    @classmethod
    def for_target(cls, embedded_target: bool, **fields) -> "DartConfig":
        return (cls.embedded if embedded_target else cls.upstream)(**fields)

    def tree_size(self, device_type: str) -> int:
        """Drafted nodes besides the root: max_nodes, else the device default."""
        return self.max_nodes if self.max_nodes is not None else default_max_nodes(device_type)


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE3 drafter (the baseline): its head and search."""

    head: str | None = None  # head dir or hub id; None: the embedded head
    depth: int = EAGLE3_DEPTH
    top_k: int = EAGLE3_TOP_K
    max_nodes: int | None = None  # drafted nodes besides the root; None: the device default
    ranking: str | None = None  # "score" (EAGLE's cumulative log-probability), "fitted", or None: the score

    def __post_init__(self):
        if self.depth < 0:
            raise ConfigError("depth", "must be >= 0")
        if self.top_k < 1:
            raise ConfigError("top_k", "must be >= 1")
        _check_size(self.max_nodes)
        _check_ranking(self.ranking, EAGLE3_RANKINGS)

    def tree_size(self, device_type: str) -> int:
        return self.max_nodes if self.max_nodes is not None else default_max_nodes(device_type)


DrafterConfig = DartConfig | Eagle3Config


@dataclass(frozen=True)
class DrafterConfigs:
    """One config per drafter: what a bench run or the app builds its drafters from."""

    dart: DartConfig = field(default_factory=DartConfig)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)

    def __getitem__(self, name: str) -> DrafterConfig:
        if name not in ("dart", "eagle3"):
            raise KeyError(name)
        return getattr(self, name)
