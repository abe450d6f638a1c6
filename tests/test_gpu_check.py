"""The GPU check (dart_core/cuda/check: dart-gpu-check, python -m dart_core.cuda.check, and the
scripts/gpu_check.py path that calls it), run here on the CPU at toy sizes: every stage runs and writes
its JSON, and on the fixed-shape forward (the path CUDA takes, here at the 64 rows it has there) its
exactness figures are all n/n, so the check cannot rot between runs on a GPU."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"  # the path existing instructions name: a shim calling the package's main
CHECK = [sys.executable, "-m", "dart_core.cuda.check"]


@pytest.mark.slow  # every stage at toy sizes in a subprocess
def test_gpu_check_runs_on_the_cpu_and_reports_exactness(tmp_path):
    out = tmp_path / "out"
    cmd = [*CHECK, "--out", str(out), "--device", "cpu", "--small", "--stages", "env,exact,sampling,big"]
    # 256 cached tokens (not 512 and 4096): the torch reference's per-chunk sums cost seconds a verify on the CPU
    cmd += ["--fixed-rows", "64", "--exact-tokens", "8", "--contexts", "256"]
    cmd += ["--paths", "fixed,eager"]  # (fixed-attn differs from fixed on CUDA only: the Triton kernels)
    cmd += ["--sweep", "fixed-split-64"]  # (a split is the Triton attention's: here the plumbing, on the torch reference)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    stages = data["stages"]
    assert set(stages) == {"env", "exact", "sampling", "big"}
    assert stages["env"]["copy_gb_s"] > 0
    # the env stage names the Triton that compiles the kernels (report.COMPILE_CHECK_TRITON: the GPU's, for CI)
    triton = importlib.util.find_spec("triton")  # (none on platforms without its wheel)
    assert stages["env"]["triton"] == (importlib.metadata.version("triton") if triton else None)
    rows = stages["exact"]["rows"]
    assert {(r["arch"], r["dtype"], r["path"]) for r in rows} == {
        (a, d, p) for a in ("llama", "qwen2", "qwen3") for d in ("bfloat16", "float16", "float32") for p in ("fixed", "eager")
    }
    for r in rows:
        if r["path"] == "fixed":  # verify == steps, bit for bit, so greedy ids are plain decoding's
            assert r["fixed_rows"] == 64 and r["verify_bitwise_equal"] == r["verify_nodes"], r
            assert r["dart_ids_equal"] == r["prompts"] and r["eagle3_ids_equal"] == r["prompts"], r
    # the plain eager path is recorded, not promised: in fp32 its verify rounds otherwise than its steps
    assert any(r["verify_bitwise_equal"] < r["verify_nodes"] for r in rows if r["path"] == "eager" and r["dtype"] == "float32")
    assert all(r["passed"] for r in stages["sampling"]["rows"])
    big = stages["big"]
    fixed = big["verify_vs_steps"]["fixed"]
    assert fixed["bitwise_equal"] == fixed["nodes"]
    assert set(big["verify"]) == {"fixed", "eager"} and set(big["verify"]["fixed"]) == {"256"}
    sweep = big["sweep"]  # the default beside the swept path in one process, ranked; both bitwise
    assert set(sweep["verify"]) == {"fixed", "fixed-split-64"} and sweep["not_bitwise"] == [], sweep
    assert sorted(p for p, _ in sweep["ranked"]["P256_step"]) == ["fixed", "fixed-split-64"], sweep["ranked"]
    assert set(sweep["ranked"]) == {"P256_step", "P256_verify64"}
    assert set(big["drafting_60"]) == {"dart", "dart-eager-head", "eagle3", "eagle3-eager"}
    assert all(big["drafting_60"][m]["nodes"] == 60 for m in big["drafting_60"])
    assert big["drafting_60"]["dart"]["graph_calls"] == big["drafting_60"]["eagle3"]["graph_calls"] == 0  # captured: CUDA only
    assert set(big["loop"]) == {"ar", "dart", "dart-eager-head", "eagle3", "eagle3-eager"}
    gemm = big["gemm"]  # each linear's GEMM at the fixed rows: on a CPU torch's alone (cuBLASLt and Triton: CUDA)
    assert gemm["rows"] == 64 and gemm["backends"] == ["torch"], gemm
    assert list(gemm["by_linear"]) == ["wqkv", "wo", "w13", "w2", "output"]
    for lin, e in gemm["by_linear"].items():
        assert e["count"] == (1 if lin == "output" else 8) and e["us"]["torch"] > 0 and e["torch_1row_us"] > 0, (lin, e)
        assert e["rows_bitwise"] == {"torch": "3/3"} and "errors" not in e, (lin, e)  # a row's bits at any place: the fixed path's premise
    assert gemm["step_ms"]["torch"] > 0 and gemm["step_ms_best_per_linear"] == gemm["step_ms"]["torch"], gemm
    prefill = big["prefill"]["65"]  # a prompt one token past the rows: two fixed-shape chunks, or one eager forward
    assert prefill["chunks"] == 2 and prefill["eager_ms"] > 0 and prefill["chunked_ms"] > 0, big["prefill"]
    assert prefill["eager_first_ms"] > 0 and prefill["chunked_first_ms"] > 0, big["prefill"]
    assert "--- big" in (out / "gpu_check.log").read_text()


@pytest.mark.slow  # the embedded model in a subprocess, its tree sizes calibrated
def test_gpu_check_embedded_stage_runs_on_the_cpu(tmp_path, fresh_cache):
    """The stage a GPU runs once the embedded model is there: plain decoding, DART and
    EAGLE3 at --nodes and at the sizes the calibration picks on the device, ids against plain's."""
    from dart_core import kernels

    out = tmp_path / "out"
    cmd = [*CHECK, "--out", str(out), "--device", "cpu", "--stages", "embedded"]
    weights = "gguf-int16" if kernels.AVAILABLE else "float32"
    cmd += ["--embedded-dtypes", weights, "--nodes", "4", "--max-new-tokens", "12"]
    # the sweep verifies a 24-node tree and times up to 64 rows: the fixed path at the 64 rows it has on CUDA
    # (the CPU's 16 would send those verifies down the plain eager path, which is not exact)
    cmd += ["--embedded-sweep", "fixed-split-64", "--contexts", "64", "--fixed-rows", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "gpu_check.json").read_text())["stages"]["embedded"][weights]
    assert {"ar", "dart@4", "eagle3@4"} <= set(rows)
    for m, row in rows.items():
        if m not in ("calibration", "prefill", "profiles", "sweep"):
            assert row["ids_equal_ar"] == row["prompts"] == 2 and row["tau"] >= 1.0, (m, row)
            # each generation's draft times: the warm-up's and the two prompts'
            assert len(row["draft_by_generation"]) == 3 and all(g["steps"] >= 1 for g in row["draft_by_generation"]), (m, row)
    # one more generation of each drafter on a new prompt, profiled: the ops that took the host's time
    assert {"dart@4", "eagle3@4"} <= set(rows["profiles"]) and "ar" not in rows["profiles"], rows["profiles"]
    for m, prof in rows["profiles"].items():
        assert "error" not in prof and prof["steps"] >= 2 and prof["top_host_total"], (m, prof)
    # the kernels path calibrates (a GPU's fixed forward too); the eager CPU path does not. The split
    # sweep times the fixed-shape forward, which the kernels' path has not: it says so; on the eager
    # path it runs (the torch reference there: a split is the Triton attention's)
    if kernels.AVAILABLE:
        cal = rows["calibration"]
        for m in ("dart", "eagle3"):
            assert f"{m}@{cal[m]['max_nodes']}" in rows and 1 <= cal[m]["max_nodes"] <= 16
        assert "no fixed-shape forward on cpu" in rows["sweep"]["skipped"], rows["sweep"]
    else:
        assert set(rows["sweep"]["verify"]) == {"fixed", "fixed-split-64"} and rows["sweep"]["not_bitwise"] == [], rows["sweep"]


