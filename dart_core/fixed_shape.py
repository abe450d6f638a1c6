"""The fixed-shape forward: the torch path (any device) made exact by construction.

A tree verify is lossless when every node's logits carry exactly the bits of the one-token step that
plain decoding would run at that node. The CPU kernels get there by computing each row from its own
inputs only (dart_core/kernels/). This module states the same contract in torch ops, for the devices
and dtypes the kernels do not cover (CUDA above all, and `--eager` on a CPU):

- **One GEMM shape.** Every forward of up to `rows` new tokens pads them to exactly `rows` rows before
  the first layer, so each linear and the LM head run one (rows x in) x (in x out) product whatever the
  number of real tokens: one shape, one library kernel, and a GEMM computes an output row from its own
  input row. (That last property is the library's, not ours; the tests and the GPU check (dart_core/cuda/check/)
  check it on every device they run on.)
- **Row-wise everything else.** RMSNorm is per row, RoPE reads a table computed once for every position
  (`RopeTable`), SiLU, products and residual adds are per element.
- **Attention with no library reduction.** Row r attends over its *logical* key sequence: the committed
  cache, then its ancestors in the tree in depth order, then itself; a one-token step sees the same
  sequence with the ancestors already committed. Scores are element-wise products summed over the head
  dimension by a fixed pairwise tree (`pairwise_sum`); the softmax's max is exact in any order; its sum
  and the weighted sum of values run over the logical positions in chunks of CHUNK keys, each chunk by
  a fixed pairwise tree, the chunks by a fixed pairwise tree over a power-of-two count. Empty chunks and
  padded positions add exact zeros, so a node sees the same arithmetic wherever its keys sit in memory
  (cache slot or tree slot) and however long its neighbours' sequences are. Attention runs in fp32.

The cost is the attention's: T x heads x keys x head_dim products, where a fused kernel reads each key
once. It is the reference the GPU's fused kernel must match, and fast enough for the tests, the tiny
targets and the embedded model; docs/gpu.md has the measured costs. What exists only for CUDA (the
Triton kernels, the captured graphs, their settings) is the package dart_core/cuda/, imported only where
`cuda_asked` says so.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import ngram_cpp

CHUNK = 64  # keys a chunk of the softmax's sums (a power of two)


def pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` (its size a power of two) by halves: x[:n/2] + x[n/2:], repeated. Every addition is
    an element-wise add, so the result does not depend on the tensor's shape, device kernels or threads,
    and appending zeros (a longer power of two) leaves it unchanged."""
    n = x.shape[dim]
    if n & (n - 1):
        raise ValueError(f"pairwise_sum needs a power-of-two length, got {n}")
    while n > 1:
        n //= 2
        x = x.narrow(dim, 0, n) + x.narrow(dim, n, n)
    return x.squeeze(dim)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def chunked_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim`, whose length is a multiple of CHUNK: a pairwise tree within each chunk of CHUNK
    positions, then a pairwise tree over the chunks padded with zeros to a power-of-two count."""
    dim = dim % x.dim()
    n = x.shape[dim]
    chunks = n // CHUNK
    x = pairwise_sum(x.unflatten(dim, (chunks, CHUNK)), dim + 1)  # (..., chunks, ...)
    pad = next_pow2(chunks) - chunks
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat((x, x.new_zeros(shape)), dim=dim)
    return pairwise_sum(x, dim)


class RopeTable:
    """cos / sin (positions, head_dim) for every position up to the model's limit, computed once in fp32
    with Transformer.rope's formula; rows are gathered by position (a gather moves bits unchanged)."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, positions: int):
        freqs = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos() * scale, emb.sin() * scale
        self.positions = positions

    def check(self, last: int) -> None:
        if last >= self.positions:
            raise ValueError(f"position {last} is beyond the model's {self.positions} positions")

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the table (no check: `check` the host's positions first; a graph cannot)."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def key_paths(parents: torch.Tensor) -> tuple[list[list[int]], int]:
    """For each node of a tree given as parent links (parents[i] < i, -1 for roots): its ancestors in
    depth order, then itself; and the longest such path."""
    par = parents.tolist()
    paths: list[list[int]] = []
    for i, p in enumerate(par):
        if p >= i:
            raise ValueError(f"parents[{i}] = {p}: a parent comes before its child")
        paths.append((paths[p] if p >= 0 else []) + [i])
    return paths, max((len(p) for p in paths), default=0)


class TreeKeys:
    """Where each row's logical keys sit in a layer's cache: the committed prefix [0, P) in place, then
    the row's path through this forward's pending entries at slots P + node. Built once a forward.

    index (T, W - P) cache slots of logical positions P.. (W = the padded sequence length), valid (T, W)
    whether a logical position is part of the row's sequence."""

    def __init__(self, parents: torch.Tensor, P: int, device: torch.device):
        paths, longest = key_paths(parents)
        T = len(paths)
        W = -(-(P + longest) // CHUNK) * CHUNK
        tail = W - P
        index = torch.zeros(T, tail, dtype=torch.long)
        valid = torch.zeros(T, W, dtype=torch.bool)
        valid[:, :P] = True
        for r, path in enumerate(paths):
            index[r, : len(path)] = torch.tensor(path) + P
            valid[r, P : P + len(path)] = True
        self.P, self.W = P, W
        self.index = index.to(device, non_blocking=True)
        self.valid = valid.to(device, non_blocking=True)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: TreeKeys) -> torch.Tensor:
    """q (T, nh, hd) after RoPE; k_cache / v_cache (nkv, capacity, hd), this forward's keys and values
    already written at slots P..P+T-1. Returns (T, nh, hd) in q's dtype: row r's softmax-weighted values
    over its logical key sequence, by the arithmetic the module docstring describes."""
    T, nh, hd = q.shape
    nkv = k_cache.shape[0]
    G = nh // nkv
    P = keys.P
    scale = 1.0 / math.sqrt(hd)
    qf = q.float().view(T, nkv, G, 1, hd)
    # keys and values of each row's logical sequence: the shared prefix read in place (broadcast), the
    # rest gathered per row; both enter the same element-wise arithmetic
    k_pre = k_cache[:, :P].float()[None, :, None]  # (1, nkv, 1, P, hd)
    v_pre = v_cache[:, :P].float()[None, :, None]
    k_tail = k_cache[:, keys.index].float().permute(1, 0, 2, 3)[:, :, None]  # (T, nkv, 1, W-P, hd)
    v_tail = v_cache[:, keys.index].float().permute(1, 0, 2, 3)[:, :, None]
    hd_pow2 = next_pow2(hd)

    def dot(kk: torch.Tensor) -> torch.Tensor:
        prod = qf * kk
        if hd_pow2 != hd:
            prod = torch.cat((prod, prod.new_zeros(*prod.shape[:-1], hd_pow2 - hd)), dim=-1)
        return pairwise_sum(prod, -1)

    scores = torch.cat((dot(k_pre), dot(k_tail)), dim=-1) * scale  # (T, nkv, G, W)
    scores = scores.masked_fill(~keys.valid[:, None, None], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m)  # exact zeros where masked
    denom = chunked_sum(p, -1)  # (T, nkv, G)
    weighted = torch.cat((p[..., :P, None] * v_pre, p[..., P:, None] * v_tail), dim=-2)  # (T, nkv, G, W, hd)
    out = chunked_sum(weighted, -2) / denom[..., None]
    return out.reshape(T, nh, hd).to(q.dtype)


class Upload:
    """Host-to-device copies of small integer tensors through a pinned staging buffer: queued without
    the host waiting for the device (a copy from pageable memory waits for the stream). The staging
    buffer is reused once the last copy out of it has run (an event); on a CPU it is a plain copy."""

    def __init__(self, dtype: torch.dtype, device: torch.device, size: int = 64):
        self.dtype, self.device = dtype, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.event = torch.cuda.Event() if self.cuda else None
        self._grow(size)

    def _grow(self, size: int) -> None:
        self.host = torch.zeros(size, dtype=self.dtype, pin_memory=self.cuda)
        self._host = self.host.numpy()  # the same memory: numpy's small copies cost the host less than torch's
        self.dev = torch.zeros(size, dtype=self.dtype, device=self.device)

    def __call__(self, values, out: torch.Tensor | None = None) -> torch.Tensor:
        """values (n,) on the host (a list, a numpy array or a CPU tensor; any shape, read flat) -> a
        device tensor (n,): into `out` if given, else a view of a buffer of this Upload's that the next
        call overwrites (in stream order: kernels queued before it still read the old values)."""
        vals = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values, dtype=self._host.dtype)
        n = vals.size
        if self.event is not None:
            self.event.synchronize()  # the last copy out of the staging buffer has run
        if n > self.host.numel():
            self._grow(max(n, 2 * self.host.numel()))
        self._host[:n] = vals.reshape(-1)
        dst = self.dev[:n] if out is None else out
        dst.copy_(self.host[:n], non_blocking=True)
        if self.event is not None:
            self.event.record()
        return dst


class FixedInputs:
    """One forward's inputs at the fixed row count, in device buffers a captured graph can keep:
    tokens and positions (R,) (padding rows: token 0 at position 0), the rows' paths (R, R) int32 (tree
    nodes, depth order) and their lengths (R,) int32, meta (2,) int32 = (P, T), and slots (R,) the cache
    slots P + row that the rows' keys and values are written to. `fill` loads a forward into them."""

    def __init__(self, rows: int, device: torch.device):
        self.rows, self.device = rows, torch.device(device)
        # tokens | positions in one int64 buffer, path | plen | meta in one int32 buffer: two copies from
        # pinned memory a forward (Upload), the host not waiting for the device
        self.token_pos = torch.zeros(2 * rows, dtype=torch.long, device=device)
        self.tokens, self.positions = self.token_pos[:rows], self.token_pos[rows:]
        self.packed = torch.zeros(rows * rows + rows + 2, dtype=torch.int32, device=device)
        self._upload_tp = Upload(torch.long, self.device, 2 * rows)
        self._upload_packed = Upload(torch.int32, self.device, rows * rows + rows + 2)
        self.path = self.packed[: rows * rows].view(rows, rows)
        self.plen = self.packed[rows * rows : rows * rows + rows]
        self.meta = self.packed[rows * rows + rows :]
        self.slots = torch.arange(rows, device=device)
        self._rows = torch.arange(rows, device=device)
        self.T = 0
        self.keys: TreeKeys | None = None  # the torch reference's view of the same tree (CPU)

    def fill(self, tokens: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, P: int, reference: bool) -> None:
        R = self.rows
        par = parents.numpy() if isinstance(parents, torch.Tensor) and parents.device.type == "cpu" else np.asarray(parents.tolist())
        T = par.shape[0] if par.ndim == 1 else -1
        if not 0 < T <= R or tokens.shape != (T,) or positions.shape != (T,):
            raise ValueError(f"a fixed-shape forward takes 1..{R} tokens with as many positions and parents, got {T}")
        # the rows' paths (key_paths', row r: its ancestors in depth order, then itself) and their lengths,
        # in one call (ngram_cpp.ancestor_paths: a row's path is its parent's and itself); it refuses a
        # parent that does not come first. The host's time before the device can start: numpy a depth at
        # a time took ~0.15 ms a 61-node tree on a 2-core EPYC, a tensor a row ~0.3 ms.
        host = np.zeros(R * R + R + 2, dtype=np.int32)
        ngram_cpp.ancestor_paths(par, host[: R * R].reshape(R, R), host[R * R : R * R + R])
        host[R * R + R], host[R * R + R + 1] = P, T
        self._upload_packed(host, self.packed)
        if tokens.device.type == "cpu" and positions.device.type == "cpu":
            tp = np.zeros(2 * R, dtype=np.int64)  # (numpy's small copies cost the host less than torch's)
            tp[:T], tp[R : R + T] = tokens.numpy(), positions.numpy()
            self._upload_tp(tp, self.token_pos)
        else:  # already on the device
            self.token_pos.zero_()
            self.tokens[:T], self.positions[:T] = tokens, positions
        torch.add(self._rows, P, out=self.slots)
        self.T = T
        self.keys = TreeKeys(parents, P, self.device) if reference else None


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, inputs: FixedInputs, kernels) -> torch.Tensor:
    """Attention of a fixed-shape forward: q (R, nh, hd); returns (R, nh, hd), zeros on padding rows.
    kernels: a cuda.triton_kernels.Kernels (CUDA), or None for the torch reference."""
    if kernels is not None:
        return kernels.attention(q, k_cache, v_cache, inputs)
    T = inputs.T
    o = attention(q[:T], k_cache, v_cache, inputs.keys)
    return torch.cat((o, o.new_zeros(q.shape[0] - T, *o.shape[1:])))


def graphs_here(device: torch.device) -> bool:
    """Whether the captured forwards (FixedRunner's, dart_core/cuda's head_graph and expand_graph)
    capture their bodies as CUDA graphs on `device` (cuda.forward.capture_graph) rather than run them
    each call: on CUDA. The tests replace it and capture_graph to replay the bodies as a graph would on a
    CPU (tests/cuda/graph_replay.py), so every caller reads both through their modules."""
    return torch.device(device).type == "cuda"


def cuda_asked(device: torch.device, use: bool | None) -> bool:
    """Whether dart_core.cuda has anything for a forward on `device` with the Triton kernels set to
    `use` (None: where they run, False: never, True: demanded): a CUDA device unless refused, or a
    demand anywhere (on a CPU, Triton's interpreter: the tests). Where this is False the CUDA package
    is not imported, so a CPU run reads nothing of it."""
    return use is not False and (torch.device(device).type == "cuda" or bool(use))


class FixedRunner:
    """Runs a model's fixed-shape forwards into one cache: its FixedInputs and, on CUDA with Triton, the
    Triton kernels (dart_core/cuda/triton_kernels.py) and the forward captured as a CUDA graph on first
    use (prefill stays eager; this runs the verifies and steps). Kept on the cache
    (`cache.fixed_runner`): a graph holds the cache's addresses. How the kernels run is the model's
    `cuda_forward` (a dart_core.cuda.config.CudaForward; None: its defaults); off CUDA, unless that
    demands the kernels, the torch reference runs and the CUDA package is not imported."""

    def __init__(self, model, cache, rows: int, device: torch.device):
        self.model, self.cache, self.rows = model, cache, rows
        self.mode = model.cuda_forward
        device = torch.device(device)
        self.inputs = FixedInputs(rows, device)
        self.kernels = None
        self.capture = False
        if cuda_asked(device, None if self.mode is None else self.mode.kernels):
            from .cuda import forward

            self.kernels = forward.kernels_for(model, cache, rows, device)
            self.capture = self.kernels is not None and graphs_here(device)
        self.graph = None
        self.outputs = None

    def __call__(self, tokens, positions, parents, capture: bool, logits: bool):
        self.inputs.fill(tokens, positions, parents, self.cache.length, reference=self.kernels is None)
        if not self.capture:
            return self.model.fixed_body(self.inputs, self.cache, self.kernels, capture, logits)
        if self.graph is None:
            self.graph, self.outputs = self._capture()
        self.graph.replay()
        out_logits, hidden, normed = self.outputs  # static buffers the next replay overwrites: copies of the real rows
        T = self.inputs.T
        return (out_logits[:T].clone() if logits else None), (hidden[:T].clone() if capture else None), normed[:T].clone()

    def _capture(self):
        """One forward captured with every output (logits and captured states) in static buffers."""
        from .cuda import forward

        return forward.capture_graph(lambda: self.model.fixed_body(self.inputs, self.cache, self.kernels, True, True), self.inputs.device)
