"""The target model runner: tokenizer + transformer + the three forwards speculative decoding needs.

    prefill(ids, cache)       the prompt, causal; logits for the last position only
    verify(tree, cache)       a whole draft tree in one forward with the tree attention mask;
                              logits for every node (a one-token step is a one-node tree)

Neither moves the cache's committed length: the caller commits what it accepts (see KVCache).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import kernels as kernel_ops
from .fixed_shape import Upload
from .gguf_checkpoint import load_gguf_transformer
from .hf_checkpoint import load_transformer
from .loading import AUTO, DEFAULT_MODEL, GGUF, GGUF_INT8, GGUF_INT16, GGUF_PATHS, embedded_gguf_path, parse_dtype, resolve_model_dir
from .model import BlockLinear, ForwardOutput, KVCache, SpareCache, Transformer, interleave_bf16_linears
from .tree import DraftTree

log = logging.getLogger(__name__)

Prompt = str | list[dict] | list[int] | torch.Tensor


@dataclass
class Target:
    name: str
    model_dir: Path
    model: Transformer
    tokenizer: object  # a transformers tokenizer
    eos_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype  # of activations
    weights: str = ""  # what the weights are read as: the dtype's name, or "gguf (Q4_1, Q8_0)"
    cache_dtype: torch.dtype | None = None  # of the KV cache; None: `dtype`
    spare: SpareCache = field(default_factory=SpareCache, repr=False, compare=False)  # the last generation's cache
    _rows_upload: Upload | None = field(default=None, repr=False, compare=False)  # Target.rows' indices to a GPU

    def __post_init__(self):
        if self.cache_dtype is None:
            self.cache_dtype = self.dtype

    @property
    def context_limit(self) -> int:
        return self.model.args.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.model.args.hidden_size

    # ------------------------------------------------------------------ prompts

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt: chat messages (template applied), a user message string, or ids."""
        if isinstance(prompt, torch.Tensor):
            ids = prompt.reshape(-1).tolist()
        elif isinstance(prompt, str):
            ids = self.encode([{"role": "user", "content": prompt}])
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._apply_chat_template(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError("a prompt is a string, a list of chat messages ({'role', 'content'}) or a list of token ids")
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def _apply_chat_template(self, messages: list[dict]) -> list[int]:
        for i, m in enumerate(messages):
            if (
                set(m) - {"role", "content"}
                or not isinstance(m.get("content"), str)
                or m.get("role")
                not in (
                    "system",
                    "user",
                    "assistant",
                )
            ):
                raise ValueError(f"message {i} must be {{'role': system|user|assistant, 'content': str}}, got {m!r}")
        if not any(m["content"].strip() for m in messages if m["role"] == "user"):
            raise ValueError("the prompt is empty: no user message has any text")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.name} has no chat template; pass token ids instead of messages")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ forwards

    def new_cache(self, capacity: int) -> KVCache:
        a = self.model.args
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity, self.cache_dtype, self.device, self._cache_scratch())

    def _cache_scratch(self) -> int:
        return 0 if self.model.kernel_path(1, self.device) else self.model.fixed_row_count(self.device)

    def lease_cache(self, capacity: int) -> KVCache:
        """An empty cache of at least `capacity` for one generation: the last generation's when it fits
        (with the graphs captured on it, SpareCache), else a new one. Give it back with `return_cache`."""
        a = self.model.args
        return self.spare.lease(a.n_layers, a.n_kv_heads, a.head_dim, capacity, self.cache_dtype, self.device, self._cache_scratch())

    def return_cache(self, cache: KVCache) -> None:
        self.spare.give(cache)

    def prefill(self, ids: list[int], cache: KVCache, capture: bool) -> ForwardOutput:
        """Run the prompt causally after the cache's prefix. Logits (1, V) for the last token; hidden (T, 3H).

        On the CPU kernels with `model.kernel_prefill`, a prompt longer than their rows runs as kernel
        forwards of kernels.MAX_ROWS tokens in turn: each row gets its one-token step's bits.
        A prompt longer than the fixed-shape forward's rows R runs as one eager forward, or, where
        model.prefill_chunk_limit allows its ceil(T / R) chunks, as fixed-shape forwards of R tokens
        in turn (on a GPU: a replay of the captured graph a chunk instead of an eager forward's
        hundreds of launches; each row then gets its one-token step's bits). Like any forward it
        leaves the prompt's entries pending: the caller commits them."""
        rows = kernel_ops.MAX_ROWS
        if len(ids) > rows and self.model.kernel_prefill and self.model.kernel_path(rows, self.device):
            return self._prefill_chunked(ids, cache, capture, rows)
        R = self.model.fixed_row_count(self.device)
        if len(ids) > R > 0 and -(-len(ids) // R) <= self.model.prefill_chunk_limit(self.device) and self.model.fixed_path(R, self.device):
            return self._prefill_chunked(ids, cache, capture, R)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(cache.length, cache.length + len(ids), device=self.device)
        return self.model(tokens, positions, cache, None, logits_at=slice(-1, None), capture=capture)

    def _prefill_chunked(self, ids: list[int], cache: KVCache, capture: bool, R: int) -> ForwardOutput:
        start = cache.length
        cache.check_room(len(ids))
        hidden = []
        try:
            for at in range(0, len(ids), R):
                chunk = ids[at : at + R]
                last = at + R >= len(ids)
                positions = torch.arange(cache.length, cache.length + len(chunk))
                out = self.model(
                    torch.tensor(chunk), positions, cache, None, slice(-1, None) if last else None, capture=capture, logits=last
                )
                if capture:
                    hidden.append(out.hidden)
                cache.commit(len(chunk))  # the next chunk attends to this one
        finally:
            cache.rewind(start)  # pending again (their keys and values stay in place)
        return ForwardOutput(logits=out.logits, hidden=torch.cat(hidden) if capture else None)

    def exact_verify(self, rows: int) -> bool:
        """Whether a verify of up to `rows` nodes computes bit for bit what one-token steps compute
        (the batch-invariant CPU kernels, dart_core/kernels/, or the fixed-shape forward, dart_core/fixed_shape.py)."""
        return self.model.exact(rows, self.device)

    def prefill_exact(self, n: int) -> bool:
        """Whether `prefill` of n tokens gives every row its one-token step's bits (then a prefill's rows
        do not depend on where the prompt is cut: dart_core/prefix_cache.py): one kernel forward or
        kernel forwards of their rows (model.kernel_prefill), or fixed-shape forwards as `prefill` runs them."""
        rows, R = kernel_ops.MAX_ROWS, self.model.fixed_row_count(self.device)
        if self.model.kernel_path(min(n, rows), self.device):
            return n <= rows or self.model.kernel_prefill
        return self.model.fixed_path(min(n, R), self.device) and (n <= R or -(-n // R) <= self.model.prefill_chunk_limit(self.device))

    def verify(self, tree: DraftTree, cache: KVCache, capture: bool) -> ForwardOutput:
        """Run every tree node in one forward. Logits (N, V); hidden (N, 3H)."""
        n = len(tree)
        tokens, positions = tree.tokens, tree.depths + cache.length
        if not self.model.fixed_path(n, self.device):  # (the fixed path uploads them with the tree: fixed_shape.FixedInputs)
            tokens, positions = tokens.to(self.device), positions.to(self.device)
        # the exact paths read the tree from its parent links; the plain eager path needs its mask
        mask = None if n == 1 or self.model.exact(n, self.device) else tree.mask.to(self.device)
        return self.model(tokens, positions, cache, mask, capture=capture, parents=tree.parents)

    def rows(self, x: torch.Tensor, nodes: list[int]) -> torch.Tensor:
        """x's rows at `nodes` (a verify's captured states at the accepted path, for the drafter): a
        slice where they are 0..n-1 (a chain, plain decoding's step); on a GPU the indices go up from
        pinned memory (fixed_shape.Upload): indexing with a list copies it from pageable memory, which waits
        for everything the device has queued (the cache's commit) once a step."""
        n = len(nodes)
        if nodes == list(range(n)):
            return x[:n]
        if x.device.type == "cpu":
            return x[nodes]
        if self._rows_upload is None:
            self._rows_upload = Upload(torch.long, x.device)
        return x.index_select(0, self._rows_upload(nodes))


def _eos_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(f"{model_dir}: no EOS token id in generation_config.json or the tokenizer")
    return frozenset(ids)


FLOAT_INPUTS_MARK = "+fp32:"  # "gguf-int8+fp32:wqkv+w2": gguf-int8 with those linears on fp32 inputs


def weights_spec(spec: str) -> tuple[str, tuple[str, ...]]:
    """A weights path name as the diagnostics take it -> (dtype, float_inputs): a --dtype choice, or
    "gguf-int8+fp32:" and linears joined by "+" (gguf_checkpoint.FLOAT_INPUT_LINEARS) for load_target's
    float_inputs. ValueError for anything else."""
    from .gguf_checkpoint import FLOAT_INPUT_LINEARS
    from .loading import DTYPE_CHOICES

    dtype, mark, rest = spec.partition(FLOAT_INPUTS_MARK)
    names = tuple(n for n in rest.split("+") if n) if mark else ()
    if dtype not in DTYPE_CHOICES or (mark and (dtype != GGUF_INT8 or not names or set(names) - set(FLOAT_INPUT_LINEARS))):
        raise ValueError(
            f"weights path {spec!r}: one of {', '.join(DTYPE_CHOICES)}, or {GGUF_INT8}{FLOAT_INPUTS_MARK}LINEAR[+LINEAR...] "
            f"with linears from {', '.join(FLOAT_INPUT_LINEARS)}"
        )
    return dtype, names


def kernel_prefill_default(dtype: str) -> bool:
    """Whether a GGUF path prefills in kernel forwards on this machine's build (load_target)."""
    if dtype == GGUF_INT8:
        return not kernel_ops.bf16_arithmetic()
    return dtype == GGUF_INT16 and kernel_ops.PATH == "avx2"


def interleave_for_this_cpu(transformer: Transformer) -> bool:
    """A bf16 model on a CPU whose kernels in use have no bf16 arithmetic (AVX2, AVX-512F, generic):
    its linears read InterleavedBF16 copies of their weights (model.interleave_bf16_linears), where
    a verify's rows cost little more than one. Returns whether any linear was converted; other
    models, devices and the avx512bf16 build (vdpbf16ps reads the weights as stored) are left alone."""
    w = transformer.norm.weight
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not kernel_ops.AVAILABLE or kernel_ops.bf16_arithmetic():
        return False
    return interleave_bf16_linears(transformer) > 0


def load_target(
    model: str | os.PathLike | None = DEFAULT_MODEL,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    kernels: bool = True,
    float_inputs: tuple[str, ...] = (),
) -> Target:
    """Load a target: "default" (embedded SmolLM2-135M-Instruct), a local directory or a hub id.

    dtype: float32 | bfloat16 | float16, or "gguf" for the embedded default read in its own GGUF
    blocks (Q4_1 layers, Q8_0 embedding) on the CPU kernels, exactly its fp32 values; "gguf-int8" for
    the same blocks against int8-quantized activations (llama.cpp's arithmetic); "gguf-int16" against
    activations quantized to 16 bits (near the exact path's answers, near int8's speed). ("auto", the
    path the calibration finds fastest for DART on this machine, is resolved before this call:
    dart_core.tools.calibrate.choose_weights.)

    kernels=False keeps every forward on the eager torch path (see Transformer). float_inputs, with
    "gguf-int8" only: linears (gguf_checkpoint.FLOAT_INPUT_LINEARS) whose inputs stay fp32, a diagnostic."""
    from transformers import AutoTokenizer

    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    name = str(model or DEFAULT_MODEL)
    if float_inputs and dtype != GGUF_INT8:
        raise ValueError(f"float_inputs apply to --dtype {GGUF_INT8} (its int8 activations), not {dtype}")
    if dtype == AUTO:
        raise ValueError(
            "dtype 'auto' is chosen by measuring this machine, which the command lines and the app do before loading "
            "(dart_core.tools.calibrate.choose_weights); load_target takes the chosen path"
        )
    if dtype in GGUF_PATHS:
        # The embedded default's own GGUF blocks on the CPU kernels; activations in fp32 (gguf-int8 /
        # gguf-int16: each linear's input quantized per block inside the kernel). The KV cache is fp32
        # on the exact path and fp16 beside integer activations: a long context's attention reads half
        # the bytes (docs/engine.md, "An fp16 KV cache").
        if name != DEFAULT_MODEL:
            raise ValueError(f"--dtype {dtype} reads the GGUF the embedded default ships; for {name!r} use float32, bfloat16 or float16")
        if device.type != "cpu" or not kernels:
            raise ValueError(f"--dtype {dtype} runs on the CPU kernels (device cpu, kernels on)")
        model_dir = resolve_model_dir(model)
        activations = {GGUF: "float", GGUF_INT16: "int16", GGUF_INT8: "int8"}[dtype]
        # gguf is the exact path: its prompt prefill multiplies in fp32 too, so every forward is the
        # fp32 copy's, bit for bit. gguf-int8 trades exactness for speed in prefill as well (bf16 GEMMs
        # where the CPU multiplies bf16 in hardware: model.default_prefill_dtype).
        prefill = torch.float32 if dtype == GGUF else None
        transformer = load_gguf_transformer(
            embedded_gguf_path(), model_dir, prefill_dtype=prefill, activations=activations, float_inputs=tuple(float_inputs)
        )
        # The prompt runs in kernel forwards (exact: every row its one-token step's bits) where they
        # beat the eager prefill's fp32 GEMMs (docs/engine.md, "Time to first token"): gguf-int8
        # wherever the CPU has no bf16 arithmetic, gguf-int16 on the AVX2 build (its many-row kernel;
        # the AVX-512 builds' 16-bit kernels were not measured against those GEMMs).
        transformer.kernel_prefill = kernel_prefill_default(dtype)
        formats = sorted({m.weight.fmt for m in transformer.modules() if isinstance(m, BlockLinear)})
        mode = f"; {activations} activations" if activations != "float" else ""
        if float_inputs:
            mode += f" (fp32 inputs to {', '.join(float_inputs)})"
        cache_dtype = torch.float32 if dtype == GGUF else torch.float16
        if cache_dtype == torch.float16:
            mode += "; fp16 KV cache"
        weights = f"{dtype} ({', '.join(formats)}{mode})"
        dtype = torch.float32
    else:
        dtype = parse_dtype(dtype)
        model_dir = resolve_model_dir(model)
        transformer = load_transformer(model_dir, dtype, device)
        weights = str(dtype).removeprefix("torch.")
        cache_dtype = dtype
        if kernels and interleave_for_this_cpu(transformer):
            weights += f" ({kernel_ops.BF16X16} linears)"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    transformer.use_kernels = kernels
    return Target(name, model_dir, transformer, tokenizer, _eos_ids(model_dir, tokenizer), device, dtype, weights, cache_dtype)
