"""The big stage's gemm part: each of the fixed-shape forward's linears at its row count, timed by backend
(torch's GEMM, cuBLASLt, our Triton GEMM at each configuration) and checked bitwise by row place."""

from __future__ import annotations

import contextlib

import torch

from ... import fixed_shape
from ...target import Target
from .. import forward
from .common import Report, recorded_failure, timed_ms, use_path

GEMM_LINEARS = ("wqkv", "wo", "w13", "w2", "output")  # the fixed forward's linears a layer, then the LM head


def gemm_places(rows: int) -> list[int]:
    """Rows whose output is compared at row 0 of another batch (bitwise): the second, the middle's and
    the last of `rows` (1, 31 and 63 at the engine's 64)."""
    return sorted({min(1, rows - 1), max(rows // 2 - 1, 0), rows - 1})


def gemm_backends(dev: torch.device) -> dict:
    """The GEMMs the `gemm` part times, by name: torch's F.linear as the fixed forward calls it (cuBLAS on
    CUDA, whichever library torch prefers), the same with cuBLASLt preferred (CUDA), and our Triton GEMM
    (triton_kernels.linear) at each of triton_kernels.LINEAR_CONFIGS where the Triton kernels run.
    Each value: (gemm(x, w), the context its calls and captures run in)."""
    import torch.nn.functional as F

    backends = {"torch": (F.linear, contextlib.nullcontext)}
    if dev.type == "cuda":

        @contextlib.contextmanager
        def cublaslt():
            before = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                yield
            finally:
                torch.backends.cuda.preferred_blas_library(before)

        backends["cublaslt"] = (F.linear, cublaslt)
    if forward.triton_kernels_here(dev, None):
        from .. import triton_kernels

        for cfg in triton_kernels.LINEAR_CONFIGS:
            name = "triton-{}x{}-w{}-s{}".format(*cfg[:4]) + (f"-k{cfg[4]}" if cfg[4] > 1 else "")  # -kN: K in N parts
            backends[name] = (lambda x, w, cfg=cfg: triton_kernels.linear(x, w, None, cfg), contextlib.nullcontext)
    return backends


def big_gemm(target: Target, r: dict, rep: Report, opts) -> None:
    """Each of the fixed forward's linears at its row count (the big target's weights: every layer's
    in turn, as a step streams them, so no weight is read from L2), timed per backend (gemm_backends)
    as one captured graph of all layers' calls: microseconds a call, GB/s and the fraction of the read
    bandwidth; the whole step's GEMM time by backend; and, per backend, whether a row's output has
    the same bits at row 0 of another batch (gemm_places; what a verified node's exactness rests on).
    Also torch's one-row GEMM, what the padding to the fixed rows costs. Into r["gemm"]."""
    dev = torch.device(target.device)
    model = target.model
    use_path(model, "fixed", opts)  # the engine's rows (or --fixed-rows)
    R = model.fixed_row_count(dev)
    places = gemm_places(R)
    env = rep.data["stages"].get("env", {})
    bw = opts.read_gb_s or env.get("read_gb_s") or env.get("copy_gb_s")
    weights = {name: [] for name in GEMM_LINEARS}
    for layer in model.layers:
        weights["wqkv"].append(layer.attention.wqkv.weight)
        weights["wo"].append(layer.attention.wo.weight)
        weights["w13"].append(layer.feed_forward.w13.weight)
        weights["w2"].append(layer.feed_forward.w2.weight)
    weights["output"].append(model.output.weight)
    backends = gemm_backends(dev)
    g = torch.Generator(dev).manual_seed(7)
    out: dict = {"rows": R, "backends": list(backends), "by_linear": {}, "blas_default": None}
    if dev.type == "cuda":
        out["blas_default"] = str(torch.backends.cuda.preferred_blas_library())
    step_us = {name: 0.0 for name in backends}
    for lin, ws in weights.items():
        N, K = ws[0].shape
        esz = ws[0].element_size()
        x = torch.randn(R, K, generator=g, device=dev).to(ws[0].dtype)
        entry: dict = {"N": N, "K": K, "count": len(ws), "us": {}, "gb_s": {}, "rows_bitwise": {}}
        if bw:
            entry["of_read_bw"] = {}
        for name, (gemm, ctx) in backends.items():
            err: dict = {}
            with recorded_failure(rep, f"big: gemm {lin} {name}", err, dev), torch.inference_mode(), ctx():
                y = gemm(x, ws[0])
                same = 0
                for i in places:
                    other = torch.randn(R, K, generator=g, device=dev).to(x.dtype)
                    other[0] = x[i]
                    same += int(torch.equal(gemm(other, ws[0])[0], y[i]))
                entry["rows_bitwise"][name] = f"{same}/{len(places)}"

                def calls(gemm=gemm):
                    return [gemm(x, w) for w in ws]

                run = calls
                if fixed_shape.graphs_here(dev):
                    graph, _ = forward.capture_graph(calls, dev)
                    run = graph.replay
                us = timed_ms(run, dev) * 1e3 / len(ws)
                entry["us"][name] = round(us, 2)
                moved = (N * K + R * K + R * N) * esz
                entry["gb_s"][name] = round(moved / us / 1e3, 1)
                if bw:
                    entry["of_read_bw"][name] = round(moved / us / 1e3 / bw, 3)
                step_us[name] += us * len(ws)
            if "error" in err:
                entry.setdefault("errors", {})[name] = err["error"]
                step_us[name] = float("nan")
        with torch.inference_mode():
            x1 = x[:1].contiguous()
            entry["torch_1row_us"] = round(timed_ms(lambda: [torch.nn.functional.linear(x1, w) for w in ws], dev) * 1e3 / len(ws), 2)
        entry["ranked"] = sorted(entry["us"].items(), key=lambda kv: kv[1])
        out["by_linear"][lin] = entry
        rep.log(f"big: gemm {lin} ({N}x{K}, x{len(ws)}) us {entry['us']} rows bitwise {entry['rows_bitwise']}")
        r["gemm"] = out
        rep.save("big", r)
    out["step_ms"] = {k: round(v / 1e3, 3) for k, v in step_us.items() if v == v}
    weight_bytes = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
    if bw:
        out["step_weights_hbm_limit_ms"] = round(weight_bytes / (bw * 1e6), 3)
    # the step's GEMMs with the fastest bitwise backend for each linear: what our own GEMMs would give
    best = 0.0
    for e in out["by_linear"].values():
        ok = [(us, n) for n, us in e["us"].items() if e["rows_bitwise"].get(n) == f"{len(places)}/{len(places)}"]
        best += min(ok)[0] * e["count"] if ok else float("nan")
    out["step_ms_best_per_linear"] = round(best / 1e3, 3) if best == best else None
