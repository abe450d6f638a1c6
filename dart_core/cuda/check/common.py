"""What the GPU check's stages share: the report (gpu_check.json, gpu_check.log), timing on the device,
the targets and random heads it checks, verify == steps, a forward path set by name, and how a failure
is recorded so that the other pieces still run."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch

from ...drafters.head import head_dtype
from ...model import ModelArgs, Transformer
from ...target import Target
from ...tools.toys import steps_depth_first
from ...tools.training import new_head_from_target
from ...tree import DraftTree
from ..config import from_path
from ..forward import kernel_head_dim, row_group_on, settings, triton_kernels_here

# the checkout the check runs from (its assets: the embedded heads and trie; --parts reads its git tree)
ROOT = Path(__file__).resolve().parents[3]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


STAGES = ("env", "exact", "sampling", "big", "profile", "embedded")


# Qwen3-8B's config.json (the fields our loader reads)
QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"],
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)


SMALL_BIG = dict(QWEN3_8B, vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64)  # fmt: skip


class Report:
    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "stages": {}}
        self.log_file = open(out / "gpu_check.log", "a", buffering=1)

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def save(self, stage: str, result) -> None:
        self.data["stages"][stage] = result
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out / "gpu_check.json")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device: torch.device, warmup: int = 2, reps: int = 7) -> float:
    """Median wall time of fn() in ms, the device synchronized around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def count_syncs(device: torch.device):
    """Counts the host-device synchronizations torch reports (its sync debug mode: .item(), .tolist(),
    .cpu(), nonzero, ...; explicit torch.cuda.synchronize() calls are not among them)."""
    box = {"n": 0, "sites": {}}
    if device.type != "cuda":
        yield box
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield box
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            box["n"] += 1
            site = f"{Path(w.filename).name}:{w.lineno}"
            box["sites"][site] = box["sites"].get(site, 0) + 1


def target_from_transformer(model: Transformer, name: str, device: torch.device, dtype: torch.dtype, eos: int) -> Target:
    return Target(name, Path("."), model, None, frozenset({eos}), device, dtype)


def random_head(target: Target, seed: int, draft_length: int | None, vd: int):
    """A random DART (draft_length set) or EAGLE3 head shaped like the target's layers, built on the
    target's device, in the dtype a loaded head would take beside it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target.vocab_size, generator=g)[:vd].sort().values
    head = new_head_from_target(target, ids, draft_length, seed).to(target.device)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, device=p.device, generator=torch.Generator(p.device).manual_seed(seed)) * 0.05)
    return head.to(dtype=head_dtype(target)).eval()


def random_big_target(dev: torch.device, small: bool) -> Target:
    cfg = SMALL_BIG if small else QWEN3_8B
    args = ModelArgs.from_hf_config(cfg)
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, args.head_dim, 2, dtype=torch.float) / args.head_dim))
    with torch.device("meta"):
        model = Transformer(args, torch.empty(args.head_dim // 2))
    model = model.to_empty(device=dev).to(torch.bfloat16)
    g = torch.Generator(dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        model.output.weight.mul_(40.0)  # peaked next-token distributions, as a trained model's
    model.inv_freq = inv_freq.to(dev)
    model.use_kernels = False  # the torch paths only, as on CUDA
    model.eval()
    return target_from_transformer(
        model, "random-qwen3-8b-shape" if not small else "random-small", dev, torch.bfloat16, 151645 % args.vocab_size
    )


def fill_cache(target: Target, P: int, capacity: int):
    cache = target.new_cache(capacity)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    cache.length = P
    return cache


def verify_against_steps(target: Target, prefix: list[int], tree: DraftTree) -> dict:
    """Every node's logits from one tree verify against its one-token step (each node stepped once, its
    ancestors committed before it: toys.steps_depth_first)."""
    cache = target.new_cache(len(prefix) + len(tree) + 1)
    target.prefill(prefix, cache, capture=False)
    cache.commit(len(prefix))
    tree_logits = target.verify(tree, cache, capture=False).logits
    step_logits = {node: out.logits[0] for node, out in steps_depth_first(target, cache, tree, capture=False)}
    same = sum(bool(torch.equal(tree_logits[i], step_logits[i])) for i in range(len(tree)))
    diff = max(float((tree_logits[i] - step_logits[i]).abs().max()) for i in range(len(tree)))
    argmax = sum(int(tree_logits[i].argmax()) == int(step_logits[i].argmax()) for i in range(len(tree)))
    return {"nodes": len(tree), "bitwise_equal": same, "argmax_equal": argmax, "max_abs_diff": diff}


class ContextLost(RuntimeError):
    """The CUDA context is unusable after a failure (an illegal address, a kernel that trapped): nothing
    after it can run in this process."""


def cuda_alive(dev: torch.device) -> bool:
    if dev.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(dev)
        return torch.ones(1, device=dev).add_(1).item() == 2.0
    except Exception:  # noqa: BLE001  (any error here means the context is gone)
        return False


@contextlib.contextmanager
def recorded_failure(rep: Report, what: str, entry: dict, dev: torch.device):
    """A failure of one piece of a stage (a forward path, a drafter) goes into `entry["error"]` and the
    log, and the stage goes on with its next piece; unless the CUDA context is lost with it (raises
    ContextLost: the stage ends there, and an isolated run goes on in a fresh process)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        rep.log(f"{what} FAILED: {traceback.format_exc()}")
        if not cuda_alive(dev):
            raise ContextLost(f"the CUDA context is lost after {what}: {entry['error']}") from e


