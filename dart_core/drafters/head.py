"""The one-layer draft head shared by DART and EAGLE3, in the published checkpoint format.

A head reads three hidden states of the frozen target (concatenated, 3·Ht wide), projects them to H
with `fc`, and runs ONE Llama-style decoder layer whose attention input is 2H wide: the normed token
embedding (taken from the target) next to the normed hidden stream. DART adds `midlayer.mask_rep`, a
learned vector standing in for the not-yet-known future positions; EAGLE3 has none.

Checkpoint: a directory (or hub repo) with config.json and model.safetensors (or, as EAGLE3 heads
such as AngelSlim's often ship, pytorch_model.bin) holding
    fc.weight [H, 3Ht]; midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight [H];
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], o_proj [H, nh·hd]; midlayer.mlp.{gate,up,down}_proj;
    norm.weight [H]; lm_head.weight [Vd, H]; d2t [Vd] (target id = i + d2t[i]); t2d [V] bool;
    DART only: midlayer.mask_rep [2H]. An `embed_tokens.weight` may be present and is ignored; d2t and
    t2d may both be absent when the draft vocabulary is the target's (identity mapping).
Loading checks every key and shape and the fit with the target, and refuses anything else.

Shapes: T = positions in a forward, P = positions already in the head's cache.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .. import kernels
from ..kernels import apply_linear
from ..loading import GGUF, hub_snapshot
from ..model import KVCache, RMSNorm, apply_rope

IGNORED_KEYS = ("embed_tokens.weight",)  # the embedding always comes from the target


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary (t2d length)
    draft_vocab_size: int
    target_hidden_size: int
    draft_length: int | None  # DART: number of mask slots D (rows = D + 1); EAGLE3: None
    double_norm: bool  # upstream DART applies the final norm twice at inference

    @property
    def is_dart(self) -> bool:
        return self.draft_length is not None

    @classmethod
    def from_dict(cls, cfg: dict, dart: bool) -> "HeadConfig":
        try:
            heads = cfg["num_attention_heads"]
            rope = cfg.get("rope_parameters") or {}
            return cls(
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                vocab_size=cfg["vocab_size"],
                draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
                target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
                draft_length=int(cfg["draft_length"]) if dart else None,
                # published DART heads were run with the norm applied twice; ours say so explicitly
                double_norm=bool(cfg.get("dart_double_norm", dart)),
            )
        except KeyError as e:
            raise ValueError(f"draft head config.json lacks the field {e.args[0]!r}") from None

    def to_dict(self) -> dict:
        d = {
            "architectures": ["LlamaForCausalLMDart" if self.is_dart else "LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
        }
        if self.is_dart:
            d["draft_length"] = self.draft_length
            d["dart_double_norm"] = self.double_norm
        return d


class DraftLayer(nn.Module):
    """The head's decoder layer; attention input is [norm(embedding), norm(hidden)] (2H wide)."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        H, q_out, kv_out = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.c = c
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * H, q_out, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * H, kv_out, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * H, kv_out, bias=False)
        self.self_attn.o_proj = nn.Linear(q_out, H, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
        if c.is_dart:
            self.mask_rep = nn.Parameter(torch.randn(2 * H))

    def attention(self, u, cos, sin, mask, cache: KVCache | None, queries: torch.Tensor | None = None) -> torch.Tensor:
        """u (T, 2H) -> (T, H). With a cache, attends to its committed prefix too (pending writes).
        queries (Tq,): compute only these rows' outputs (keys and values still come from all T rows;
        mask then has Tq rows) -> (Tq, H), the same rows as the full call gives, for less work."""
        c, a = self.c, self.self_attn
        T = u.shape[0]
        uq, cq, sq = (u, cos, sin) if queries is None else (u[queries], cos[queries], sin[queries])
        Tq = uq.shape[0]
        q = apply_rope(apply_linear(a.q_proj, uq).view(Tq, c.num_attention_heads, c.head_dim).transpose(0, 1)[None], cq, sq)
        k = apply_rope(apply_linear(a.k_proj, u).view(T, c.num_key_value_heads, c.head_dim).transpose(0, 1)[None], cos, sin)
        v = apply_linear(a.v_proj, u).view(T, c.num_key_value_heads, c.head_dim).transpose(0, 1)[None]
        if cache is not None:
            k, v = cache.write(0, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=c.num_attention_heads != c.num_key_value_heads)
        return apply_linear(a.o_proj, out[0].transpose(0, 1).reshape(Tq, -1))

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        x = self.post_attention_layernorm(h)
        return h + apply_linear(m.down_proj, F.silu(apply_linear(m.gate_proj, x)) * apply_linear(m.up_proj, x))


class DraftHead(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DraftLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        # a plain fp32 attribute, not a buffer, so that casting the head to bf16 leaves it exact
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim))

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, hd) for rope positions (T,)."""
        if self.inv_freq.device != positions.device:  # one copy per device, not one per call
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def inputs(self, aux: torch.Tensor | None, hidden: torch.Tensor | None, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention input u (T, 2H) and residual (T, H) for real positions, from target states
        aux (T, 3Ht) through fc, or from the head's own previous outputs hidden (T, H) (EAGLE3 expansion)."""
        g = apply_linear(self.fc, aux) if aux is not None else hidden
        layer = self.midlayer
        return torch.cat((layer.input_layernorm(emb), layer.hidden_norm(g)), dim=-1), g

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, Vd) draft-vocabulary logits."""
        h = self.norm(h)
        if self.config.double_norm:
            h = self.norm(h)
        return apply_linear(self.lm_head, h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


class KernelHead:
    """A loaded head's inference forward on the CPU kernels (dart_core/kernels/), for drafting.

    The eager forward runs ~60 small torch ops a step; here q|k|v and gate|up are one weight each
    (copies made once, the head itself is not modified), RoPE, the cache write and the attention are
    one kernel call, and norms are fused kernels. Attention is causal over the new rows after the
    cached prefix (a chain for `kernels.tree_attention`), which is what DART's draft forward and
    the first forward of EAGLE3's step compute. Same results as the eager forward up to rounding
    (tests compare them); drafts need no exactness, the verify guarantees the output.
    Use `KernelHead.supports(head)` first: CPU, float32/bfloat16/float16, kernels built."""

    def __init__(self, head: DraftHead, int8: bool = False):
        """int8: the linears' weights as Q8_0 blocks against int8 activations (kernels.quantize_q8_0),
        rows interleaved in 16s where they divide (the fast int8 layout, BlockWeight.interleaved)."""
        c, layer = head.config, head.midlayer
        a, m = layer.self_attn, layer.mlp
        self.c, self.int8 = c, int8

        def weight(w: torch.Tensor):
            if not int8:
                return w
            q = kernels.quantize_q8_0(w)
            return q.interleaved() if q.rows % 16 == 0 else q

        with torch.no_grad():
            self.fc = weight(head.fc.weight.detach())
            self.wqkv = weight(torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)).detach().contiguous())
            self.wo = weight(a.o_proj.weight.detach())
            self.wgu = weight(torch.cat((m.gate_proj.weight, m.up_proj.weight)).detach().contiguous())
            self.wdown = weight(m.down_proj.weight.detach())
            self.lm_head = weight(head.lm_head.weight.detach())
        self.input_norm, self.hidden_norm = layer.input_layernorm.weight.detach(), layer.hidden_norm.weight.detach()
        self.post_norm, self.final_norm = layer.post_attention_layernorm.weight.detach(), head.norm.weight.detach()
        self.eps = c.rms_norm_eps
        self.q_out, self.kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.rope = kernels.RopeTable(head.inv_freq, 1.0)
        self.mask = layer.mask_rep.detach().contiguous() if c.is_dart else None
        self.dtype = head.fc.weight.dtype
        self._plan = self._draft_plan() if c.is_dart else None
        self._layer_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # draft's cache views: (cache.k, k[0, 0], v[0, 0])

    def _draft_plan(self) -> torch.Tensor:
        """The raw pointers `draft` hands the C++ (`draft_forward`; the tensors are this object's, kept)."""
        fields = []
        for w in (self.fc, self.wqkv, self.wo, self.wgu, self.wdown, self.lm_head):
            fields += kernels.plan_fields(w, self.dtype)
        for t in (self.input_norm, self.hidden_norm, self.post_norm, self.final_norm, self.mask):
            if t.dtype != self.dtype or not t.is_contiguous():
                raise ValueError(f"KernelHead: norms and the mask must be contiguous {self.dtype} tensors")
            fields.append(t.data_ptr())
        plan = torch.tensor(fields, dtype=torch.int64)
        if plan.numel() != kernels.draft_fields():
            raise RuntimeError(f"KernelHead: the draft plan has {plan.numel()} fields, the extension wants {kernels.draft_fields()}")
        return plan

    def draft(self, aux: torch.Tensor, emb: torch.Tensor, cache: KVCache, masks: int) -> torch.Tensor:
        """A DART head's whole draft forward in one C++ call: `inputs`, the mask rows, `layer` and
        `logits` as the per-op methods run them. aux (S, 3H) and emb (S, H) for the S committed tokens,
        then `masks` mask rows; keys and values written at cache.length.. as pending entries.
        Returns the last masks + 1 rows' logits (masks + 1, Vd)."""
        if self._plan is None:
            raise ValueError("KernelHead.draft is DART's forward (a head with mask_rep)")
        S, H = emb.shape
        if aux.shape != (S, 3 * H) or aux.dtype != self.dtype or emb.dtype != self.dtype:
            raise ValueError(f"draft: aux (S, 3H) and emb (S, H) {self.dtype} tensors, got {tuple(aux.shape)} {tuple(emb.shape)}")
        if cache.k.dtype != self.dtype:
            raise ValueError(f"draft: the head's cache must be {self.dtype}")
        T, P = S + masks, cache.length
        cache.check_room(T)
        self.rope.ensure(P + T)
        aux, emb = aux.contiguous(), emb.contiguous()
        logits = torch.empty(masks + 1, self.c.draft_vocab_size, dtype=self.dtype)
        if self._layer_kv is None or self._layer_kv[0] is not cache.k:  # taken once a cache, not a step (~5 us)
            self._layer_kv = (cache.k, cache.k[0, 0], cache.v[0, 0])
        c = self.c
        kernels.draft_forward(
            self._plan, S, masks, H, c.intermediate_size, c.draft_vocab_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, self.eps, c.double_norm, aux, emb, self.rope, P, *self._layer_kv[1:], logits,
        )  # fmt: skip
        return logits

    @staticmethod
    def supports(head: DraftHead) -> bool:
        w = head.fc.weight
        return kernels.supports(w.dtype, w.device)

    def inputs(self, aux: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As DraftHead.inputs from target states: aux (T, 3Ht), emb (T, H) -> u (T, 2H), residual (T, H)."""
        return self.inputs_from_hidden(kernels.linear(aux.contiguous(), self.fc), emb)

    def inputs_from_hidden(self, hidden: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As DraftHead.inputs from a hidden state (T, H): the head's own previous outputs (an EAGLE3
        expansion) or fc of the target states (`inputs`); emb (T, H) -> u (T, 2H), residual (T, H) = hidden."""
        hidden = hidden.contiguous()
        _, e = kernels.add_rmsnorm(emb.contiguous(), None, self.input_norm, self.eps)
        _, n = kernels.add_rmsnorm(hidden, None, self.hidden_norm, self.eps)
        return torch.cat((e, n), dim=-1), hidden

    def tree_layer(
        self,
        u: torch.Tensor,
        residual: torch.Tensor,
        cache: KVCache,
        committed: int,
        positions: torch.Tensor,
        parents: torch.Tensor,
        prior: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer for n new rows of a draft tree (u (n, 2H), residual (n, H)) after the
        `committed` cache entries and m earlier scratch rows of the same tree, whose q|k|v rows are
        `prior` (m, q+2kv) and whose keys and values sit at cache slots committed..committed+m-1 (as this
        call leaves them). Every row attends to the committed entries, its ancestors and itself:
        parents (m+n,) and positions (m+n,) cover the earlier rows first. The earlier rows go through
        the attention again (their keys and values are rewritten unchanged), which keeps the tree in
        the one attention kernel; only the new rows go on through o and the MLP. Nothing is committed.
        Returns the new rows' outputs (n, H) and their q|k|v rows (n, q+2kv), the next call's prior."""
        n = u.shape[0]
        qkv_new = kernels.linear(u.contiguous(), self.wqkv)
        qkv = qkv_new if prior is None else torch.cat((prior, qkv_new))
        T = qkv.shape[0]
        if cache.length != committed:
            raise ValueError(f"tree_layer: the cache holds {cache.length} committed entries, the tree follows {committed}")
        cache.check_room(T)
        q, k, v = qkv.split((self.q_out, self.kv_out, self.kv_out), dim=1)
        attn = kernels.tree_attention(
            q,
            k,
            v,
            self.rope,
            positions,
            cache.k[0, 0],
            cache.v[0, 0],
            committed,
            parents,
            self.c.num_attention_heads,
            self.c.num_key_value_heads,
        )
        return self._attention_out_mlp(attn[T - n :], residual), qkv_new

    def _attention_out_mlp(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o, the residual, the post-attention norm and the MLP: (keep, q_out) attention rows -> (keep, H)."""
        h = residual + kernels.linear(attn.contiguous(), self.wo)
        _, x = kernels.add_rmsnorm(h.contiguous(), None, self.post_norm, self.eps)
        return h + kernels.linear(kernels.silu_mul(kernels.linear(x, self.wgu)), self.wdown)

    def layer(self, u: torch.Tensor, residual: torch.Tensor, cache: KVCache, keep: int) -> torch.Tensor:
        """The decoder layer for T new rows at cache positions cache.length.. (u (T, 2H), residual
        (T, H)); their keys/values are written as pending entries. Returns the last `keep` rows (keep, H)."""
        T = u.shape[0]
        P = cache.length
        cache.check_room(T)
        qkv = kernels.linear(u.contiguous(), self.wqkv)
        q, k, v = qkv.split((self.q_out, self.kv_out, self.kv_out), dim=1)
        positions = torch.arange(P, P + T)
        chain = torch.arange(-1, T - 1)  # each new row sees the prefix and the new rows before it
        attn = kernels.tree_attention(
            q, k, v, self.rope, positions, cache.k[0, 0], cache.v[0, 0], P, chain, self.c.num_attention_heads, self.c.num_key_value_heads
        )
        return self._attention_out_mlp(attn[T - keep :], residual[T - keep :])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """As DraftHead.logits: (T, H) -> (T, Vd)."""
        _, x = kernels.add_rmsnorm(h.contiguous(), None, self.final_norm, self.eps)
        if self.c.double_norm:
            _, x = kernels.add_rmsnorm(x, None, self.final_norm, self.eps)
        return kernels.linear(x, self.lm_head)


def expected_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    H, I = c.hidden_size, c.intermediate_size
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {
        "fc.weight": (H, 3 * c.target_hidden_size),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q_out, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv_out, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv_out, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q_out),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (c.draft_vocab_size, H),
        "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }
    if c.is_dart:
        shapes["midlayer.mask_rep"] = (2 * H,)
    return shapes


TRAINED_FILE = "trained.json"  # beside a head trained here: {"run", "step", "elapsed_s"} of the run that made it


def trained_record(name: str | os.PathLike | None) -> dict | None:
    """What a local head's TRAINED_FILE says of its training ({"run", "step", "elapsed_s"}, the keys it
    has), or None for a hub id or a head without one: how the bench names which heads it compared.
    A file that is not a JSON object with an integer step is a clear error, not a silent None."""
    if name is None:
        return None
    path = Path(name).expanduser() / TRAINED_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int) or isinstance(record.get("step"), bool):
        raise ValueError(f'{path}: expected {{"run": name, "step": int, "elapsed_s": seconds}}, got {record!r}')
    return {k: record[k] for k in ("run", "step", "elapsed_s") if k in record}


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # safetensors preferred; EAGLE3 heads often ship .bin only


def resolve_head_dir(name: str | os.PathLike) -> Path:
    path = Path(name).expanduser()
    if not path.exists():
        if str(name).count("/") != 1 or str(name).startswith((".", "/", "~")):
            raise FileNotFoundError(f"draft head {str(name)!r} is neither a local directory nor a hub id")
        path = Path(hub_snapshot(str(name), ["config.json", *WEIGHT_FILES]))
    if not (path / "config.json").is_file() or not any((path / f).is_file() for f in WEIGHT_FILES):
        raise FileNotFoundError(f"{path} must hold config.json and model.safetensors (or pytorch_model.bin)")
    return path


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """The head's tensors from model.safetensors, else pytorch_model.bin (tensors only, no pickled code)."""
    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    try:
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except (
        pickle.UnpicklingError,
        RuntimeError,
        OSError,
        EOFError,
        ValueError,
    ) as e:  # torch.load's errors for corrupt or non-tensor files
        raise ValueError(f"{path / 'pytorch_model.bin'} is not a readable state dict: {e}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path / 'pytorch_model.bin'} does not hold a flat dict of tensors")
    return state


def load_head(name: str | os.PathLike, dart: bool, target, dtype=None, device=None) -> DraftHead:
    """Load a head for `target`, refusing a checkpoint whose tensors or sizes do not fit."""
    path = resolve_head_dir(name)
    cfg_dict = json.loads((path / "config.json").read_text())
    if dart and "draft_length" not in cfg_dict:
        raise ValueError(f"{path}: config.json has no draft_length: not a DART head (an EAGLE3 head?)")
    c = HeadConfig.from_dict(cfg_dict, dart)
    if c.target_hidden_size != target.hidden_size:
        raise ValueError(f"{path}: head expects target hidden size {c.target_hidden_size}, the target has {target.hidden_size}")
    if c.vocab_size != target.vocab_size:
        raise ValueError(f"{path}: head was trained for a vocabulary of {c.vocab_size}, the target has {target.vocab_size}")
    if c.hidden_size != target.hidden_size:
        raise ValueError(
            f"{path}: head hidden size {c.hidden_size} differs from the target's {target.hidden_size} (the embedding is shared)"
        )
    state = read_state(path)
    for k in IGNORED_KEYS:
        state.pop(k, None)
    if c.draft_vocab_size == c.vocab_size and "d2t" not in state and "t2d" not in state:
        # a head drafting over the full vocabulary may omit the mapping (upstream EAGLE drops it then)
        state["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    shapes = expected_shapes(c)
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint does not match a {'DART' if dart else 'EAGLE3'} head: missing {missing}, unexpected {unexpected}"
        )
    for k, shape in shapes.items():
        if tuple(state[k].shape) != shape:
            raise ValueError(f"{path}: tensor {k} has shape {tuple(state[k].shape)}, expected {shape}")
    d2t = state["d2t"].long()
    target_ids = torch.arange(c.draft_vocab_size) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= target.vocab_size:
        raise ValueError(f"{path}: d2t maps draft ids outside the target vocabulary")
    head = DraftHead(c)
    state["d2t"], state["t2d"] = d2t, state["t2d"].bool()
    head.load_state_dict(state, strict=True)
    return head.to(device=device or target.device, dtype=dtype or head_dtype(target)).eval()


def int8_beside(target) -> bool:
    """Whether a head's kernel forward runs on Q8_0 weights and int8 activations beside `target` (a draft
    step reads half the bytes of the bf16 head, and drafts need no exactness: the verify decides):
    beside the GGUF paths, whose target forward is block weights already, and beside a bf16 target on
    kernels without bf16 arithmetic (any build but avx512bf16), which widen every bf16 weight to fp32
    where int8 dot products need no conversion."""
    if str(getattr(target, "weights", "")).startswith(GGUF):
        return True
    return getattr(target, "dtype", None) == torch.bfloat16 and kernels.PATH not in (None, "avx512bf16")


def head_dtype(target) -> torch.dtype:
    """The dtype a head runs in beside `target`: the target's, except beside GGUF weights (whose
    activations are fp32), where it keeps its stored bf16: half the bytes a draft step reads, and
    drafts need no exactness (the verify decides)."""
    return torch.bfloat16 if str(getattr(target, "weights", "")).startswith(GGUF) else target.dtype
