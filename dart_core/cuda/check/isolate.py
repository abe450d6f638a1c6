"""Each piece of each stage in a process of its own (--isolate, the default on CUDA): a lost CUDA context,
a crash or a hang past --piece-timeout costs that piece only; the pieces' results merged into one report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .common import ROOT, Report, has_failure


def pieces(stage: str, paths: list[str], sweep_paths: list[str] = (), gemm: bool = False) -> list[tuple[str, list[str]]]:
    """A stage's isolated pieces: (name, the options naming it). The exact stage and the big stage's
    verify run a process a forward path; the big stage's sweep (sweep_paths) one process for all its
    paths; its GEMMs by backend (`gemm`: the gemm part asked for) one process; the big stage's drafting
    and loop one more process, on the first path whose verify did not fail."""
    if stage == "exact":
        return [(f"exact-{p}", ["--stages", "exact", "--paths", p]) for p in paths]
    if stage == "big":
        verify = [(f"big-{p}", ["--stages", "big", "--paths", p, "--big-parts", "verify"]) for p in paths]
        sweep = [("big-sweep", ["--stages", "big", "--big-parts", "sweep"])] if sweep_paths else []
        gemms = [("big-gemm", ["--stages", "big", "--big-parts", "gemm"])] if gemm else []
        drafting = [("big-drafting", ["--stages", "big", "--big-parts", "drafting"])]  # --paths: filled in when it runs
        return verify + sweep + gemms + drafting
    return [(stage, ["--stages", stage])]


def merge_piece(stage: str, merged: dict, part: dict, name: str) -> None:
    """One piece's result into its stage's: the exact stage's rows appended, the big stage's verify
    results by path, the rest taken whole; a piece's failure kept under errors[name]."""
    error = part.pop("error", None)
    part.pop("traceback", None)
    seconds = part.pop("seconds", 0.0)
    if stage == "exact":
        merged.setdefault("rows", []).extend(part.get("rows", []))
    elif stage == "big":
        for k, v in part.items():
            if k in ("verify", "verify_vs_steps", "errors"):
                merged.setdefault(k, {}).update(v)
            else:
                merged[k] = v
    else:
        merged.update(part)
    if error:
        merged.setdefault("errors", {})[name] = error
    merged["seconds"] = round(merged.get("seconds", 0.0) + seconds, 1)


def run_isolated(a, argv: list[str], stages: list[str], rep: Report) -> int:
    """Each piece of each stage in a process of its own (a lost CUDA context, a crash, a hang past
    --piece-timeout ends that piece only), merged into one report as a single process would write it.
    A piece runs with this run's options, then those naming it (argparse keeps an option's last value)."""
    paths = a.paths.split(",")
    sweep = [p for p in a.sweep.split(",") if p] if "sweep" in a.big_parts.split(",") else []
    failed = 0
    # the pieces import this checkout's package, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    for stage in stages:
        rep.log(f"--- {stage} (a process a piece)")
        merged: dict = {}
        for name, naming in pieces(stage, paths, sweep, "gemm" in a.big_parts.split(",")):
            if name == "big-drafting":
                ok = [p for p in paths if p not in merged.get("errors", {}) and p in merged.get("verify", {})] or paths
                naming = naming + ["--paths", ok[0]]
            out = a.out / "pieces" / name
            cmd = [sys.executable, "-m", "dart_core.cuda.check", *argv, "--out", str(out), *naming, "--no-isolate"]
            cmd += ["--read-gb-s", str(a.read_gb_s)] if a.read_gb_s else []
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(cmd, timeout=a.piece_timeout, env=env).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            seconds = round(time.perf_counter() - t0, 1)
            log = out / "gpu_check.log"
            if log.exists():
                rep.log_file.write(log.read_text())
            result = json.loads((out / "gpu_check.json").read_text()).get("stages", {}) if (out / "gpu_check.json").exists() else {}
            part = result.get(stage, {})
            if stage == "env" and part.get("read_gb_s"):
                a.read_gb_s = part["read_gb_s"]  # the big stage's HBM limit, in its own processes
            if rc != 0 and "error" not in part:
                part["error"] = f"the process ended with {rc} (after {seconds} s; its last results kept)"
            merge_piece(stage, merged, part, name)
            rep.data.setdefault("pieces", []).append({"name": name, "rc": rc, "seconds": seconds})
            rep.log(f"{name}: exit {rc} in {seconds} s")
            rep.save(stage, merged)
        failed += has_failure(merged)
    rep.log(f"done: {len(stages) - failed}/{len(stages)} stages ran without a failure")
    return 1 if failed else 0
