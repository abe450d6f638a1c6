"""The command line's flags and their one translation into the library's typed settings, shared by
the bench, the app and the tools: each drafter's flags (with the upstream app's names as aliases),
the target's model / dtype / device / threads flags, llama.cpp's binaries and GGUF (the peers), and
`drafter_configs`, which turns parsed flags into a DartConfig and an Eagle3Config, refusing a flag
out of range by its name.

    p = argparse.ArgumentParser(); add_drafter_flags(p)
    args = p.parse_args()
    configs = drafter_configs(args, default_target=args.model == DEFAULT_MODEL)  # ValueError naming the flag
    drafter = build_drafter("dart", target, configs.dart)
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from ..drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD
from ..drafters.config import (
    DEFAULT_BEAM_WIDTH,
    DEFAULT_MAX_NODES,
    EAGLE3_DEPTH,
    EAGLE3_TOP_K,
    ConfigError,
    DartConfig,
    DrafterConfigs,
    Eagle3Config,
)
from ..drafters.dart import CONTEXT_EXTEND, CONTEXT_ORDER, EMBEDDED_WEIGHTS, UPSTREAM_WEIGHTS, ScoreWeights
from ..drafters.registry import UPSTREAM_NGRAM
from ..loading import DEFAULT_MODEL, DTYPE_CHOICES
from ..tools import peers

DEFAULT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ------------------------------------------------------------------------------ the target


def add_model_flag(p, *names: str, help: str | None = None) -> None:
    p.add_argument(
        *(names or ("--model",)),
        default=DEFAULT_MODEL,
        help=help or "target: 'default' (embedded SmolLM2-135M-Instruct), a local dir or a hub id",
    )


# What each --dtype is (argparse help: % doubled).
WEIGHTS_HELP = (
    "the target's weights: float32/bfloat16/float16 (any checkpoint), or the embedded default's own GGUF blocks "
    "(Q4_1/Q8_0) on the CPU kernels: gguf (fp32 activations: exactly its fp32 copy), gguf-int16 (activations "
    "quantized to 16 bits a block: near the fp32 copy's answers, at nearly int8's step) or gguf-int8 (int8 "
    "activations, llama.cpp's arithmetic: the cheapest step, the furthest from the fp32 copy; docs/engine.md)"
)
AUTO_HELP = (
    "Default auto: for the embedded default on the CPU kernels, the path of calibrate.WEIGHTS_CANDIDATES (gguf, "
    "gguf-int16: at least 99.5%% top-1 agreement with the fp32 copy) whose DART is expected fastest from this machine's "
    "measured costs (dart_core/tools/calibrate/; measured once, cached); else (and with --no-calibration) bfloat16."
)


def add_dtype_flag(p, default: str = "bfloat16", choices=DTYPE_CHOICES, help: str | None = None, name: str = "--dtype") -> None:
    p.add_argument(name, default=default, choices=choices, help=help or WEIGHTS_HELP)


def add_device_flag(p, default: str | None = DEFAULT_DEVICE, help: str | None = None) -> None:
    p.add_argument("--device", default=default, help=help or "cpu or cuda (default: cuda if available)")


def add_threads_flag(p, help: str | None = None) -> None:
    p.add_argument("--threads", type=int, default=None, help=help or "torch CPU threads (default: torch's choice)")


def add_llamacpp_flags(g) -> None:
    """--llamacpp-bin and --gguf: where llama.cpp's binaries are and the GGUF they run (the bench's
    llamacpp* methods, the app's compare rows; dart_core/tools/peers.py)."""
    g.add_argument(
        "--llamacpp-bin",
        default=None,
        help=f"directory of llama.cpp's binaries (default: ${peers.BIN_ENV}, else what `make peers` builds: "
        "~/.cache/dart-demo/llamacpp/<cpu kind>/bin)",
    )
    g.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the GGUF llama.cpp runs (default: the one the embedded target came from; another target needs it). Not --dtype gguf",
    )


