"""The target transformer (Llama / Qwen2 / Qwen3) with a preallocated KV cache and tree attention.

We own the forward pass, gpt-fast style, instead of patching Hugging Face modules: the speculative
loop needs three things HF's forward does not give cheaply — an arbitrary (tree) attention mask over
the new tokens, writes into a cache we can compact after acceptance, and the residual stream at a few
chosen layers. The projections are fused (q|k|v and gate|up), which saves kernel launches at batch
size 1; a linear may keep its weight packed (BlockLinear: GGUF blocks, interleaved bf16) for the CPU
kernels. Loading lives beside it: hf_checkpoint.py (safetensors), gguf_checkpoint.py (a GGUF's blocks).

The math follows HF's modeling code (fp32 RMSNorm, rotate-half RoPE with HF's inverse frequencies,
SDPA attention) so that greedy decoding agrees with `transformers`' own `generate` token for token.

Shapes: B = 1 (batch), T = new tokens, P = tokens already in the cache, H = hidden size,
nh / nkv = query / key-value heads, hd = head dim, V = vocab.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from . import fixed_shape, kernels

if TYPE_CHECKING:
    from .cuda.config import CudaForward

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelArgs:
    """Architecture hyper-parameters, read from an HF config.json."""

    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has biases on q/k/v
    qk_norm: bool  # Qwen3 normalises q and k per head

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: supported are {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        n_heads = cfg["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
        )

    def capture_layers(self) -> tuple[int, int, int]:
        """Layers whose *input* residual stream EAGLE3 and DART read: 2, L//2 and L-3 (HF hidden_states[i])."""
        layers = (2, self.n_layers // 2, self.n_layers - 3)
        if len(set(layers)) != 3 or min(layers) < 1:
            raise ValueError(f"a target needs at least 7 layers for 3 distinct captured layers, got {self.n_layers}")
        return layers


# Rows of the fixed-shape forward by device type: every forward of up to this many new tokens off the
# CPU kernels runs at exactly this many rows (dart_core/fixed_shape.py). CUDA: the paper's 60-node trees fit;
# a CPU (--eager) pays for each padded row in its GEMMs, so it keeps a tree's worth of the CPU's sizes.
FIXED_ROWS = {"cuda": 64, "cpu": 16}

# A prompt longer than the fixed rows runs as fixed-shape forwards of that many tokens in turn when it
# needs at most this many (Target.prefill), else as one eager forward. CUDA: 2, measured on the H200
# (docs/results/gpu-h200-2026-11-29.json): two chunks beat the eager forward's launches for the
# embedded model (2.4 against 22.8 ms) and at the 8B shape (10.7 against 20.3 ms); at 8 chunks the
# embedded model still gains (9.3 against 24.4) but the 8B loses (45 against 20). A CPU (--eager) pays
# for every padded row: always eager there.
FIXED_PREFILL_CHUNKS = {"cuda": 2, "cpu": 0}
# Past those on CUDA, a prompt still runs in chunks while they read at most this many bytes of weights
# between them (each chunk reads them all; the eager forward once): what a chunk costs grows with the
# model's bytes, an eager forward's launches do not. Set between the two measured shapes: the 8B's
# 16.4 GB in bf16 gained at 2 chunks and lost at 8 (2 here), the embedded model's 0.27 GB gained at 8
# (122 here: every prompt of the bench's sets; its prompts past 2 chunks ran eagerly at ~23-24 ms,
# where 8 chunks took 9.3). Between them it is a rule of thumb, not a measurement (gpu_check's
# `prefill` times 2, 4 and 8 chunks against the eager forward at both shapes).
PREFILL_CHUNK_READ_BYTES = 33e9


class KVCache:
    """Preallocated keys/values for every layer, plus the committed length.

    A forward writes its T new tokens at slots [length, length+T) of every layer ("pending") without
    moving `length`. The caller then either `commit`s them in order (prefill, plain decoding) or
    `commit_path`s a subset (the accepted root-to-leaf path of a verified tree), which moves those
    entries into place. Anything beyond `length` is scratch and is overwritten by the next forward.
    """

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device | str, scratch: int = 0
    ):
        if capacity <= 0:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}")
        # scratch: slots past the capacity that a forward may write and nobody keeps (the fixed-shape
        # forward writes the keys of all its rows, padding included)
        shape = (n_layers, 1, n_kv_heads, capacity + scratch, head_dim)  # (L, B, nkv, cap + scratch, hd)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        self._upload: fixed_shape.Upload | None = None  # commit_path's node indices to a GPU

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nkv, T, hd) as pending entries; return the layer's keys/values up to length+T."""
        self.check_room(k.shape[2])
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def check_room(self, n: int) -> None:
        """Raise unless n more entries fit after the committed ones."""
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length}+{n} entries > capacity {self.capacity}")

    def commit(self, n: int) -> None:
        """Keep the first n pending entries, in order."""
        self.check_room(n)
        self.length += n

    def commit_path(self, nodes: list[int]) -> None:
        """Keep the pending entries at offsets `nodes` (ascending, nodes[0] == 0 for the root), in that order."""
        n = len(nodes)
        if nodes != list(range(n)):  # a chain is already in place
            L = self.length
            src = [L + i for i in nodes]  # the entries' slots (added on the host: one launch less a step)
            if self.k.device.type != "cpu":  # from pinned memory: the host does not wait for the device
                if self._upload is None:
                    self._upload = fixed_shape.Upload(torch.long, self.k.device)
                src = self._upload(src)
            else:
                src = torch.tensor(src)
            dst = slice(L, L + n)
            self.k[:, :, :, dst] = self.k.index_select(3, src)
            self.v[:, :, :, dst] = self.v.index_select(3, src)
        self.commit(n)

    def rewind(self, length: int) -> None:
        """Forget everything after `length` committed entries."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length}: committed length is {self.length}")
        self.length = length

    @property
    def scratch(self) -> int:
        return self.k.shape[3] - self.capacity


def same_device(where: torch.device, asked: torch.device | str) -> bool:
    """Whether a tensor on `where` is on the device `asked` names: "cuda" (no index: the current
    device, where a target's tensors go) matches "cuda:0" (where they are then), as torch's == does not."""
    asked = torch.device(asked)
    return where.type == asked.type and (asked.index is None or where.index is None or where.index == asked.index)


class SpareCache:
    """One idle KV cache kept for the next generation it fits. A CUDA graph holds the addresses of the
    cache it was captured on (the target's fixed forward, DART's head forward: each kept on its cache),
    so handing the last generation's cache to the next one replays the graphs it captured instead of
    capturing them again (on a GPU, a capture is some forwards' time; on a CPU, reuse saves the
    allocations). A forward's results do not depend on the cache's capacity, so a larger cache than
    asked gives the same bits. Thread-safe: generations running at once each hold a cache of their own."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: KVCache | None = None

    def take(self, capacity: int, scratch: int, dtype: torch.dtype, device: torch.device) -> KVCache | None:
        """The idle cache, emptied, if it holds `capacity` entries with this scratch, dtype and device."""
        with self._lock:
            c = self._idle
            if c is None or c.capacity < capacity or c.scratch != scratch or c.k.dtype != dtype or not same_device(c.k.device, device):
                return None
            self._idle = None
        c.length = 0
        return c

    # Where forwards are captured as graphs (fixed_shape.graphs_here), a new cache's capacity is rounded up to
    # a multiple of this: a later generation a little longer than the one before still fits the cache
    # and replays its graphs, where an exact fit captured them again (seen on an H200: the embedded
    # model's drafting at 16 ms a step instead of 0.9, each measured generation longer than the last).
    GRAPH_CAPACITY_STEP = 512

    def lease(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype, device, scratch: int = 0) -> KVCache:
        """The idle cache when it fits (`take`), else a new KVCache of these dimensions (the spare of one
        model or head: its cache's dimensions are the same every time), with room to spare where graphs
        are captured (GRAPH_CAPACITY_STEP). Callers bound their writes by the capacity they asked for."""
        cache = self.take(capacity, scratch, dtype, device)
        if cache is not None:
            return cache
        if fixed_shape.graphs_here(device):
            capacity = -(-capacity // self.GRAPH_CAPACITY_STEP) * self.GRAPH_CAPACITY_STEP
        return KVCache(n_layers, n_kv_heads, head_dim, capacity, dtype, device, scratch)

    def give(self, cache: KVCache) -> None:
        """A generation is done with `cache`: kept unless the idle one is larger."""
        with self._lock:
            if self._idle is None or cache.capacity >= self._idle.capacity:
                self._idle = cache


class RowCache:
    """Keys/values of B separate sequences, one cache row each (continuous batching, `decode_rows`).

    k, v (L, B, nkv, capacity, hd); row b holds lengths[b] committed tokens. A forward writes each
    row's new token at slot lengths[b] of its row without moving the lengths; `commit` keeps them. A
    row is filled from a prefilled one-sequence KVCache (`load`) and emptied by `clear`."""

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, rows: int, capacity: int, dtype: torch.dtype, device: torch.device | str
    ):
        if rows <= 0 or capacity <= 0:
            raise ValueError(f"a row cache needs rows and capacity, got {rows} rows of {capacity}")
        shape = (n_layers, rows, n_kv_heads, capacity, head_dim)
        # zeros, not empty: a row's unused slots are never read, but the eager path's padded attention
        # multiplies them by a zero weight, and 0 * NaN would not be 0
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.rows, self.capacity = rows, capacity

    def load(self, row: int, cache: KVCache) -> None:
        """Row `row` takes the committed entries of a one-sequence cache (a prompt prefilled alone)."""
        n = cache.length
        if n >= self.capacity:
            raise RuntimeError(f"a prompt of {n} tokens leaves no room in cache rows of {self.capacity}")
        self.k[:, row, :, :n] = cache.k[:, 0, :, :n]
        self.v[:, row, :, :n] = cache.v[:, 0, :, :n]
        self.lengths[row] = n

    def clear(self, row: int) -> None:
        self.lengths[row] = 0

    def commit(self) -> None:
        """Keep every row's pending token."""
        self.lengths += 1

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager path: store k, v (B, nkv, 1, hd) at each row's slot; return the layer's keys and
        values (B, nkv, end, hd) up to the longest row's new slot (see `attention_mask`)."""
        end = int(self.lengths.max()) + 1
        if end > self.capacity:
            raise RuntimeError(f"a sequence fills its cache row of {self.capacity} entries")
        rows = torch.arange(self.rows, device=self.k.device)
        self.k[layer, rows, :, self.lengths] = k[:, :, 0]
        self.v[layer, rows, :, self.lengths] = v[:, :, 0]
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def attention_mask(self) -> torch.Tensor:
        """(B, 1, 1, end) bool: row b sees its own lengths[b] + 1 keys of the padded `write` result."""
        end = int(self.lengths.max()) + 1
        return (torch.arange(end, device=self.k.device)[None, :] <= self.lengths[:, None])[:, None, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before scaling, as HF does (one fused op instead of five).
        # (the product cast back too: a GGUF model's fp32 norm weights must not widen a bf16 prefill)
        return (self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, hd); cos/sin (T, hd). Rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """mod(x); a float weight of another dtype than x (a prefill in Transformer.prefill_dtype) is
    converted for the call: a bf16 model's prompt runs fp32 GEMMs where the CPU has no bf16 arithmetic."""
    w = mod.weight
    if isinstance(w, torch.Tensor) and w.dtype != x.dtype:
        return F.linear(x, w.to(x.dtype), None if mod.bias is None else mod.bias.to(x.dtype))
    return mod(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        q_out, kv_out = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = nn.Linear(args.hidden_size, q_out + 2 * kv_out, bias=args.qkv_bias)
        self.wo = nn.Linear(q_out, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        a = self.args
        B, T, _ = x.shape
        q_out, kv_out = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        q, k, v = _linear(self.wqkv, x).split([q_out, kv_out, kv_out], dim=-1)
        q = q.view(B, T, a.n_heads, a.head_dim)
        k = k.view(B, T, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, nh, T, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, nkv, T, hd)
        v = v.view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        k_all, v_all = cache.write(layer, k, v)  # (B, nkv, P+T, hd)
        if k_all.dtype != q.dtype:  # a prefill in Transformer.prefill_dtype, or an fp16 cache beside fp32 activations
            k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)
        # mask None: one new token, or a causal forward into an empty cache (Transformer._attention_mask),
        # where SDPA's own causal masking is exact and skips the masked half of the work
        out = F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=a.n_heads != a.n_kv_heads
        )
        return _linear(self.wo, out.transpose(1, 2).reshape(B, T, q_out))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)  # gate | up
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(self.w13, x).chunk(2, dim=-1)
        return _linear(self.w2, F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = MLP(args)

    def forward(self, x, cos, sin, cache, layer, mask):
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, mask)
        return h + self.feed_forward(self.ffn_norm(h))


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # (T', V) fp32 for the requested positions (None if not asked for)
    hidden: torch.Tensor | None  # (T, 3H) captured residual streams, concatenated low|mid|high
    final: torch.Tensor | None = None  # (T', H) final-normed hidden state, the input of the LM head


class Transformer(nn.Module):
    """Decoder-only LM. `forward` never mutates the cache's committed length: see KVCache.

    Two paths compute the same function. Forwards of up to `kernels.MAX_ROWS` new tokens on a CPU
    run the batch-invariant kernels (dart_core/kernels/): a row's logits are then bit-identical
    whatever other rows run with it, which makes a tree verify exactly as lossless as plain decoding,
    and it is the faster path at decode sizes. Longer forwards (prompt prefill), other devices, or
    `use_kernels=False` run the eager torch path (SDPA, torch GEMMs).
    """

    def __init__(self, args: ModelArgs, inv_freq: torch.Tensor, rope_scale: float = 1.0, use_kernels: bool = True):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scale = rope_scale
        self.capture = args.capture_layers() if args.n_layers >= 7 else ()
        self.use_kernels = use_kernels
        self.use_layer_stack = True  # False: the per-op loop (tests compare the two)
        # The eager path's activation dtype where it differs from the cache's (None: the same): the
        # gguf-int8 model's prompt prefill runs in bf16 where the CPU multiplies bf16 in hardware (BlockLinear),
        # a bf16 model's in fp32 where it does not (`_linear`), the keys and values stored in the
        # cache's dtype; every kernel-path forward keeps the model's dtype.
        self.prefill_dtype: torch.dtype | None = None
        # A prompt longer than the kernels' rows runs as kernel forwards of kernels.MAX_ROWS rows in turn
        # (Target.prefill): every prompt row then gets the bits of its one-token step, as a verified node
        # does, so the keys and values a prefill writes are those plain decoding would have written.
        # False: one eager forward (torch's GEMMs). load_target turns it on where it is the faster
        # prefill too (docs/engine.md, "Time to first token").
        self.kernel_prefill = False
        self._stack: kernels.LayerStack | None = None
        self._rope_table: kernels.RopeTable | None = None  # fp32 angles for the kernel path, built on first use
        # A dict here collects seconds by stage of kernel-path forwards ("layers": the decoder layers'
        # one call, "head": the LM head's linear and its fp32 logits; the rest is the forward's wall minus these), for
        # `dart-kernels --split`; None (the default) times nothing.
        self.stage_seconds: dict[str, float] | None = None
        # Rows of the fixed-shape forward (dart_core/fixed_shape.py), the exact path of forwards the kernels do
        # not run: None takes FIXED_ROWS for the device, 0 turns it off (the plain eager path).
        self.fixed_rows: int | None = None
        # How the fixed-shape forward runs on CUDA (its Triton kernels, row groups, split, GEMMs: one
        # dart_core.cuda.config.CudaForward, set whole at the edge; None: its defaults). Off CUDA the
        # torch reference runs and nothing reads it unless it demands the kernels (kernels=True: Triton's
        # interpreter on a CPU, the tests).
        self.cuda_forward: CudaForward | None = None
        # A prompt of more than the fixed rows runs as that many fixed-shape forwards when its chunks
        # are at most this many (Target.prefill), else as one eager forward; 0: always eager; None
        # (the default): prefill_chunk_limit's rule for the device. A replay a chunk against an eager
        # forward's launches: which is faster depends on the model's size and the device (gpu_check
        # times both).
        self.fixed_prefill_chunks: int | None = None
        self._weight_bytes: int | None = None
        self._fixed_rope: fixed_shape.RopeTable | None = None

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The token embeddings of `ids` in `dtype` (a draft head's): a GGUF embedding dequantizes straight
        into it, its fp32 values rounded as `.to` rounds them, without the fp32 copy."""
        if isinstance(self.tok_embeddings, BlockEmbedding):
            return self.tok_embeddings(ids, dtype)
        return self.tok_embeddings(ids).to(dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        tree_mask: torch.Tensor | None = None,
        logits_at: torch.Tensor | slice | None = None,
        capture: bool = False,
        final: bool = False,
        logits: bool = True,
        parents: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Run T new tokens after the cache's committed prefix.

        tokens (T,) int64; positions (T,) int64 rope positions; tree_mask (T, T) bool, True where new
        token i may attend to new token j, and parents (T,) int64 the same tree as parent links
        (parents[i] < i, -1 for the root); both None = causal; logits_at selects which of the T
        positions get logits (None = all); capture returns the three EAGLE3/DART residual streams for
        all T; final returns the final-normed hidden states (the LM head's input) at those positions.
        """
        T = tokens.shape[0]
        device = self.norm.weight.device  # tokens and positions may come from the host (Target.verify on the fixed path)
        if self.kernel_path(T, device) and (parents is not None or tree_mask is None):
            if parents is None:
                parents = torch.arange(-1, T - 1)
            cache.check_room(T)
            attention = kernels.TreeAttention(
                self._rope_table_for_kernels(),
                positions,
                parents,
                cache.length,
                self.args.n_heads,
                self.args.n_kv_heads,
                tuple(cache.k.shape[2:]),
                self.norm.weight.dtype,
                cache.k.dtype,
            )
            return self._forward_kernels(tokens, attention, cache.k[:, 0], cache.v[:, 0], logits_at, capture, final, logits)
        if self.fixed_path(T, device):
            if parents is None:
                if tree_mask is not None:
                    raise ValueError("the fixed-shape forward takes a tree as parent links (parents), not only its mask")
                parents = torch.arange(-1, T - 1)
            return self._forward_fixed(tokens, positions, parents, cache, logits_at, capture, final, logits, device)
        tokens, positions = tokens.to(device), positions.to(device)
        x = self.tok_embeddings(tokens[None])  # (1, T, H)
        dtype = x.dtype if self.prefill_dtype is None else self.prefill_dtype
        cos, sin = self.rope(positions, dtype)
        mask = self._attention_mask(tree_mask, cache.length, T, x.device)
        return self._forward_eager(x, cos, sin, cache, mask, logits_at, capture, final, logits)

    @torch.inference_mode()
    def decode_rows(
        self, tokens: torch.Tensor, cache: RowCache, capture: bool = False, final: bool = False, logits: bool = True
    ) -> ForwardOutput:
        """One new token for each of B separate sequences (continuous batching): tokens (B,) int64,
        token b at position and slot cache.lengths[b] of row b. Returns logits (B, V), the captured
        states (B, 3H) and final states (B, H) as `forward` does. Leaves the lengths (cache.commit()).

        On the kernels (B <= kernels.MAX_ROWS on a CPU) row b's results are bit-identical to the
        one-token step of plain decoding of sequence b alone; elsewhere the eager path pads each row's
        keys to the longest and masks them."""
        B = tokens.shape[0]
        if tokens.shape != (cache.rows,):
            raise ValueError(f"one token per cache row: got {tuple(tokens.shape)} for {cache.rows} rows")
        if self.kernel_path(B, tokens.device):
            attention = kernels.RowsAttention(
                self._rope_table_for_kernels(),
                cache.lengths,
                self.args.n_heads,
                self.args.n_kv_heads,
                tuple(cache.k.shape[1:]),
                self.norm.weight.dtype,
                cache.k.dtype,
            )
            return self._forward_kernels(tokens, attention, cache.k, cache.v, None, capture, final, logits)
        x = self.tok_embeddings(tokens)[:, None]  # (B, 1, H)
        cos, sin = self.rope(cache.lengths, x.dtype if self.prefill_dtype is None else self.prefill_dtype)
        return self._forward_eager(x, cos[:, None, None], sin[:, None, None], cache, cache.attention_mask(), None, capture, final, logits)

    def _forward_eager(self, x, cos, sin, cache, mask, logits_at, capture, final, logits) -> ForwardOutput:
        """The torch path of `forward` and `decode_rows`: x (B, T, H) embeddings with B == 1 or T == 1;
        cos / sin broadcast against (B, heads, T, hd). The outputs are (B*T, ...) rows."""
        out_dtype = x.dtype
        if self.prefill_dtype is not None:
            x = x.to(self.prefill_dtype)
        captured = []
        for i, layer in enumerate(self.layers):
            if capture and i in self.capture:
                captured.append(x.flatten(0, 1))
            x = layer(x, cos, sin, cache, i, mask)
        x = x.flatten(0, 1).to(out_dtype)
        if logits_at is not None:
            x = x[logits_at]
        normed = self.norm(x)
        out_logits = self.output(normed).float() if logits else None
        hidden = torch.cat(captured, dim=-1).to(out_dtype) if capture else None
        return ForwardOutput(logits=out_logits, hidden=hidden, final=normed if final else None)

    def fixed_row_count(self, device: torch.device) -> int:
        """The fixed-shape forward's rows on this device (0: off)."""
        if self.fixed_rows is not None:
            return self.fixed_rows
        return FIXED_ROWS.get(torch.device(device).type, FIXED_ROWS["cpu"])

    def prefill_chunk_limit(self, device: torch.device) -> int:
        """Fixed-shape chunks a prompt may run as on this device (0: prompts past the fixed rows run
        eager): FIXED_PREFILL_CHUNKS, and on CUDA as many more as read PREFILL_CHUNK_READ_BYTES of
        this model's weights; fixed_prefill_chunks where set."""
        if self.fixed_prefill_chunks is not None:
            return self.fixed_prefill_chunks
        kind = torch.device(device).type
        least = FIXED_PREFILL_CHUNKS.get(kind, 0)
        return max(least, int(PREFILL_CHUNK_READ_BYTES // self.weight_bytes())) if kind == "cuda" else least

    def weight_bytes(self) -> int:
        """The bytes of the model's weights (its parameters and buffers, as held), counted once."""
        if self._weight_bytes is None:
            tensors = [*self.parameters(), *self.buffers()]
            self._weight_bytes = max(1, sum(t.numel() * t.element_size() for t in tensors))
        return self._weight_bytes

    def fixed_path(self, T: int, device: torch.device) -> bool:
        """Whether a forward of T new tokens runs the fixed-shape forward (the exact eager path)."""
        return 0 < T <= self.fixed_row_count(device) and not self.kernel_path(T, device)

    def exact(self, T: int, device: torch.device) -> bool:
        """Whether a forward of T new tokens computes each row from its own inputs only (a verified
        node gets its one-token step's bits): the CPU kernels or the fixed-shape forward."""
        return self.kernel_path(T, device) or self.fixed_path(T, device)

    def _forward_fixed(self, tokens, positions, parents, cache, logits_at, capture, final, logits, device) -> ForwardOutput:
        """`forward` on the fixed-shape path (dart_core/fixed_shape.py): the T new tokens padded to the fixed
        row count for every GEMM, attention per row over its logical key sequence; on CUDA through the
        Triton kernels, captured once a cache as a CUDA graph and replayed."""
        T = tokens.shape[0]
        cache.check_room(T)
        rows = self.fixed_row_count(device)
        if cache.k.shape[3] < cache.length + rows:
            raise RuntimeError(f"the fixed-shape forward writes {rows} rows: the cache needs that much scratch (Target.new_cache adds it)")
        rope = self._fixed_rope_table(device)
        rope.check(cache.length + T - 1)
        runner = getattr(cache, "fixed_runner", None)
        if runner is None or runner.model is not self or runner.rows != rows or runner.mode != self.cuda_forward:
            runner = cache.fixed_runner = fixed_shape.FixedRunner(self, cache, rows, device)
        out_logits, hidden, normed = runner(tokens, positions, parents, capture, logits)
        out_logits = None if out_logits is None else out_logits[:T]
        normed = normed[:T]
        if logits_at is not None:
            normed = normed[logits_at]
            out_logits = None if out_logits is None else out_logits[logits_at]
        return ForwardOutput(logits=out_logits, hidden=None if hidden is None else hidden[:T], final=normed if final else None)

    def _fixed_rope_table(self, device) -> fixed_shape.RopeTable:
        if self._fixed_rope is None or self._fixed_rope.cos.device != torch.device(device):
            self._fixed_rope = fixed_shape.RopeTable(self.inv_freq, self.rope_scale, self.args.max_position_embeddings)
        return self._fixed_rope

    def fixed_body(self, inputs: fixed_shape.FixedInputs, cache: KVCache, kernels, capture: bool, logits: bool):
        """The fixed-shape forward of inputs (loaded by FixedInputs.fill) at its R rows: returns logits
        (R, V) fp32 (or None), the captured residual streams (R, 3H) (or None) and the final-normed
        states (R, H). Shapes and addresses do not depend on the forward, so this can be captured.
        kernels: cuda.triton_kernels.Kernels (the attention, and with `fused` the element-wise work between
        the GEMMs, as Triton kernels) or None (torch ops throughout)."""
        if kernels is not None and kernels.gemm:
            return self._fixed_body_gemm(inputs, cache, kernels, capture, logits)
        a = self.args
        R = inputs.rows
        q_out, kv_out = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        fused = kernels is not None and kernels.fused
        rope = self._fixed_rope
        x = self.tok_embeddings(inputs.tokens)  # (R, H); padding rows read token 0 and are dropped
        if not fused:
            cos, sin = rope.lookup(inputs.positions, x.dtype)
            cos, sin = cos[:, None], sin[:, None]  # (R, 1, hd) against (R, heads, hd)

        def norm_after(x, y, norm: RMSNorm):  # (x + y, norm(x + y)); y None: (x, norm(x))
            if fused:
                return (x, kernels.rmsnorm(x, norm.weight, norm.eps)) if y is None else kernels.rmsnorm(x, norm.weight, norm.eps, y)
            x = x if y is None else x + y
            return x, norm(x)

        captured = []
        x, h = norm_after(x, None, self.layers[0].attention_norm)
        for i, layer in enumerate(self.layers):
            if capture and i in self.capture:
                captured.append(x)
            att = layer.attention
            k_cache, v_cache = cache.k[i, 0], cache.v[i, 0]  # (nkv, capacity + scratch, hd)
            qkv = _linear(att.wqkv, h)
            if fused:
                q = kernels.qkv_rope(qkv, att, k_cache, v_cache, rope, inputs, a)
            else:
                q, k, v = qkv.split([q_out, kv_out, kv_out], dim=-1)
                q, k = q.view(R, a.n_heads, a.head_dim), k.view(R, a.n_kv_heads, a.head_dim)
                if a.qk_norm:
                    q, k = att.q_norm(q), att.k_norm(k)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                k_cache.index_copy_(1, inputs.slots, k.transpose(0, 1).to(k_cache.dtype))
                v_cache.index_copy_(1, inputs.slots, v.reshape(R, a.n_kv_heads, a.head_dim).transpose(0, 1).to(v_cache.dtype))
            o = fixed_shape.attend(q, k_cache, v_cache, inputs, kernels).reshape(R, q_out)
            x, h = norm_after(x, _linear(att.wo, o), layer.ffn_norm)
            mlp = layer.feed_forward
            gu = _linear(mlp.w13, h)
            if fused:
                act = kernels.silu_mul(gu)
            else:
                gate, up = gu.chunk(2, dim=-1)
                act = F.silu(gate) * up
            nxt = self.layers[i + 1].attention_norm if i + 1 < len(self.layers) else self.norm
            x, h = norm_after(x, _linear(mlp.w2, act), nxt)
        normed = h
        out_logits = self.output(normed).float() if logits else None  # the LM head on all R rows too
        return out_logits, (torch.cat(captured, dim=-1) if capture else None), normed

    def _fixed_body_gemm(self, inputs: fixed_shape.FixedInputs, cache: KVCache, kernels, capture: bool, logits: bool):
        """fixed_body with our GEMMs (CudaForward.gemm): a layer is the normed q|k|v product, the q|k|v kernel,
        the attention, the output product added to the residual stream, the normed gate|up product
        through SiLU times up, the down product added to the stream (kernels.linear, cuda.triton_kernels.linear).
        The final norm and the LM head as fixed_body runs them."""
        x = self.tok_embeddings(inputs.tokens)  # (R, H); padding rows read token 0 and are dropped
        a, R = self.args, inputs.rows
        captured = []
        for i, layer in enumerate(self.layers):
            if capture and i in self.capture:
                captured.append(x)
            att, mlp = layer.attention, layer.feed_forward
            k_cache, v_cache = cache.k[i, 0], cache.v[i, 0]
            qkv = kernels.linear(x, att.wqkv.weight, att.wqkv.bias, norm=layer.attention_norm.weight, eps=layer.attention_norm.eps)
            q = kernels.qkv_rope(qkv, att, k_cache, v_cache, self._fixed_rope, inputs, a)
            o = fixed_shape.attend(q, k_cache, v_cache, inputs, kernels).reshape(R, a.n_heads * a.head_dim)
            x = kernels.linear(o, att.wo.weight, att.wo.bias, residual=x)
            act = kernels.linear(x, mlp.w13.weight, norm=layer.ffn_norm.weight, eps=layer.ffn_norm.eps, silu=True)
            x = kernels.linear(act, mlp.w2.weight, mlp.w2.bias, residual=x)
        normed = kernels.rmsnorm(x, self.norm.weight, self.norm.eps)
        out_logits = self.output(normed).float() if logits else None
        return out_logits, (torch.cat(captured, dim=-1) if capture else None), normed

    def kernel_path(self, T: int, device: torch.device) -> bool:
        """Whether a forward of T new tokens runs the batch-invariant kernels."""
        return self.use_kernels and T <= kernels.MAX_ROWS and kernels.supports(self.output.weight.dtype, device)

    def _rope_table_for_kernels(self) -> kernels.RopeTable:
        if self._rope_table is None:
            self._rope_table = kernels.RopeTable(self.inv_freq, self.rope_scale)
        return self._rope_table

    def _forward_kernels(self, tokens, attention, k_cache, v_cache, logits_at, capture, final, logits) -> ForwardOutput:
        """The kernel path of `forward` and `decode_rows` (same contract): attention is the forward's
        TreeAttention or RowsAttention, k_cache / v_cache (L, *attention.cache_shape). Every op here is
        row-wise, so a row's result depends on its own inputs only (attention: on its own key sequence)."""
        x = self.tok_embeddings(tokens)  # (T, H)
        stack = self._layer_stack()
        t0 = time.perf_counter()
        if stack is not None:
            x, pending, hidden = stack(x, attention, k_cache, v_cache, self.capture if capture else ())
        else:
            x, pending, hidden = self._layers_per_op(x, attention, k_cache, v_cache, capture)
        t1 = time.perf_counter()
        if logits_at is not None:
            x, pending = x[logits_at].contiguous(), pending[logits_at].contiguous()
        _, normed = kernels.add_rmsnorm(x, pending, self.norm.weight, self.norm.eps)
        t2 = time.perf_counter()
        out_logits = kernels.linear(normed, self.output.weight).float() if logits else None
        if self.stage_seconds is not None:  # the timestamps cost ~0.1 us each: not worth a branch apiece
            s = self.stage_seconds
            s["layers"], s["head"] = s.get("layers", 0.0) + t1 - t0, s.get("head", 0.0) + time.perf_counter() - t2
        return ForwardOutput(logits=out_logits, hidden=hidden, final=normed if final else None)

    def _layer_stack(self) -> kernels.LayerStack | None:
        """The decoder layers as one C++ call (kernels.LayerStack), built on first use and again when the
        weights were replaced; None where it does not apply (Qwen3's q/k norms, `use_layer_stack` off)."""
        if not self.use_layer_stack or self.args.qk_norm:
            return None
        if self._stack is None or self._stack.stale():
            a = self.args
            self._stack = kernels.LayerStack(self.layers, self.norm.weight.dtype, a.rms_norm_eps, a.intermediate_size)
        return self._stack

    def step_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer's linears and norms, the final norm and
        the LM head (the embedding lookup reads one row, left out)."""
        total = self.output.weight.nbytes + self.norm.weight.nbytes  # tensors and BlockWeights both have .nbytes
        for layer in self.layers:
            for lin in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2):
                total += lin.weight.nbytes + (0 if lin.bias is None else lin.bias.nbytes)
            total += layer.attention_norm.weight.nbytes + layer.ffn_norm.weight.nbytes
        return total

    def reset_layer_stack(self) -> None:
        """Forget the LayerStack's plan (its raw weight pointers): call after replacing a single weight."""
        self._stack = None

    def _layers_per_op(self, x, attention, k_cache, v_cache, capture: bool):
        """The decoder layers one kernel call at a time (the reference LayerStack reproduces bit for
        bit, and the path of models it does not cover). Returns (x, pending, captured or None)."""
        a = self.args
        T = x.shape[0]
        q_out, kv_out = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        captured = []
        pending = None  # the previous block's MLP output, added to x by the next fused add + norm
        for i, layer in enumerate(self.layers):
            att, ffn = layer.attention, layer.feed_forward
            x, h = kernels.add_rmsnorm(x, pending, layer.attention_norm.weight, layer.attention_norm.eps)
            if capture and i in self.capture:
                captured.append(x)
            qkv = kernels.linear(h, att.wqkv.weight, att.wqkv.bias)  # (T, q|k|v)
            q, k, v = qkv.split([q_out, kv_out, kv_out], dim=-1)
            if a.qk_norm:
                q = att.q_norm(q.reshape(T, a.n_heads, a.head_dim)).reshape(T, q_out)
                k = att.k_norm(k.reshape(T, a.n_kv_heads, a.head_dim)).reshape(T, kv_out)
            o = attention(q, k, v, k_cache[i], v_cache[i])
            x, h = kernels.add_rmsnorm(x, kernels.linear(o, att.wo.weight), layer.ffn_norm.weight, layer.ffn_norm.eps)
            pending = kernels.linear(kernels.silu_mul(kernels.linear(h, ffn.w13.weight)), ffn.w2.weight)
        return x, pending, (torch.cat(captured, dim=-1) if capture else None)

    @staticmethod
    def _attention_mask(tree_mask: torch.Tensor | None, P: int, T: int, device) -> torch.Tensor | None:
        """Boolean (1, 1, T, P+T) mask: every new token sees the whole prefix, and new tokens see each other per tree_mask.
        None where no mask is needed: one new token (it attends to everything before it), or a causal
        forward into an empty cache (P == 0: the attention runs SDPA's is_causal, which is top-left
        aligned and so exact only without a prefix)."""
        if tree_mask is None:
            if T == 1 or P == 0:
                return None
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
        prefix = torch.ones(T, P, dtype=torch.bool, device=device)
        return torch.cat((prefix, tree_mask.to(device)), dim=1)[None, None]


# ---------------------------------------------------------------------------------------------------
# Linears and embeddings whose weights keep a packed layout (GGUF blocks, interleaved bf16)


class BlockLinear(nn.Module):
    """A bias-free linear whose weight is stored in a layout of its own: a kernels.BlockWeight (GGUF
    blocks) or kernels.InterleavedBF16 (bf16 rows interleaved in 16s). The kernel path reads it
    directly. Longer inputs (prompt prefill) multiply by its values dequantized for the call in
    `gemm_dtype`: fp32 (exact values), or bf16 where the CPU multiplies bf16 in hardware
    (AVX512-BF16/AMX: a 769-token prefill 1.3 s -> ~0.4 s on one thread of a Xeon; the prompt's keys
    and values then carry bf16 rounding, shared by every method). The exact gguf path keeps fp32;
    gguf-int8 takes bf16 where it can."""

    def __init__(self, weight: kernels.PackedWeight, gemm_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = weight
        self.bias = None
        self.gemm_dtype = gemm_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= kernels.MAX_ROWS and x.device.type == "cpu":  # e.g. the LM head on the last prompt position
            return kernels.linear(x.reshape(rows, x.shape[-1]).contiguous(), self.weight).view(*x.shape[:-1], self.weight.rows)
        return F.linear(x.to(self.gemm_dtype), self.weight.dequantize(dtype=self.gemm_dtype)).to(x.dtype)


class BlockEmbedding(nn.Module):
    """Token embeddings stored as GGUF blocks: a lookup dequantizes the rows it needs (fp32, or rounded
    to `dtype` as `.to` rounds fp32)."""

    def __init__(self, weight: kernels.BlockWeight):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.dequantize(ids, dtype).view(*ids.shape, self.weight.cols)


def interleave_bf16_linears(model: Transformer) -> int:
    """Every bias-free linear of a bf16 model's decoder layers, and its LM head, read from an
    InterleavedBF16 copy (kernels/formats.py) instead of the bf16 tensor, in place; returns how many. For CPUs
    without bf16 arithmetic (target.load_target decides): there a verify of 6 rows costs ~1.1x a
    one-row step in that layout against ~1.4-1.6x as stored (docs/engine.md). A tied embedding keeps
    its tensor for lookups (one row a token) and the LM head gets the copy. Linears whose rows are not
    whole groups of 16, or that have a bias, stay as they are; the prompt prefill reads the copies'
    values (exact) in the model's prefill dtype."""
    gemm = model.prefill_dtype or torch.bfloat16

    def convert(lin: nn.Module) -> nn.Module:
        w = lin.weight
        if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.shape[0] % 16 or getattr(lin, "bias", None) is not None:
            return lin
        return BlockLinear(kernels.InterleavedBF16.from_tensor(w), gemm)

    done = 0
    for layer in model.layers:
        att, ffn = layer.attention, layer.feed_forward
        for owner, name in ((att, "wqkv"), (att, "wo"), (ffn, "w13"), (ffn, "w2")):
            new = convert(getattr(owner, name))
            done += new is not getattr(owner, name)
            setattr(owner, name, new)
    head = convert(model.output)
    done += head is not model.output
    model.output = head
    model.reset_layer_stack()
    return done


def default_prefill_dtype() -> torch.dtype:
    """bf16 GEMMs for a fast GGUF model's prompt prefill where the CPU has bf16 arithmetic, else fp32
    (the exact gguf path asks for fp32: target.load_target)."""
    return torch.bfloat16 if kernels.PATH == "avx512bf16" else torch.float32
