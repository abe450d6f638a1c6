"""The fixed forward's Triton kernels compiled for the H200 (sm_90) on a machine without a GPU, so CI
catches what only the device's compiler would: run as a script, it prints one JSON object that
tests/cuda/test_triton_kernels.py asserts on.

Triton's interpreter (tests/cuda/triton_interpreted.py) runs the kernels' program on numpy: it never lowers
them to the GPU, where a kernel can fail to compile (a tensor-core product below its smallest shape, a
layout the backend cannot convert, shared memory past the device's) or spill registers. Here the engine
runs its own code, `Transformer.fixed_body`, DART's captured head forward (`HeadGraph._body`) and
EAGLE3's captured first forward and expansion (`HeadGraph._body`, `ExpandGraph._body`), on
the CPU at the shapes the device check runs (gpu_check's tiny targets in every dtype, Qwen3-8B's shape,
the embedded model's shape, each path: fused or not, rows grouped or not), with every Triton launch
turned into a compile for sm_90: the same arguments, specializations and options the launch would take
on an H200 (Triton's driver answered by `AbsentGPU` below), through Triton's own backend and the ptxas it
ships. Each compiled kernel is then put through `ptxas -v` for its registers and spills. Nothing runs
on a GPU and no result is computed (the kernels' outputs stay uninitialized; the torch ops between them
run on garbage); whether the compiled code computes the right bits is the interpreter's and the
device's to say.

The compiler is whichever Triton the process imports: the test extra's, or the device's own version
(tests/cuda/device_triton.py puts it first on PYTHONPATH), each with the ptxas it ships; the test runs both.
The same compile runs for the GPUs of a Space's hardware menu (T4, A100, A10G, L4) at what the app runs
there (the embedded model in bf16 and both drafters' captured forwards): `space_gpus`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # tests/: support
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from dart_core import fixed_shape  # noqa: E402
from dart_core.cuda import triton_kernels  # noqa: E402
from dart_core.cuda.check.common import DTYPES, QWEN3_8B, random_head, target_from_transformer  # noqa: E402  (the GPU check's shapes)
from dart_core.cuda.config import default_row_group  # noqa: E402
from dart_core.cuda.expand_graph import ExpandGraph  # noqa: E402
from dart_core.cuda.head_graph import HeadGraph, graph_rows  # noqa: E402
from dart_core.hf_checkpoint import load_transformer  # noqa: E402
from dart_core.model import FIXED_ROWS, KVCache, ModelArgs, Transformer  # noqa: E402

from support import TINY_EOS, build_tiny_checkpoint  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # the H200 (Hopper: compute capability 9.0, 32-thread warps)
SHARED_LIMIT = 232448  # bytes of shared memory a block may take on sm_90 (227 KiB)
# The GPUs a Space's hardware menu offers (docs/app.md), where the app runs the embedded model in bf16:
# compute capability -> the shared memory a block may take there
SPACE_GPUS = {75: 65536, 80: 166912, 86: 101376, 89: 101376}  # T4, A100, A10G, L4
ROWS = FIXED_ROWS["cuda"]

# SmolLM2-135M-Instruct's shape (the embedded model; its DART head, assets/dart/config.json, has the same)
SMOLLM2 = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


class AbsentGPU:
    """What Triton's launch asks of its driver before it compiles, answered for a GPU that is not here
    (the H200 unless told otherwise). A launch stops after the compile (below), so nothing else of a
    driver is needed."""

    def __init__(self, target: GPUTarget = TARGET):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


class Compiles:
    """Every Triton launch while active compiles for TARGET instead of running; the kernels are kept
    with the label of what the engine was doing."""

    def __init__(self, target: GPUTarget = TARGET):
        self.kernels: list[dict] = []
        self.label = ""
        self.errors: list[dict] = []
        self.target = target

    def __enter__(self):
        compiles = self
        self._getitem = JITFunction.__getitem__

        def getitem(fn, grid):
            def launch(*args, **kwargs):
                try:
                    k = fn.run(*args, grid=grid, warmup=True, **kwargs)
                except Exception as e:  # noqa: BLE001  (recorded: the test fails on any)
                    compiles.errors.append({"label": compiles.label, "kernel": fn.__name__, "error": f"{type(e).__name__}: {e}"[:2000]})
                    return None
                compiles.kernels.append({"label": compiles.label, "kernel": fn.__name__, "compiled": k})
                return None

            return launch

        JITFunction.__getitem__ = getitem
        driver.set_active(AbsentGPU(self.target))
        return self

    def __exit__(self, *exc):
        JITFunction.__getitem__ = self._getitem


def ptxas_report(ptx: str, arch: str, tmp: Path) -> dict:
    """Registers and spills of a kernel's PTX by the ptxas Triton ships (what its own compile ran)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(TARGET.arch).path
    src = tmp / "k.ptx"
    src.write_text(ptx)
    cmd = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src), "-o", str(tmp / "k.cubin")]  # Triton's own
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return {"ptxas_error": run.stderr[-1000:]}
    text = run.stderr + run.stdout
    regs = re.search(r"Used (\d+) registers", text)
    stores = re.search(r"(\d+) bytes spill stores", text)
    loads = re.search(r"(\d+) bytes spill loads", text)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_stores": int(stores.group(1)) if stores else 0,
        "spill_loads": int(loads.group(1)) if loads else 0,
    }