def add_target_flags(p, dtype: str = "bfloat16", dtype_choices=DTYPE_CHOICES, device: str | None = DEFAULT_DEVICE) -> None:
    """--model, --dtype, --device and --threads, as most tools take them."""
    add_model_flag(p)
    add_dtype_flag(p, dtype, dtype_choices)
    add_device_flag(p, device)
    add_threads_flag(p)


def apply_threads(args: argparse.Namespace) -> None:
    """--threads N: torch's CPU threads (unset: torch's own choice)."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


# ------------------------------------------------------------------------------ the drafters


def _dart_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--dart-model",
        "--dart-model-name-or-path",
        dest="dart_model",
        default=None,
        help=f"DART head dir or hub id (default: the embedded head, assets/{DEFAULT_DART_HEAD.name})",
    )
    g.add_argument(
        "--ngram-model",
        "--ngram-model-name-or-path",
        dest="ngram_model",
        default=None,
        help="n-gram file (.ngram or upstream .trie), a directory with full.trie/small.trie or one *.ngram, or a hub id "
        f"such as upstream's {UPSTREAM_NGRAM} (the local HF cache first, then the hub). Default: the embedded trie "
        f"for the default target; {UPSTREAM_NGRAM}, as upstream's app, for a Qwen3 target with a named head; else none",
    )
    g.add_argument(
        "--use-small-ngram", action="store_true", help="with an n-gram directory or hub id, load small.trie instead of full.trie"
    )
    g.add_argument("--no-ngram", action="store_true", help="prune draft trees without the n-gram model")
    g.add_argument(
        "--tree-top-k",
        type=int,
        default=None,
        help=f"candidates per depth (default: {EMBEDDED_WEIGHTS.top_k} for the embedded target, else {UPSTREAM_WEIGHTS.top_k})",
    )
    g.add_argument(
        "--level-exponent",
        type=float,
        default=None,
        help=f"tree score: level l weighs (l+1)^this (default {EMBEDDED_WEIGHTS.level_exponent} embedded, else "
        f"{UPSTREAM_WEIGHTS.level_exponent})",
    )
    g.add_argument(
        "--logit-decay",
        type=float,
        default=None,
        help=f"tree score: the head's log-probability at level l weighs this^l (default {EMBEDDED_WEIGHTS.logit_decay} embedded, else "
        f"{UPSTREAM_WEIGHTS.logit_decay})",
    )
    g.add_argument(
        "--ngram-weight",
        type=float,
        default=None,
        help=f"tree score: weight of the trie's log-probability (default {EMBEDDED_WEIGHTS.ngram_weight})",
    )
    g.add_argument(
        "--ngram-first-level",
        choices=["on", "off"],
        default=None,
        help="tree score: whether the trie also scores depth 1 (default on for the embedded target, else off)",
    )
    g.add_argument("--beam-width", type=int, default=DEFAULT_BEAM_WIDTH)
    g.add_argument(
        "--max-nodes",
        type=int,
        default=None,
        help="drafted tree nodes besides the root (default: on the CPU kernels, the size calibrated on this machine for a head "
        f"with a tree_sizes.json (dart_core/tools/calibrate/); else per device: {DEFAULT_MAX_NODES})",
    )
    g.add_argument(
        "--no-calibration",
        action="store_true",
        help=f"tree sizes left unset take the device default ({DEFAULT_MAX_NODES}) instead of this machine's calibration",
    )
    g.add_argument("--draft-depth", type=int, default=None, help="use only the head's first N rows (tree depth <= N; default: all D+1)")
    g.add_argument(
        "--tree-min-score",
        type=float,
        default=None,
        help="score floor: past --tree-min-nodes, keep a node only if its tree score (a log-probability-like sum, "
        "<= 0) is at least this, so trees shrink where the draft is unsure (default: off, every tree has --max-nodes)",
    )
    g.add_argument("--tree-min-nodes", type=int, default=0, help="nodes kept whatever their score when --tree-min-score is set (default 0)")
    g.add_argument("--no-context-ngram", action="store_true", help="prune without the context n-gram (the conversation's own repeats)")
    g.add_argument(
        "--context-weight",
        type=float,
        default=None,
        help=f"context n-gram weight at a full-length match, in [0, 1] (default {EMBEDDED_WEIGHTS.context_weight} for the embedded "
        f"target, else {UPSTREAM_WEIGHTS.context_weight})",
    )
    g.add_argument(
        "--context-candidates",
        type=int,
        default=None,
        help=f"context-only candidates per tree node (default {EMBEDDED_WEIGHTS.context_max_candidates} embedded, else "
        f"{UPSTREAM_WEIGHTS.context_max_candidates})",
    )
    g.add_argument(
        "--context-extend",
        type=int,
        default=CONTEXT_EXTEND,
        help=f"tree levels past the head's rows that follow a context match (default {CONTEXT_EXTEND})",
    )
    g.add_argument("--context-order", type=int, default=CONTEXT_ORDER, help=f"longest context match in tokens (default {CONTEXT_ORDER})")
    g.add_argument(
        "--dart-ranking",
        choices=["fitted", "score"],
        default=None,
        help="how the pruner ranks tree nodes: 'fitted', the head's model of P(node accepted) (acceptance.json beside it, "
        "dart-fit), or 'score', the hand-weighted head and trie log-probabilities (the --level-exponent "
        "... flags). Default: fitted where the head has one for the trie in use, else score",
    )
    g.add_argument(
        "--adaptive-tree",
        action="store_true",
        help="per step, keep the prefix of the fitted ranking with the most expected tokens per ms of this machine's "
        "measured step cost, up to --max-nodes (needs the fitted ranking)",
    )


def _eagle3_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--eagle3-model",
        "--eagle3-model-name-or-path",
        dest="eagle3_model",
        default=None,
        help=f"EAGLE3 head dir or hub id (default: the embedded head, assets/{DEFAULT_EAGLE3_HEAD.name})",
    )
    g.add_argument(
        "--eagle3-depth", type=int, default=EAGLE3_DEPTH, help=f"expansion steps after the root's (EAGLE3 default {EAGLE3_DEPTH})"
    )
    g.add_argument(
        "--eagle3-top-k", type=int, default=EAGLE3_TOP_K, help=f"children per node and frontier size (EAGLE3 default {EAGLE3_TOP_K})"
    )
    g.add_argument(
        "--eagle3-ranking",
        choices=["fitted", "score"],
        default=None,
        help="how EAGLE3 keeps its pool's nodes: 'score', EAGLE's cumulative log-probability, or 'fitted', the head's model "
        "of P(node accepted) (acceptance.json beside it, dart-fit --method eagle3). Default: the score",
    )
    g.add_argument(
        "--eagle3-max-nodes",
        type=int,
        default=None,
        help="drafted tree nodes besides the root (default: calibrated like --max-nodes where the head has a "
        "tree_sizes.json, else DART's --max-nodes, so both verify trees of one size)",
    )


DRAFTER_FLAGS = {"dart": ("DART draft trees", _dart_flags), "eagle3": ("EAGLE3 draft trees (the baseline)", _eagle3_flags)}


def add_drafter_flags(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """Every drafter's flags, one argument group each; returns the groups by drafter name."""
    groups = {}
    for name, (title, add) in DRAFTER_FLAGS.items():
        groups[name] = parser.add_argument_group(title)
        add(groups[name])
    return groups


