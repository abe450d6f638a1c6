"""scripts/benchmark_report.py's bookkeeping on stored cells (the bench runs themselves are covered
by tests/test_bench.py): finished cells are read, not re-run; the document and the README's headline
block are written from them; sections of other devices are kept."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("benchmark_report", ROOT / "scripts" / "benchmark_report.py")
report = importlib.util.module_from_spec(spec)
sys.modules["benchmark_report"] = report  # dataclasses look their module up
spec.loader.exec_module(report)


def method(tps: float, ar_tps: float, tau=None, hist=None) -> dict:
    spec = tau is not None
    return {
        "tokens_per_s": tps, "tau": tau, "speedup_vs_ar": tps / ar_tps, "new_tokens": 40, "wall_s": 40 / tps, "steps": 20 if spec else None,
        "draft_ms": 3.0 if spec else None, "prune_ms": 0.1 if spec else None, "verify_ms": 30.0 if spec else None, "other_ms": 1.0 if spec else None,
        "accept_hist": hist, "acceptance_by_depth": None,
    }  # fmt: skip


def fake_cell(cell, speed: float) -> dict:
    ar = 20.0
    methods = {"ar": method(ar, ar, 1.0, [40])}
    for m in cell.methods:
        if m in ("eagle3", "dart"):
            methods[m] = method(ar * speed, ar, 2.0, [5, 10, 5])
        elif m != "ar":
            methods[m] = method(ar * 0.9, ar)
    env = {"device": "cpu", "threads": 2, "gpu": None, "cpu": "Test CPU", "model": "default", "dtype": "bfloat16", "torch": "x",
           "transformers": "y", "python": "3.11", "git_commit": "abc", "max_new_tokens": 8}  # fmt: skip
    return {"env": env, "methods": methods, "samples": [{"question_id": 0, "method": m, "output_ids": []} for m in cell.methods]}


def test_report_from_stored_cells(tmp_path, monkeypatch):
    work = tmp_path / "work"
    out = tmp_path / "docs" / "benchmarks.md"
    argv = ["--limit", "1", "--max-new-tokens", "8", "--work", str(work), "--out", str(out), "--datasets", "mt_bench", "gsm8k"]
    args = report.parse_args(argv)
    work.mkdir()
    for i, cell in enumerate(report.plan(args)):
        (work / f"{cell.name}.json").write_text(json.dumps(fake_cell(cell, 1.5 + 0.5 * (i % 2))))
    monkeypatch.setattr(report.subprocess, "run", lambda *a, **k: pytest.fail("a stored cell was re-run"))
    monkeypatch.setattr(report, "_can_write_png", lambda: False)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nold\n{report.README_END}\nrest\n")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    out.parent.mkdir()
    out.write_text(report.HEADER + "\n<!-- report:cuda:start -->\nGPU numbers\n<!-- report:cuda:end -->\n")
    assert report.main(argv + ["--readme"]) == 0
    doc = out.read_text()
    assert "GPU numbers" in doc and doc.count("<!-- report:cpu:start -->") == 1
    # mt_bench t0 is the first cell (speed 1.5), gsm8k t0 the second (2.0): mean 1.75x for dart and eagle3
    assert "| **mean** | 0.90x | 0.90x | 1.75x | 1.75x | 20.0 |" in doc
    assert "**tree size**" in doc and "**CPU threads**" in doc and "### Temperature 1" in doc
    assert "| dart | 3.00 (9%) | 0.10 (0%) | 30.00 (88%) | 1.00 (3%) | 34.10 | 40 |" in doc
    assert "| dart | 0.75 | 0.25 |" in doc  # P(accept >= 1) = 15/20, P(>= 2) = 5/20
    assert (out.parent / "figures" / "cpu-speedup.html").is_file()
    text = readme.read_text()
    assert "old" not in text and "| dart | 1.75x | 2.00 |" in text and text.startswith("intro") and text.endswith("rest\n")
    assert report.main(argv) == 0 and out.read_text().count("<!-- report:cpu:start -->") == 1  # rewriting replaces the section