def has_failure(result) -> bool:
    """Whether a stage's result records a failure anywhere (an "error", or "errors" not empty)."""
    if isinstance(result, dict):
        return "error" in result or bool(result.get("errors")) or any(has_failure(v) for v in result.values())
    if isinstance(result, list):
        return any(has_failure(v) for v in result)
    return False


def fault(where: str) -> None:
    """Fault injection for the tests of the check's own failure handling (tests/test_gpu_check.py):
    GPU_CHECK_FAULT=<path>:raise makes that forward path's work raise; <path>:exit ends the process
    there, as a lost CUDA context ends a process's use of the device."""
    spec = os.environ.get("GPU_CHECK_FAULT", "")
    path, _, how = spec.partition(":")
    if spec and path == where:
        if how == "exit":
            os._exit(86)
        raise RuntimeError(f"fault injected at {where} (GPU_CHECK_FAULT={spec})")


def use_path(model: Transformer, path: str, opts) -> None:
    """Set `model` on the forward path `path` (config.PATH_HELP names them; config.from_path reads one):
    eager turns the fixed-shape forward off, every other path runs it at opts.fixed_rows rows (0: the
    engine's for the device) with the CudaForward the path names (its split, else --fixed-split's, else
    the engine's)."""
    a = model.args
    cfg = from_path(path, a.n_heads // a.n_kv_heads, getattr(opts, "fixed_split", None) or None)
    model.fixed_rows = 0 if path == "eager" else (opts.fixed_rows or None)
    model.cuda_forward = cfg


def forward_engine(model: Transformer, dev: torch.device) -> str:
    """What a forward path runs on this device, in words (a CPU has no Triton kernels: fixed and
    fixed-attn are the torch reference there)."""
    if model.fixed_row_count(dev) == 0:
        return "eager torch"
    cfg = settings(model)
    if triton_kernels_here(dev, cfg.kernels) and kernel_head_dim(model.args.head_dim):
        group = row_group_on(model, dev)
        rows = [f"{group} rows a program"] if group > 1 else []
        rows += [f"{cfg.split}-key splits"] if cfg.split else []
        rows = f" ({', '.join(rows)})" if rows else ""
        parts = f" (K in {cfg.gemm_parts} parts where a linear's programs are fewer than the SMs)" if cfg.gemm_parts > 1 else ""
        work = f" + our GEMMs with the element-wise work{parts}" if cfg.gemm else " + fused element-wise" if cfg.fused else ""
        return "Triton attention" + rows + work + ", CUDA graph"
    return "torch reference, uncaptured"
