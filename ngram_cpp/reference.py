"""Pure-Python n-gram model and pruner: the executable specification of the C++ code.

Slow but obviously correct; the tests check that the C++ agrees with it on random cases, and it is
the fallback when the extension is not built (e.g. on a platform without a compiler).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass

import numpy as np

COMPACT_MAGIC = b"DARTNGRM"
COMPACT_VERSION = 1
MAX_ORDER = 8
HEADER = struct.Struct("<8sIIII Q 8Q 64s")  # magic, version, order, vocab, flags, total, level sizes, fingerprint
ALIGN = 8
FLAG_VOCAB_IS_LOWER_BOUND = 1  # vocab_size is only max token id + 1 (converted from an upstream .trie)
UNIFORM_WEIGHT = 0.01  # smoothed mode, as in ngram.cpp
TOKEN_ID_LIMIT = 2**31  # ids must fit the trie's int32 tokens
MAX_EXPANDED_NODES = 1 << 24  # the pruner refuses searches larger than this (as pruner.cpp)
UPSTREAM_RECORD = struct.Struct("<iQIQ")  # token, parent, freq (an int32 upstream, read as the uint32 it counted), n_children
UPSTREAM_CHILD = struct.Struct("<iQ")  # child token, child index


@dataclass(frozen=True)
class PruneParams:
    """Tree search parameters (defaults: upstream DART's tree_search_config)."""

    top_k: int = 25
    beam_width: int = 20
    max_nodes: int = 60  # drafted nodes kept, root excluded
    level_exponent: float = -0.7  # level weight (l + 1) ** level_exponent
    logit_decay: float = 0.9  # draft log-prob weight decay ** l
    ngram_weight: float = 0.5
    use_ngram: bool = True
    ngram_on_first_level: bool = False  # upstream builds with -DNO_NGRAM_ON_FIRST_TOKEN
    eps: float = 1e-10
    # The context n-gram (ours; see ngram_cpp/src/pruner.h): draft probabilities mixed with the
    # continuations of the longest earlier match, lambda = context_weight * match / max_order.
    context_weight: float = 0.0  # 0: off
    context_min_match: int = 1
    context_extend: int = 0  # levels past the head's rows drafted from the context alone
    context_extend_min_match: int = 2
    context_max_candidates: int = 4  # context-only candidates per parent
    # A score floor (trees that adapt their size): past the first min_nodes of the ranking a node is
    # kept only if its score is >= min_score; -inf keeps max_nodes nodes.
    min_score: float = float("-inf")
    min_nodes: int = 0
    # The fitted ranking (ngram_cpp/src/pruner.h): levels * ACCEPTANCE_FEATURES logistic weights, row
    # l for level l (the last row for deeper levels); (): the hand-weighted score above.
    acceptance: tuple = ()
    # Adaptive size (with `acceptance`): row_costs[r - 1] is the cost of a step verifying r rows; per
    # step the tree keeps the prefix of the ranking with the most expected tokens per unit of cost.
    row_costs: tuple = ()


@dataclass
class PrunedTree:
    """The verifier's arrays. N = kept nodes + 1; index 0 is the root.

    Nodes are in depth order; within a depth, best score first (ties: expansion order), so every
    parent precedes its children. retrieve rows are root-to-leaf paths in lexicographic order of the
    leaves' token sequences (a prefix before its extensions), as upstream's encode_tree.
    """

    tokens: np.ndarray  # (N,) int64
    parents: np.ndarray  # (N,) int64, root -1
    positions: np.ndarray  # (N,) int64 depth
    scores: np.ndarray  # (N,) float32 cumulative beam score
    mask: np.ndarray  # (N, N) bool, row i = i and its ancestors
    retrieve: np.ndarray  # (leaves, max_depth + 1) int64, -1 padded
    sources: np.ndarray | None = None  # (N,) uint8: FROM_HEAD, HEAD_AND_CONTEXT, FROM_CONTEXT


FROM_HEAD, HEAD_AND_CONTEXT, FROM_CONTEXT = 0, 1, 2
MAX_CONTEXT_ORDER = 8
ACCEPTANCE_FEATURES = 14
FEATURE_FLOOR = 1e-6  # as pruner.cpp's kFeatureFloor
FEATURE_NAMES = (
    "bias",
    "score",
    "increment",
    "ln head p",
    "in head top-k",
    "head rank 0",
    "ln(1 + head rank)",
    "ln row's top p",
    "ln trie q",
    "trie seen",
    "context match / max order",
    "ln context share",
    "context seen",
    "parent's fitted ln P",
)


def acceptance_features(
    score: float,
    inc: float,
    head: bool,
    p: float,
    rank: int,
    head_row: bool,
    row_top: float,
    q: float,
    match: int,
    max_order: int,
    c: float,
    parent_fit: float,
) -> list[float]:
    """The fitted ranking's features of one node, as pruner.cpp's acceptance_features (pruner.h says
    what each argument is)."""
    return [
        1.0,
        score,
        inc,
        math.log(max(p, FEATURE_FLOOR)) if head else 0.0,
        1.0 if head else 0.0,
        1.0 if head and rank == 0 else 0.0,
        math.log1p(rank) if head else 0.0,
        math.log(max(row_top, FEATURE_FLOOR)) if head_row else 0.0,
        math.log(q) if q > 0.0 else 0.0,
        1.0 if q > 0.0 else 0.0,
        match / max_order if match > 0 else 0.0,
        math.log(c) if c > 0.0 else 0.0,
        1.0 if c > 0.0 else 0.0,
        parent_fit,
    ]


def log_sigmoid(z: float) -> float:
    """ln(sigmoid(z)) without overflow, as pruner.cpp's."""
    return -math.log1p(math.exp(-z)) if z >= 0.0 else z - math.log1p(math.exp(z))


def acceptance_logit(weights, level: int, x: list[float]) -> float:
    """w_level . x, summed in feature order (as pruner.cpp, so the scores agree to the bit)."""
    levels = len(weights) // ACCEPTANCE_FEATURES
    row = min(level, levels - 1) * ACCEPTANCE_FEATURES
    z = 0.0
    for f in range(ACCEPTANCE_FEATURES):
        z += weights[row + f] * x[f]
    return z


class PyContextIndex:
    """The context n-gram of one conversation (as ngram_cpp/src/context.h): for n = 1..max_order,
    the tokens that followed every n-gram seen so far, with counts in first-seen order."""

    def __init__(self, max_order: int):
        if not 1 <= max_order <= MAX_CONTEXT_ORDER:
            raise ValueError(f"context max_order must be in 1..{MAX_CONTEXT_ORDER}")
        self.max_order = max_order
        self.seq: list[int] = []
        self.maps: list[dict[tuple, dict[int, int]]] = [{} for _ in range(max_order)]
        self.last: list[dict[tuple, int]] = [{} for _ in range(max_order)]

    def __len__(self) -> int:
        return len(self.seq)

    def extend(self, tokens) -> None:
        for t in np.asarray(tokens, dtype=np.int64).reshape(-1).tolist():
            if t < 0:
                raise ValueError(f"token id {t} is negative")
            for n in range(1, min(self.max_order, len(self.seq)) + 1):
                key = tuple(self.seq[-n:])
                counts = self.maps[n - 1].setdefault(key, {})
                counts[t] = counts.get(t, 0) + 1
                self.last[n - 1][key] = t
            self.seq.append(t)

    def lookup(self, virtual_tokens, min_len: int = 1) -> tuple[int, dict[int, int], int]:
        """(match length, {token: count} in first-seen order, most recent continuation) of the longest
        suffix of indexed + virtual tokens seen earlier with a continuation; (0, {}, -1) if none."""
        virt = [int(t) for t in np.asarray(virtual_tokens, dtype=np.int64).reshape(-1)]
        full = self.seq + virt
        for n in range(min(self.max_order, len(full)), max(1, min_len) - 1, -1):
            key = tuple(full[-n:])
            counts = dict(self.maps[n - 1].get(key, {}))
            last = self.last[n - 1].get(key, -1)
            if virt and len(self.seq) >= n and tuple(self.seq[-n:]) == key:
                counts[virt[0]] = counts.get(virt[0], 0) + 1
                last = virt[0]
            if counts:
                return n, counts, last
        return 0, {}, -1


class PyNGramModel:
    """Dict trie: children[node] maps token -> child node; counts[node]; node 0 is the root."""

    def __init__(self, order: int, vocab_size: int):
        self.order, self.vocab_size = order, vocab_size
        self.children: list[dict[int, int]] = [{}]
        self.counts: list[int] = [0]
        self.fingerprint = ""
        self.vocab_known = True  # False: vocab_size is only max token id + 1 (an upstream .trie)

    @property
    def total(self) -> int:
        return self.counts[0]

    @property
    def num_nodes(self) -> int:
        return len(self.counts)

    def set_metadata(self, vocab_size: int, fingerprint: str) -> None:
        """As NGramModel::set_metadata: stamp the tokenizer's vocabulary size and fingerprint."""
        if vocab_size < self.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the trie's largest token id + 1 ({self.vocab_size})")
        if len(fingerprint.encode()) >= 64:
            raise ValueError("tokenizer fingerprint is longer than 63 characters")
        self.vocab_size, self.vocab_known, self.fingerprint = vocab_size, True, fingerprint

    def add(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        for s in range(len(tokens)):
            node = 0
            self.counts[0] += 1
            for t in tokens[s : s + self.order]:
                nxt = self.children[node].get(t)
                if nxt is None:
                    nxt = len(self.counts)
                    self.children[node][t] = nxt
                    self.children.append({})
                    self.counts.append(0)
                node = nxt
                self.counts[node] += 1

    def _find(self, ctx: list[int]) -> int | None:
        node = 0
        for t in ctx:
            node = self.children[node].get(t)
            if node is None:
                return None
        return node

    def prob(self, context, token: int, smoothed: bool = False) -> float:
        context = [int(t) for t in context]
        if smoothed:
            return self._smoothed(context, int(token))
        for length in range(min(self.order - 1, len(context)), 0, -1):
            node = self._find(context[len(context) - length :])
            if node is None:
                continue
            child = self.children[node].get(int(token))
            if child is not None and self.counts[node] > 0:
                return self.counts[child] / self.counts[node]
        return 0.0

    def probs(self, context, tokens, smoothed: bool = False) -> np.ndarray:
        return np.array([self.prob(context, t, smoothed) for t in tokens], dtype=np.float64)

    def _smoothed(self, context: list[int], token: int) -> float:
        """Interpolation with fixed weights (as ngram.cpp): a uniform floor, plus the 2^len-weighted
        average of the count ratios over the context lengths that occur (len 0 = unigram)."""
        weight_sum, p = 0.0, 0.0
        for length in range(min(self.order - 1, len(context)) + 1):
            node = 0 if length == 0 else self._find(context[len(context) - length :])
            if node is None or self.counts[node] == 0:
                continue
            w = float(1 << length)
            weight_sum += w
            child = self.children[node].get(token)
            if child is not None:
                p += w * (self.counts[child] / self.counts[node])
        floor = UNIFORM_WEIGHT / max(self.vocab_size, 1)
        return (1.0 - UNIFORM_WEIGHT) * (p / weight_sum) + floor if weight_sum > 0 else floor

    # -- reading our files (small files only: everything is parsed into dicts)

    @classmethod
    def load(cls, path) -> "PyNGramModel":
        data = open(path, "rb").read()
        if data[:8] == COMPACT_MAGIC:
            return cls._from_compact(data, str(path))
        return cls._from_upstream(data, str(path))

    @classmethod
    def _from_compact(cls, data: bytes, path: str) -> "PyNGramModel":
        if len(data) < HEADER.size:
            raise RuntimeError(f"{path}: truncated: smaller than the compact header")
        magic, version, order, vocab, flags, total, *rest = HEADER.unpack_from(data)
        sizes, fingerprint = rest[:MAX_ORDER], rest[MAX_ORDER]
        if version != COMPACT_VERSION or not 1 <= order <= MAX_ORDER:
            raise RuntimeError(f"{path}: unsupported version {version} or order {order}")
        if flags & ~FLAG_VOCAB_IS_LOWER_BOUND or any(sizes[order:]) or fingerprint[-1] != 0:
            raise RuntimeError(f"{path}: corrupt header")
        pos = _align(HEADER.size)
        levels = []
        for lv in range(order):
            n = sizes[lv]
            arrays = []
            for dtype, count in ((np.int32, n), (np.uint32, n)) + (((np.uint64, n + 1),) if lv + 1 < order else ()):
                nbytes = count * np.dtype(dtype).itemsize
                if pos + nbytes > len(data):
                    raise RuntimeError(f"{path}: truncated or corrupt: level arrays exceed the file")
                arrays.append(np.frombuffer(data, dtype=dtype, count=count, offset=pos))
                pos = _align(pos + nbytes)
            levels.append(arrays)
        if pos != len(data):
            raise RuntimeError(f"{path}: corrupt: file size does not match the header's level sizes")
        for lv in range(order - 1):
            fc, next_size = levels[lv][2], sizes[lv + 1]
            if fc[0] != 0 or fc[-1] != next_size or np.any(np.diff(fc.astype(np.int64)) < 0):
                raise RuntimeError(f"{path}: corrupt: child index ranges do not match level sizes")
        m = cls(order, vocab)
        m.counts[0] = total
        m.vocab_known = not flags & FLAG_VOCAB_IS_LOWER_BOUND
        try:
            m.fingerprint = fingerprint.rstrip(b"\0").decode()
        except UnicodeDecodeError as e:
            raise RuntimeError(f"{path}: corrupt header (fingerprint)") from e
        parents = [0]  # node ids of the previous level, in level order
        for lv, arrays in enumerate(levels):
            toks, cnts = arrays[0], arrays[1]
            ids = []
            if lv == 0:
                owner = [0] * len(toks)
            else:
                fc = levels[lv - 1][2]
                owner = np.repeat(np.arange(len(parents)), np.diff(fc.astype(np.int64))).tolist()
            for i, (t, c) in enumerate(zip(toks.tolist(), cnts.tolist())):
                node = len(m.counts)
                m.children.append({})
                m.counts.append(c)
                m.children[parents[owner[i]] if lv else 0][t] = node
                ids.append(node)
            parents = ids
        return m

    @classmethod
    def _from_upstream(cls, data: bytes, path: str) -> "PyNGramModel":
        """fvliang/DART's .trie, checked as fully as ngram.cpp checks it (a corrupt file raises RuntimeError)."""
        if len(data) < 16:
            raise RuntimeError(f"{path}: truncated: no upstream .trie header")
        order, n_nodes = struct.unpack_from("<QQ", data)
        if not 1 <= order <= MAX_ORDER:
            raise RuntimeError(f"{path}: invalid order {order}")
        if n_nodes == 0 or n_nodes > (len(data) - 16) // UPSTREAM_RECORD.size:
            raise RuntimeError(f"{path}: corrupt: node count exceeds the file size")
        pos = 16
        records = []  # (token, parent, freq, [(child token, child index)])
        for _ in range(n_nodes):
            if pos + UPSTREAM_RECORD.size > len(data):
                raise RuntimeError(f"{path}: truncated upstream .trie file")
            tok, parent, freq, nc = UPSTREAM_RECORD.unpack_from(data, pos)
            pos += UPSTREAM_RECORD.size
            if pos + UPSTREAM_CHILD.size * nc > len(data):
                raise RuntimeError(f"{path}: truncated upstream .trie file")
            kids = [UPSTREAM_CHILD.unpack_from(data, pos + UPSTREAM_CHILD.size * c) for c in range(nc)]
            pos += UPSTREAM_CHILD.size * nc
            records.append((tok, parent, freq, kids))
        if pos != len(data):
            raise RuntimeError(f"{path}: corrupt: trailing bytes after the last node")

        m = cls(order, 0)
        m.vocab_known = False
        m.children = [{} for _ in range(n_nodes)]
        m.counts = [freq for _, _, freq, _ in records]
        seen = [False] * n_nodes
        seen[0] = True
        frontier = [0]
        for depth in range(order + 1):
            nxt = []
            for node in frontier:
                kids = records[node][3]
                if kids and depth == order:
                    raise RuntimeError(f"{path}: corrupt: trie deeper than its order")
                for t, idx in kids:
                    if not 0 < idx < n_nodes:
                        raise RuntimeError(f"{path}: corrupt: child index out of range")
                    if t in m.children[node]:
                        raise RuntimeError(f"{path}: corrupt: duplicate child token")
                    if seen[idx]:
                        raise RuntimeError(f"{path}: corrupt: a node has two parents")
                    if t < 0:
                        raise RuntimeError(f"{path}: corrupt: negative token id")
                    if records[idx][0] != t or records[idx][1] != node:
                        raise RuntimeError(f"{path}: corrupt: child record disagrees with its parent")
                    seen[idx] = True
                    m.children[node][t] = idx
                    m.vocab_size = max(m.vocab_size, t + 1)
                    nxt.append(idx)
                # every occurrence of a continuation is an occurrence of its context (the root is recomputed below)
                if depth >= 1 and sum(records[idx][2] for _, idx in kids) > records[node][2]:
                    raise RuntimeError(f"{path}: corrupt: children count more than their parent")
            frontier = nxt
        if not all(seen):
            raise RuntimeError(f"{path}: corrupt: node {seen.index(False)} is unreachable from the root")
        # the root counts every token, i.e. the sum of level 1 (robust to upstream's int32 overflow)
        m.counts[0] = sum(m.counts[c] for c in m.children[0].values())
        return m


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


def _children(
    tokens,
    probs,
    kk: int,
    level: int,
    root: int,
    context: list[int],
    path: list[int],
    model,
    params: PruneParams,
    index,
    base: float,
    parent_fit: float,
    features: bool = False,
):
    """The candidates one parent (the path root + `path`, at `level` = len(path), score `base`)
    expands into, in the pruner's order: (token, score increment, source, fitted ln P (0 without a
    fitted ranking), the fitted ranking's features if `features` or that ranking is on, else None)."""
    d = tokens.shape[0]
    fitted = bool(params.acceptance)
    use_context = index is not None and params.context_weight > 0
    order = model.order if model is not None else 1
    ctx_len = order - 1
    w = math.pow(float(level + 1), params.level_exponent)
    decay = math.pow(params.logit_decay, float(level))
    head_row = level < d
    ngram_term = model is not None and params.use_ngram and ctx_len > 0 and (level > 0 or params.ngram_on_first_level)
    ngram = ngram_term or ((fitted or features) and model is not None and params.use_ngram and ctx_len > 0)
    cand = [int(t) for t in tokens[level, :kk]] if head_row else []
    row_top = max((float(probs[level, i]) for i in range(kk)), default=0.0) if head_row else 0.0
    seq = context + [root] + path
    match, lam, cont = 0, 0.0, {}
    if use_context:
        match, cont, _ = index.lookup([root] + path, params.context_min_match)
        if match:
            lam = params.context_weight * match / index.max_order
    total = sum(cont.values())
    extra = []
    if match and (head_row or match >= params.context_extend_min_match):
        extra = [t for t in cont if t not in cand]  # first-seen order
        extra.sort(key=lambda t: -cont[t])  # stable: ties keep first-seen order
        extra = extra[: params.context_max_candidates]
    q = [1.0] * (len(cand) + len(extra))
    if ngram:
        q = list(model.probs(seq[-ctx_len:], cand + extra))
    out = []
    for i, tok in enumerate(cand + extra):
        c = cont.get(tok, 0) / total if match else 0.0
        p = float(probs[level, i]) if i < len(cand) else 0.0
        source = FROM_CONTEXT if i >= len(cand) else (HEAD_AND_CONTEXT if c > 0 else FROM_HEAD)
        term = decay * math.log((1.0 - lam) * p + lam * c + params.eps)
        if ngram_term:  # the n-gram probability is mixed with the context too
            term += params.ngram_weight * math.log((1.0 - lam) * q[i] + lam * c + params.eps)
        inc = min(0.0, w * term)
        x, fit = None, 0.0
        if fitted or features:
            x = acceptance_features(
                base + inc,
                inc,
                i < len(cand),
                p,
                i if i < len(cand) else -1,
                head_row,
                row_top,
                q[i] if ngram else 0.0,
                match,
                index.max_order if use_context else 1,
                c,
                parent_fit,
            )
        if fitted:  # never more likely than the parent (pruner.h)
            fit = min(log_sigmoid(acceptance_logit(params.acceptance, level, x)), parent_fit if path else 0.0)
        out.append((tok, inc, source, fit, x))
    return out


def _search(tokens, probs, kk: int, root: int, context: list[int], model, params: PruneParams, index, eos_id: int, features: bool = False):
    """The beam search's pool: (token, parent, depth, score, source, fitted ln P, features or None) per
    expanded node, in expansion order."""
    d = tokens.shape[0]
    use_context = index is not None and params.context_weight > 0
    levels = d + (params.context_extend if use_context else 0)
    # the score's cut cannot tell a beam of max_nodes from a wider one (pruner.cpp); the fitted one can,
    # and the pruner caps it there too
    beam_width = min(params.beam_width, max(params.max_nodes, 1)) if params.acceptance else params.beam_width
    pool: list[tuple] = []
    beam = [-1]
    for level in range(levels):
        if not beam:
            break
        nxt = []
        for parent in beam:
            path = []
            n = parent
            while n >= 0:
                path.append(pool[n][0])
                n = pool[n][1]
            path = path[::-1]
            base = pool[parent][3] if parent >= 0 else 0.0
            parent_fit = pool[parent][5] if parent >= 0 else 0.0
            depth = pool[parent][2] + 1 if parent >= 0 else 1
            for tok, inc, source, fit, x in _children(
                tokens, probs, kk, level, int(root), context, path, model, params, index, base, parent_fit, features
            ):
                pool.append((tok, parent, depth, base + inc, source, fit, x))
                nxt.append(len(pool) - 1)
        nxt.sort(key=lambda n: (pool[n][0] == eos_id, -pool[n][3], n))
        nxt = nxt[:beam_width]
        while nxt and pool[nxt[-1]][0] == eos_id:
            nxt.pop()
        beam = nxt
    return pool


def pool_features(tokens, probs, root: int, context, model, params: PruneParams, index, eos_id: int = -1) -> list[tuple]:
    """Every node the pruner's search expands, as (token, parent pool index or -1, depth, features), the
    features those the fitted ranking scores it with (the parent's fitted value left 0: it depends on
    the fit): what dart_core/tools/fitting.py fits on. The search is the score's, as in the pruner."""
    tokens = np.asarray(tokens, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float32)
    plain = dataclasses.replace(params, acceptance=(), row_costs=())
    ctx = [int(t) for t in np.asarray(context, dtype=np.int64).reshape(-1)]
    pool = _search(tokens, probs, min(tokens.shape[1], params.top_k), int(root), ctx, model, plain, index, eos_id, features=True)
    return [(e[0], e[1], e[2], e[6]) for e in pool]


def prune_reference(tokens, probs, root: int, context, model, params: PruneParams, eos_id: int, index=None) -> PrunedTree:
    """DART's n-gram guided beam search, step by step (arguments as ngram_cpp.prune).

    A node at level l (depth l + 1) scores its parent's score plus
        min(0, (l + 1) ** level_exponent * (logit_decay ** l * ln(p + eps) + ngram_weight * ln(q + eps)))
    with p its draft probability and q the n-gram probability (upstream rule) of its token after the
    last order-1 tokens of context + root + path; no n-gram term at level 0 unless
    ngram_on_first_level. Each level extends the beam_width best non-EOS children (score desc, then
    expansion order); the tree keeps the max_nodes best expanded nodes by (score desc, depth asc,
    expansion order asc). With a context index and context_weight > 0, p is mixed with the context
    continuations and context-only candidates join (see PruneParams and ngram_cpp/src/pruner.h).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float32)
    if tokens.ndim != 2 or tokens.shape != probs.shape or tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ValueError(f"tokens and probs must both be [d, k] with d, k >= 1 (got {tokens.shape} and {probs.shape})")
    d, k = tokens.shape
    kk = min(k, params.top_k)
    if params.top_k < 1 or params.beam_width < 1 or params.max_nodes < 0:
        raise ValueError("top_k and beam_width must be >= 1, max_nodes >= 0")
    if (
        not all(math.isfinite(x) for x in (params.eps, params.level_exponent, params.logit_decay, params.ngram_weight))
        or not params.eps > 0
    ):
        raise ValueError("score weights must be finite and eps > 0")
    if (kk + (params.context_max_candidates if index is not None and params.context_weight > 0 else 0)) * (
        1 + params.beam_width * (d - 1 + (params.context_extend if index is not None and params.context_weight > 0 else 0))
    ) > MAX_EXPANDED_NODES:
        raise ValueError(f"d * beam_width * top_k is too large (more than {MAX_EXPANDED_NODES} expanded nodes)")
    vocab = model.vocab_size if model is not None and model.vocab_known else TOKEN_ID_LIMIT
    context = [int(t) for t in np.asarray(context, dtype=np.int64).reshape(-1)]
    if not 0 <= root < vocab or tokens.min() < 0 or tokens.max() >= vocab or any(not 0 <= t < vocab for t in context):
        raise ValueError(f"token ids (root, context, candidates) must be in [0, {vocab})")
    if not (np.isfinite(probs).all() and (probs >= 0).all() and (probs <= 1).all()):
        raise ValueError("draft probabilities must be in [0, 1]")
    if any(len(set(row)) != len(row) for row in tokens.tolist()):
        raise ValueError("a token appears twice in one row")
    if not 0.0 <= params.context_weight <= 1.0:
        raise ValueError("context_weight must be in [0, 1]")
    if (
        params.context_min_match < 1
        or params.context_extend < 0
        or params.context_extend_min_match < 1
        or params.context_max_candidates < 0
    ):
        raise ValueError("context_min_match and context_extend_min_match must be >= 1, context_extend and context_max_candidates >= 0")
    if math.isnan(params.min_score) or params.min_nodes < 0:
        raise ValueError("min_score must not be NaN and min_nodes must be >= 0")
    if len(params.acceptance) % ACCEPTANCE_FEATURES or not all(math.isfinite(w) for w in params.acceptance):
        raise ValueError(f"acceptance must hold levels * {ACCEPTANCE_FEATURES} finite weights")
    if params.row_costs and not params.acceptance:
        raise ValueError("row_costs (adaptive size) needs the acceptance model")
    if not all(c > 0 and math.isfinite(c) for c in params.row_costs):
        raise ValueError("row_costs must be positive and finite")
    pool = _search(tokens, probs, kk, int(root), context, model, params, index, eos_id)
    key = 5 if params.acceptance else 3  # the final cut's order: the fitted ln P, else the score

    ranked = sorted(range(len(pool)), key=lambda n: (-pool[n][key], pool[n][2], n))[: params.max_nodes]
    floor = next((i for i in range(params.min_nodes, len(ranked)) if pool[ranked[i]][key] < params.min_score), len(ranked))
    ranked = ranked[:floor]
    if params.acceptance and params.row_costs:  # adaptive size: the most expected tokens per unit of cost
        limit = min(len(ranked), len(params.row_costs) - 1)
        n = min(limit, params.min_nodes)
        expected = 1.0 + sum(math.exp(pool[ranked[i]][5]) for i in range(n))
        best, best_n = expected / params.row_costs[n], n
        for n in range(n + 1, limit + 1):
            expected += math.exp(pool[ranked[n - 1]][5])
            if expected / params.row_costs[n] > best:
                best, best_n = expected / params.row_costs[n], n
        ranked = ranked[:best_n]
    kept, chosen = [], set()
    for n in ranked:
        if pool[n][1] >= 0 and pool[n][1] not in chosen:
            continue
        chosen.add(n)
        kept.append(n)
    kept.sort(key=lambda n: pool[n][2])  # stable: best first within a depth

    N = len(kept) + 1
    index = {n: i + 1 for i, n in enumerate(kept)}
    out_tokens = [int(root)] + [pool[n][0] for n in kept]
    parents = [-1] + [index.get(pool[n][1], 0) for n in kept]
    positions = [0] + [pool[n][2] for n in kept]
    scores = [0.0] + [pool[n][key] for n in kept]
    mask = np.zeros((N, N), dtype=bool)
    mask[0, 0] = True
    for i in range(1, N):
        mask[i] = mask[parents[i]]
        mask[i, i] = True
    has_child = set(parents[1:])
    paths = []
    for i in range(N):
        if i in has_child:
            continue
        path, n = [], i
        while n > 0:
            path.append(n)
            n = parents[n]
        paths.append(path[::-1])
    paths.sort(key=lambda p: [out_tokens[n] for n in p])
    width = max(positions) + 1
    retrieve = np.full((len(paths), width), -1, dtype=np.int64)
    for r, p in enumerate(paths):
        retrieve[r, 0] = 0
        retrieve[r, 1 : 1 + len(p)] = p
    return PrunedTree(
        np.array(out_tokens, dtype=np.int64),
        np.array(parents, dtype=np.int64),
        np.array(positions, dtype=np.int64),
        np.array(scores, dtype=np.float32),
        mask,
        retrieve,
        np.array([FROM_HEAD] + [pool[n][4] for n in kept], dtype=np.uint8),
    )


def ancestor_paths_reference(parents, paths, lengths) -> None:
    """ancestor_paths (tree.h) in Python: paths[i] <- node i's path from its root (root first, i last,
    then zeros), lengths[i] <- its length, for parent links parents[i] < i (-1 for a root)."""
    par = [int(p) for p in parents]
    width = paths.shape[1]
    if paths.ndim != 2 or paths.shape[0] < len(par) or lengths.shape[0] < len(par):
        raise ValueError(f"ancestor_paths: {len(par)} nodes need as many rows of paths and lengths")
    rows: list[list[int]] = []
    for i, p in enumerate(par):
        if p >= i or p < -1:
            raise ValueError(
                f"parents[{i}] = {p}: a parent comes before its child" if p >= i else f"parents[{i}] = {p}: a parent is a node or -1"
            )
        path = (rows[p] if p >= 0 else []) + [i]
        if len(path) > width:
            raise ValueError(f"node {i}'s path is longer than {width}")
        rows.append(path)
        paths[i] = 0
        paths[i, : len(path)] = path
        lengths[i] = len(path)