def one_layer(cfg: dict, dtype: torch.dtype, vocab: int = 1024) -> Transformer:
    """A random model of cfg's layer shape with one layer and a small vocabulary (the kernels' shapes
    do not depend on either), on the CPU."""
    cfg = dict(cfg, num_hidden_layers=1, vocab_size=vocab)
    args = ModelArgs.from_hf_config(cfg)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, args.head_dim, 2, dtype=torch.float) / args.head_dim))
    model = Transformer(args, inv_freq).to(dtype)
    model.use_kernels = False
    return model.eval()


def forward(
    model: Transformer, dtype: torch.dtype, fused: bool, row_group: int, split: int | None = None, gemm: bool = False, parts: int = 1
) -> None:
    """model.fixed_body at the device's row count over a tree of 40 nodes after up to 700 cached tokens,
    the Triton kernels as the engine's FixedRunner would build them on CUDA (split: keys a split, None
    the default; gemm: our GEMMs, CudaForward.gemm, with K in `parts` parts where a linear's programs
    are fewer than the H200's SMs, CudaForward.gemm_parts)."""
    a = model.args
    P = min(700, a.max_position_embeddings - 100)
    cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, P + 200, dtype, "cpu", scratch=ROWS)
    cache.length = P
    model._fixed_rope = model._fixed_rope_table("cpu")
    inputs = fixed_shape.FixedInputs(ROWS, torch.device("cpu"))
    parents = torch.tensor([-1] + [i // 2 for i in range(39)])
    inputs.fill(torch.arange(40) % a.vocab_size, torch.arange(P, P + 40), parents, P, reference=False)
    kernels = triton_kernels.Kernels(ROWS, a, cache.k.shape[3], dtype, torch.device("cpu"), fused, row_group, split, gemm, parts)
    with torch.inference_mode():
        model.fixed_body(inputs, cache, kernels, False, True)  # capture: torch.cat only (no kernel)


def head_forward(model: Transformer, dtype: torch.dtype, draft_length: int, vd: int) -> None:
    """DART's captured head forward (HeadGraph._body) on a random head shaped like model's layer."""
    target = target_from_transformer(model, "compile", torch.device("cpu"), dtype, TINY_EOS)
    head = random_head(target, 11, draft_length, vd)
    rows = graph_rows(draft_length)
    cache = KVCache(1, head.config.num_key_value_heads, head.config.head_dim, 600, head.fc.weight.dtype, "cpu", scratch=rows)
    cache.length = 300
    graph = HeadGraph(head, target, cache, rows)
    graph.meta.copy_(torch.tensor([300, 3 + draft_length, 3], dtype=torch.int32))
    with torch.inference_mode():
        graph._body()


def eagle3_forwards(model: Transformer, dtype: torch.dtype, vd: int) -> None:
    """EAGLE3's captured drafting on a random head shaped like model's layer: its first forward
    (HeadGraph._body, 3 pending tokens) and its expansion (ExpandGraph._body) at the width and depth
    gpu_check drafts 60 nodes with (10 x 7)."""
    target = target_from_transformer(model, "compile", torch.device("cpu"), dtype, TINY_EOS)
    head = random_head(target, 12, None, vd)
    rows = graph_rows(0)
    cache = KVCache(1, head.config.num_key_value_heads, head.config.head_dim, 600, head.fc.weight.dtype, "cpu", scratch=rows)
    cache.length = 300
    first = HeadGraph(head, target, cache, rows)
    first.meta.copy_(torch.tensor([300, 3, 3], dtype=torch.int32))
    graph = ExpandGraph(head, target, cache, 10, 7)
    with torch.inference_mode():
        first._body()
        graph._body()


def gemms(model: Transformer, dtype: torch.dtype) -> None:
    """Our GEMM (triton_kernels.linear) at each configuration gpu_check's `gemm` part times, on each of the
    layer's linears and the LM head at the device's row count."""
    layer = model.layers[0]
    weights = (layer.attention.wqkv.weight, layer.attention.wo.weight, layer.feed_forward.w13.weight, layer.feed_forward.w2.weight)
    with torch.inference_mode():
        for w in (*weights, model.output.weight):
            x = torch.zeros(ROWS, w.shape[1], dtype=dtype)
            for cfg in triton_kernels.LINEAR_CONFIGS:
                triton_kernels.linear(x, w, None, cfg)


def space_gpus() -> dict:
    """What the app runs on a Space's GPU hardware (the embedded model in bf16: the fixed forward, DART's
    captured head, EAGLE3's captured drafting) compiled for each of SPACE_GPUS: errors, kernels and the
    most shared memory a kernel takes, against that GPU's limit. (Registers are ptxas's per GPU and
    left to sm_90's account above.)"""
    report = {}
    for cc, limit in SPACE_GPUS.items():
        with Compiles(GPUTarget("cuda", cc, 32)) as c:
            model = one_layer(SMOLLM2, torch.bfloat16)
            for label, run in (
                ("fixed", lambda: forward(model, torch.bfloat16, True, 1)),
                ("dart-head", lambda: head_forward(model, torch.bfloat16, 4, 2048)),
                ("eagle3", lambda: eagle3_forwards(model, torch.bfloat16, 2048)),
            ):
                c.label = label
                run()
        report[f"sm_{cc}"] = {
            "kernels": sorted({k["kernel"] for k in c.kernels}),
            "launches": len(c.kernels),
            "max_shared": max((k["compiled"].metadata.shared for k in c.kernels), default=0),
            "shared_limit": limit,
            "errors": c.errors,
        }
    return report


def main() -> int:
    out: dict = {
        "triton": triton.__version__,
        "triton_path": str(Path(triton.__file__).parent),
        "target": f"{TARGET.backend} sm_{TARGET.arch}",
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp, Compiles() as c:
        tmp = Path(tmp)
        cases = []
        for arch in ("llama", "qwen2", "qwen3"):  # gpu_check's exact stage
            path = build_tiny_checkpoint(tmp / arch, arch, seed=1)
            for dname, dtype in DTYPES.items():
                cases.append((f"tiny-{arch}", dname, lambda path=path, dtype=dtype: load_transformer(path, dtype, "cpu")))
        cases.append(("qwen3-8b", "bfloat16", lambda: one_layer(QWEN3_8B, torch.bfloat16)))  # the big stage
        for dname, dtype in DTYPES.items():  # the embedded stage
            cases.append(("smollm2-135m", dname, lambda dtype=dtype: one_layer(SMOLLM2, dtype)))
        for name, dname, build in cases:
            model = build()
            model.use_kernels = False
            dtype = DTYPES[dname]
            G = model.args.n_heads // model.args.n_kv_heads
            paths = {"fixed": (True, 1, None), "fixed-grouped": (True, default_row_group(G), None), "fixed-attn": (False, 1, None)}
            # gpu_check's fixed-gemm, rows grouped as the engine groups them on sm_90
            if name in ("qwen3-8b", "smollm2-135m", "tiny-qwen2"):
                grouped = dtype != torch.float32 and not name.startswith("tiny-")  # (the grouped tile's toy and fp32 spills aside)
                paths["fixed-gemm"] = (True, default_row_group(G) if grouped else 1, None, True)
            if name == "qwen3-8b":  # gpu_check's fixed-grouped-16 (a 64-row tile at the 8B shape), and its sweep's smallest split
                paths["fixed-gemm-k2"] = (True, default_row_group(G), None, True, 2)  # and the sweep's K in parts
                paths["fixed-grouped-16"] = (True, 16, None)
                paths["fixed-split-64"] = (True, 1, 64)
                paths["fixed-grouped-16-split-64"] = (True, 16, 64)
            if name == "smollm2-135m":  # the embedded stage's split sweep, on the engine's grouping there
                paths["fixed-grouped-split-64"] = (True, default_row_group(G), 64)
            for pname, (fused, group, split, *gemm) in paths.items():
                c.label = f"{name} {dname} {pname}"
                forward(model, dtype, fused, group, split, *gemm)
                out["runs"].append(c.label)
            if name == "qwen3-8b":  # gpu_check's gemm part
                c.label = f"{name} {dname} gemm"
                gemms(model, dtype)
                out["runs"].append(c.label)
            if name.startswith("tiny-llama") or name in ("qwen3-8b", "smollm2-135m"):
                c.label = f"{name} {dname} dart-head"
                head_forward(model, dtype, 3 if name.startswith("tiny") else 4, 64 if name.startswith("tiny") else 2048)
                out["runs"].append(c.label)
                c.label = f"{name} {dname} eagle3"
                eagle3_forwards(model, dtype, 64 if name.startswith("tiny") else 2048)
                out["runs"].append(c.label)
        seen: dict[str, dict] = {}  # one report a distinct compiled kernel
        for k in c.kernels:
            ck = k["compiled"]
            key = ck.hash
            if key not in seen:
                md = ck.metadata
                seen[key] = {
                    "kernel": k["kernel"],
                    "labels": [],
                    "num_warps": md.num_warps,
                    "num_stages": md.num_stages,
                    "shared": md.shared,
                    **ptxas_report(ck.asm["ptx"], f"sm_{TARGET.arch}a", tmp),
                }
            seen[key]["labels"].append(k["label"])
        out["launches"] = len(c.kernels)
        out["kernels"] = list(seen.values())
        out["errors"] = c.errors
    out["space_gpus"] = space_gpus()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