def drafter_args(**overrides) -> argparse.Namespace:
    """Every drafter flag at its default, with `overrides` (dest names, e.g. max_nodes=16), as the
    command line would parse them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_drafter_flags(parser)
    args = parser.parse_args([])
    for dest, value in overrides.items():
        if not hasattr(args, dest):
            raise ValueError(f"no drafter flag has the destination {dest!r}")
        setattr(args, dest, value)
    return args


# flag dest -> ScoreWeights field; a flag left unset takes the preset's value
WEIGHT_FLAGS = {
    "tree_top_k": "top_k",
    "level_exponent": "level_exponent",
    "logit_decay": "logit_decay",
    "ngram_weight": "ngram_weight",
    "ngram_first_level": "ngram_on_first_level",
    "context_weight": "context_weight",
    "context_candidates": "context_max_candidates",
}
# config field (or ScoreWeights field) -> the flag that sets it, to name the flag in an error
DART_FIELD_FLAGS = {
    **{field: "--" + flag.replace("_", "-") for flag, field in WEIGHT_FLAGS.items()},
    "max_nodes": "--max-nodes",
    "beam_width": "--beam-width",
    "depth": "--draft-depth",
    "min_score": "--tree-min-score",
    "min_nodes": "--tree-min-nodes",
    "context_extend": "--context-extend",
    "context_order": "--context-order",
    "ranking": "--dart-ranking",
}
EAGLE3_FIELD_FLAGS = {
    "depth": "--eagle3-depth",
    "top_k": "--eagle3-top-k",
    "max_nodes": "--eagle3-max-nodes",
    "ranking": "--eagle3-ranking",
}


def score_weights(args: argparse.Namespace, default_target: bool) -> ScoreWeights:
    """The tree score's weights: the flags given, else the preset of the target (the embedded one's,
    tuned for its head; upstream's for any other)."""
    preset = EMBEDDED_WEIGHTS if default_target else UPSTREAM_WEIGHTS
    given = {field: getattr(args, flag) for flag, field in WEIGHT_FLAGS.items() if getattr(args, flag) is not None}
    if "ngram_on_first_level" in given:
        given["ngram_on_first_level"] = given["ngram_on_first_level"] == "on"
    return replace(preset, **given)


