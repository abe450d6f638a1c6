"""Building the drafters the bench, the app and the tools offer, from their typed configs.

    drafter = build_drafter("dart", target, DartConfig.embedded(max_nodes=8))

`build_drafter` raises OSError / ValueError when a head or n-gram file cannot be loaded; the caller
decides whether that is fatal (the bench, a head named on the command line) or a note (the app's
optional embedded heads). Command-line flags become configs in dart_core/cli/options.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..loading import ngram_hub_dir
from . import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD, DEFAULT_NGRAM
from .config import ConfigError, DartConfig, DrafterConfig, Eagle3Config

# Upstream's app defaults --ngram-model-name-or-path to this hub repo (full.trie, small.trie with
# --use-small-ngram); its tries are built with Qwen3's tokenizer.
UPSTREAM_NGRAM = "fvliang/dart-qwen3-ngram"
UPSTREAM_NGRAM_TARGETS = ("qwen3", "qwen3_moe")  # targets (config model_type) whose token ids those tries hold
FULL_TRIE, SMALL_TRIE = "full.trie", "small.trie"

DEFAULT_HEADS = {"dart": DEFAULT_DART_HEAD, "eagle3": DEFAULT_EAGLE3_HEAD}
CONFIG_TYPES = {"dart": DartConfig, "eagle3": Eagle3Config}


def embedded_head_exists(name: str) -> bool:
    return (DEFAULT_HEADS[name] / "config.json").exists()


@dataclass(frozen=True)
class NgramChoice:
    """The n-gram file DART prunes with (None: none) and, for the app's header, a note saying which
    one or why there is none."""

    path: Path | None
    note: str | None = None


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _ngram_in(path: Path, trie: str) -> Path:
    """In a directory, `trie` (full.trie or small.trie) or its one *.ngram (or *.ngram.xz)."""
    found = next((c for c in [path / trie, *sorted(path.glob("*.ngram")), *sorted(path.glob("*.ngram.xz"))] if c.is_file()), None)
    if found is None:
        raise FileNotFoundError(f"no {trie}, *.ngram or *.ngram.xz in {path}")
    return found


def _named_ngram(name: str, trie: str) -> Path:
    """A named n-gram: a file, a directory, else a hub id (the local HF cache first, then the hub), as
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


def ngram_choice(config: DartConfig, target=None) -> NgramChoice:
    """The n-gram file DART prunes with, and why.

    use_ngram off: none. A named file, directory or hub id (full.trie, small.trie with small_ngram,
    or one *.ngram) must resolve, else FileNotFoundError. Unnamed: the embedded trie for the embedded
    target; for a Qwen3 `target` with a named head, upstream's default (UPSTREAM_NGRAM), fetched as
    upstream's app fetches it (the HF cache, else the hub; when neither has it: none, with a note); for
    any other target none (upstream's tries hold Qwen3 token ids)."""
    if not config.use_ngram:
        return NgramChoice(None, "DART prunes its trees without an n-gram model (--no-ngram).")
    trie = SMALL_TRIE if config.small_ngram else FULL_TRIE
    if config.ngram is not None:
        return NgramChoice(_named_ngram(str(config.ngram), trie))
    if config.embedded_target:
        return NgramChoice(DEFAULT_NGRAM) if DEFAULT_NGRAM.exists() else NgramChoice(None, "DART prunes its trees without an n-gram model.")
    unnamed = "DART prunes its trees without an n-gram model: none was named (--ngram-model-name-or-path)"
    if target is None or config.head is None:
        return NgramChoice(None, unnamed + ".")
    if _model_type(target) not in UPSTREAM_NGRAM_TARGETS:
        return NgramChoice(None, f"{unnamed}, and upstream's default, {UPSTREAM_NGRAM}, holds Qwen3 token ids, not this target's.")
    try:
        path = _ngram_in(ngram_hub_dir(UPSTREAM_NGRAM, trie), trie)
    except FileNotFoundError as e:
        return NgramChoice(None, f"{unnamed}, and upstream's default could not be found: {e}.")
    return NgramChoice(
        path,
        f"DART prunes with upstream's default n-gram {UPSTREAM_NGRAM} ({trie}), as upstream's app does "
        "(--ngram-model-name-or-path names another, --no-ngram turns it off).",
    )


def resolve_ngram(config: DartConfig, target=None) -> Path | None:
    """The n-gram file DART prunes with (ngram_choice without the note)."""
    return ngram_choice(config, target).path


def prune_params(config: DartConfig, device_type: str, ngram: bool):
    """DART's pruning parameters (ngram_cpp.PruneParams): the tree size, beam, score floor and
    weights of `config`, with the trie (`ngram`) and the context n-gram on or off."""
    import ngram_cpp

    from .dart import weighted

    floor = {} if config.min_score is None else {"min_score": config.min_score, "min_nodes": config.min_nodes}
    plain = ngram_cpp.PruneParams(beam_width=config.beam_width, max_nodes=config.tree_size(device_type), use_ngram=ngram, **floor)
    return weighted(plain, config.weights, config.context, config.context_extend)


def _build_dart(target, config: DartConfig):
    from .dart import DartParams, load_dart_drafter

    ngram = ngram_choice(config, target).path
    params = DartParams(prune_params(config, target.device.type, ngram is not None), config.depth, config.context_order)
    if config.adaptive and not config.row_costs:
        raise ConfigError("row_costs", "must be measured for an adaptive tree size (dart_core.tools.calibrate.with_row_costs)")
    return load_dart_drafter(config.head or DEFAULT_DART_HEAD, target, ngram, params, config.ranking, config.adaptive, config.row_costs)


def _build_eagle3(target, config: Eagle3Config):
    from .eagle3 import Eagle3Params, load_eagle3_drafter

    params = Eagle3Params(config.depth, config.top_k, config.tree_size(target.device.type))
    return load_eagle3_drafter(config.head or DEFAULT_EAGLE3_HEAD, target, params, config.ranking)


_BUILDERS = {"dart": _build_dart, "eagle3": _build_eagle3}


def build_drafter(name: str, target, config: DrafterConfig | None = None):
    """Build the drafter `name` ("dart" or "eagle3") for `target` from its config (None: the
    config's defaults, i.e. the embedded presets)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown drafter {name!r}: choose from {', '.join(_BUILDERS)}")
    if not isinstance(config, (CONFIG_TYPES[name], type(None))):
        raise TypeError(f"{name}: expected a {CONFIG_TYPES[name].__name__}, got {type(config).__name__}")
    return _BUILDERS[name](target, config if config is not None else CONFIG_TYPES[name]())
