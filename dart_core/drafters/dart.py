"""DART drafting: one head forward drafts every depth at once, the n-gram pruner makes it a tree.

Per step the head sees the tokens committed since its last forward (their target hidden states and,
shifted by one, their embeddings; the last one is paired with the root's embedding), followed by D
copies of the learned mask vector. One forward gives D+1 rows of logits: row j predicts depth j+1
of the tree (upstream's "shifted logits"). Each row's top-k (softmaxed within the top-k, as upstream)
goes to the C++ beam search, which keeps the best `max_nodes` as the tree to verify.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import ngram_cpp

from ..fixed_shape import Upload
from ..generate import Proposal
from ..model import SpareCache
from ..tree import DraftTree
from .captured import captured_head
from .head import DraftHead, KernelHead, int8_beside, load_head
from .session import HeadSession

CONTEXT_TAIL = 8  # committed tokens passed to the pruner as n-gram context (order - 1 are used)

# The context n-gram (the conversation's own repeats; ngram_cpp/src/pruner.h has the score).
CONTEXT_ORDER = 4  # longest suffix matched against the conversation
CONTEXT_EXTEND = 4  # levels past the head's rows that follow a context match alone
CONTEXT_EXTEND_MIN_MATCH = 2


@dataclass(frozen=True)
class ScoreWeights:
    """The weights of the pruner's tree score (ngram_cpp/src/pruner.h) that suit one head and tree size."""

    top_k: int  # candidates per head row
    level_exponent: float  # level l's terms weigh (l+1)^level_exponent
    logit_decay: float  # the head's log-probability at level l weighs decay^l
    ngram_weight: float  # the 3-gram trie's log-probability, against the head's
    ngram_on_first_level: bool  # whether the trie also scores depth 1
    context_weight: float  # lambda at a full-length context match (0.8: a 4-token match gives the context 0.8 of the weight)
    context_max_candidates: int  # context-only candidates per parent


# The public pruner's values (ngram_cpp.PruneParams) with the context n-gram's (docs/drafters.md):
# the default for targets other than the embedded one (their heads were made with these).
UPSTREAM_WEIGHTS = ScoreWeights(
    top_k=25,
    level_exponent=-0.7,
    logit_decay=0.9,
    ngram_weight=0.5,
    ngram_on_first_level=False,
    context_weight=0.8,
    context_max_candidates=4,
)
# The embedded head on the CPU default tree, chosen by exact greedy replay (dart-tune scoring,
# coordinate ascent over 9 fields at 5 nodes on prompts 11-20 of the six bench sets: τ 2.306 ->
# 2.351); on the bench's own first 10 prompts τ 2.241 -> 2.287 at 5 nodes, 2.424 -> 2.473 at 8.
EMBEDDED_WEIGHTS = ScoreWeights(
    top_k=10,
    level_exponent=0.0,
    logit_decay=1.0,
    ngram_weight=0.5,
    ngram_on_first_level=True,
    context_weight=0.65,
    context_max_candidates=8,
)


def weighted(prune: ngram_cpp.PruneParams, w: ScoreWeights, context: bool = True, extend: int = CONTEXT_EXTEND) -> ngram_cpp.PruneParams:
    """Tree parameters with the score weights `w`, the context n-gram on (extending `extend` levels
    past the head's rows) or off."""
    prune = replace(
        prune,
        top_k=w.top_k,
        level_exponent=w.level_exponent,
        logit_decay=w.logit_decay,
        ngram_weight=w.ngram_weight,
        ngram_on_first_level=w.ngram_on_first_level,
        context_max_candidates=w.context_max_candidates,
    )
    return with_context(prune, context, w.context_weight, extend)


def with_context(prune: ngram_cpp.PruneParams, on: bool, weight: float, extend: int = CONTEXT_EXTEND) -> ngram_cpp.PruneParams:
    """Tree parameters with the context n-gram on (the given weight and extension) or off."""
    if not on:
        return replace(prune, context_weight=0.0, context_extend=0)
    return replace(prune, context_weight=weight, context_extend=extend, context_extend_min_match=CONTEXT_EXTEND_MIN_MATCH)