def weight_flag_args(w: ScoreWeights) -> list[str]:
    """Command-line flags that give the tree score exactly the weights `w` (score_weights' inverse)."""
    argv = []
    for flag, field in WEIGHT_FLAGS.items():
        value = getattr(w, field)
        argv += [f"--{flag.replace('_', '-')}", ("on" if value else "off") if isinstance(value, bool) else str(value)]
    return argv


def _flag_error(e: ConfigError, flags: dict[str, str]) -> ValueError:
    return ValueError(f"{flags.get(e.field, e.field)} {e.rule}")


def dart_config(args: argparse.Namespace, default_target: bool) -> DartConfig:
    """DART's config from its flags; ValueError naming the first flag out of range."""
    try:
        return DartConfig.for_target(
            default_target,
            head=args.dart_model,
            weights=score_weights(args, default_target),
            ngram=args.ngram_model,
            small_ngram=args.use_small_ngram,
            use_ngram=not args.no_ngram,
            max_nodes=args.max_nodes,
            beam_width=args.beam_width,
            depth=args.draft_depth,
            min_score=args.tree_min_score,
            min_nodes=args.tree_min_nodes,
            context=not args.no_context_ngram,
            context_extend=args.context_extend,
            context_order=args.context_order,
            ranking=getattr(args, "dart_ranking", None),
            adaptive=getattr(args, "adaptive_tree", False),
        )
    except ConfigError as e:
        raise _flag_error(e, DART_FIELD_FLAGS) from None


def eagle3_config(args: argparse.Namespace) -> Eagle3Config:
    """EAGLE3's config from its flags (its tree size unset: DART's --max-nodes, so both verify trees
    of one size); ValueError naming the first flag out of range."""
    nodes = args.eagle3_max_nodes if args.eagle3_max_nodes is not None else args.max_nodes
    try:
        return Eagle3Config(args.eagle3_model, args.eagle3_depth, args.eagle3_top_k, nodes, getattr(args, "eagle3_ranking", None))
    except ConfigError as e:
        raise _flag_error(e, EAGLE3_FIELD_FLAGS) from None


def drafter_configs(args: argparse.Namespace, default_target: bool) -> DrafterConfigs:
    """Both drafters' configs from the flags; ValueError naming the first flag out of range."""
    return DrafterConfigs(dart_config(args, default_target), eagle3_config(args))


def unset_sizes(args: argparse.Namespace) -> set[str]:
    """The drafters whose tree size the flags leave to the calibration: DART without --max-nodes,
    EAGLE3 without --eagle3-max-nodes (calibrated on its own where its head has a τ table, else
    following DART's size: calibrate.calibrate_unset_sizes)."""
    return {name for name, dest in (("dart", "max_nodes"), ("eagle3", "eagle3_max_nodes")) if getattr(args, dest) is None}
