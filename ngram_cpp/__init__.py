"""N-gram trie and DART's n-gram guided tree pruner.

    model = ngram_cpp.load("assets/ngram/smollm2-3gram.ngram.xz")   # compact (mmap), upstream .trie, or either as .xz
    model.prob([12, 7], 99)                                       # upstream rule: longest matching context
    tree = ngram_cpp.prune(tokens, probs, root, context, model, ngram_cpp.PruneParams())

The C++ extension (`ngram_cpp._ngram`) is compiled by the package build. Where it is missing, the
same API runs on the pure-Python reference implementation (`HAVE_CPP` says which), only slower.

File formats (details in ngram_cpp/src/ngram.h): our compact format is a 160-byte header (magic
"DARTNGRM", version, order, vocab size, flags, total count, nodes per level, tokenizer fingerprint)
followed, per level, by the sorted token, count and child-offset arrays; it is memory-mapped, so
loading costs milliseconds at any size. The upstream format is fvliang/DART's `.trie` byte layout,
read and written unchanged; it records no vocabulary size or tokenizer (`vocab_known` is False and
`convert(..., vocab_size=, fingerprint=)` stamps them).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from .reference import (
    COMPACT_MAGIC,
    FROM_CONTEXT,
    FROM_HEAD,
    HEAD_AND_CONTEXT,
    PrunedTree,
    PruneParams,
    PyContextIndex,
    PyNGramModel,
    ancestor_paths_reference,
    prune_reference,
)

try:
    from . import _ngram

    HAVE_CPP = True
except ImportError:  # the extension was not built: fall back to the Python reference
    _ngram = None
    HAVE_CPP = False

__all__ = [
    "FROM_CONTEXT",
    "FROM_HEAD",
    "HEAD_AND_CONTEXT",
    "HAVE_CPP",
    "ContextIndex",
    "NGram",
    "PruneParams",
    "PrunedTree",
    "Pruner",
    "ancestor_paths",
    "build",
    "convert",
    "decompressed",
    "load",
    "prune",
    "tokenizer_fingerprint",
]

DEFAULT_ORDER = 3
# N-gram slices buffered before the builder sorts them and spills a run to disk: at order 3 a slice
# is 12 bytes, ~30 while its run is sorted, so ~600 MB of RAM at most.
DEFAULT_SLICES_IN_MEMORY = 20_000_000


class NGram:
    """An n-gram model, backed by the C++ trie when available."""

    def __init__(self, impl):
        self._impl = impl

    @property
    def order(self) -> int:
        return self._impl.order

    @property
    def vocab_size(self) -> int:
        return self._impl.vocab_size

    @property
    def vocab_known(self) -> bool:
        """True when vocab_size is the tokenizer's; False when it is only max token id + 1 (upstream .trie)."""
        return self._impl.vocab_known

    @property
    def total(self) -> int:
        return self._impl.total

    @property
    def num_nodes(self) -> int:
        return self._impl.num_nodes

    @property
    def fingerprint(self) -> str:
        return self._impl.fingerprint

    @property
    def native(self):
        """The C++ model (None with the Python fallback)."""
        return self._impl if HAVE_CPP and not isinstance(self._impl, PyNGramModel) else None

    def prob(self, context, token: int, smoothed: bool = False) -> float:
        """P(token | context).

        Upstream rule (default): the longest context suffix (up to order-1 tokens) after which `token`
        occurs gives count(suffix + token) / count(suffix); never seen after any suffix -> 0 (there is
        no unigram level and no discounting). smoothed=True: fixed-weight interpolation, 0.01/vocab
        plus 0.99 x the 2^len-weighted mean of those ratios over every occurring suffix length
        (len 0 = unigram), so no token gets 0 (details in ngram_cpp/src/ngram.cpp).
        context: token ids (list or int64 array), oldest first; only the last order-1 are used.
        Kept thin: per call this costs ~1 us of Python/pybind11 overhead around a ~0.2 us lookup."""
        return self._impl.prob(context, token, smoothed)

    def probs(self, context, tokens, smoothed: bool = False) -> np.ndarray:
        """P(t | context) for every t in tokens, one context lookup for all of them. (n,) float64."""
        return self._impl.probs(context, tokens, smoothed)

    def save(self, path, fmt: str = "compact") -> None:
        """Write in `compact` (ours, memory-mappable) or `upstream` (.trie) format."""
        if self.native is None:
            raise RuntimeError("saving needs the C++ extension (ngram_cpp._ngram)")
        if fmt == "compact":
            self._impl.save_compact(str(path))
        elif fmt == "upstream":
            self._impl.save_upstream(str(path))
        else:
            raise ValueError(f"unknown format {fmt!r}: 'compact' or 'upstream'")

    def validate(self) -> None:
        """Check every array (reads the whole file); raises RuntimeError on the first inconsistency.

        Loading checks only the header and the array bounds (so that it stays O(1)); lookups on a
        damaged file stay in bounds but may answer nonsense until this has been run."""
        if self.native is None:
            return  # the Python reader checks everything while parsing
        self._impl.validate()

    def set_metadata(self, vocab_size: int, fingerprint: str) -> None:
        """Stamp the tokenizer's vocabulary size and fingerprint (e.g. on an upstream .trie before saving it compact)."""
        self._impl.set_metadata(int(vocab_size), str(fingerprint))