ACCEPTANCE_FILE = "acceptance.json"  # beside a DART head: the pruner's fitted ranking (dart-fit)
ACCEPTANCE_FORMAT = "dart-acceptance/1"


@dataclass(frozen=True)
class FittedRanking:
    """A logistic model of P(node accepted) per tree level for the pruner (ngram_cpp/src/pruner.h),
    fitted by exact replay for one head and trie, with the tree settings it was fitted under (the
    features depend on them: the top-k's ranks, the context's candidates and orders)."""

    weights: tuple[float, ...]  # levels * ngram_cpp ACCEPTANCE_FEATURES, row by row
    trie: str  # the n-gram file's name it was fitted with (the trie probability is a feature)
    top_k: int
    context_max_candidates: int
    context_extend: int
    context_order: int
    path: Path | None = None


def load_fitted_ranking(head_dir: str | os.PathLike | None) -> FittedRanking | None:
    """The head's fitted ranking (ACCEPTANCE_FILE beside its config.json), or None where it has none.
    A file that is there but unreadable is an error: it would silently change the trees otherwise."""
    from ngram_cpp.reference import ACCEPTANCE_FEATURES

    if head_dir is None or not (Path(head_dir) / ACCEPTANCE_FILE).is_file():
        return None
    path = Path(head_dir) / ACCEPTANCE_FILE
    try:
        data = json.loads(path.read_text())
        if data.get("format") != ACCEPTANCE_FORMAT or data.get("features") is None or len(data["features"]) != ACCEPTANCE_FEATURES:
            raise ValueError(
                f"format {data.get('format')!r} with {len(data.get('features') or [])} features, expected "
                f"{ACCEPTANCE_FORMAT} with {ACCEPTANCE_FEATURES}"
            )
        weights = tuple(float(w) for row in data["weights"] for w in row)
        if not weights or any(len(row) != ACCEPTANCE_FEATURES for row in data["weights"]):
            raise ValueError("weights must be rows of one weight per feature")
        t = data["tree"]
        return FittedRanking(
            weights,
            str(data["trie"]),
            int(t["top_k"]),
            int(t["context_max_candidates"]),
            int(t["context_extend"]),
            int(t["context_order"]),
            path,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a fitted ranking ({e}); refit it with dart-fit") from None


def with_fitted_ranking(prune: ngram_cpp.PruneParams, ranking: FittedRanking) -> ngram_cpp.PruneParams:
    """Tree parameters that rank by the fitted model, with the candidate settings it was fitted under."""
    return replace(
        prune,
        acceptance=ranking.weights,
        top_k=ranking.top_k,
        context_max_candidates=ranking.context_max_candidates,
        context_extend=ranking.context_extend if prune.context_weight > 0 else 0,
    )


def pruner_eos(target) -> int:
    """The EOS id the pruner never extends a branch past: upstream's, the tokenizer's eos_token_id
    (upstream's tree_search.py passes it; for Qwen3 <|im_end|> 151645, where the lowest of the
    target's stop ids would be <|endoftext|> 151643); without one, the lowest stop id; -1 without
    any. Only the pruner uses one id: the generation loop stops at every id of target.eos_ids."""
    tok = getattr(target.tokenizer, "eos_token_id", None)
    if tok is not None:
        return int(tok)
    return min(target.eos_ids) if target.eos_ids else -1


@dataclass(frozen=True)
class DartParams:
    prune: ngram_cpp.PruneParams = field(default_factory=ngram_cpp.PruneParams)
    depth: int | None = None  # use only the first `depth` rows (tree depth <= depth); None: all D+1
    context_order: int = CONTEXT_ORDER  # the context n-gram's longest match (used when prune.context_weight > 0)


class DartDrafter:
    name = "dart"
    needs_hidden = True

    def __init__(
        self,
        head: DraftHead,
        target,
        ngram: ngram_cpp.NGram | None,
        params: DartParams = DartParams(),
        use_kernels: bool = True,
        kernel_head: KernelHead | None = None,
    ):
        if not head.config.is_dart:
            raise ValueError("DartDrafter needs a DART head (with draft_length and mask_rep)")
        if params.depth is not None and params.depth < 1:
            raise ValueError(f"draft depth must be >= 1, got {params.depth}")
        self.head, self.target, self.ngram, self.params = head, target, ngram, params
        self.max_nodes = params.prune.max_nodes
        self.eos_id = pruner_eos(target)
        # the head's forward on the CPU kernels where they run (else the eager module); kernel_head:
        # one built before for this head, shared
        if kernel_head is None and use_kernels and KernelHead.supports(head):
            kernel_head = KernelHead(head, int8=int8_beside(target))
        self.fast = kernel_head if use_kernels else None
        # the head's forward captured as a CUDA graph (dart_core/cuda/head_graph.py): None where it runs (CUDA with
        # Triton, no CPU kernels), False never, True demanded (on a CPU: Triton's interpreter, uncaptured)
        self.head_graph: bool | None = None
        # the last session's head cache (with its captured forward), for the next session (SpareCache)
        self.spare = SpareCache()

    def with_params(self, params: DartParams) -> "DartDrafter":
        """The same loaded head, kernel weights and trie with other tree parameters (cheap)."""
        d = DartDrafter(self.head, self.target, self.ngram, params, use_kernels=self.fast is not None, kernel_head=self.fast)
        d.head_graph = self.head_graph
        d.spare = self.spare  # the same head: its sessions' caches serve both
        return d

    def new_session(self, capacity: int) -> "_DartSession":
        return _DartSession(self, capacity)


class _DartSession(HeadSession):
    needs = "DART"

    def __init__(self, drafter: DartDrafter, capacity: int):
        super().__init__(drafter)
        c = drafter.head.config
        dev = drafter.target.device
        graph = captured_head(drafter, "head_graph")  # dart_core.cuda.head_graph where it runs
        rows = graph.graph_rows(c.draft_length) if graph else 0
        size, dtype = capacity + c.draft_length + 1, drafter.head.fc.weight.dtype
        self.cache = drafter.spare.lease(1, c.num_key_value_heads, c.head_dim, size, dtype, dev, rows)  # with its captured forward
        # the captured forward also ranks its rows at the pruner's top-k (the first session's, where several share it)
        top_k = drafter.params.prune.top_k
        self.graph = graph.kept_on(self.cache, drafter.head, drafter.target, rows, top_k) if graph else None
        self.committed: list[int] = []
        self._upload = Upload(torch.long, dev) if dev.type == "cuda" else None  # the pending ids, from pinned memory
        p = drafter.params
        self.index = ngram_cpp.ContextIndex(p.context_order) if p.prune.context_weight > 0 else None
        self._pruners: dict[int, ngram_cpp.Pruner] = {}  # the pruner at each step budget seen
        # each draft id's target id, where the head runs on the host (draft_candidates maps its top-k through it)
        head = drafter.head
        self._target_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size)).numpy() if head.d2t.device.type == "cpu" else None

    def extend(self, ids: list[int], hidden: torch.Tensor | None) -> None:
        """As every head session, and the pruner's context: the last committed tokens, the context n-gram's index."""
        super().extend(ids, hidden)
        self.committed = (self.committed + ids)[-CONTEXT_TAIL:]
        if self.index is not None:
            self.index.extend(ids)

    @torch.inference_mode()
    def draft_logits(self, root: int, rows: int | None = None) -> torch.Tensor:
        """One head forward over the pending tokens + mask slots -> (rows, Vd) logits, rows <= D+1
        (default D+1). Slots attend only to earlier positions, so running the first rows-1 of the
        D mask slots gives exactly the first `rows` rows of the full forward, for less work."""
        head, target = self.d.head, self.d.target
        layer, D = head.midlayer, head.config.draft_length
        if rows is not None:
            if not 1 <= rows <= D + 1:
                raise ValueError(f"rows must be in [1, {D + 1}], got {rows}")
            D = rows - 1
        S = len(self.pending_ids)
        if self.graph is not None and self.graph.takes(S):  # the captured forward (a GPU), a prompt in chunks
            return self._captured(root, D, False)
        ids = torch.tensor(self.pending_ids[1:] + [root])
        ids = self._upload(ids) if self._upload is not None else ids.to(target.device)
        emb = target.model.embed(ids, head.fc.weight.dtype)
        aux = self.pending_aux[0] if len(self.pending_aux) == 1 else torch.cat(self.pending_aux)
        if self.d.fast is not None:  # the CPU kernels: the whole forward in one call
            logits = self.d.fast.draft(aux, emb, self.cache, D)
        else:  # the eager module
            u, residual = head.inputs(aux, None, emb)
            u = torch.cat((u, layer.mask_rep.expand(D, -1)))  # (S+D, 2H): masks bypass both norms
            residual = torch.cat((residual, layer.mask_rep[: head.config.hidden_size].expand(D, -1)))
            P = self.cache.length
            positions = torch.arange(P, P + S + D, device=target.device)
            cos, sin = head.rope(positions, u.dtype)
            causal = torch.ones(S + D, S + D, dtype=torch.bool, device=target.device).tril_()
            mask = torch.cat((torch.ones(S + D, P, dtype=torch.bool, device=target.device), causal), dim=1)[None, None]
            h = residual + layer.attention(u, cos, sin, mask, self.cache)
            logits = head.logits(layer.mlp_block(h[-(D + 1) :]))  # the last real position and the D masks
        # the real positions' keys/values stay valid (the root is always committed next); masks are scratch
        self.cache.commit(S)
        self.pending_ids, self.pending_aux = [], []
        return logits

    def _captured(self, root: int, D: int, ranked: bool):
        """The pending tokens and D masks through the captured forward (in chunks where they are many):
        the logits, or with `ranked` the rows ranked at its top-k (HeadGraph.ranked, on the host)."""
        out, last = self.graph.chunked(self.pending_ids[1:] + [root], torch.cat(self.pending_aux), D, ranked)
        self.cache.commit(last)
        self.pending_ids, self.pending_aux = [], []
        return out

    @torch.inference_mode()
    def draft_candidates(self, root: int, rows: int) -> tuple:
        """The first `rows` rows' top-k candidates as the pruner takes them: target ids (rows, k) int64
        and their probabilities softmaxed within the top-k (as upstream) fp32, numpy arrays. Through the
        captured forward where it ranks at this top-k (the ranking in the graph, one wait for the
        device); else from draft_logits (on a GPU: both copies queued, then one wait)."""
        p = self.d.params.prune
        if not 1 <= rows <= self.d.head.config.draft_length + 1:
            raise ValueError(f"rows must be in [1, {self.d.head.config.draft_length + 1}], got {rows}")
        k = min(p.top_k, self.d.head.config.draft_vocab_size)
        if self.graph is not None and self.graph.k == k and self.graph.takes(len(self.pending_ids)):
            return self._captured(root, rows - 1, True)
        logits = self.draft_logits(root, rows)
        if self._target_ids is not None:
            # torch's CPU topk ranks every dtype in float32 (the order and values a float copy gets): no copy
            vals, idx = logits.topk(k, dim=-1)
            probs = vals.softmax(-1, dtype=torch.float32)  # renormalised within the top-k, as upstream
            return self._target_ids[idx.numpy()], probs.numpy()
        vals, idx = logits.float().topk(k, dim=-1)
        probs = vals.softmax(-1)
        tokens = self.d.head.to_target_ids(idx)
        if tokens.device.type == "cuda":
            tokens, probs = tokens.to("cpu", non_blocking=True), probs.to("cpu", non_blocking=True)
            torch.cuda.current_stream(self.d.target.device).synchronize()
        return tokens.numpy(), probs.numpy()

    def propose(self, root: int, max_nodes: int) -> Proposal:
        t0 = time.perf_counter()
        p = self.d.params.prune
        # a tree of `max_nodes` nodes is at most that deep: deeper rows could not change it
        rows = max(1, min(self.d.head.config.draft_length + 1, self.d.params.depth or max_nodes, max_nodes))
        tokens, probs = self.draft_candidates(root, rows)  # (the draft's time ends with them on the host)
        t1 = time.perf_counter()
        pruner = self._pruners.get(max_nodes)
        if pruner is None:  # once a size a session (the parameters' native copy: ~25 us)
            pruner = self._pruners[max_nodes] = ngram_cpp.Pruner(self.d.ngram, replace(p, max_nodes=max_nodes), self.d.eos_id, self.index)
        node_tokens, parents, depths, scores, sources = pruner.nodes(tokens, probs, root, self.committed)
        tree = DraftTree.from_pruner(node_tokens, parents, depths, scores)
        t2 = time.perf_counter()
        # sources: per tree node, 0 the head's candidate, 1 one the context also proposed, 2 the context's alone
        info = {"topk_tokens": tokens.tolist(), "topk_probs": probs.tolist(), "sources": sources.tolist()}
        return Proposal(tree, t1 - t0, t2 - t1, info)


