"""The per-machine tree size (dart_core/tools/calibrate/): the choice rule on hand-made tables, capped
drafters replaying as drafters built at that size, the τ tables and the forward-cost cache, and the
flags left to it."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from dart_core.cli import calibrate as calibrate_cli
from dart_core.cli.bench import parse_args
from dart_core.cli.options import drafter_args, drafter_configs, unset_sizes
from dart_core.drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD
from dart_core.drafters.config import DartConfig, DrafterConfigs, Eagle3Config
from dart_core.drafters.registry import build_drafter
from dart_core.tools import calibrate
from dart_core.tools.replay import record_greedy, replay

from support import tiny_target

PROMPTS = ["Write a short poem about a lighthouse keeper.", "List the planets of the solar system in order."]


def test_choice_maximises_expected_tokens_per_second():
    forward = {1: 9.0, 2: 9.5, 3: 10.0, 4: 11.0, 5: 12.0, 6: 13.0, 7: 19.0}  # the verify alone: for the table only
    tau = {1: 1.5, 2: 1.9, 3: 2.1, 4: 2.3, 5: 2.4, 6: 2.5}
    steps = {0: 10.0, 1: 11.5, 2: 12.0, 3: 13.0, 4: 14.0, 5: 15.0, 6: 21.0}  # the loop's step, plain at 0
    choice = calibrate.choose_max_nodes(forward, tau, steps)
    # by hand: n=3 -> 2.1/13=0.1615, n=4 -> 2.3/14=0.1643, n=5 -> 2.4/15=0.16, n=6 -> 2.5/21
    assert choice.max_nodes == 4 and choice.calibrated and choice.plain_tokens_per_s == pytest.approx(100.0)
    assert choice.table[3] == {"nodes": 4, "tau": 2.3, "verify_ms": 12.0, "step_ms": 14.0, "tokens_per_s": pytest.approx(1e3 * 2.3 / 14.0)}
    assert "4 drafted nodes" in choice.reason and "against plain decoding's 100" in choice.reason
    # a dearer step moves the choice down; sizes without a loop step are not considered
    assert calibrate.choose_max_nodes(forward, tau, {**steps, 4: 30.0}).max_nodes == 3
    assert calibrate.choose_max_nodes(forward, tau, {0: 10.0, 1: 11.5}).max_nodes == 1
    # no size beats plain decoding: still the fastest size (DART was asked for), and the reason says so
    slow = calibrate.choose_max_nodes(forward, tau, {0: 5.0, 1: 11.5, 2: 12.0})
    assert slow.max_nodes == 2 and "below plain decoding's 200" in slow.reason and "plain decoding is expected faster" in slow.reason
    with pytest.raises(ValueError):
        calibrate.choose_max_nodes(forward, tau, {0: 10.0})
    with pytest.raises(ValueError):  # no plain step to compare with
        calibrate.choose_max_nodes(forward, tau, {1: 11.5})


def test_only_sizes_that_could_win_are_timed_in_the_loop():
    forward = {1: 4.0, 2: 5.0, 3: 5.6, 4: 6.7, 5: 7.6, 9: 10.5, 11: 12.8}
    tau = {1: 1.57, 2: 1.90, 3: 2.13, 4: 2.28, 8: 2.62, 10: 2.73}
    # τ per verify ms: 0.314, 0.339, 0.318, 0.300, 0.250 (0.74 of the best), 0.213 (0.63): 10 is left out
    assert calibrate.loop_sizes(forward, tau, [1, 2, 3, 4, 8, 10]) == [1, 2, 3, 4, 8]
    assert calibrate.loop_sizes(forward, tau, [5]) == []  # no forward cost for 6 rows


def test_loop_steps_after_a_prefill_are_timed_once_it_has_settled(monkeypatch):
    """The steps right after a run's prefill are slower (docs/engine.md): a size's timed steps start
    after LOOP_WARMUP steps AND LOOP_SETTLE_S seconds of untimed ones, so a short step is not read
    with the prefill's after-effects (3 untimed steps read plain decoding ~15% slow)."""
    import importlib

    gen = importlib.import_module("dart_core.generate")  # the module (dart_core.generate is also the loop's function)

    slow, fast = [0.02] * 5, [0.004] * 40  # 0.1 s of slow steps, then the steady step

    def fake_generate(target, ids, drafter, params):
        yield gen.StepEvent(0, [1], 0, None, [], gen.StageTimes())
        for i, t in enumerate(slow + fast):
            yield gen.StepEvent(i + 1, [1], 0, object(), [0], gen.StageTimes(verify=t))

    class Target:
        def encode(self, messages):
            return [1, 2, 3]

    monkeypatch.setattr(gen, "generate", fake_generate)
    monkeypatch.setattr(calibrate.measure, "LOOP_WARMUP", 3)
    monkeypatch.setattr(calibrate.measure, "LOOP_SETTLE_S", 0.09)
    assert calibrate.loop_step_ms(Target(), None, [0], steps=6) == {0: pytest.approx(4.0)}
    monkeypatch.setattr(calibrate.measure, "LOOP_SETTLE_S", 0.0)  # by steps alone: the slow steps are read
    assert calibrate.loop_step_ms(Target(), None, [0], steps=6)[0] > 10.0