@pytest.mark.slow  # five processes at toy sizes
def test_a_lost_process_costs_its_piece_only(tmp_path):
    """--isolate (the default on CUDA) runs each stage, and each forward path of the exact and big
    stages, in a process of its own: a path whose process dies (as one does when a kernel loses the
    CUDA context; here GPU_CHECK_FAULT ends it) is recorded as failed and every other piece still runs,
    the big stage's drafting and loop on the first path that verified."""
    out = tmp_path / "out"
    cmd = [*CHECK, "--out", str(out), "--device", "cpu", "--small", "--isolate", "--stages", "env,exact,big"]
    cmd += ["--fixed-rows", "64", "--exact-tokens", "4", "--contexts", "256", "--paths", "fixed,eager", "--sweep", ""]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "GPU_CHECK_FAULT": "fixed:exit"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert [(p["name"], p["rc"]) for p in data["pieces"]] == [
        ("env", 0), ("exact-fixed", 86), ("exact-eager", 0), ("big-fixed", 86), ("big-eager", 0), ("big-gemm", 0), ("big-drafting", 0),
    ]  # fmt: skip
    stages = data["stages"]
    assert "ended with 86" in stages["exact"]["errors"]["exact-fixed"]
    assert {r["path"] for r in stages["exact"]["rows"]} == {"eager"} and len(stages["exact"]["rows"]) == 9
    big = stages["big"]
    assert set(big["errors"]) == {"big-fixed"} and set(big["verify"]) == {"eager"}
    assert big["verify"]["eager"]["256"]["hbm_limit_ms"] > 0  # env's bandwidth reached the big stage's process
    assert big["loop_path"] == "eager" and set(big["loop"]) == {"ar", "dart", "dart-eager-head", "eagle3", "eagle3-eager"}
    log = (out / "gpu_check.log").read_text()
    assert "exact-fixed: exit 86" in log and "big: loop eagle3" in log  # the pieces' logs in the run's