# How the pruner ranks nodes when the caller does not say: "fitted" where the head has a fitted
# ranking for the trie in use and the context n-gram is on (docs/drafters.md has the measurements).
DEFAULT_RANKING = "fitted"
RANKINGS = ("fitted", "score")


def ranked_params(params: DartParams, ranking: str | None, head_dir: str | os.PathLike | None, ngram_path) -> DartParams:
    """`params` with the ranking asked for: "score" the hand-weighted score (unchanged), "fitted" the
    head's fitted ranking (ValueError where it has none), None the DEFAULT_RANKING where it applies
    (the head has a fitted ranking, fitted with this trie, and the context n-gram is on), else the score."""
    if ranking not in (None, *RANKINGS):
        raise ValueError(f"unknown ranking {ranking!r}: choose from {', '.join(RANKINGS)}")
    if ranking == "score" or (ranking is None and DEFAULT_RANKING == "score"):
        return params
    fitted = load_fitted_ranking(head_dir)
    if fitted is None:
        if ranking == "fitted":
            raise ValueError(f"the DART head {head_dir} has no fitted ranking ({ACCEPTANCE_FILE}; dart-fit writes one)")
        return params
    trie = None if ngram_path is None else Path(ngram_path).name.removesuffix(ngram_cpp.XZ)  # a compressed trie is the same trie
    same_inputs = trie == fitted.trie and params.prune.context_weight > 0
    if ranking is None and not same_inputs:
        return params  # its features would not mean what they meant in the fit
    return replace(params, prune=with_fitted_ranking(params.prune, fitted), context_order=fitted.context_order)


