"""The drafters the bench and the app offer, declared once: each one's command-line flags (with the
upstream app's names as aliases), its per-device defaults and how it is built.

    p = argparse.ArgumentParser(); add_drafter_flags(p)
    args = p.parse_args(); check_drafter_flags(args)
    drafter = build_drafter("dart", target, args, default_target=True)

`build_drafter` raises OSError / ValueError when a head or n-gram file cannot be loaded; the caller
decides whether that is fatal (the bench, a head named on the command line) or a note (the app's
optional embedded heads).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..loading import ngram_hub_dir
from . import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD, DEFAULT_MAX_NODES, DEFAULT_NGRAM, default_max_nodes
from .dart import CONTEXT_EXTEND, CONTEXT_ORDER, EMBEDDED_WEIGHTS, UPSTREAM_WEIGHTS, ScoreWeights


# Upstream's app defaults --ngram-model-name-or-path to this hub repo (full.trie, small.trie with
# --use-small-ngram; facts doc §5.3, §7.1); its tries are built with Qwen3's tokenizer.
UPSTREAM_NGRAM = "fvliang/dart-qwen3-ngram"
UPSTREAM_NGRAM_TARGETS = ("qwen3", "qwen3_moe")  # targets (config model_type) whose token ids those tries hold


@dataclass(frozen=True)
class DrafterSpec:
    name: str  # the method name in the bench and the app
    title: str  # its flags' group in --help
    add_flags: Callable[[argparse._ArgumentGroup], None]
    build: Callable[..., object]  # (target, args, default_target: bool, **variant) -> a Drafter
    head_dest: str  # the args attribute naming its head (None: the embedded one)
    default_head: Path


def _dart_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--dart-model", "--dart-model-name-or-path", dest="dart_model", default=None,
                   help=f"DART head dir or hub id (default: the embedded head, assets/{DEFAULT_DART_HEAD.name})")
    g.add_argument("--ngram-model", "--ngram-model-name-or-path", dest="ngram_model", default=None,
                   help="n-gram file (.ngram or upstream .trie), a directory with full.trie/small.trie or one *.ngram, or a hub id "
                        f"such as upstream's {UPSTREAM_NGRAM} (the local HF cache first, then the hub). Default: the embedded trie "
                        f"for the default target; {UPSTREAM_NGRAM}, as upstream's app, for a Qwen3 target with a named head; else none")
    g.add_argument("--use-small-ngram", action="store_true", help="with an n-gram directory or hub id, load small.trie instead of full.trie")
    g.add_argument("--no-ngram", action="store_true", help="prune draft trees without the n-gram model")
    g.add_argument("--tree-top-k", type=int, default=None,
                   help=f"candidates per depth (default: {EMBEDDED_WEIGHTS.top_k} for the embedded target, else {UPSTREAM_WEIGHTS.top_k})")
    g.add_argument("--level-exponent", type=float, default=None,
                   help=f"tree score: level l weighs (l+1)^this (default {EMBEDDED_WEIGHTS.level_exponent} embedded, else {UPSTREAM_WEIGHTS.level_exponent})")
    g.add_argument("--logit-decay", type=float, default=None,
                   help=f"tree score: the head's log-probability at level l weighs this^l (default {EMBEDDED_WEIGHTS.logit_decay} embedded, else {UPSTREAM_WEIGHTS.logit_decay})")
    g.add_argument("--ngram-weight", type=float, default=None,
                   help=f"tree score: weight of the trie's log-probability (default {EMBEDDED_WEIGHTS.ngram_weight})")
    g.add_argument("--ngram-first-level", choices=["on", "off"], default=None,
                   help="tree score: whether the trie also scores depth 1 (default on for the embedded target, else off)")
    g.add_argument("--beam-width", type=int, default=20)
    g.add_argument("--max-nodes", type=int, default=None,
                   help="drafted tree nodes besides the root (default: on the CPU kernels, the size calibrated on this machine for a head "
                        f"with a tree_sizes.json (dart_core/calibrate.py); else per device: {DEFAULT_MAX_NODES})")
    g.add_argument("--no-calibration", action="store_true",
                   help=f"tree sizes left unset take the device default ({DEFAULT_MAX_NODES}) instead of this machine's calibration")
    g.add_argument("--draft-depth", type=int, default=None, help="use only the head's first N rows (tree depth <= N; default: all D+1)")
    g.add_argument("--tree-min-score", type=float, default=None,
                   help="score floor: past --tree-min-nodes, keep a node only if its tree score (a log-probability-like sum, "
                        "<= 0) is at least this, so trees shrink where the draft is unsure (default: off, every tree has --max-nodes)")
    g.add_argument("--tree-min-nodes", type=int, default=0, help="nodes kept whatever their score when --tree-min-score is set (default 0)")
    g.add_argument("--no-context-ngram", action="store_true", help="prune without the context n-gram (the conversation's own repeats)")
    g.add_argument("--context-weight", type=float, default=None,
                   help=f"context n-gram weight at a full-length match, in [0, 1] (default {EMBEDDED_WEIGHTS.context_weight} for the embedded target, else {UPSTREAM_WEIGHTS.context_weight})")
    g.add_argument("--context-candidates", type=int, default=None,
                   help=f"context-only candidates per tree node (default {EMBEDDED_WEIGHTS.context_max_candidates} embedded, else {UPSTREAM_WEIGHTS.context_max_candidates})")
    g.add_argument("--context-extend", type=int, default=CONTEXT_EXTEND, help=f"tree levels past the head's rows that follow a context match (default {CONTEXT_EXTEND})")
    g.add_argument("--context-order", type=int, default=CONTEXT_ORDER, help=f"longest context match in tokens (default {CONTEXT_ORDER})")
    g.add_argument("--dart-ranking", choices=["fitted", "score"], default=None,
                   help="how the pruner ranks tree nodes: 'fitted', the head's model of P(node accepted) (acceptance.json beside it, "
                        "scripts/fit_acceptance.py), or 'score', the hand-weighted head and trie log-probabilities (the --level-exponent "
                        "... flags). Default: fitted where the head has one for the trie in use, else score")
    g.add_argument("--adaptive-tree", action="store_true",
                   help="per step, keep the prefix of the fitted ranking with the most expected tokens per ms of this machine's "
                        "measured step cost, up to --max-nodes (needs the fitted ranking)")


def _eagle3_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--eagle3-model", "--eagle3-model-name-or-path", dest="eagle3_model", default=None,
                   help=f"EAGLE3 head dir or hub id (default: the embedded head, assets/{DEFAULT_EAGLE3_HEAD.name})")
    g.add_argument("--eagle3-depth", type=int, default=7, help="expansion steps after the root's (EAGLE3 default 7)")
    g.add_argument("--eagle3-top-k", type=int, default=10, help="children per node and frontier size (EAGLE3 default 10)")
    g.add_argument("--eagle3-ranking", choices=["fitted", "score"], default=None,
                   help="how EAGLE3 keeps its pool's nodes: 'score', EAGLE's cumulative log-probability, or 'fitted', the head's model "
                        "of P(node accepted) (acceptance.json beside it, scripts/fit_acceptance.py --method eagle3). Default: the score")
    g.add_argument("--eagle3-max-nodes", type=int, default=None,
                   help="drafted tree nodes besides the root (default: calibrated like --max-nodes where the head has a "
                        "tree_sizes.json, else DART's --max-nodes, so both verify trees of one size)")


def max_nodes(args: argparse.Namespace, device_type: str) -> int:
    """DART's tree size: --max-nodes, else the device default."""
    return args.max_nodes if args.max_nodes is not None else default_max_nodes(device_type)