@pytest.mark.slow  # the big stage at toy sizes in a subprocess
def test_a_failing_drafter_leaves_the_others_rows(tmp_path):
    out = tmp_path / "out"
    cmd = [*CHECK, "--out", str(out), "--device", "cpu", "--small", "--stages", "big"]
    cmd += ["--fixed-rows", "64", "--contexts", "256", "--paths", "fixed", "--sweep", ""]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "GPU_CHECK_FAULT": "dart:raise"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    big = json.loads((out / "gpu_check.json").read_text())["stages"]["big"]
    assert "fault injected at dart" in big["drafting_60"]["dart"]["error"] and "fault injected" in big["loop"]["dart"]["error"]
    assert big["drafting_60"]["eagle3"]["nodes"] == 60 and big["drafting_60"]["dart-eager-head"]["nodes"] == 60
    assert big["drafting_60"]["eagle3-eager"]["nodes"] == 60
    assert big["loop"]["ar"]["tau"] == 1.0 and big["loop"]["eagle3"]["steps"] > 0
    assert big["verify_vs_steps"]["fixed"]["bitwise_equal"] == big["verify_vs_steps"]["fixed"]["nodes"]


@pytest.mark.slow  # a toy target profiled in a subprocess
def test_gpu_check_profile_stage_runs_on_the_cpu(tmp_path):
    """The profile stage (where the fixed forward's time goes, kernel by kernel, at 1 and 64 rows) that
    a GPU runs beside the main check."""
    out = tmp_path / "out"
    cmd = [*CHECK, "--out", str(out), "--device", "cpu", "--small", "--stages", "profile"]
    cmd += ["--fixed-rows", "64", "--contexts", "256"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prof = json.loads((out / "gpu_check.json").read_text())["stages"]["profile"]
    assert {"P256_rows1", "P256_rows64"} <= set(prof), prof
    for key in ("P256_rows1", "P256_rows64"):
        assert prof[key]["verify_ms"] > 0 and prof[key]["kernel_ms_total"] > 0 and prof[key]["top"], prof[key]


def test_gpu_check_refuses_unknown_stages(tmp_path):
    proc = subprocess.run([*CHECK, "--out", str(tmp_path), "--stages", "env,warp"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown stages ['warp']" in proc.stderr


def test_gpu_check_names_its_forward_paths(tmp_path):
    """--paths takes PATHS and fixed-grouped-N (N rows an attention program, N >= 1), each path on the
    Triton attention maybe ending in -split-S (S keys a split, a multiple of 64), refusing the rest
    before any stage runs; each path sets the row group and split it names (None: the engine's own
    choice). --sweep takes the paths on the Triton attention, --fixed-split a multiple of 64."""
    bad_paths = (
        "fixed-grouped-0", "fixed-grouped-x", "fixed-row", "fixed-split-32", "fixed-split-100", "eager-split-64",
        "fixed-gemm-k0", "fixed-gemm-kx",
    )  # fmt: skip
    for option, bad in (*(("--paths", f"fixed,{b}") for b in bad_paths), ("--sweep", "fixed-split-64,eager"), ("--fixed-split", "96")):
        proc = subprocess.run([*CHECK, "--out", str(tmp_path), option, bad], capture_output=True, text=True)
        assert proc.returncode == 2 and f"{option}: " in proc.stderr, (option, bad, proc.stderr[-500:])
    from types import SimpleNamespace

    from dart_core.cuda.check.common import use_path
    from dart_core.cuda.config import CudaForward, from_path
    from dart_core.model import Transformer

    model = Transformer.__new__(Transformer)  # use_path sets attributes only; the shape is read from args
    model.args = SimpleNamespace(n_heads=32, n_kv_heads=8)
    for path in ("fixed", "fixed-grouped", "fixed-gemm-k2", "fixed-attn-split-256", "fixed-torch", "eager"):
        use_path(model, path, SimpleNamespace(fixed_rows=0))  # (the paths' settings: tests/cuda/test_forward.py)
        assert model.cuda_forward == from_path(path, 4) and model.fixed_rows == (0 if path == "eager" else None), path
    use_path(model, "fixed-grouped", SimpleNamespace(fixed_rows=64, fixed_split=256))  # --fixed-split: paths without their own
    assert (model.cuda_forward, model.fixed_rows) == (CudaForward(row_group=4, split=256), 64)
    # the big stage's pieces: a process a path, the sweep's paths in one, the GEMMs by backend, then drafting and the loop
    from dart_core.cuda.check.gemm import gemm_places
    from dart_core.cuda.check.isolate import pieces

    assert [n for n, _ in pieces("big", ["fixed", "eager"], ["fixed-split-64"])] == [
        "big-fixed", "big-eager", "big-sweep", "big-drafting",
    ]  # fmt: skip
    assert [n for n, _ in pieces("big", ["fixed"])] == ["big-fixed", "big-drafting"]
    assert [n for n, _ in pieces("big", ["fixed"], gemm=True)] == ["big-fixed", "big-gemm", "big-drafting"]
    # the gemm part's rows compared at row 0 of another batch, at any --fixed-rows (64: the engine's)
    assert (gemm_places(64), gemm_places(16), gemm_places(2), gemm_places(1)) == (
        [1, 31, 63], [1, 7, 15], [0, 1], [0],
    )  # fmt: skip


# What the simulated remote machine runs on this CPU: the device check at its smallest (the plan's
# plumbing, not the check: the tests above run that), the embedded stage at a few tokens (its env at toy sizes)
SIMULATED_CHECK = "--device cpu --small --stages env"
SIMULATED_STAGE = (
    "--device cpu --small --embedded-dtypes float32 --nodes 2 --max-new-tokens 2 --no-calibrate --no-profile-drafters --embedded-sweep ''"
)


@pytest.mark.slow  # the GGUF compressed (~15 s), the gguf wheel from PyPI, then the calls run here, the embedded stage among them
def test_parts_carry_the_embedded_model_within_a_device_call(tmp_path):
    """--parts: every command's carry fits beside the checkout in 64 MiB and the command in 2,000
    characters, the parts join into the embedded GGUF, byte for byte, and the printed commands, run
    here in turn as the machine without network would run them (each in the checkout, with an $OUT of its own),
    start the check in the background, return its results while the parts travel, and end with the
    check's results and the embedded stage's on the joined GGUF."""
    import ast
    import lzma
    import re
    import shutil

    from dart_core.cuda.check.parts import DEVICE_CHECK_ARGS
    from dart_core.loading import embedded_gguf_path

    root = ROOT
    sets = sorted((root.parent / "shared" / "data" / "bench").glob("*.jsonl"))  # the bench's sets, where they are beside the checkout
    folder = f"device_parts/test-{os.getpid()}"  # under the git-ignored device_parts/
    machine = tmp_path / "machine"  # the device machine's /tmp
    cmd = [*CHECK, "--parts", folder, "--parts-scratch", str(machine)]
    cmd += ["--parts-check-args", SIMULATED_CHECK, "--parts-stage-args", SIMULATED_STAGE]
    cmd += ["--parts-bench-sets", str(sets[0].parent)] if sets else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        tree_mib = float(re.search(r"the tracked tree: ([0-9.]+) MiB", proc.stdout).group(1))
        lines = proc.stdout.splitlines()
        carries = [ast.literal_eval(line.removeprefix("carry=")) for line in lines if line.startswith("carry=")]
        commands = [line.removeprefix("command: ") for line in lines if line.startswith("command: ")]
        parts = sorted((root / folder).glob("embedded.xz.*"))
        assert len(parts) >= 2 and len(commands) == len(carries) == len(parts) + 1
        assert [c[0] for c in carries[:-1]] == [str(p.relative_to(root)) for p in parts]
        for carry, command in zip(carries, commands):
            assert tree_mib + sum((root / f).stat().st_size for f in carry) / 2**20 <= 64, carry
            device = command.replace(str(machine), "/tmp").replace(SIMULATED_CHECK, DEVICE_CHECK_ARGS)
            device = device.replace(SIMULATED_STAGE, "--max-new-tokens 64 --embedded-dtypes bfloat16")  # --parts-stage-args' default
            assert len(device) <= 2000, device  # the call's limit, as the device's session prints it
        joined = lzma.decompress(b"".join(p.read_bytes() for p in parts))
        assert joined == embedded_gguf_path().read_bytes()
        last = commands[-1]
        assert "--stages env,embedded" in last
        if sets:  # the last call carries the first two prompts of each bench set, as the bench prompts them
            assert carries[-1] == [f"{folder}/prompts.jsonl"] and f"--prompts {folder}/prompts.jsonl" in last
            prompts = [json.loads(line) for line in (root / folder / "prompts.jsonl").read_text().splitlines()]
            first = json.loads(sets[0].read_text().splitlines()[0])["turns"][0]
            assert len(prompts) == 2 * len(sets) and prompts[0] == [{"role": "user", "content": first}]
        else:
            assert carries[-1] == [] and "--prompts" not in last
        # the session, call by call: python3 is this venv's (the device's has torch too)
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        outs = []
        for i, command in enumerate(commands):
            out = tmp_path / f"out{i}"
            out.mkdir()
            run = subprocess.run(
                ["bash", "-c", command], cwd=root, env={**env, "OUT": str(out)}, capture_output=True, text=True, timeout=900
            )
            if i == 0 or i == len(commands) - 1:  # the middle calls end on the log's tail, there or not yet
                assert run.returncode == 0, (i, run.stdout[-3000:], run.stderr[-3000:])
            assert sum(f.is_file() for f in out.rglob("*")) <= 8, sorted(out.rglob("*"))  # what a call returns
            outs.append(out)
        assert (machine / "gc" / "done").exists()
        assert sorted(p.name for p in (machine / "emb").glob("embedded.xz.*")) == [p.name for p in parts]
        check = json.loads((outs[-1] / "check.json").read_text())  # the background check's results, returned at the end
        assert set(check["stages"]) == {"env"} and check["stages"]["env"]["device"] == "cpu"
        assert "--- env" in (outs[-1] / "check.log").read_text()
        embedded = json.loads((outs[-1] / "gpu_check.json").read_text())["stages"]["embedded"]["float32"]
        n = len(prompts) if sets else 2
        for m in ("ar", "dart@2", "eagle3@2"):
            assert embedded[m]["prompts"] == n and embedded[m]["ids_equal_ar"] == n, (m, embedded[m])
        # the session's two reports read together (--targets): the embedded model's row from the last's
        tables = subprocess.run(
            [*CHECK, "--targets", str(outs[-1] / "check.json"), str(outs[-1] / "gpu_check.json")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert tables.returncode == 0 and "| embedded float32: dart@2 against plain decoding, ids = plain's | " in tables.stdout, tables
    finally:
        shutil.rmtree(root / folder, ignore_errors=True)
        pid = machine / "gc" / "pid"
        if pid.exists() and not (machine / "gc" / "done").exists():  # a check the session left running
            subprocess.run(["bash", "-c", f"kill -- -$(cat {pid})"], capture_output=True)


def test_parts_refuse_a_folder_git_would_carry():
    proc = subprocess.run([*CHECK, "--parts", "docs/parts"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "git-ignored" in proc.stderr


def test_targets_read_off_the_h200_run_of_2026_11_29():
    """--targets on the last device run's file: what docs/gpu.md says of it, met and not."""
    from dart_core.cuda.check import report

    path = ROOT / "docs" / "results" / "gpu-h200-2026-11-29.json"
    rows = {r["target"].split(" (")[0].split(",")[0]: r for r in report.targets(report.report_stages(json.loads(path.read_text())))}
    assert rows["tiny targets"]["met"] and rows["tiny targets"]["measured"] == "1431/1431; 216/216"  # 53 nodes x 9 x 3 paths
    assert rows["sampling: one-step chi-square"]["met"]
    step = rows["8B shape: one-row step over the HBM limit"]
    assert step["met"] is False and step["measured"].startswith("1.612 (fixed;")
    verify = rows["8B shape: 64-row verify over the one-row step"]
    assert verify["met"] is False and verify["measured"].startswith("1.404 (fixed-grouped;") and "fixed 1.769" in verify["measured"]
    assert rows["8B shape: DART draft + prune at 60 nodes"]["met"] and rows["8B shape: DART draft + prune at 60 nodes"][
        "measured"
    ].startswith("0.866")
    assert rows["embedded bfloat16: dart@60 against plain decoding"]["met"] is False
    assert rows["embedded bfloat16: τ of dart@60"]["measured"] == 2.565
    proc = subprocess.run([*CHECK, "--targets", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("| **no** |") == 4 and proc.stdout.count("| yes |") == 3, proc.stdout
    assert "Triton on the device: not recorded" in proc.stdout  # (that run's env stage did not record it)


def test_targets_met_unmet_and_unmeasured():
    """A path counts only where its verify was bitwise its steps'; a stage a run lacks is not measured."""
    from dart_core.cuda.check import report

    def verify(step, ratio):
        return {"512": {"step_over_hbm_limit": step, "ratio_64_to_1": ratio}, "4096": {"step_over_hbm_limit": step, "ratio_64_to_1": ratio}}

    big = {
        "verify": {"fixed": verify(1.5, 1.4), "eager": verify(1.0, 1.0)},
        "verify_vs_steps": {"fixed": {"nodes": 24, "bitwise_equal": 24}, "eager": {"nodes": 24, "bitwise_equal": 0}},
        "sweep": {
            "verify": {"fixed-gemm": verify(1.25, 1.1), "fixed-split-64": verify(1.1, 1.0)},
            "verify_vs_steps": {"fixed-gemm": {"nodes": 24, "bitwise_equal": 24}, "fixed-split-64": {"nodes": 24, "bitwise_equal": 23}},
        },
        "drafting_60": {"dart": {"draft_ms": 0.7, "prune_ms": 0.4}},
    }
    embedded = {"bfloat16": {"ar": {}, "dart@60": {"vs_ar": 2.1, "ids_equal_ar": 12, "prompts": 12, "tau": 3.0}}}
    rows = {r["target"].split(" (")[0]: r for r in report.targets({"big": big, "embedded": embedded})}
    step, verify64 = rows["8B shape: one-row step over the HBM limit"], rows["8B shape: 64-row verify over the one-row step"]
    # eager (not the Triton attention) and fixed-split-64 (23/24 bitwise) do not count
    assert step["met"] and step["measured"].startswith("1.25 (fixed-gemm;") and "fixed 1.5" in step["measured"]
    assert verify64["met"] and verify64["measured"].startswith("1.1 (fixed-gemm;")
    assert rows["8B shape: DART draft + prune at 60 nodes"]["met"] is False
    assert rows["embedded bfloat16: dart@60 against plain decoding, ids = plain's"]["met"]
    assert rows["embedded bfloat16: τ of dart@60"]["met"]
    assert rows["tiny targets: verify == steps bitwise; dart and eagle3 ids = plain's"]["met"] is None
    assert rows["sampling: one-step chi-square"]["met"] is None
    assert "not measured" in report.targets_table(report.targets({}))


def test_the_devices_triton_read_off_a_run_against_the_compile_checks():
    """--targets says whether the Triton a run's env stage saw is the version CI compiles the kernels under
    as the device's (report.COMPILE_CHECK_TRITON, which tests/cuda/device_triton.py installs), and what to
    change where it is not."""
    from dart_core.cuda.check import report

    assert "not recorded" in report.triton_note({"env": {"device": "cuda"}})
    assert report.triton_note({"env": {"triton": report.COMPILE_CHECK_TRITON}}).endswith("(the same)")
    assert "set dart_core/cuda/check/report.py's COMPILE_CHECK_TRITON to 9.9.9" in report.triton_note({"env": {"triton": "9.9.9"}})


def test_the_scripts_path_and_python_m_run_the_same_check():
    """scripts/gpu_check.py (the path existing instructions name) and python -m dart_core.cuda.check are
    the one command line: the same --help, naming every stage."""
    shim = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    module = subprocess.run([*CHECK, "--help"], capture_output=True, text=True, timeout=120)
    assert shim.returncode == module.returncode == 0 and shim.stdout == module.stdout, shim.stderr[-2000:]
    assert all(f"  {stage} " in shim.stdout for stage in ("env", "exact", "sampling", "big", "profile", "embedded")), shim.stdout
