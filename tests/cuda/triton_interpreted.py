"""The fixed forward's Triton kernels (dart_core/cuda/triton_kernels.py) run by Triton's interpreter on a CPU,
so CI checks them without a GPU: run as a script, it prints one JSON object of measurements that
tests/cuda/test_triton_kernels.py asserts on. TRITON_INTERPRET must be set before Triton is first imported,
hence a process of its own.

What the interpreter can and cannot say: it runs the kernels' program (indexing, masks, the loops over
chunks and splits, the rounding to the dtype) on numpy, so it checks that they compute what the torch
ops they replace compute, and that a verified node gets its one-token step's bits in that execution.
It does not run the GPU's instructions (the GPU check, dart_core/cuda/check/, checks those bitwise on the device), and
its bfloat16 is not the GPU's (it truncates where a GPU rounds, and its bf16 tensor-core dot is not
emulated), so the dtypes here are fp32 and fp16.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: support

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle  # noqa: E402

from dart_core import fixed_shape  # noqa: E402
from dart_core.cuda import triton_kernels  # noqa: E402
from dart_core.cuda.config import CudaForward, default_row_group  # noqa: E402
from dart_core.model import RMSNorm, apply_rope  # noqa: E402

from support import TINY_VOCAB, build_tiny_checkpoint, nodes_unlike_their_steps, random_tree_under, tiny_target  # noqa: E402

_library_dot = InterpreterBuilder.create_dot


def fixed_order_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's tl.dot for float tiles with one order of arithmetic for every output element: d
    plus the products added in k order, each in fp32 (an fp16 or fp32 product is exact in fp64 and rounds
    once to fp32; the fp16 inputs' products are exact in fp32). Triton's own dot is numpy's matmul, whose
    BLAS kernel gives a row other bits at another place of its tile on some CPUs (AVX2's OpenBLAS in
    fp16 and fp32; on AVX-512 in fp32 only), so a kernel's rows would differ for the library's reasons,
    not the kernel's: with this dot the tests check what the kernels themselves do (their masks,
    branches, guards, loops) for a row wherever it sits, as the GPU's tensor cores must for theirs,
    which gpu_check checks on the device."""
    floats = (np.float16, np.float32)  # (bf16 tiles hold raw bits here: left to Triton's own dot)
    if not (a.data.dtype in floats and b.data.dtype in floats and d.data.dtype == np.float32):
        return _library_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    x, y = a.data.astype(np.float64), b.data.astype(np.float64)
    acc = d.data.astype(np.float32, copy=True)
    for k in range(x.shape[-1]):
        acc = (acc + (x[..., :, k : k + 1] * y[..., k : k + 1, :]).astype(np.float32)).astype(np.float32)
    return TensorHandle(acc, d.dtype.scalar)


InterpreterBuilder.create_dot = fixed_order_dot

_library_patch_lang = interpreter._patch_lang
_langs: dict = {}  # a function's triton.language modules, by function


def patch_lang_once(fn):
    """The interpreter's patching of triton.language for a call of `fn`, skipped where the launch
    running it has patched the same modules already. Triton's interpreter patches them at every
    device-function call (inspect.getmembers over tl, tl.core, tl.math and tensor, never undone: the
    launch's own patches, made first, are what its end restores), a fifth of the interpreted tests' time;
    a call inside a launch finds every module it would patch patched (tl.load no longer Triton's
    builtin) and would change nothing."""
    langs = _langs.get(fn)
    if langs is None:
        langs = _langs[fn] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
    if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
        return interpreter._LangPatchScope()
    return _library_patch_lang(fn)


interpreter._patch_lang = patch_lang_once
# No int32 overflow check on every integer add and multiply (the interpreter's default, a GPU build's
# only with debug on): at these tiny shapes no offset comes near 2^31, so it could catch nothing here, and
# it was a third of the interpreted time (an int64 copy of each operation and an assert on it)
interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options, sanitize_overflow=False)

