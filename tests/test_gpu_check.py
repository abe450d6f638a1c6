"""scripts/gpu_check.py, the device check of the GPU path, run here on the CPU at toy sizes: every
stage runs and writes its JSON, and on the CPU kernels its exactness figures are all n/n (the
kernels' contract), so the script cannot rot between the sessions that get a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.mark.slow  # every stage at toy sizes in a subprocess
def test_gpu_check_runs_on_the_cpu_and_reports_exactness(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--device", "cpu", "--small", "--stages", "env,exact,sampling,big"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    stages = data["stages"]
    assert set(stages) == {"env", "exact", "sampling", "big"}
    assert stages["env"]["copy_gb_s"] > 0
    rows = stages["exact"]["rows"]
    assert {(r["arch"], r["dtype"]) for r in rows} == {
        (a, d) for a in ("llama", "qwen2", "qwen3") for d in ("bfloat16", "float16", "float32")
    }
    for r in rows:
        assert r["dart_ids_equal"] == r["prompts"] and r["eagle3_ids_equal"] == r["prompts"], r
        assert r["verify_bitwise_equal"] == r["verify_nodes"], r  # the CPU kernels: verify == steps, bit for bit
    assert all(r["passed"] for r in stages["sampling"]["rows"])
    big = stages["big"]
    assert big["verify_vs_steps"]["bitwise_equal"] == big["verify_vs_steps"]["nodes"]
    assert set(big["verify"]) == {"512", "4096"} and set(big["drafting_60"]) == {"dart", "eagle3"}
    assert big["drafting_60"]["dart"]["nodes"] == 60
    assert set(big["loop"]) == {"ar", "dart", "eagle3"}
    assert "--- big" in (out / "gpu_check.log").read_text()


def test_gpu_check_refuses_unknown_stages(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--stages", "env,warp"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown stages ['warp']" in proc.stderr