def load_dart_drafter(
    head_path: str | os.PathLike,
    target,
    ngram_path: str | os.PathLike | None = None,
    params: DartParams = DartParams(),
    ranking: str | None = "score",
    adaptive_size: bool = False,
    row_costs: tuple[float, ...] = (),
) -> DartDrafter:
    """A DART drafter for `target` from a head checkpoint and (optionally) an n-gram file; `ranking`
    as ranked_params (the default keeps `params` as given). adaptive_size: trees whose size adapts per
    step (ngram_cpp/src/pruner.h): the prefix of the fitted ranking with the most expected tokens per
    unit of `row_costs` (row_costs[r - 1]: a step verifying r rows, measured by the caller on this
    machine: dart_core.tools.calibrate.with_row_costs); needs the fitted ranking."""
    from .head import resolve_head_dir

    head = load_head(head_path, dart=True, target=target)
    if ranking != "score" or adaptive_size:
        params = ranked_params(params, "fitted" if adaptive_size else ranking, resolve_head_dir(head_path), ngram_path)
    ngram = None
    if ngram_path is not None:
        fingerprint = ngram_cpp.tokenizer_fingerprint(target.tokenizer) if target.tokenizer is not None else None
        ngram = ngram_cpp.load(ngram_path, expected_fingerprint=fingerprint, expected_vocab_size=target.vocab_size)
    if adaptive_size:
        if not params.prune.acceptance:
            raise ValueError("an adaptive tree size needs the fitted ranking (P(node accepted)); this drafter ranks by the score")
        if not row_costs:
            raise ValueError("an adaptive tree size needs this machine's step cost by rows (dart_core.tools.calibrate.with_row_costs)")
        params = replace(params, prune=replace(params.prune, row_costs=tuple(row_costs)))
    return DartDrafter(head, target, ngram, params)