@pytest.mark.slow
def test_loop_steps_are_timed_in_the_loop_and_cached(embedded_bf16, fresh_cache, monkeypatch):
    monkeypatch.setattr(calibrate.measure, "ROUNDS", 1)
    monkeypatch.setattr(calibrate.measure, "LOOP_WARMUP", 1)
    monkeypatch.setattr(calibrate.measure, "LOOP_SETTLE_S", 0.0)
    drafter = build_drafter("dart", embedded_bf16, DartConfig(max_nodes=3))
    ms = calibrate.loop_step_ms(embedded_bf16, drafter, [0, 1, 3], steps=2)
    assert set(ms) == {0, 1, 3} and all(v > 0 for v in ms.values())
    with pytest.raises(ValueError):
        calibrate.loop_step_ms(embedded_bf16, None, [0, 2], steps=1)
    # calibrate_drafter times the loop once, then reads it back for the same drafter, host and weights
    monkeypatch.setattr(calibrate.measure, "MAX_CALIBRATED_ROWS", 3)
    monkeypatch.setattr(calibrate.measure, "REPEATS", 1)
    monkeypatch.setattr(calibrate.measure, "SETTLE_S", 0.0)
    monkeypatch.setattr(calibrate.measure, "LOOP_STEPS", 1)
    monkeypatch.setattr(calibrate.measure, "LOOP_SHORTLIST", 0.0)  # every size timed
    first = calibrate.calibrate_drafter(embedded_bf16, drafter, DEFAULT_DART_HEAD, fallback=5, threads=1)
    assert first.calibrated and [r["nodes"] for r in first.table] == [1, 2]
    monkeypatch.setattr(calibrate.measure, "loop_step_ms", lambda *a, **k: pytest.fail("timed again instead of read back"))
    again = calibrate.calibrate_drafter(embedded_bf16, drafter, DEFAULT_DART_HEAD, fallback=5, threads=1)
    assert [r["step_ms"] for r in again.table] == [r["step_ms"] for r in first.table] and again.max_nodes == first.max_nodes