def _is_compact(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(COMPACT_MAGIC)) == COMPACT_MAGIC


XZ = ".xz"  # an n-gram file compressed with xz (the repository ships its trie so: a fifth of the bytes)


def cache_dir() -> Path:
    """Where compressed n-gram files are decompressed: $DART_CACHE_DIR/ngram (default ~/.cache/dart-demo)."""
    return Path(os.environ.get("DART_CACHE_DIR") or Path.home() / ".cache" / "dart-demo") / "ngram"


def decompressed(path) -> Path:
    """The plain file of a `.xz`-compressed n-gram file: decompressed once into cache_dir()/<digest of
    the compressed bytes>/<name without .xz>, then read from there (a compact file is memory-mapped,
    which a compressed one cannot be). The same compressed bytes always give the same file."""
    import lzma

    path = Path(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    out = cache_dir() / digest / path.name.removesuffix(XZ)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".partial-")
    try:
        with os.fdopen(fd, "wb") as f, lzma.open(path) as src:
            while chunk := src.read(1 << 22):
                f.write(chunk)
        os.replace(tmp, out)  # atomic: a reader never sees half a file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def load(path, expected_fingerprint: str | None = None, expected_vocab_size: int | None = None) -> NGram:
    """Load a compact (.ngram, memory-mapped) or upstream (.trie) file; the format is detected. A name
    ending in .xz is decompressed first (decompressed()).

    With `expected_fingerprint` / `expected_vocab_size`, a trie built for another tokenizer is refused.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no n-gram file at {path}")
    if path.name.endswith(XZ):
        path = decompressed(path)
    compact = _is_compact(path)
    try:
        if HAVE_CPP:
            impl = _ngram.NGramModel.load_compact(str(path)) if compact else _ngram.NGramModel.load_upstream(str(path))
        else:
            impl = PyNGramModel.load(path)
    except RuntimeError as e:
        if compact:
            raise
        raise RuntimeError(
            f"{e}; the file does not start with the compact magic {COMPACT_MAGIC.decode()}, so it was read as an upstream .trie"
        ) from e
    model = NGram(impl)
    if expected_fingerprint and model.fingerprint and model.fingerprint != expected_fingerprint:
        raise ValueError(
            f"{path} was built for another tokenizer (fingerprint {model.fingerprint[:12]}…, expected {expected_fingerprint[:12]}…)"
        )
    if expected_vocab_size is not None and model.vocab_size > expected_vocab_size:
        raise ValueError(f"{path} holds token ids up to {model.vocab_size - 1}, beyond the tokenizer's vocabulary of {expected_vocab_size}")
    return model


def build(
    sequences: Iterable,
    vocab_size: int,
    order: int = DEFAULT_ORDER,
    fingerprint: str = "",
    slices_in_memory: int = DEFAULT_SLICES_IN_MEMORY,
    spill_dir: str | os.PathLike | None = None,
) -> NGram:
    """Count every n-gram (n <= order) of the sequences, which never share n-grams across each other.

    Streams: beyond `slices_in_memory` buffered n-gram slices, sorted runs spill to `spill_dir` (a
    temporary directory by default) and are merged at the end.
    """
    if not HAVE_CPP:
        model = PyNGramModel(order, vocab_size)
        for seq in sequences:
            model.add(seq)
        model.fingerprint = fingerprint
        return NGram(model)
    with tempfile.TemporaryDirectory(dir=spill_dir) as tmp:
        builder = _ngram.Builder(order, vocab_size, slices_in_memory, tmp)
        for seq in sequences:
            builder.add(np.asarray(seq, dtype=np.int64))
        return NGram(builder.finish(fingerprint))


def convert(src, dst, fmt: str | None = None, vocab_size: int | None = None, fingerprint: str | None = None) -> NGram:
    """Convert between formats (the target format defaults to the other one); the input is fully validated.

    `vocab_size`/`fingerprint` stamp the tokenizer into the output header, which an upstream .trie
    lacks (the compact loader then refuses the file for another tokenizer).
    """
    model = load(src)
    if fmt is None:
        fmt = "upstream" if _is_compact(Path(src)) else "compact"
    if vocab_size is not None or fingerprint is not None:
        model.set_metadata(
            model.vocab_size if vocab_size is None else vocab_size, model.fingerprint if fingerprint is None else fingerprint
        )
    model.validate()
    model.save(dst, fmt)
    return model


class ContextIndex:
    """The context n-gram of one conversation: every n-gram (n <= max_order) of the tokens given to
    `extend` so far, with the tokens that followed it. The DART pruner looks up the longest suffix of
    (these tokens + root + a draft path) that occurred before and proposes what followed it.
    Updating costs O(max_order) per new token (C++ where built, else the Python reference)."""

    def __init__(self, max_order: int = 4, tokens=()):
        self._impl = _ngram.ContextIndex(int(max_order)) if HAVE_CPP else PyContextIndex(int(max_order))
        if len(tokens):
            self.extend(tokens)

    def extend(self, tokens) -> None:
        self._impl.extend(np.asarray(tokens, dtype=np.int64).reshape(-1))

    def __len__(self) -> int:
        return len(self._impl)

    @property
    def max_order(self) -> int:
        return self._impl.max_order

    def lookup(self, virtual_tokens, min_len: int = 1) -> tuple[int, dict[int, int], int]:
        """(match length, {token: count}, most recent continuation) of the longest suffix of the
        indexed tokens + virtual_tokens (root, path) that occurred earlier; (0, {}, -1) if none."""
        return self._impl.lookup(np.asarray(virtual_tokens, dtype=np.int64).reshape(-1), int(min_len))


def prune(
    tokens,
    probs,
    root: int,
    context,
    model: NGram | None,
    params: PruneParams = PruneParams(),
    eos_id: int = -1,
    index: ContextIndex | None = None,
) -> PrunedTree:
    """Turn per-depth top-k draft candidates into a draft tree (DART's n-gram guided beam search).

    tokens  (d, k) int64    target-vocabulary ids; row j holds the candidates for depth j + 1
    probs   (d, k) float32  their draft probabilities, already softmaxed within the row (as upstream)
    root    int             the token the target just produced (tree index 0)
    context (n,) int64      committed tokens before the root, NOT including it (the last order-1 of
                            context + root + path are the n-gram context)
    model   the n-gram model, or None (draft probabilities only)
    eos_id  sequences ending in it are never extended (-1: none)
    index   the context n-gram over every committed token before the root (used when
            params.context_weight > 0), or None
    Returns a PrunedTree (N = kept nodes + 1, index 0 = root, depth order); the score and the
    selection rule are in ngram_cpp/src/pruner.h. Raises ValueError on bad shapes, ids, probabilities
    or parameters. Uses the C++ extension when available, else the Python reference (same trees).
    """
    if not _runs_native(model):
        return prune_reference(
            tokens, probs, root, context, None if model is None else model._impl, params, eos_id, None if index is None else index._impl
        )
    out = _ngram.prune(
        np.asarray(tokens, dtype=np.int64),
        np.asarray(probs, dtype=np.float32),
        int(root),
        np.asarray(context, dtype=np.int64).reshape(-1),
        None if model is None else model.native,
        _native_params(params),
        int(eos_id),
        None if index is None else index._impl,
    )
    return PrunedTree(**out)


class Pruner:
    """`prune` bound to one model, parameter set, EOS id and context index, for a caller that prunes every
    step with the same ones (DART's drafter): their native copies are taken once, and `nodes` returns
    the tree's node arrays alone, without the mask and the retrieve rows (the same search, the same nodes)."""

    def __init__(self, model: NGram | None, params: PruneParams, eos_id: int = -1, index: ContextIndex | None = None):
        self.model, self.params, self.eos_id, self.index = model, params, int(eos_id), index
        self._native = None
        if _runs_native(model):
            self._native = (
                None if model is None else model.native,
                _native_params(params),
                self.eos_id,
                None if index is None else index._impl,
            )

    def nodes(self, tokens: np.ndarray, probs: np.ndarray, root: int, context) -> tuple[np.ndarray, ...]:
        """prune(tokens, probs, root, context, ...)'s tokens, parents, positions (the depths), scores and
        sources; tokens int64 and probs float32 (d, k) arrays (others are converted)."""
        if self._native is None:
            t = prune(tokens, probs, root, context, self.model, self.params, self.eos_id, self.index)
            return t.tokens, t.parents, t.positions, t.scores, t.sources
        out = _ngram.prune(tokens, probs, root, context, *self._native, False)
        return out["tokens"], out["parents"], out["positions"], out["scores"], out["sources"]


def _runs_native(model: NGram | None) -> bool:
    """Whether prune runs the C++ search with this model (else the Python reference)."""
    return HAVE_CPP and (model is None or model.native is not None)


def ancestor_paths(parents: np.ndarray, paths: np.ndarray, lengths: np.ndarray) -> None:
    """Fill paths[i] (int32 rows of paths.shape[1]) with node i's path from its root, root first and i
    last, then zeros, and lengths[i] (int32) with its length, for a tree given by parent links
    parents (n,) int64, parents[i] < i, -1 for a root: the fixed-shape forward's rows' paths, built on
    the host once a step (one call instead of numpy's operations a depth). Raises ValueError on a parent
    that does not come before its child or a path longer than a row."""
    if not HAVE_CPP:
        return ancestor_paths_reference(parents, paths, lengths)
    if paths.dtype != np.int32 or lengths.dtype != np.int32 or not paths.flags.c_contiguous or not lengths.flags.c_contiguous:
        raise ValueError("ancestor_paths writes into C-contiguous int32 arrays")
    _ngram.ancestor_paths(np.asarray(parents, dtype=np.int64), paths, lengths)


def _native_params(params: PruneParams):
    """The C++ extension's copy of `params` (read-only there), built once per distinct value: a drafter
    passes the same values every step, and copying the fitted ranking's weights took a few us."""
    try:
        return _cached_native_params(params)
    except TypeError:  # a field given as a list (unhashable): built for this call alone
        return _build_native_params(params)


def _build_native_params(params: PruneParams):
    native = _ngram.PruneParams()
    for f in dataclasses.fields(PruneParams):
        setattr(native, f.name, getattr(params, f.name))
    return native


_cached_native_params = functools.lru_cache(maxsize=64)(_build_native_params)


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable hash of a tokenizer's vocabulary, stored in compact files to catch mismatches."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256()
    for tok, idx in vocab:
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]  # the compact header holds up to 63 characters
