"""The per-machine tree size (dart_core/calibrate.py): the choice rule on hand-made tables, capped
drafters replaying as drafters built at that size, the τ tables and the forward-cost cache, and the
flags left to it."""

from __future__ import annotations

import json

import pytest

from dart_core import calibrate
from dart_core.bench import parse_args
from dart_core.drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD
from dart_core.drafters.registry import build_drafter, drafter_args
from dart_core.replay import record_greedy, replay

PROMPTS = ["Write a short poem about a lighthouse keeper.", "List the planets of the solar system in order."]


def test_choice_maximises_expected_tokens_per_second():
    forward = {1: 10.0, 2: 10.5, 3: 11.0, 4: 12.0, 5: 13.0, 6: 14.0, 7: 20.0}
    tau = {1: 1.5, 2: 1.9, 3: 2.1, 4: 2.3, 5: 2.4, 6: 2.5}
    draft = {n: 1.0 for n in tau}
    choice = calibrate.choose_max_nodes(forward, tau, draft)
    # by hand: n=3 -> 2.1/(12+1)=0.1615, n=4 -> 2.3/(13+1)=0.1643, n=5 -> 2.4/(14+1)=0.16, n=6 -> 2.5/21
    assert choice.max_nodes == 4 and choice.calibrated
    assert choice.table[3]["tokens_per_s"] == pytest.approx(1e3 * 2.3 / 14.0)
    assert "4 drafted nodes" in choice.reason and "plain decoding's 100" in choice.reason
    # a dearer verify moves the choice down; sizes without a forward cost are not considered
    assert calibrate.choose_max_nodes({**forward, 5: 30.0}, tau, draft).max_nodes == 3
    assert calibrate.choose_max_nodes({1: 10.0, 2: 10.5}, tau, draft).max_nodes == 1
    with pytest.raises(ValueError):
        calibrate.choose_max_nodes({1: 10.0}, tau, draft)


@pytest.fixture(scope="module")
def records(embedded_bf16):
    return [record_greedy(embedded_bf16, p, 40) for p in PROMPTS]


@pytest.mark.parametrize("method", ["dart", "eagle3"])
def test_capped_drafter_replays_as_the_drafter_built_at_that_size(embedded_bf16, records, method):
    big = build_drafter(method, embedded_bf16, drafter_args(max_nodes=12, eagle3_max_nodes=12), True)
    for n in (1, 3, 5, 8):
        built = build_drafter(method, embedded_bf16, drafter_args(max_nodes=n, eagle3_max_nodes=n), True)
        for rec in records:
            a, b = replay(calibrate.SizeCapped(big, n), rec), replay(built, rec)
            assert a.accepted == b.accepted and a.tree_sizes == b.tree_sizes, (method, n)
            assert max(a.tree_sizes) <= n
    taus = calibrate.tau_by_size(big, records, [1, 5])
    assert 1.0 <= taus[1] <= taus[5]


def test_tau_tables(tmp_path):
    assert calibrate.read_tau_table(tmp_path) is None  # no file: no calibration, not an error
    assert calibrate.read_tau_table(None) is None
    (tmp_path / calibrate.TAU_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="tree_sizes.json"):
        calibrate.read_tau_table(tmp_path)
    (tmp_path / calibrate.TAU_FILE).write_text(json.dumps({"tau": {"3": 0.5}}))
    with pytest.raises(ValueError, match=">= 1"):
        calibrate.read_tau_table(tmp_path)
    (tmp_path / calibrate.TAU_FILE).write_text(json.dumps({"tau": {"3": 2.0, "1": 1.5}}))
    assert calibrate.read_tau_table(tmp_path) == {1: 1.5, 3: 2.0}
    for head in (DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD):  # the shipped tables are readable and cover the CPU sizes
        table = calibrate.read_tau_table(head)
        assert table is not None and set(range(1, 9)) <= set(table)


def test_forward_costs_are_cached_per_machine_and_weights(embedded_target, tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "REPEATS", 2)  # real timings, fewer of them: the cache is under test
    first = calibrate.forward_costs(embedded_target, threads=1, rows=3)
    assert not first.from_cache and set(first.ms) == {1, 2, 3} and all(v > 0 for v in first.ms.values())
    again = calibrate.forward_costs(embedded_target, threads=1, rows=3)
    assert again.from_cache and again.ms == first.ms
    assert not calibrate.forward_costs(embedded_target, threads=1, rows=3, refresh=True).from_cache
    assert not calibrate.forward_costs(embedded_target, threads=2, rows=3).from_cache  # another key
    files = list((tmp_path / "calibration").glob("forwards-*.json"))
    assert len(files) == 2
    for f in files:
        f.write_text("{damaged")
    assert not calibrate.forward_costs(embedded_target, threads=1, rows=3).from_cache  # measured again, not trusted


def test_unset_sizes_are_calibrated_and_set_ones_kept(embedded_bf16, tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))
    # the real calibration, cut to trees of up to 4 nodes, 2 timings a size and a short record: the wiring is under test
    monkeypatch.setattr(calibrate, "MAX_CALIBRATED_ROWS", 5)
    monkeypatch.setattr(calibrate, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "OVERHEAD_TOKENS", 16)
    args = parse_args(["--methods", "ar,dart,eagle3", "--dataset", "unused.jsonl", "--max-nodes", "7"])
    choices = calibrate.calibrate_unset_sizes(embedded_bf16, args, {"dart", "eagle3"}, True)
    assert args.max_nodes == 7 and "dart" not in choices  # given on the command line: kept
    assert choices["eagle3"].calibrated and args.eagle3_max_nodes == choices["eagle3"].max_nodes
    assert 1 <= args.eagle3_max_nodes <= calibrate.MAX_CALIBRATED_ROWS - 1

    args = parse_args(["--methods", "ar,dart", "--dataset", "unused.jsonl", "--no-calibration"])
    assert calibrate.calibrate_unset_sizes(embedded_bf16, args, {"dart"}, True) == {} and args.max_nodes is None

    # a head without a τ table keeps the device default, and says why; EAGLE3 then follows DART's size
    bare = tmp_path / "head"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).symlink_to(DEFAULT_EAGLE3_HEAD / f)
    args = parse_args(["--methods", "ar,eagle3", "--dataset", "unused.jsonl", "--eagle3-model", str(bare)])
    choice = calibrate.calibrate_unset_sizes(embedded_bf16, args, {"eagle3"}, True)["eagle3"]
    assert not choice.calibrated and "no tree_sizes.json" in choice.reason and args.eagle3_max_nodes is None