@pytest.fixture(scope="module")
def records(embedded_bf16):
    return [record_greedy(embedded_bf16, p, 40) for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dart", "eagle3"])
def test_a_smaller_tree_size_replays_as_the_drafter_built_at_that_size(embedded_bf16, records, method):
    big = build_drafter(method, embedded_bf16, drafter_configs(drafter_args(max_nodes=12), True)[method])
    for n in (1, 3, 5, 8):
        built = build_drafter(method, embedded_bf16, drafter_configs(drafter_args(max_nodes=n), True)[method])
        for rec in records:
            a, b = replay(big, rec, n), replay(built, rec)
            assert a.accepted == b.accepted and a.tree_sizes == b.tree_sizes, (method, n)
            assert max(a.tree_sizes) <= n
    taus = calibrate.tau_by_size(big, records, [1, 5])
    assert 1.0 <= taus[1] <= taus[5]


def test_the_calibration_runs_where_a_verify_is_exact_and_its_cost_depends_on_the_tree(embedded_bf16, tiny_llama):
    """The CPU kernels: trees up to 16 nodes; the eager path on a CPU (its fixed forward pads every step
    to the same rows; beyond them not exact): not calibrated, the configs come back as they were. (On a
    CUDA GPU the fixed-shape forward calibrates up to 60 nodes: scripts/gpu_check.py.)"""
    from dart_core import kernels

    if kernels.AVAILABLE:
        assert calibrate.calibrated_rows(embedded_bf16) == calibrate.MAX_CALIBRATED_ROWS
    eager = tiny_target(tiny_llama.model_dir)
    eager.model.use_kernels = False
    assert calibrate.calibrated_rows(eager) == 0
    configs = drafter_configs(drafter_args(), True)
    assert calibrate.calibrate_unset_sizes(eager, configs, {"dart", "eagle3"}) == (configs, {})
    assert "gpu" not in calibrate.machine_key(embedded_bf16, 2)  # a CPU's key names no GPU (its cached files stay valid)


@pytest.mark.parametrize(
    "text, sizes", [("1-16", list(range(1, 17))), ("2,5,8", [2, 5, 8]), ("1-3,20,24,3", [1, 2, 3, 20, 24]), ("60", [60])]
)
def test_write_tau_sizes(text, sizes):
    assert calibrate_cli.parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["", "a-3", "0-4", "3,x", "-2"])
