"""A draft head's forward over the pending tokens on a GPU at a fixed row count, captured once as a
CUDA graph: DART's draft forward (the pending tokens and D mask slots, to the D + 1 rows' logits), and
EAGLE3's first forward of a step (the pending tokens, to the state at the root that its expansion
starts from: drafters/eagle3.py's `extend_root`).

The eager head forward (drafters/dart.py's draft_logits) is some sixty small torch ops whose shapes change with
the pending tokens S and the head's cache length P, and launching them costs more than the head's
arithmetic on a GPU. Here the forward always runs `rows` rows: the S pending tokens, the D mask slots,
then padding rows. P, S and the real row count are read from a device tensor, so the shapes and
addresses never change and the forward is captured once per session and replayed every step:

- the token embeddings and the target states through `fc`, the two norms, the mask slots put in by
  a select (rows S..S+D-1 take `mask_rep`), RoPE gathered from a table computed once;
- q|k|v in one GEMM (a copy of the three weights made once), then the fixed forward's fused kernel
  (triton_kernels.qkv_rope) rotating q and k and writing the keys and values at cache slots P + row
  (padding rows write scratch slots past the session's capacity, which nobody keeps);
- attention over the committed prefix and the chain of new rows by the fixed forward's Triton kernels
  (dart_core/cuda/triton_kernels.py: P and the real rows read on the device; padding rows give zeros);
- the D + 1 rows that give logits (the last pending token and the masks) gathered at S - 1 on the
  device, then the MLP, the final norm(s) and the LM head; for an EAGLE3 head (no masks, D = 0) the
  last pending token's row through the MLP is the result (its expansion, expand_graph.py, takes the
  logits from there);
- for DART, the rows' top-k as the pruner takes them (`ranked`): the k best draft ids mapped to target
  ids and their probabilities softmaxed within the k, in the graph too, read back into pinned host
  buffers with one wait, where the eager tail after the logits was five more launches and two copies a
  step for the host to queue.

Drafts need no exactness (the target's verify decides), so this only has to compute what the eager
forward computes, up to rounding: the tests compare the two (tests/cuda/triton_interpreted.py runs this
module's forward in Triton's interpreter on a CPU). More pending tokens than the rows take beside the
masks (the prompt's first draft) go through the same forward in chunks (`chunked`): the leading ones
rows - D at a time for their keys and values, committed, then the rest for the result, so no draft runs
the eager head, whose shapes would change with every prompt's length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import fixed_shape
from ..fixed_shape import RopeTable, Upload
from ..model import KVCache
from . import forward
from .forward import kernel_head_dim, triton_kernels_here


def graph_rows(draft_length: int) -> int:
    """Rows of the captured forward: room for the D mask slots and the pending tokens of a step whose
    whole tree was accepted (at most D + 1, and the root), in a multiple of 16."""
    return -(-(2 * (draft_length + 1) + 1) // 16) * 16


def supported(head, device: torch.device, demand: bool = False) -> bool:
    """Whether a draft head's captured forward runs here (this module's, and EAGLE3's expansion,
    expand_graph.py): CUDA with Triton (or, when demanded, Triton's interpreter on a CPU: the tests),
    a power-of-two head dim of at least 16, a float head."""
    float_head = head.fc.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return triton_kernels_here(device, True if demand else None) and kernel_head_dim(head.config.head_dim) and float_head


def wanted(drafter, flag: str) -> bool:
    """Whether a session of `drafter` (DART's or EAGLE3's) runs the captured forward its attribute `flag`
    asks for: None where it runs (`supported`, and no CPU kernel head), False never, True demanded
    (RuntimeError where it cannot run)."""
    use = getattr(drafter, flag)
    run = use is not False and drafter.fast is None and supported(drafter.head, drafter.target.device, demand=bool(use))
    if use and not run:
        raise RuntimeError(f"{flag}=True needs Triton on CUDA (or its interpreter), no CPU kernel head, a power-of-two head dim")
    return run


class HeadGraph:
    """One session's head forward at `rows` rows into its head cache (which needs `rows` slots of
    scratch past its capacity). Call with the pending ids (host), their target states (device) and D;
    returns, for a DART head, the (D + 1, Vd) fp32 logits; for an EAGLE3 head (D = 0), the state at the
    last pending token (1, H) in the head's dtype. A DART head's forward built with top_k also ranks
    its rows (`ranked`: the pruner's inputs, on the host)."""

    def __init__(self, head, target, cache: KVCache, rows: int, top_k: int | None = None):
        from . import triton_kernels  # (Triton imported only where the forward runs)

        c = head.config
        dev = torch.device(target.device)
        dt = head.fc.weight.dtype
        if cache.k.shape[3] < cache.capacity + rows:
            raise ValueError(f"the head's captured forward writes {rows} rows: its cache needs that much scratch")
        self.head, self.target, self.cache, self.rows, self.dev = head, target, cache, rows, dev
        self.D = c.draft_length if c.is_dart else 0
        self.state = not c.is_dart  # EAGLE3: the state at the root, not logits
        # the candidates a row the forward ranks (DART), None: logits only
        self.k = min(top_k, c.draft_vocab_size) if top_k and not self.state else None
        self._host = None  # the ranked rows' pinned host copies (ids, probabilities), made at the first read
        R = rows
        a = head.midlayer.self_attn
        self.wqkv = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))  # one GEMM (a copy, made once)
        self.rope = RopeTable(head.inv_freq.to(dev), 1.0, c.max_position_embeddings)
        self.ids = torch.zeros(R, dtype=torch.long, device=dev)
        self.aux = torch.zeros(R, 3 * c.target_hidden_size, dtype=dt, device=dev)
        self.meta = torch.zeros(3, dtype=torch.int32, device=dev)  # P, real rows (S + D), S
        path = torch.zeros(R, R, dtype=torch.int32)
        for r in range(R):  # row r's path through the new rows: a chain, 0..r
            path[r, : r + 1] = torch.arange(r + 1, dtype=torch.int32)
        self.path = path.to(dev)
        self.plen = torch.arange(1, R + 1, dtype=torch.int32, device=dev)
        self.row_index = torch.arange(R, device=dev)
        self.sel = torch.arange(self.D + 1, device=dev)
        self.ws = triton_kernels.Workspace(
            R, c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim, cache.k.shape[3], dev
        )
        self.q = torch.empty(R, c.num_attention_heads, c.head_dim, dtype=dt, device=dev)
        self.att_out = torch.empty(R, c.num_attention_heads, c.head_dim, dtype=dt, device=dev)
        self._kernels = triton_kernels
        self._upload_ids = Upload(torch.long, dev, R)
        self._upload_meta = Upload(torch.int32, dev, 3)
        self.capture = fixed_shape.graphs_here(dev)
        self.graph = None
        self.out = None
        self.calls = 0  # forwards run here (the rest of the session's went eager)

    def fits(self, S: int) -> bool:
        """Whether S pending tokens fit the rows beside all D masks (the logits rows are gathered for all)."""
        return 1 <= S <= self.rows - self.D and self.cache.length + S + self.D <= self.rope.positions

    def takes(self, S: int) -> bool:
        """Whether S pending tokens go through this forward, in chunks where they do not fit (`chunked`):
        their positions and the masks' within the RoPE table."""
        return S >= 1 and self.cache.length + S + self.D <= self.rope.positions

    def chunked(self, ids: list[int], aux: torch.Tensor, D: int, ranked: bool = False) -> tuple:
        """This forward for any number of pending tokens (`takes`): while more remain than fit beside
        the masks, the next rows - D of them run with no masks, their keys and values committed to the
        cache (the result discarded); the rest run with D masks. Returns that last forward's result (the
        logits, or with `ranked` the ranked rows: `ranked`'s) and how many tokens it ran, for the
        caller to commit as it commits a single forward's."""
        step, at = self.rows - self.D, 0
        while len(ids) - at > step:
            self._run(ids[at : at + step], aux[at : at + step], 0)
            self.cache.commit(step)
            at += step
        last = ids[at:], aux[at:], D
        return (self.ranked(*last) if ranked else self(*last)), len(ids) - at

    def __call__(self, ids: list[int], aux: torch.Tensor, D: int) -> torch.Tensor:
        out = self._run(ids, aux, D)
        out = out[0] if self.k is not None else out
        return out[: D + 1].clone() if self.capture else out[: D + 1]  # a static buffer is the next replay's

    def ranked(self, ids: list[int], aux: torch.Tensor, D: int):
        """The forward's D + 1 rows ranked as the pruner takes them: (D + 1, k) target ids (int64) and
        their probabilities softmaxed within the row's k (fp32), numpy arrays on the host (on a GPU,
        pinned buffers that the next call overwrites, read after one wait for the device)."""
        if self.k is None:
            raise ValueError("this head forward was built without top_k: it gives logits only")
        _, all_tokens, all_probs = self._run(ids, aux, D)
        tokens, probs = all_tokens[: D + 1], all_probs[: D + 1]
        if self.dev.type != "cuda":
            return tokens.numpy(), probs.numpy()
        if self._host is None:
            self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (all_tokens, all_probs))
        host = self._host[0][: D + 1], self._host[1][: D + 1]
        host[0].copy_(tokens, non_blocking=True)
        host[1].copy_(probs, non_blocking=True)
        torch.cuda.current_stream(self.dev).synchronize()
        return host[0].numpy(), host[1].numpy()

    def _run(self, ids: list[int], aux: torch.Tensor, D: int):
        """Load the inputs and run the forward: the body's outputs (on a GPU, the graph's static buffers)."""
        S = len(ids)
        if not 0 <= D <= self.D or not self.fits(S) or aux.shape[0] != S:
            raise ValueError(
                f"the captured head forward takes 1..{self.rows - self.D} pending tokens with their states and 0..{self.D} masks"
            )
        self._upload_ids(ids + [0] * (self.rows - S), self.ids)  # (a list into the pinned buffer: no host tensors)
        self.aux[:S].copy_(aux)  # rows past S keep older (finite) states: masks and padding do not read them
        self._upload_meta([self.cache.length, S + D, S], self.meta)
        self.calls += 1
        if not self.capture:
            return self._body()
        if self.graph is None:
            self.graph, self.out = forward.capture_graph(self._body, self.dev)
        self.graph.replay()
        return self.out

    def _body(self) -> torch.Tensor:
        head, c = self.head, self.head.config
        layer, a = head.midlayer, head.midlayer.self_attn
        R, H, dt = self.rows, c.hidden_size, self.aux.dtype
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        P, T, S = self.meta[0], self.meta[1], self.meta[2]
        rows = self.row_index
        emb = self.target.model.tok_embeddings(self.ids).to(dt)
        g = F.linear(self.aux, head.fc.weight)
        u = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(g)), dim=-1)
        residual = g
        if self.D:
            masks = ((rows >= S) & (rows < T))[:, None]  # the mask slots bypass both norms
            u = torch.where(masks, layer.mask_rep.to(dt), u)
            residual = torch.where(masks, layer.mask_rep[:H].to(dt), g)
        positions = (rows + P).clamp(max=self.rope.positions - 1)  # padding rows past the table: any row
        k_cache, v_cache = self.cache.k[0, 0], self.cache.v[0, 0]
        kern = self._kernels
        q = kern.qkv_rope(
            F.linear(u, self.wqkv), self.q, k_cache, v_cache, None, None, c.rms_norm_eps,
            self.rope.cos, self.rope.sin, positions, self.meta, nh, nkv, hd,
        )  # fmt: skip
        att = kern.attention(q, k_cache, v_cache, self.path, self.plen, self.meta, self.att_out, self.ws)
        h = residual + F.linear(att.reshape(R, nh * hd), a.o_proj.weight)
        h = layer.mlp_block(h.index_select(0, self.sel + (S - 1)))  # the last pending token and the D masks
        if self.state:
            return h
        logits = head.logits(h).float()
        if self.k is None:
            return logits
        vals, idx = logits.topk(self.k, dim=-1)
        return logits, head.to_target_ids(idx), vals.softmax(-1)  # softmaxed within the top-k, as upstream


def kept_on(cache: KVCache, head, target, rows: int, top_k: int | None = None) -> HeadGraph:
    """The head forward on a session's leased head cache: built once a cache and kept there (a graph
    holds its cache's addresses), so every session that leases the cache replays it; its count of
    calls restarted for the session. top_k: the rows it ranks, where it is built here (a session whose
    top-k differs from the kept forward's ranks the logits itself)."""
    graph = getattr(cache, "head_graph", None)
    if graph is None:
        graph = cache.head_graph = HeadGraph(head, target, cache, rows, top_k)
    graph.calls = 0
    return graph
