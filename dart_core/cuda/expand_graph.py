"""EAGLE3's tree expansion on a GPU at a fixed width and depth, captured once as a CUDA graph.

The eager expansion (drafters/eagle3.py's `_Eagle3Session.expand`) runs, for each of its `depth` levels, some
forty small torch ops (the head's layer over the frontier, its logits, two top-k) and then reads the
level back to the host to pick the next frontier: on a GPU that is launches and one wait a level, far
more than the head's arithmetic, while DART's one draft forward is captured (head_graph.py). A fair
baseline gets the same treatment. Here the whole search is one graph: the root's top-k, then every
level with the frontier's rows fixed at top_k, their paths through the fed levels built on the device
(a row's path: its parent's, then itself), the level's top-k children and the best top_k of them as
the next frontier chosen on the device, and everything the host needs (each level's children, their
log-probabilities and cumulative scores, the chosen frontier) in one buffer read back once a step.
The committed length P is read from a device tensor, so the graph is captured once per session cache
and replayed every step.

The layer is the fixed forward's: q|k|v in one GEMM (a copy of the three weights made once), the fused
kernel rotating q and k and writing the keys and values at the level's scratch slots P + level x top_k
+ row (triton_kernels.qkv_rope), the Triton attention over the committed prefix and each row's path.
Drafts need no exactness (the target's verify decides), so this only has to compute what the eager
expansion computes, up to rounding: the tests compare the two pools (tests/cuda/triton_interpreted.py runs
this forward in Triton's interpreter on a CPU). Steps whose budget asks for a narrower or shallower
search than the graph's run eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import fixed_shape
from ..fixed_shape import RopeTable, Upload
from ..model import KVCache
from . import forward


class ExpandGraph:
    """One EAGLE3 session's expansion at width `top_k` and `depth` levels into its head cache (whose
    capacity must hold depth x top_k scratch entries past the committed ones). Call with the root's
    state h (1, H) on the device; returns the search as host lists (see `__call__`)."""

    def __init__(self, head, target, cache: KVCache, top_k: int, depth: int):
        from . import triton_kernels  # (Triton imported only where the forward runs)

        c = head.config
        dev = torch.device(target.device)
        dt = head.fc.weight.dtype
        if top_k < 1 or depth < 1:
            raise ValueError(f"a captured expansion needs a width and a depth of at least 1, got {top_k} and {depth}")
        self.head, self.target, self.cache, self.k, self.depth, self.dev = head, target, cache, top_k, depth, dev
        a = head.midlayer.self_attn
        self.wqkv = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))  # one GEMM (a copy, made once)
        self.rope = RopeTable(head.inv_freq.to(dev), 1.0, c.max_position_embeddings)
        self.h0 = torch.zeros(1, c.hidden_size, dtype=dt, device=dev)
        self.P = torch.zeros(1, dtype=torch.int32, device=dev)
        k = top_k
        self.width = torch.tensor([0, k], dtype=torch.int32, device=dev)  # + P: the attention's (P, real rows)
        self.level_slots = [torch.tensor([L * k, 0], dtype=torch.int32, device=dev) for L in range(depth)]
        self.plens = [torch.full((k,), L + 1, dtype=torch.int32, device=dev) for L in range(depth)]
        self.rows = torch.arange(k, device=dev)
        G = c.num_attention_heads // c.num_key_value_heads
        self.ws = triton_kernels.Workspace(k, c.num_key_value_heads, G, c.head_dim, cache.k.shape[3], dev)
        self.q = torch.empty(k, c.num_attention_heads, c.head_dim, dtype=dt, device=dev)
        self.att_out = torch.empty(k, c.num_attention_heads, c.head_dim, dtype=dt, device=dev)
        self._kernels = triton_kernels
        self._upload_P = Upload(torch.int32, dev, 1)
        self.capture = fixed_shape.graphs_here(dev)
        self.graph = None
        self.flat = None
        self.calls = 0

    def fits(self, top_k: int, depth: int, committed: int) -> bool:
        """Whether a step's search (its width, depth, and the cache's committed length) is this graph's."""
        room = self.cache.capacity - committed >= self.k * self.depth
        return top_k == self.k and depth == self.depth and room and committed + self.depth <= self.rope.positions

    def __call__(self, h: torch.Tensor) -> tuple[list[float], list[float], list[tuple[list[float], list[float], list[float], list[float]]]]:
        """The search from the root's state h (1, H), the cache's committed length its prefix: the root's
        top-k (target ids, log-probabilities), then for each level its children (target ids, their own
        log-probabilities, their cumulative scores; top_k per frontier row, row-major) and the indices
        of the next frontier among them (ascending). Values as floats (ids exact)."""
        self.h0.copy_(h)
        self._upload_P([self.cache.length], self.P)
        self.calls += 1
        if not self.capture:
            flat = self._body()
        else:
            if self.graph is None:
                self.graph, self.flat = forward.capture_graph(self._body, self.dev)
            self.graph.replay()
            flat = self.flat
        vals = flat.tolist()  # one copy to the host, one wait
        k, i = self.k, 2 * self.k
        levels = []
        for _ in range(self.depth):
            n = k * k
            levels.append((vals[i : i + n], vals[i + n : i + 2 * n], vals[i + 2 * n : i + 3 * n], vals[i + 3 * n : i + 3 * n + k]))
            i += 3 * n + k
        return vals[:k], vals[k : 2 * k], levels

    def _body(self) -> torch.Tensor:
        head, c, k = self.head, self.head.config, self.k
        layer, a = head.midlayer, head.midlayer.self_attn
        nh, nkv, hd, dt = c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.h0.dtype
        k_cache, v_cache = self.cache.k[0, 0], self.cache.v[0, 0]
        att_meta = self.P + self.width  # (P, k)
        top = head.logits(self.h0).float().log_softmax(-1)[0].topk(k)
        ids, scores = head.to_target_ids(top.indices), top.values
        outs = [ids, scores]
        frontier_h = self.h0.expand(k, -1)
        path = self.rows[:, None].to(torch.int32)  # level 0: row r is node r of the fed levels
        for L in range(self.depth):
            emb = self.target.model.tok_embeddings(ids).to(dt)
            u = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(frontier_h)), dim=-1)
            positions = (self.P + L).long().repeat(k)  # every frontier row sits at depth L past the prefix
            q = self._kernels.qkv_rope(
                F.linear(u, self.wqkv), self.q, k_cache, v_cache, None, None, c.rms_norm_eps,
                self.rope.cos, self.rope.sin, positions, att_meta + self.level_slots[L], nh, nkv, hd,
            )  # fmt: skip
            padded = F.pad(path, (0, self.depth - path.shape[1])).contiguous()
            att = self._kernels.attention(q, k_cache, v_cache, padded, self.plens[L], att_meta, self.att_out, self.ws)
            out = layer.mlp_block(frontier_h + F.linear(att.reshape(k, nh * hd), a.o_proj.weight))
            child = head.logits(out).float().log_softmax(-1).topk(k, dim=-1)
            cand = (scores[:, None] + child.values).reshape(-1)  # (k * k,) cumulative
            best = cand.topk(k).indices.sort().values
            child_ids = head.to_target_ids(child.indices.reshape(-1))
            outs += [child_ids, child.values.reshape(-1), cand, best]
            parent = best // k
            ids, scores, frontier_h = child_ids[best], cand[best], out[parent]
            path = torch.cat((path[parent], ((L + 1) * k + self.rows)[:, None].to(torch.int32)), dim=1)
        return torch.cat([t.reshape(-1).double() for t in outs])