def test_write_tau_sizes_refused(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        calibrate_cli.parse_sizes(text)


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


def test_each_size_is_timed_after_its_own_forwards(monkeypatch):
    """A forward runs slower for tens of ms after a bigger one, so each row count runs untimed (at
    least twice) before its timed forwards, in ROUNDS passes over the counts."""
    calls = []

    class FakeCache:
        length = 0

        def commit(self, n):
            self.length += n

    class FakeTarget:
        device = torch.device("cpu")

        def new_cache(self, capacity):
            return FakeCache()

        def prefill(self, ids, cache, capture):
            pass

        def model(self, tokens, positions, cache):
            calls.append(len(tokens))

    monkeypatch.setattr(calibrate.measure, "SETTLE_S", 0.0)
    ms = calibrate.measure_forwards(FakeTarget(), [1, 4, 2], repeats=6)
    assert set(ms) == {1, 4, 2} and all(v >= 0 for v in ms.values())
    runs = [(k, len(list(g))) for k, g in itertools.groupby(calls)]
    per_round = -(-6 // calibrate.measure.ROUNDS)
    assert [k for k, _ in runs] == [1, 4, 2] * calibrate.measure.ROUNDS
    assert all(n == 2 + per_round for _, n in runs)  # two to settle, then the timed ones


@pytest.mark.slow
def test_forward_split_times_the_layers_and_the_head_inside_the_step(embedded_bf16, tiny_llama, monkeypatch):
    """kernels --split: the layers and the LM head are timed inside real one-token forwards, the rest
    is what is left of their wall time, the bytes are the step's, and the model times nothing after."""
    from dart_core.cli.kernels import split_line

    monkeypatch.setattr(calibrate.measure, "SPLIT_SETTLE_S", 0.0)
    s = calibrate.forward_split(embedded_bf16, forwards=4, prefix=16)
    assert s.layers_ms > 0 and s.head_ms > 0 and s.rest_ms > 0 and s.ms > s.layers_ms + s.head_ms
    model = embedded_bf16.model
    assert s.head_bytes == model.output.weight.nbytes
    assert s.layers_bytes + s.head_bytes + model.norm.weight.nbytes == model.step_weight_bytes()
    assert model.stage_seconds is None
    line = split_line("bfloat16", s, bandwidth=20.0)
    assert f"layers {s.layers_ms:.2f} ms ({s.layers_bytes / 1e6:.1f} MB at" in line
    assert line.endswith(f"the weights at 20.0 GB/s: {(s.layers_bytes + s.head_bytes) / 20e6:.2f} ms")
    monkeypatch.setattr(tiny_llama.model, "use_kernels", False)
    with pytest.raises(ValueError, match="eager torch"):
        calibrate.forward_split(tiny_llama, forwards=1, prefix=4)


def test_kernels_split_without_time_is_an_error(capsys):
    from dart_core.cli import kernels as kernels_cli

    with pytest.raises(SystemExit) as e:
        kernels_cli.main(["--split"])
    assert e.value.code == 2 and "give --time" in capsys.readouterr().err


@pytest.mark.slow
def test_forward_costs_are_cached_per_machine_and_weights(embedded_target, tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate.measure, "REPEATS", 2)  # real timings, fewer of them: the cache is under test
    monkeypatch.setattr(calibrate.measure, "SETTLE_S", 0.0)
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


def short_calibration(monkeypatch, rows: int) -> None:
    """The real calibration cut short: `rows` verify rows timed, 2 timings a size, one loop step after one untimed."""
    for name, value in (("MAX_CALIBRATED_ROWS", rows), ("REPEATS", 2), ("SETTLE_S", 0.0), ("ROUNDS", 1), ("LOOP_STEPS", 1),
                        ("LOOP_WARMUP", 1), ("LOOP_SETTLE_S", 0.0)):  # fmt: skip
        monkeypatch.setattr(calibrate.measure, name, value)


@pytest.mark.slow
def test_unset_sizes_are_calibrated_and_set_ones_kept(embedded_bf16, fresh_cache, tmp_path, monkeypatch):
    # the real calibration, cut to trees of up to 4 nodes, 2 timings a size and a short record: the wiring is under test
    short_calibration(monkeypatch, rows=5)
    args = parse_args(["--methods", "ar,dart,eagle3", "--dataset", "unused.jsonl", "--max-nodes", "7"])
    assert unset_sizes(args) == {"eagle3"}
    configs, choices = calibrate.calibrate_unset_sizes(embedded_bf16, drafter_configs(args, True), unset_sizes(args))
    assert configs.dart.max_nodes == 7 and "dart" not in choices  # given on the command line: kept
    assert choices["eagle3"].calibrated and configs.eagle3.max_nodes == choices["eagle3"].max_nodes
    assert 1 <= configs.eagle3.max_nodes <= calibrate.measure.MAX_CALIBRATED_ROWS - 1

    unset = drafter_configs(drafter_args(), True)
    assert calibrate.calibrate_unset_sizes(embedded_bf16, unset, {"dart"}, enabled=False) == (unset, {})  # --no-calibration

    # a head without a τ table keeps the device default, and says why; EAGLE3 then follows DART's size
    bare = tmp_path / "head"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).symlink_to(DEFAULT_EAGLE3_HEAD / f)
    args = parse_args(["--methods", "ar,eagle3", "--dataset", "unused.jsonl", "--eagle3-model", str(bare), "--max-nodes", "3"])
    configs, choices = calibrate.calibrate_unset_sizes(embedded_bf16, drafter_configs(args, True), {"eagle3"})
    choice = choices["eagle3"]
    assert not choice.calibrated and "no tree_sizes.json" in choice.reason and configs.eagle3.max_nodes == 3


# ------------------------------------------------------------------------------ the weights path (--dtype auto)


def _path(dtype, step_ms, tps, nodes=None):
    return {
        "dtype": dtype,
        "weights": dtype,
        "forward_ms": {1: step_ms, 2: step_ms * 1.1},
        "measured_at": "now",
        "plain_tokens_per_s": 1e3 / step_ms,
        "dart": None if nodes is None else {"max_nodes": nodes},
        "tokens_per_s": tps,
    }


def test_weights_are_ranked_by_expected_dart_speed_else_by_the_step():
    # DART's rule: the faster step loses when its verify rows cost more (the GGUF-on-AVX2 case)
    choice = calibrate.rank_weights([_path("gguf", 10.0, 80.0, 1), _path("bfloat16", 15.0, 95.0, 4)], "dart")
    assert choice.dtype == "bfloat16" and choice.calibrated and choice.rule == "dart"
    assert "95 tok/s at 4 drafted nodes" in choice.reason and "gguf's 80 tok/s at 1 drafted nodes" in choice.reason
    assert [p["chosen"] for p in choice.paths] == [False, True] and choice.path("bfloat16")["chosen"]
    plain = calibrate.rank_weights([_path("gguf", 10.0, 100.0), _path("bfloat16", 15.0, 66.7)], "plain", "no DART head at x")
    assert plain.dtype == "gguf" and "10.0 ms" in plain.reason and "no DART head at x" in plain.reason
    with pytest.raises(ValueError):
        calibrate.rank_weights([], "dart")


def test_auto_is_bfloat16_where_nothing_is_measured():
    from dart_core import kernels

    cases = [
        ("org/other", "cpu", True, False, "not the embedded default"),
        ("default", "cpu", False, False, "--eager"),
        ("default", "cuda", True, False, "on cuda"),
    ]
    if kernels.AVAILABLE:
        cases.append(("default", "cpu", True, True, "--no-calibration"))
        assert calibrate.fixed_weights("default", "cpu", True) is None  # measured
    for model, device, use_kernels, no_calibration, why in cases:
        choice = calibrate.fixed_weights(model, device, use_kernels, no_calibration)
        assert choice.dtype == "bfloat16" and not choice.calibrated and not choice.paths and why in choice.reason


def test_auto_needs_an_explicit_dtype_to_write_tau():
    with pytest.raises(SystemExit):
        calibrate_cli.main(["--write-tau", "dart", "--dataset", "unused.jsonl"])
    assert parse_args(["--dataset", "unused.jsonl"]).dtype == "auto"  # the bench's default


@pytest.mark.slow
def test_auto_measures_each_path_once_and_caches_the_choice(fresh_cache, embedded_on, monkeypatch):
    from dart_core import kernels

    if not kernels.AVAILABLE:
        pytest.skip("GGUF weights need the CPU kernels")
    # choose_weights loads each candidate path on each call (five GGUF loads below, seconds each to parse
    # the file): they come from the session's loads (embedded_on), the measuring and caching under test
    # run as they are
    real = calibrate_load_target()

    def shared(model, device, dtype, kernels=True):
        if (model, device, kernels) == ("default", "cpu", True):
            return embedded_on(dtype)
        return real(model, device, dtype, kernels=kernels)

    monkeypatch.setattr("dart_core.target.load_target", shared)
    # the real measurement, cut to trees of up to 3 nodes, 2 timings a size and a short record: the wiring is under test
    short_calibration(monkeypatch, rows=4)
    monkeypatch.setattr(calibrate.measure, "LOOP_SHORTLIST", 0.0)  # every size timed
    said = []
    target, choice, dart = calibrate.choose_weights("default", "cpu", True, threads=1, log=said.append)
    assert choice.calibrated and choice.rule == "dart" and not choice.from_cache
    assert [p["dtype"] for p in choice.paths] == list(calibrate.WEIGHTS_CANDIDATES)
    best = max(choice.paths, key=lambda p: p["tokens_per_s"])
    assert best["chosen"] and best["dtype"] == choice.dtype and target.weights == best["weights"]
    assert dart is not None and dart.calibrated and 1 <= dart.max_nodes <= 3 and best["dart"]["max_nodes"] == dart.max_nodes
    for p in choice.paths:  # each path's own forward costs and loop steps, plain decoding's from the loop too
        assert set(p["forward_ms"]) == {1, 2, 3, 4} and [r["nodes"] for r in p["dart"]["table"]] == [1, 2, 3]
        assert all(r["step_ms"] > 0 for r in p["dart"]["table"]) and p["plain_tokens_per_s"] == p["dart"]["plain_tokens_per_s"]
    assert sum("timing the generation loop's steps" in m for m in said) == len(calibrate.WEIGHTS_CANDIDATES)
    # a second start reads the choice back and loads only the chosen path
    loads = []
    real = calibrate_load_target()
    monkeypatch.setattr("dart_core.target.load_target", lambda *a, **k: loads.append(a[2]) or real(*a, **k))
    again_target, again, again_dart = calibrate.choose_weights("default", "cpu", True, threads=1)
    assert again.from_cache and again.dtype == choice.dtype and again.paths == choice.paths
    assert loads == [choice.dtype] and again_target.weights == target.weights and again_dart == dart
    # other DART flags are another choice (its drafting costs differ): measured again
    no_ngram = DartConfig(use_ngram=False)
    assert not calibrate.choose_weights("default", "cpu", True, no_ngram, threads=1)[1].from_cache
    # the tree size timed while choosing is DART's size, not timed again
    configs, sizes = calibrate.calibrate_unset_sizes(again_target, DrafterConfigs(), {"dart"}, known={"dart": again_dart})
    assert sizes["dart"] is again_dart and configs.dart.max_nodes == dart.max_nodes


def calibrate_load_target():
    from dart_core.target import load_target

    return load_target


@pytest.mark.slow
def test_write_tau_measures_a_named_head_and_writes_beside_it(tmp_path, embedded_on):
    """The shipped tables' command end to end, small: a copy of the embedded EAGLE3 head, one prompt,
    two sizes. The table lands beside the named head (not in assets/) and equals the replay's τ."""
    import shutil

    from dart_core import kernels

    if not kernels.AVAILABLE:
        pytest.skip("the shipped tables were measured on the GGUF path, which needs the CPU kernels")
    head = tmp_path / "head"
    head.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DEFAULT_EAGLE3_HEAD / name, head / name)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": [PROMPTS[0]]}) + "\n")
    shipped = (DEFAULT_EAGLE3_HEAD / calibrate.TAU_FILE).read_text()
    args = ["--dtype", "gguf", "--write-tau", "eagle3", "--eagle3-model", str(head), "--dataset", str(questions)]
    assert calibrate_cli.main([*args, "--skip", "0", "--limit", "1", "--max-new-tokens", "12", "--sizes", "1,3", "--threads", "1"]) == 0
    table = json.loads((head / calibrate.TAU_FILE).read_text())
    assert (DEFAULT_EAGLE3_HEAD / calibrate.TAU_FILE).read_text() == shipped
    assert table["method"] == "eagle3" and set(table["tau"]) == {"1", "3"} and "--eagle3-model" in table["command"]
    target = embedded_on("gguf")
    record = record_greedy(target, [{"role": "user", "content": PROMPTS[0]}], 12)
    drafter = build_drafter("eagle3", target, Eagle3Config(head=str(head), max_nodes=3))
    assert table["tau"]["3"] == round(calibrate.tau_by_size(drafter, [record], [3])[3], 4) and table["tau"]["1"] >= 1.0
    with pytest.raises(SystemExit):  # a head that is not a directory gets a clear error, not a table elsewhere
        calibrate_cli.main([*args[:4], "--eagle3-model", str(tmp_path / "missing")])