# flag -> ScoreWeights field; a flag left unset takes the preset's value
WEIGHT_FLAGS = {"tree_top_k": "top_k", "level_exponent": "level_exponent", "logit_decay": "logit_decay", "ngram_weight": "ngram_weight",
                "ngram_first_level": "ngram_on_first_level", "context_weight": "context_weight", "context_candidates": "context_max_candidates"}


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


def tree_params(args: argparse.Namespace, device_type: str, ngram: bool, context: bool = True, default_target: bool = False):
    """DART's pruning parameters from the flags."""
    import ngram_cpp

    from .dart import weighted

    floor = {} if args.tree_min_score is None else {"min_score": args.tree_min_score, "min_nodes": args.tree_min_nodes}
    plain = ngram_cpp.PruneParams(beam_width=args.beam_width, max_nodes=max_nodes(args, device_type), use_ngram=ngram, **floor)
    return weighted(plain, score_weights(args, default_target), context and not args.no_context_ngram, args.context_extend)


@dataclass(frozen=True)
class NgramChoice:
    """The n-gram file DART prunes with (None: none) and, for the app's header, a note saying which
    one or why there is none."""

    path: Path | None
    note: str | None = None


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _ngram_in(path: Path, trie: str) -> Path:
    """In a directory, `trie` (full.trie or small.trie) or its one *.ngram."""
    found = next((c for c in [path / trie, *sorted(path.glob("*.ngram"))] if c.is_file()), None)
    if found is None:
        raise FileNotFoundError(f"no {trie} or *.ngram in {path}")
    return found


