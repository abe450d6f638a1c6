"""dart-curve: the curve tables from a run's history and bench points, and the README block."""

from __future__ import annotations

import json

import pytest

from dart_core.cli import curve as mod


@pytest.fixture()
def curve(tmp_path, monkeypatch):
    monkeypatch.setattr(mod, "CURVE_DIR", tmp_path / "training")
    monkeypatch.setattr(mod, "POINTS", tmp_path / "training" / "points.jsonl")
    monkeypatch.setattr(mod, "README", tmp_path / "README.md")
    (tmp_path / "training").mkdir()
    return mod


def test_tables_show_every_eval_and_bench_point(curve, tmp_path):
    history = [
        {"step": 250, "train_loss": 4.5, "val_kl": 4.685, "val_hit1": [0.276, 0.073, 0.05], "elapsed_s": 180.0},
        {"step": 500, "train_loss": 3.9, "val_kl": 3.9, "val_hit1": [0.35, 0.1, 0.07], "elapsed_s": 360.0},
        {"step": 750, "train_loss": 3.8, "val_kl": 3.7, "val_hit1": [0.36, 0.11], "elapsed_s": 450.0},  # resumed with fewer rows
    ]
    (tmp_path / "training" / "dart-v1.history.json").write_text(json.dumps(history))
    point = {
        "label": "dart-v1",
        "method": "dart",
        "step": 500,
        "train_hours": 0.1,
        "tau": 2.5,
        "tau_by_set": {s: 2.0 + i / 10 for i, s in enumerate(curve.BENCH_SETS)},
        "limit": 5,
        "max_new_tokens": 128,
        "max_nodes": 5,
        "commit": "abc1234",
    }
    tuned = {**point, "step": 750, "weights": "embedded"}  # the old point has no "weights": upstream's
    (tmp_path / "training" / "points.jsonl").write_text(json.dumps(point) + "\n" + json.dumps(tuned) + "\n")
    text = curve.tables()
    assert "| 250 | 0.05 | 4.685 | 27.6% | 7.3% | 5.0% |" in text
    assert "| 500 | 0.10 | 3.900 | 35.0% | 10.0% | 7.0% |" in text
    assert "| 750 | 0.12 | 3.700 | 36.0% | 11.0% | – |" in text
    assert "| 500 | 0.10 | 5 | upstream | 2.50 | 2.00 | 2.10 | 2.20 | 2.30 | 2.40 | 2.50 | 5 | 128 |" in text
    assert "| 750 | 0.10 | 5 | embedded | 2.50 |" in text
    for table in text.split("\n\n"):  # every table's separator has one cell per header cell
        lines = [line for line in table.splitlines() if line.startswith("|")]
        if lines:
            assert lines[1].count("|---") == lines[0].count("|") - 1, table


def test_readme_block_is_rewritten_in_place_and_needs_its_markers(curve, tmp_path):
    (tmp_path / "training" / "dart-v1.history.json").write_text(
        json.dumps([{"step": 1, "val_kl": 1.0, "val_hit1": [0.5], "elapsed_s": 36.0}])
    )
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{curve.MARK_START}\nold\n{curve.MARK_END}\nafter\n")
    assert curve.main(["table", "--readme"]) == 0
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith(f"{curve.MARK_END}\nafter\n") and "old" not in text
    assert "| 1 | 0.01 | 1.000 | 50.0% |" in text
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit):
        curve.main(["table", "--readme"])


def test_the_head_snapshot_carries_the_step_it_was_copied_at(curve, tmp_path, monkeypatch):
    import torch

    run = tmp_path / "run"
    (run / "train" / "head").mkdir(parents=True)
    (run / "train" / "head" / "config.json").write_text("{}")
    torch.save({"step": 40, "elapsed_s": 7200.0}, run / "train" / "checkpoint.pt")
    assert curve.snapshot_head(run, tmp_path / "copy") == (40, 2.0)
    assert (tmp_path / "copy" / "config.json").read_text() == "{}"
    states = iter([(40, 2.0), (41, 2.1)] * 5)  # a checkpoint lands during every copy
    monkeypatch.setattr(curve, "run_state", lambda run: next(states))
    monkeypatch.setattr(curve.time, "sleep", lambda s: None)
    with pytest.raises(SystemExit, match="kept changing"):
        curve.snapshot_head(run, tmp_path / "copy")


def test_a_saved_head_is_a_point_at_its_trained_step(curve, tmp_path):
    """`point --head DIR` benches a head saved earlier (a milestone) at the step and hours of its
    trained.json, and leaves the run's history alone; a head without the file has no place on the curve."""
    import shutil

    from support import EMBEDDED_EAGLE3_HEAD, committed_asset

    committed_asset(EMBEDDED_EAGLE3_HEAD / "config.json")
    head = tmp_path / "head"
    shutil.copytree(EMBEDDED_EAGLE3_HEAD, head)
    (head / "trained.json").write_text('{"run": "r", "step": 1234, "elapsed_s": 5400.0}')
    data = tmp_path / "bench"
    data.mkdir()
    for s in curve.BENCH_SETS:
        (data / f"{s}.jsonl").write_text(json.dumps({"question_id": 1, "turns": [f"Say one word about {s}."]}) + "\n")
    args = ["point", "--head", str(head), "--label", "e3", "--method", "eagle3", "--data", str(data), "--limit", "1",
            "--max-new-tokens", "6", "--max-nodes", "2", "--dtype", "float32", "--threads", "1"]  # fmt: skip
    assert curve.main(args) == 0
    rec = json.loads(curve.POINTS.read_text().splitlines()[-1])
    assert (rec["label"], rec["step"], rec["train_hours"], rec["max_nodes"]) == ("e3", 1234, 1.5, 2)
    assert set(rec["tau_by_set"]) == set(curve.BENCH_SETS) and rec["tau"] >= 1.0
    assert rec["command"].startswith("dart-curve point --head HEAD --label e3 --method eagle3")
    assert not (curve.CURVE_DIR / "e3.history.json").exists()
    (head / "trained.json").unlink()
    with pytest.raises(SystemExit, match="no trained.json"):
        curve.main(args)