DTYPES = {"float32": torch.float32, "float16": torch.float16}


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def elementwise(dtype: torch.dtype) -> dict:
    """Each element-wise kernel against the torch ops it replaces (max abs differences; the residual add
    and the value copy bitwise)."""
    g = torch.Generator().manual_seed(0)
    R, H, inter, nh, nkv, hd, P = 5, 96, 80, 4, 2, 16, 37

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    r: dict = {}
    x, y = rnd(R, H), rnd(R, H)
    norm = RMSNorm(H, 1e-6).to(dtype)
    norm.weight.data = rnd(H)
    res, out = triton_kernels.rmsnorm(x, norm.weight.data, norm.eps, y)
    r["add_bitwise"] = torch.equal(res, x + y)
    r["add_norm"] = diff(out, norm(x + y))
    r["norm"] = diff(triton_kernels.rmsnorm(x, norm.weight.data, norm.eps), norm(x))
    r["norm_fp32_weight"] = diff(
        triton_kernels.rmsnorm(x, norm.weight.data.float(), norm.eps),
        (norm.weight.float() * F.rms_norm(x.float(), (H,), eps=1e-6).to(dtype)).to(dtype),
    )
    gu = rnd(R, 2 * inter)
    gate, up = gu.chunk(2, dim=-1)
    r["silu_mul"] = diff(triton_kernels.silu_mul(gu), F.silu(gate) * up)
    table = fixed_shape.RopeTable(1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), 1.0, 128)
    positions = torch.tensor([40, 41, 42, 41, 0])
    meta = torch.tensor([P, R], dtype=torch.int32)
    for qk_norm in (False, True):
        qkv = rnd(R, (nh + 2 * nkv) * hd)
        qn, kn = RMSNorm(hd, 1e-6).to(dtype), RMSNorm(hd, 1e-6).to(dtype)
        qn.weight.data, kn.weight.data = rnd(hd), rnd(hd)
        k_cache, v_cache = torch.zeros(nkv, 64, hd, dtype=dtype), torch.zeros(nkv, 64, hd, dtype=dtype)
        q = torch.empty(R, nh, hd, dtype=dtype)
        triton_kernels.qkv_rope(
            qkv, q, k_cache, v_cache, qn.weight.data if qk_norm else None, kn.weight.data if qk_norm else None, 1e-6,
            table.cos, table.sin, positions, meta, nh, nkv, hd,
        )  # fmt: skip
        tq, tk, tv = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        tq, tk = tq.reshape(R, nh, hd), tk.reshape(R, nkv, hd)
        if qk_norm:
            tq, tk = qn(tq), kn(tk)
        cos, sin = table.lookup(positions, dtype)
        tq, tk = apply_rope(tq, cos[:, None], sin[:, None]), apply_rope(tk, cos[:, None], sin[:, None])
        name = "qkv_rope_norm" if qk_norm else "qkv_rope"
        r[name + "_q"] = diff(q, tq)
        r[name + "_k"] = diff(k_cache[:, P : P + R], tk.transpose(0, 1))
        r[name + "_v_bitwise"] = torch.equal(v_cache[:, P : P + R], tv.reshape(R, nkv, hd).transpose(0, 1))
        r[name + "_rest_untouched"] = bool((k_cache[:, :P] == 0).all() and (k_cache[:, P + R :] == 0).all())
    return r