def _named_ngram(name: str, trie: str) -> Path:
    """--ngram-model: a file, a directory, else a hub id (the local HF cache first, then the hub), as
    upstream's app resolves it (a local path first, then the hub)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return _ngram_in(path, trie)
    if path.is_file():
        return path
    if _is_hub_id(name):
        return _ngram_in(ngram_hub_dir(name, trie), trie)
    raise FileNotFoundError(f"no n-gram file at {path}")


def _model_type(target) -> str | None:
    """The target checkpoint's config.json model_type (None when unreadable)."""
    try:
        return json.loads((Path(target.model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def ngram_choice(args: argparse.Namespace, default_target: bool, target=None) -> NgramChoice:
    """The n-gram file DART prunes with, and why.

    --no-ngram: none. A named file, directory or hub id (full.trie, small.trie with --use-small-ngram,
    or one *.ngram) must resolve, else FileNotFoundError. Unnamed: the embedded trie for the default
    target; for a Qwen3 `target` with a named head, upstream's default (UPSTREAM_NGRAM), fetched as
    upstream's app fetches it (the HF cache, else the hub; when neither has it: none, with a note); for any other
    target none (upstream's tries hold Qwen3 token ids)."""
    if args.no_ngram:
        return NgramChoice(None, "DART prunes its trees without an n-gram model (--no-ngram).")
    trie = "small.trie" if args.use_small_ngram else "full.trie"
    if args.ngram_model is not None:
        return NgramChoice(_named_ngram(args.ngram_model, trie))
    if default_target:
        return NgramChoice(DEFAULT_NGRAM) if DEFAULT_NGRAM.exists() else NgramChoice(None, "DART prunes its trees without an n-gram model.")
    unnamed = "DART prunes its trees without an n-gram model: none was named (--ngram-model-name-or-path)"
    if target is None or args.dart_model is None:
        return NgramChoice(None, unnamed + ".")
    if _model_type(target) not in UPSTREAM_NGRAM_TARGETS:
        return NgramChoice(None, f"{unnamed}, and upstream's default, {UPSTREAM_NGRAM}, holds Qwen3 token ids, not this target's.")
    try:
        path = _ngram_in(ngram_hub_dir(UPSTREAM_NGRAM, trie), trie)
    except FileNotFoundError as e:
        return NgramChoice(None, f"{unnamed}, and upstream's default could not be found: {e}.")
    return NgramChoice(path, f"DART prunes with upstream's default n-gram {UPSTREAM_NGRAM} ({trie}), as upstream's app does "
                             "(--ngram-model-name-or-path names another, --no-ngram turns it off).")


def resolve_ngram(args: argparse.Namespace, default_target: bool, target=None) -> Path | None:
    """The n-gram file DART prunes with (ngram_choice without the note)."""
    return ngram_choice(args, default_target, target).path


def _build_dart(target, args: argparse.Namespace, default_target: bool, context: bool = True, ngram: NgramChoice | None = None):
    """ngram: the choice made already (the app makes it once, for its note); None: make it here."""
    from .dart import DartParams, load_dart_drafter

    ngram = (ngram or ngram_choice(args, default_target, target)).path
    params = DartParams(tree_params(args, target.device.type, ngram is not None, context, default_target), args.draft_depth, args.context_order)
    return load_dart_drafter(args.dart_model or DEFAULT_DART_HEAD, target, ngram, params, getattr(args, "dart_ranking", None),
                             getattr(args, "adaptive_tree", False))


def _build_eagle3(target, args: argparse.Namespace, default_target: bool):
    from .eagle3 import Eagle3Params, load_eagle3_drafter

    nodes = args.eagle3_max_nodes if args.eagle3_max_nodes is not None else max_nodes(args, target.device.type)
    return load_eagle3_drafter(args.eagle3_model or DEFAULT_EAGLE3_HEAD, target, Eagle3Params(args.eagle3_depth, args.eagle3_top_k, nodes),
                               getattr(args, "eagle3_ranking", None))


DRAFTERS: dict[str, DrafterSpec] = {
    "dart": DrafterSpec("dart", "DART draft trees", _dart_flags, _build_dart, "dart_model", DEFAULT_DART_HEAD),
    "eagle3": DrafterSpec("eagle3", "EAGLE3 draft trees (the baseline)", _eagle3_flags, _build_eagle3, "eagle3_model", DEFAULT_EAGLE3_HEAD),
}


def add_drafter_flags(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """Every drafter's flags, one argument group each; returns the groups by drafter name."""
    groups = {}
    for spec in DRAFTERS.values():
        groups[spec.name] = parser.add_argument_group(spec.title)
        spec.add_flags(groups[spec.name])
    return groups


def drafter_args(**overrides) -> argparse.Namespace:
    """Every drafter flag at its default, with `overrides` (dest names, e.g. max_nodes=16): the
    settings a library caller gets without a command line."""
    parser = argparse.ArgumentParser(add_help=False)
    add_drafter_flags(parser)
    args = parser.parse_args([])
    for dest, value in overrides.items():
        if not hasattr(args, dest):
            raise ValueError(f"no drafter flag has the destination {dest!r}")
        setattr(args, dest, value)
    return args


def check_drafter_flags(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first flag out of range."""
    if args.context_weight is not None and not 0.0 <= args.context_weight <= 1.0:
        raise ValueError("--context-weight must be in [0, 1]")
    if args.context_candidates is not None and args.context_candidates < 0:
        raise ValueError("--context-candidates must be >= 0")
    for flag in ("level_exponent", "logit_decay", "ngram_weight"):
        if getattr(args, flag) is not None and not math.isfinite(getattr(args, flag)):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number")
    if args.context_extend < 0 or args.context_order < 1:
        raise ValueError("--context-extend must be >= 0 and --context-order >= 1")
    for flag, value in (("--max-nodes", args.max_nodes), ("--eagle3-max-nodes", args.eagle3_max_nodes)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0")
    if (args.tree_top_k is not None and args.tree_top_k < 1) or args.beam_width < 1 or args.eagle3_top_k < 1 or args.eagle3_depth < 0:
        raise ValueError("--tree-top-k, --beam-width and --eagle3-top-k must be >= 1, --eagle3-depth >= 0")
    if args.tree_min_nodes < 0 or (args.tree_min_score is not None and not args.tree_min_score <= 0.0):
        raise ValueError("--tree-min-nodes must be >= 0 and --tree-min-score <= 0 (tree scores are never positive)")
    if args.draft_depth is not None and args.draft_depth < 1:
        raise ValueError("--draft-depth must be >= 1")


def head_is_named(name: str, args: argparse.Namespace) -> bool:
    """Whether the command line named this drafter's head (else the embedded one is used)."""
    return getattr(args, DRAFTERS[name].head_dest) is not None


def embedded_head_exists(name: str) -> bool:
    return (DRAFTERS[name].default_head / "config.json").exists()


def build_drafter(name: str, target, args: argparse.Namespace, default_target: bool, **variant):
    """Build the drafter `name` for `target` from the flags (variant: e.g. context=False for DART)."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: choose from {', '.join(DRAFTERS)}")
    return DRAFTERS[name].build(target, args, default_target, **variant)
