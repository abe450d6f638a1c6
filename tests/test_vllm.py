"""DART inside vLLM, for real: vLLM's CPU build in the venv `make vllm` builds (dart_vllm/env.py), with
this checkout's plugin. `make test` builds that venv first and `.ci/run` runs these tests, so a
missing venv is a failure here, not a skip. Each vLLM engine start costs tens of seconds on 2 cores:
one bench run starts three, the server one, the app's compare turn one."""

from __future__ import annotations

import html
import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

from dart_vllm import env

from support import EMBEDDED_DART_HEAD, ROOT, committed_asset

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ROOT / "assets" / "eval_prompts.jsonl"


@pytest.fixture(scope="module")
def vllm_python():
    info = env.probe(env.venv_python())  # EnvError (a failure) where `make vllm` has not run
    assert env.ready(info) is None, f"the vLLM venv is not ready: {env.ready(info)} (run `make vllm`)"
    return env.venv_python()


def test_make_vllm_is_idempotent(vllm_python):
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "dart-vllm-env")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ready:" in proc.stdout and "building" not in proc.stdout
    assert time.perf_counter() - t0 < 120  # a check, not a build


@pytest.fixture(scope="module")
def bench(vllm_python, tmp_path_factory):
    """One bench run: our plain decoding and vLLM's plain, EAGLE3 and DART rows, 3 held-out prompts x 48 tokens."""
    out = tmp_path_factory.mktemp("vllm") / "bench.json"
    cmd = [str(ROOT / ".venv" / "bin" / "dart-bench"), "--methods", "ar,vllm,vllm-eagle3@3,vllm-dart@3", "--dataset", str(PROMPTS)]
    cmd += ["--limit", "3", "--max-new-tokens", "48", "--dtype", "float32", "--threads", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def _ids(run, method):
    return [s["output_ids"] for s in run["samples"] if s["method"] == method]


def test_the_bench_has_vllm_rows_with_their_counters(bench):
    run, table = bench
    for m in ("vllm", "vllm-eagle3@3", "vllm-dart@3"):
        assert m in run["methods"] and f"| {m} |" in table
    assert run["env"]["vllm"]["version"] == env.VLLM_VERSION
    dart = run["methods"]["vllm-dart@3"]
    assert dart["tau"] > 1.0  # DART's drafts were accepted inside vLLM
    assert run["methods"]["vllm"]["tau"] == 1.0


def test_vllm_dart_greedy_ids_are_vllms_own(bench):
    """Greedy fidelity: vllm-dart's ids equal vLLM's plain decoding's wherever vllm-eagle3's do (vLLM
    verifies with other shapes than it decodes with, so a near-tie may round either way; ours and
    EAGLE3's parting from plain on the same prompt is that, not the plugin)."""
    run, _ = bench
    plain, eagle3, dart = (_ids(run, m) for m in ("vllm", "vllm-eagle3@3", "vllm-dart@3"))
    assert len(plain) == len(dart) == 3
    for p, e, d in zip(plain, eagle3, dart):
        if e == p:
            assert d == p
    # the bench's own account of it: the counts, and vLLM plain's top-2 logit gap at every new token
    fidelity = run["vllm_fidelity"]
    assert fidelity["same_as_vllm"]["vllm-dart@3"] == f"{sum(d == p for p, d in zip(plain, dart))}/3"
    assert run["methods"]["vllm-dart@3"]["same_as_vllm"] == fidelity["same_as_vllm"]["vllm-dart@3"]
    for s in run["samples"]:
        if s["method"] == "vllm":
            assert len(s["top2_gaps"]) == len(s["output_ids"]) and all(g >= 0 for g in s["top2_gaps"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_with_the_plugin_answers_a_completion(vllm_python, tmp_path):
    """`vllm serve` (the OpenAI-compatible server) with a DART head: a completion request is answered,
    and vLLM's own counters show DART's drafts proposed and accepted."""
    from dart_core.loading import ensure_embedded_model

    committed_asset(EMBEDDED_DART_HEAD)
    port = _free_port()
    spec = json.dumps({"method": "eagle3", "model": str(EMBEDDED_DART_HEAD), "num_speculative_tokens": 3, "parallel_drafting": True})
    cmd = [str(vllm_python.parent / "vllm"), "serve", str(ensure_embedded_model()), "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30)]
    cmd += ["--speculative-config", spec, "--served-model-name", "smollm2"]
    log = (tmp_path / "serve.log").open("w")
    environ = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    environ.pop("PYTHONPATH", None)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "vllm serve did not come up in 600 s:\n" + (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(2)
        body = json.dumps({"model": "smollm2", "prompt": "The three primary colours are", "max_tokens": 32, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"].strip(), answer
        assert answer["usage"]["completion_tokens"] > 0
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        counts = {
            name: float(line.split()[-1])
            for line in metrics.splitlines()
            if not line.startswith("#")
            for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")
            if line.startswith(name)
        }
        assert counts.get("vllm:spec_decode_num_drafts_total", 0) > 0 and counts.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, (
            counts
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_the_apps_compare_turn_has_the_vllm_row(vllm_python, embedded_target):
    """--compare-vllm vllm-dart@2 end to end: the app starts the engine with the DART head, a greedy
    compare turn (AR, then vLLM's DART chain) through the app's own handler gives the vLLM row, with
    vLLM's text in its pane and its ids = AR's (the embedded float32 target: both compute in fp32)."""
    from app import render
    from app.engine import Engine, PeerResult
    from app.launch import load_vllm_peers, parse_args
    from app.ui import DemoApp, Settings
    from dart_core.cli.options import drafter_configs

    args = parse_args(["--compare-vllm", "vllm-dart@2"])
    engine = Engine(embedded_target, {}, max_new_tokens=24)
    notes = []
    found, line = engine.compute.run(load_vllm_peers, args, embedded_target, drafter_configs(args, True), notes, lambda _: None)
    try:
        assert not notes and [p.method for p in found] == ["vllm-dart@2"] and "Compare mode ends with vLLM DART (plugin)@2" in line
        engine.peers = {p.method: p for p in found}
        app = DemoApp(engine, Settings("embedded", 24, compare=True, pruner=None, exact=True, peers_line=line))
        app.build()
        turn = app.stops.arm("test")
        frames = list(app.respond(turn, "Name three colours.", [], [], "ar", True, True, 0.0, 1.0, 0, 24))
        assert any("running vLLM…" in f[app.panes] for f in frames[:-1])
        ar, peer = frames[-1][app.runs]
        assert isinstance(peer, PeerResult) and peer.error is None, peer.error
        assert 1 <= peer.new_tokens <= 24 and peer.engine_s > 0 and peer.peer.drafted > 0
        assert peer.output_ids == ar.output_ids and html.escape(peer.text) in render.compare_html([peer], [None], [])
    finally:
        for p in found:
            p.runner.close()