def attention(dtype: torch.dtype) -> dict:
    """The split and combine kernels against fixed_shape.attention (the torch reference), a program a row and
    a group of rows a program: a tree whose keys span three splits (P = 1030), and one whose shallow
    rows end in the second split while its deeper rows reach the third (P = 1022: a group's rows with
    no keys in a split beside rows with some, and chunks of committed keys next to chunks of tree
    keys); the latter also at the smallest split (64 keys, a chunk a split: 16 splits of committed
    keys, the tree's rows across the next boundary)."""
    g = torch.Generator().manual_seed(1)
    R, nh, nkv, hd, cap = 8, 4, 2, 16, 1100
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    k_cache = torch.randn(nkv, cap, hd, generator=g).to(dtype)
    v_cache = torch.randn(nkv, cap, hd, generator=g).to(dtype)
    q = torch.randn(R, nh, hd, generator=g).to(dtype)
    T = len(parents)
    r: dict = {}
    r["splits"] = {}
    for split, contexts in ((triton_kernels.SPLIT, (1030, 1022)), (triton_kernels.BLOCK, (1022,))):
        for P in contexts:
            inputs = fixed_shape.FixedInputs(R, torch.device("cpu"))
            inputs.fill(torch.zeros(T, dtype=torch.long), torch.arange(T), parents, P, reference=True)
            ref = fixed_shape.attention(q[:T], k_cache, v_cache, inputs.keys)
            ws = triton_kernels.Workspace(R, nkv, nh // nkv, hd, cap, "cpu", split)
            outs = {}
            for group in (1, 2, default_row_group(nh // nkv), 16):  # 16: past triton_kernels.UNROLLED_ROWS, a loop
                out = torch.empty(R, nh, hd, dtype=dtype)
                outs[group] = triton_kernels.attention(q, k_cache, v_cache, inputs.path, inputs.plen, inputs.meta, out, ws, group).clone()
                key = f"P{P}_split{split}_group{group}"
                r[f"{key}_max_diff"] = diff(outs[group][:T], ref)
                r[f"{key}_padding_rows_zero"] = bool((outs[group][T:] == 0).all())
                r[f"{key}_finite"] = bool(outs[group].isfinite().all())
            r[f"P{P}_split{split}_groups_equal"] = all(torch.equal(o, outs[1]) for o in outs.values())
        r["splits"][split] = ws.nsplit
    return r


def linear(dtype: torch.dtype) -> dict:
    """Our GEMM (triton_kernels.linear, what gpu_check's gemm part times beside torch's) against F.linear in
    fp32 at each configuration, on shapes that fill no tile exactly (5 or 64 rows, columns and K past a
    block; K of 5 blocks, which 4 parts cut unevenly: 2, 2 and 1 blocks), with and without a bias; and a
    row's output at row 0 of another batch against its own. Then the fixed-gemm forward's prologue and
    epilogue, at the forward's configuration and with K in parts."""
    g = torch.Generator().manual_seed(2)
    shapes = ((5, 72, 200, False), (64, 130, 96, True), (5, 40, 600, True))
    r: dict = {
        "max_diff": 0.0,
        "places_bitwise": 0,
        "places": 0,
        "shapes": len(shapes),
        "configs": len(triton_kernels.LINEAR_CONFIGS),
        "configs_in_parts": sum(c[4] > 1 for c in triton_kernels.LINEAR_CONFIGS),
    }
    for M, N, K, bias in shapes:
        x = torch.randn(M, K, generator=g).to(dtype)
        w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
        b = torch.randn(N, generator=g).to(dtype) if bias else None
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        for cfg in triton_kernels.LINEAR_CONFIGS:
            y = triton_kernels.linear(x, w, b, cfg)
            r["max_diff"] = max(r["max_diff"], diff(y, ref))
            for i in (1, M - 1):
                other = torch.randn(M, K, generator=g).to(dtype)
                other[0] = x[i]
                r["places_bitwise"] += int(torch.equal(triton_kernels.linear(other, w, b, cfg)[0], y[i]))
                r["places"] += 1
    # the fixed-gemm forward's prologue and epilogue against the torch ops they replace (model.RMSNorm,
    # the linear, SiLU times up, the residual add; in the dtype), at the forward's configuration (None)
    # and with K in 3 parts (a block of 64 each)
    M, K, inter = 5, 192, 40
    x = torch.randn(M, K, generator=g).to(dtype)
    norm = RMSNorm(K, 1e-5).to(dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype)
    w = (torch.randn(2 * inter, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(2 * inter, generator=g).to(dtype)
    res = torch.randn(M, 2 * inter, generator=g).to(dtype)
    gate, up = F.linear(norm(x), w).chunk(2, dim=-1)
    for name, cfg in (("", None), ("_parts", (32, 64, 4, 2, 3))):
        r["norm_bias" + name] = diff(triton_kernels.linear(x, w, b, cfg, norm=norm.weight.data, eps=norm.eps), F.linear(norm(x), w, b))
        r["norm_silu" + name] = diff(
            triton_kernels.linear(x, w, None, cfg, norm=norm.weight.data, eps=norm.eps, silu=True), F.silu(gate) * up
        )
        r["residual" + name] = diff(triton_kernels.linear(x, w, None, cfg, residual=res), res + F.linear(x, w))
    return r


def tiny_checkpoint(root: Path, arch: str) -> Path:
    """The tiny random checkpoint of `arch` under root, built the first time it is asked for."""
    return root / arch if (root / arch).exists() else build_tiny_checkpoint(root / arch, arch, seed=1)


def eager_and_captured(target, make, flags: tuple[str, ...], seed: int):
    """Two drafters from make(), their captured forwards off (each of `flags` False) and demanded (True);
    40 random tokens, the target's forward over them (their captured states), and a session of each."""
    drafters = {}
    for graph in (False, True):
        d = make()
        for flag in flags:
            setattr(d, flag, graph)
        drafters[graph] = d
    rng = random.Random(seed)
    tokens = [rng.randrange(TINY_VOCAB) for _ in range(40)]
    out = target.model(torch.tensor(tokens), torch.arange(len(tokens)), target.new_cache(64), capture=True)
    sessions = {k: d.new_session(64) for k, d in drafters.items()}
    assert sessions[True].graph is not None and sessions[False].graph is None
    return drafters, tokens, out, sessions


def against_plain(target, drafters: dict, prompt: list[int], new_tokens: int) -> dict:
    """Greedy generations of `prompt` by the eager (False) and the captured (True) drafter: how many give
    plain decoding's ids, and each one's tau."""
    from dart_core import ARDrafter, GenerationParams, complete

    ar = complete(target, prompt, ARDrafter(), GenerationParams(new_tokens)).output_ids
    runs = {k: complete(target, prompt, d, GenerationParams(new_tokens)) for k, d in drafters.items()}
    return {
        "ids_equal_ar": sum(run.output_ids == ar for run in runs.values()),
        "tau_graph": round(runs[True].tau, 3),
        "tau_eager": round(runs[False].tau, 3),
    }


def model(arch: str, dtype: torch.dtype, fused: bool, root: Path, row_group: int, split: int | None = None, gemm: int = 0) -> dict:
    """A tiny random target's fixed forward on the kernels (8 rows): a random tree's verify against the
    one-token steps along its paths (bitwise: logits and captured states) and against the torch
    reference's verify (max logit difference, argmax agreement). split: keys a split (None: the
    default); with one, the prefix ends 3 keys before the first split ends, so the tree's paths cross it.
    gemm: as case_name's; `parts_launches` counts the launches that added K's parts."""
    path = tiny_checkpoint(root, arch)
    rng = random.Random(4)
    prefix = [rng.randrange(TINY_VOCAB) for _ in range(45 if split is None else split - 3)]
    tree = random_tree_under(rng, prefix[-1], 6, TINY_VOCAB)
    outs = {}
    launches = []
    parts_kernel = triton_kernels._linear_parts_kernel

    class Counted:  # the parts' sums, counted as launched
        def __getitem__(self, grid):
            launches.append(grid)
            return parts_kernel[grid]

    triton_kernels._linear_parts_kernel = Counted()
    try:
        for kernels in (True, False):
            target = tiny_target(path, dtype)
            target.model.use_kernels = False  # the fixed path, as on CUDA
            target.model.fixed_rows = 8
            # (the torch reference has no GEMMs of its own)
            target.model.cuda_forward = CudaForward(kernels, fused, row_group, split, bool(gemm) and kernels, max(1, gemm))
            cache = target.new_cache(len(prefix) + len(tree) + 16)
            target.prefill(prefix, cache, capture=False)
            cache.commit(len(prefix))
            outs[kernels] = (target, cache, target.verify(tree, cache, capture=True))
        target, cache, out = outs[True]
        kern = cache.fixed_runner.kernels
        assert type(kern) is triton_kernels.Kernels and kern.fused == fused and kern.row_group == row_group and kern.gemm == bool(gemm)
        assert kern.gemm_parts == max(1, gemm)
        bad = nodes_unlike_their_steps(target, cache, tree, out)  # the steps run on the same runner: its split too
    finally:
        triton_kernels._linear_parts_kernel = parts_kernel
    ref = outs[False][2]
    return {
        "nodes": len(tree),
        "nodes_unlike_steps": bad,
        "logits_vs_torch": diff(out.logits, ref.logits),
        "argmax_agree": int((out.logits.argmax(-1) == ref.logits.argmax(-1)).sum()),
        "row_group": kern.row_group,
        "split": kern.ws.split,
        "gemm": kern.gemm,
        "gemm_parts": kern.gemm_parts,
        "parts_launches": len(launches),
        "prefix": len(prefix),
        "depth": int(tree.depths.max()),
    }


def head_forward(root: Path) -> dict:
    """DART's captured head forward (dart_core/cuda/head_graph.py, uncaptured here) against the eager
    head forward, step by step through one session's pending tokens (fp32, a tiny Qwen3 target, a
    random head): the logits' largest difference, the top-8 ids, fewer rows, and a generation's ids
    against plain decoding's."""
    import ngram_cpp
    from dart_core import ARDrafter, GenerationParams, complete
    from dart_core.drafters.dart import DartDrafter, DartParams
    from dart_core.tools.training import new_head_from_target

    target = tiny_target(tiny_checkpoint(root, "qwen3"), torch.float32)
    target.model.use_kernels = False
    g = torch.Generator().manual_seed(3)
    head = new_head_from_target(target, torch.randperm(target.vocab_size, generator=g)[:64].sort().values, 3, 3)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    head.eval()
    params = DartParams(ngram_cpp.PruneParams(top_k=8, beam_width=4, max_nodes=6))
    drafters, tokens, out, sessions = eager_and_captured(
        target, lambda: DartDrafter(head, target, None, params, use_kernels=False), ("head_graph",), 8
    )
    r = {"steps": 0, "max_diff": 0.0, "topk_equal": 0, "rows_checked": 0, "ranked_steps": 0}
    at = 0
    for n in (20, 3, 1, 5, 4, 2, 4):  # pending tokens a step (the first: a prompt's draft, past the 13 the rows take: 2 forwards)
        for k, session in sessions.items():
            session.extend(tokens[at : at + n], out.hidden[at : at + n])
        root = tokens[at + n]
        rows = 1 + r["steps"] % 4  # 1..D+1 rows
        if r["steps"] % 2:  # the rows ranked as the pruner takes them (in the captured forward: its top-8)
            ranked = {k: session.draft_candidates(root, rows) for k, session in sessions.items()}
            (ids, probs), (eager_ids, eager_probs) = ranked[True], ranked[False]
            r["max_diff"] = max(r["max_diff"], float(np.abs(probs - eager_probs).max()))
            r["topk_equal"] += int(np.array_equal(ids, eager_ids))
            r["rows_checked"] += int(ids.shape == eager_ids.shape == probs.shape == (rows, 8) and ids.dtype == np.int64)
            r["ranked_steps"] += 1
        else:
            logits = {k: session.draft_logits(root, rows).float() for k, session in sessions.items()}
            r["max_diff"] = max(r["max_diff"], diff(logits[True], logits[False]))
            r["topk_equal"] += int(torch.equal(logits[True].topk(8).indices, logits[False].topk(8).indices))
            r["rows_checked"] += int(logits[True].shape == logits[False].shape == (rows, 64))
        r["steps"] += 1
        at += n
    r["graph_calls"] = sessions[True].graph.calls
    r.update(against_plain(target, drafters, tokens[:30], 24))  # a prompt the first draft takes in 3 forwards
    # the next generation takes the head cache the last one gave back, with the forward built on it
    # (on a GPU, the graph captured there: replayed, not captured again), and is still lossless
    kept = drafters[True].spare._idle
    graph = kept.head_graph
    other = tokens[10:15]
    again = complete(target, other, drafters[True], GenerationParams(16))
    r["head_graph_reused"] = drafters[True].spare._idle is kept and kept.head_graph is graph and graph.calls == again.steps - 1
    r["reused_ids_equal_ar"] = again.output_ids == complete(target, other, ARDrafter(), GenerationParams(16)).output_ids
    return r


def expand_forward(root: Path) -> dict:
    """EAGLE3's captured drafting (its first forward, cuda/head_graph.py, and its expansion,
    cuda/expand_graph.py; uncaptured here) against the eager one, proposal by proposal through a
    session, the prompt's first forward too (more pending tokens than the rows: in chunks): the same
    trees and scores up to rounding; a generation through it gives plain decoding's ids and the eager
    drafting's tau; the next session reuses both."""
    import ngram_cpp  # noqa: F401  (the drafters' pruner module, loaded as the engine loads it)
    from dart_core.drafters.eagle3 import Eagle3Drafter, Eagle3Params

    from support import random_eagle3_head

    target = tiny_target(tiny_checkpoint(root, "llama"), torch.float32)
    target.model.use_kernels = False
    head = random_eagle3_head(target, seed=6)
    params = Eagle3Params(depth=4, top_k=4, max_nodes=15)
    drafters, tokens, out, sessions = eager_and_captured(
        target, lambda: Eagle3Drafter(head, target, params, use_kernels=False), ("head_graph", "expand_graph"), 9
    )
    r = {"steps": 0, "trees_equal": 0, "max_score_diff": 0.0, "nodes": 0}
    at = 0
    for n in (20, 3, 1, 5, 4, 2):  # the first: a prompt past the 16 rows (2 forwards)
        for session in sessions.values():
            session.extend(tokens[at : at + n], out.hidden[at : at + n])
        trees = {k: session.propose(tokens[at + n], 15).tree for k, session in sessions.items()}
        a, b = trees[True], trees[False]
        same = torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        r["trees_equal"] += int(same)
        if same:
            r["max_score_diff"] = max(r["max_score_diff"], diff(a.scores, b.scores))
        r["nodes"] = max(r["nodes"], len(a) - 1)
        r["steps"] += 1
        at += n
    r["graph_calls"] = sessions[True].graph.calls
    r["head_graph_calls"] = sessions[True].head_graph.calls
    captured = (sessions[True].head_graph, sessions[True].graph)
    for session in sessions.values():
        session.close()
    r.update(against_plain(target, drafters, tokens[:24], 20))  # a prompt past the rows (in 2), a cache as big as the sessions'
    kept = drafters[True].spare._idle
    r["expand_graph_reused"] = kept is not None and (kept.head_graph, kept.expand_graph) == captured
    return r


def replayed(root: Path) -> dict:
    """The engine's captured forwards as CUDA graphs would run them (tests/cuda/graph_replay.py: captured once,
    each replay's record of ops and launches held to the capture's): the fixed forward (plain decoding's
    steps, tree verifies, a prompt in chunks), DART's head forward, EAGLE3's first forward and expansion,
    on the interpreted kernels. Greedy generations through the replays against plain decoding run
    uncaptured, a second prompt reusing the graphs; and a forward made to read a buffer rebound after
    the capture (as a GPU graph would, it keeps the old one) is caught."""
    from graph_replay import GraphReplayError, simulated

    import ngram_cpp
    from dart_core import ARDrafter, GenerationParams, complete
    from dart_core.drafters.dart import DartDrafter, DartParams
    from dart_core.drafters.eagle3 import Eagle3Drafter, Eagle3Params
    from dart_core.tools.training import new_head_from_target

    from support import random_eagle3_head

    def fixed_target():
        target = tiny_target(tiny_checkpoint(root, "llama"), torch.float32)
        target.model.use_kernels = False
        target.model.fixed_rows, target.model.fixed_prefill_chunks = 8, 3
        target.model.cuda_forward = CudaForward(kernels=True)
        return target

    target = fixed_target()
    g = torch.Generator().manual_seed(5)
    dart_head = new_head_from_target(target, torch.randperm(target.vocab_size, generator=g)[:64].sort().values, 3, 5)
    with torch.no_grad():
        for p in dart_head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    dart = DartDrafter(
        dart_head.eval(), target, None, DartParams(ngram_cpp.PruneParams(top_k=8, beam_width=4, max_nodes=6)), use_kernels=False
    )
    eagle3 = Eagle3Drafter(random_eagle3_head(target, seed=7), target, Eagle3Params(depth=3, top_k=4, max_nodes=6), use_kernels=False)
    dart.head_graph = eagle3.head_graph = eagle3.expand_graph = True
    rng = random.Random(11)
    # (prompt, new tokens): 18 > 8 rows, a prompt in three chunks, and past the drafters' head forwards'
    # rows (DART: 13 beside its masks, EAGLE3: 16), their first drafts in two; then a second generation
    # on the same graphs
    prompts = [([rng.randrange(TINY_VOCAB) for _ in range(n)], new) for n, new in ((18, 6), (4, 3))]
    plain = [complete(target, p, ARDrafter(), GenerationParams(new)).output_ids for p, new in prompts]  # uncaptured
    r: dict = {"ids_equal_ar": {}, "steps": {}}
    with simulated() as stats:
        for name, drafter in (("ar", ARDrafter()), ("dart", dart), ("eagle3", eagle3)):
            runs = [complete(target, p, drafter, GenerationParams(new)) for p, new in prompts]
            r["ids_equal_ar"][name] = sum(run.output_ids == ids for run, ids in zip(runs, plain))
            r["steps"][name] = sum(run.steps for run in runs)
    r["captures"], r["replays"] = stats.captures, stats.replays
    r["captured"] = sorted({".".join(n.split(".")[:2]) for n in stats.names})  # class.method of each body
    r["ops_per_capture"] = stats.ops

    # a forward whose step input reaches the body through a buffer rebound at each fill
    fill = fixed_shape.FixedInputs.fill

    def rebinding_fill(self, *args, **kwargs):
        fill(self, *args, **kwargs)
        self.meta = self.meta.clone()

    fixed_shape.FixedInputs.fill = rebinding_fill
    try:
        with simulated():
            complete(fixed_target(), prompts[1][0], ARDrafter(), GenerationParams(3))
        r["rebound_buffer_caught"] = None
    except GraphReplayError as e:
        r["rebound_buffer_caught"] = str(e).splitlines()[0]
    finally:
        fixed_shape.FixedInputs.fill = fill
    return r


# tiny targets' forwards on the kernels (model): (arch, dtype, fused, rows a program, split, our GEMMs).
# The engine's default (fused, a program a row); Qwen3's norms in fp16 with rows grouped and the
# smallest split (a chunk a split: the tree's paths across a split's end); the attention alone (torch ops
# between the GEMMs, Qwen2's biases); our GEMMs with the work between them (CudaForward.gemm) in fp16 with
# rows grouped, and in fp32 with Qwen2's biases across the smallest split.
MODEL_CASES = (
    ("llama", "float32", True, 1, None, False),
    ("qwen3", "float16", True, 8, triton_kernels.BLOCK, False),
    ("qwen2", "float32", False, 1, None, False),
    ("llama", "float16", True, 8, None, True),
    ("qwen2", "float32", True, 1, triton_kernels.BLOCK, 2),  # our GEMMs, K in 2 parts (the down product's 2 blocks)
)


def case_name(arch: str, dtype: str, fused: bool, group: int, split: int | None, gemm: int) -> str:
    """gemm: 0 torch's GEMMs, 1 ours (CudaForward.gemm), P > 1 ours with K in P parts (CudaForward.gemm_parts)."""
    kind = ("gemm" + (f"-k{gemm}" if gemm > 1 else "")) if gemm else "fused" if fused else "attention"
    name = f"{arch}-{dtype}-{kind}" + (f"-group{group}" if group > 1 else "")
    return name + (f"-split{split}" if split else "")


SECTIONS = ("kernels", *(case_name(*c) for c in MODEL_CASES), "head", "expand", "replayed")


def main() -> None:
    """triton_interpreted.py ROOT [SECTION ...]: the SECTIONS asked for (all by default), one JSON object;
    tests/cuda/test_triton_kernels.py runs them in two processes at once and merges the two."""
    root = Path(sys.argv[1])
    asked = sys.argv[2:] or list(SECTIONS)
    unknown = set(asked) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}: from {', '.join(SECTIONS)}")
    result: dict = {"seconds": {}, "sections": list(SECTIONS)}
    cases = {case_name(*c): c for c in MODEL_CASES}
    for section in asked:
        t0 = time.perf_counter()
        if section == "kernels":
            for key, fn in (("elementwise", elementwise), ("attention", attention), ("linear", linear)):
                result[key] = {name: fn(dtype) for name, dtype in DTYPES.items()}
        elif section in cases:
            arch, dtype, fused, group, split, gemm = cases[section]
            result.setdefault("models", {})[section] = model(arch, DTYPES[dtype], fused, root, group, split, gemm)
        else:
            result[section] = {"head": head_forward, "expand": expand_forward, "replayed": replayed}[section](root)
        result["seconds"][section] = round(time.perf_counter() - t0, 1)  # what CI's time goes to
        print(f"{section}: {result['seconds'][section]} s", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
