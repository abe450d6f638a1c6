"""The Gradio app end to end, on a real server in a subprocess: the /generate API through
gradio_client, malformed requests, two clients at once, a cancelled request, and a headless-Chromium
session that chats, sees text stream in and the draft tree drawn, stops a request and goes on.
The browser tests send a prompt only once the app has unlocked its prompt box (app.screenshot.send):
a Send clicked while Gradio still counts the last turn as pending is dropped without a word.

The server runs the embedded target in bfloat16 on the batch-invariant CPU kernels (float32 where
they are not built): either way every method's greedy text equals plain decoding's token for token,
and the compare table must say so. It runs the embedded EAGLE3 head (with a smaller tree, to keep the test
cheap); without one, a wiring fixture stands in: the embedded DART head's weights in the EAGLE3 format
(the same layer without the mask embedding), so the compare path and the API still run a real EAGLE3
drafter, whose speed and acceptance then mean nothing. The server starts without llama.cpp flags: where
`make peers` has built llama.cpp, compare mode ends with its row by default and the browser test checks
it (tests/test_app_llamacpp.py covers the rest of it); elsewhere the header says why there is none.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.engine import MIN_REFERENCE_TOKENS
from app.screenshot import CHROMIUM, DONE_JS, LOCKED_JS, launch, open_app, send, send_and_wait
from dart_core import kernels
from dart_core.cli import installed_command
from dart_core.tools import peers

from support import committed_asset, eagle3_fixture_head

# a real server with the embedded target in a subprocess: minutes on 2 cores
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DART_HEAD = ROOT / "assets" / "dart"
HAVE_DART = (DART_HEAD / "config.json").exists()
HAVE_EAGLE3 = (ROOT / "assets" / "eagle3" / "config.json").exists()
METHODS = ["dart", "eagle3", "ar"] if HAVE_DART else ["ar"]
MAX_NEW = 12  # tokens per test request: enough for several multi-token steps, cheap on 2 CPU cores
SERVER_MAX_NEW = 512  # long enough that a Stop or cancel always lands before a long answer ends, even on the fast kernels
START_TIMEOUT_S = 240
DTYPE = "bfloat16" if kernels.AVAILABLE else "float32"  # exact greedy texts need the kernels in bf16
KEYS = {"text", "new_tokens", "tau", "tokens_per_s", "speedup_vs_ar", "tree_size", "first_token_s", "reused_tokens", "done"}


def llamacpp_reason() -> str | None:
    """Why the app's default llama.cpp row cannot run here (None: it runs)."""
    from dart_core.loading import embedded_gguf_path

    try:
        return peers.unavailable("llamacpp", peers.resolve_bin_dir(None), embedded_gguf_path())
    except FileNotFoundError as e:
        return str(e)


HAVE_LLAMACPP = llamacpp_reason() is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the committed heads: without them METHODS would shrink to ["ar"] and the compare checks pass vacuously
    committed_asset(DART_HEAD / "config.json")
    committed_asset(ROOT / "assets" / "eagle3" / "config.json")
    port = free_port()
    cmd = [
        *installed_command("dart-app"),
        "--dtype",
        DTYPE,
        "--server-port",
        str(port),
        "--max-new-tokens",
        str(SERVER_MAX_NEW),
        "--no-warmup",
    ]
    if HAVE_DART:
        if not HAVE_EAGLE3:  # the embedded EAGLE3 head is the app's default when it is there
            cmd += ["--eagle3-model-name-or-path", str(eagle3_fixture_head(tmp_path_factory.mktemp("heads") / "eagle3"))]
        cmd += ["--eagle3-depth", "4", "--eagle3-top-k", "4"]
    log_path = tmp_path_factory.mktemp("server") / "app.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
        )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            if time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"the app did not start in {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client

    return Client(server, verbose=False)


def generate(client, message, method="ar", max_new=MAX_NEW, temperature=0.0, top_p=1.0, top_k=0, tree_size=None) -> dict:
    return client.predict(message, method, max_new, temperature, top_p, top_k, tree_size, api_name="/generate")


def test_generate_endpoint(client):
    for method in METHODS:
        r = generate(client, "Name a colour.", method)
        assert set(r) == KEYS
        assert r["text"].strip() and 1 <= r["new_tokens"] <= MAX_NEW and r["tau"] >= 1.0 and r["tokens_per_s"] > 0 and r["done"]
        assert (r["tree_size"] is None) == (method == "ar")  # a drafting method reports the size it ran at (the app's default)
    if len(METHODS) > 1:  # speed-ups are quoted against an AR run long enough not to be all prefill
        assert (
            generate(client, "Count from one to thirty in words.", "ar", max_new=MIN_REFERENCE_TOKENS)["new_tokens"] == MIN_REFERENCE_TOKENS
        )
        assert generate(client, "Name a colour.", METHODS[0])["speedup_vs_ar"] > 0


def test_every_method_gives_ar_text(client):
    outs = {m: generate(client, "Write one sentence about rivers.", m)["text"] for m in METHODS}
    assert len(set(outs.values())) == 1, outs


@pytest.mark.skipif(not HAVE_DART, reason="no DART head")
def test_a_request_sets_the_tree_size(client):
    """Any size from 0 to the app's largest (32 on a CPU) runs, and every one gives plain decoding's text."""
    prompt = "Write one sentence about rivers."
    ar = generate(client, prompt, "ar")["text"]
    for method, n in (("dart", 0), ("dart", 1), ("dart", 32 if kernels.AVAILABLE else 15), ("eagle3", 12)):
        r = generate(client, prompt, method, tree_size=n)
        assert r["tree_size"] == n and r["text"] == ar, (method, n)


BAD_REQUESTS = [
    (("", "ar", MAX_NEW, 0.0, 1.0, 0), "empty"),
    (("   \n", "ar", MAX_NEW, 0.0, 1.0, 0), "empty"),
    (("hi", "medusa", MAX_NEW, 0.0, 1.0, 0), "unknown method"),
    (("hi", "ar", MAX_NEW, -1.0, 1.0, 0), "temperature"),
    (("hi", "ar", MAX_NEW, 0.7, 0.0, 0), "top_p"),
    (("hi", "ar", MAX_NEW, 0.7, 1.0, -3), "top_k"),
    (("hi", "ar", 0, 0.0, 1.0, 0), "max_new_tokens"),
    (("hi", "ar", SERVER_MAX_NEW + 1, 0.0, 1.0, 0), "max_new_tokens"),
    (("hi", "ar", 2.5, 0.0, 1.0, 0), "max_new_tokens"),
    (("word " * 3000, "ar", MAX_NEW, 0.0, 1.0, 0), "context limit"),
    (("x" * 30_000, "ar", MAX_NEW, 0.0, 1.0, 0), "characters"),
    (("hi", "ar", MAX_NEW, 0.0, 1.0, 0, 4), "drafts no tree"),
    (("hi", METHODS[0], MAX_NEW, 0.0, 1.0, 0, -1), "tree size" if HAVE_DART else "drafts no tree"),
    (("hi", METHODS[0], MAX_NEW, 0.0, 1.0, 0, 33), "tree size" if HAVE_DART else "drafts no tree"),
]


@pytest.mark.parametrize("args, reason", BAD_REQUESTS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_rejected_and_the_app_keeps_serving(client, args, reason):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=reason):
        client.predict(*args, api_name="/generate")
    assert generate(client, "Say yes.", max_new=2)["new_tokens"] >= 1


def test_two_clients_streaming_at_once_get_their_solo_outputs(server):
    from gradio_client import Client

    prompts = ["Name a fruit.", "Name an animal."]
    method = METHODS[0]
    clients = [Client(server, verbose=False) for _ in prompts]
    solo = [generate(c, p, method)["text"] for c, p in zip(clients, prompts)]
    jobs = [c.submit(p, method, MAX_NEW, 0.0, 1.0, 0, None, api_name="/generate") for c, p in zip(clients, prompts)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = [r["text"] for r in pool.map(lambda j: j.result(timeout=300), jobs)]
    assert together == solo
    assert all(len(j.outputs()) >= 2 for j in jobs)  # streamed: partial results came before the final one


def test_a_client_reuses_its_own_prefix_only(server):
    """The prefix cache through the API: a client's repeated prompt reuses its rows (the whole prompt: no
    prefill) and answers the same; another client's first request reuses nothing of the first's."""
    from gradio_client import Client

    a, b = Client(server, verbose=False), Client(server, verbose=False)
    first = generate(a, "Name a planet.", METHODS[0])
    again = generate(a, "Name a planet.", METHODS[0])
    other = generate(b, "Name a planet.", METHODS[0])
    assert first["reused_tokens"] == 0 and other["reused_tokens"] == 0
    assert again["reused_tokens"] > 0 and again["first_token_s"] > 0
    assert first["text"] == again["text"] == other["text"]


def test_80_concurrent_requests_get_their_solo_answers(server):
    """80 requests at once from 8 clients, mixed methods: every served answer is its prompt's solo
    answer (a client's prefix cache never crosses to another), and what the queue cannot hold
    (beyond its 64 places) is refused with the queue's message, not an error of the engine."""
    from gradio_client import Client

    prompts = ["Name a fruit.", "Name an animal.", "Name a city.", "Name a tool."]
    solo_client = Client(server, verbose=False)
    solo = {p: generate(solo_client, p, "ar")["text"] for p in prompts}
    clients = [Client(server, verbose=False) for _ in range(8)]
    jobs = []
    for i in range(80):
        p, method = prompts[i % len(prompts)], METHODS[(i // len(prompts)) % len(METHODS)]
        jobs.append((p, method, clients[i % len(clients)].submit(p, method, MAX_NEW, 0.0, 1.0, 0, None, api_name="/generate")))
    served, refused = 0, []
    for p, method, job in jobs:
        try:
            r = job.result(timeout=600)
        except Exception as e:  # noqa: BLE001 (the client's error for a full queue)
            refused.append(str(e))
            continue
        assert r["text"] == solo[p], (p, method)
        served += 1
    assert served >= 64 and len(refused) <= 16
    assert all("queue" in e.lower() for e in refused), refused[:3]
    assert generate(solo_client, "Say yes.", max_new=2)["new_tokens"] >= 1  # and the app keeps serving


def test_a_cancelled_request_frees_the_engine(client):
    job = client.submit("Tell me a long story about a dragon.", "ar", SERVER_MAX_NEW, 0.0, 1.0, 0, None, api_name="/generate")
    while len(job.outputs()) < 2:
        assert not job.done(), "the long request finished before it could be cancelled"
        time.sleep(0.05)
    partial = job.outputs()[-1]
    job.cancel()
    t0 = time.perf_counter()
    assert generate(client, "Say yes.", max_new=2)["done"]
    waited = time.perf_counter() - t0
    remaining = (SERVER_MAX_NEW - partial["new_tokens"]) / partial["tokens_per_s"]
    assert waited < remaining, f"the next request waited {waited:.1f} s, as long as the cancelled one had left ({remaining:.1f} s)"


def open_chat(pw, server, max_new: int = 2 * MAX_NEW):
    """Headless Chromium on the app, with the token limit set for the browser tests; (browser, page)."""
    browser = launch(pw)
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    open_app(page, server)
    page.locator("#max-new input[type=number]").fill(str(max_new))
    page.locator("#max-new input[type=number]").press("Enter")
    return browser, page


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no Chromium: apt-get install chromium")
def test_browser_chat_streams_and_draws_the_tree(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser, page = open_chat(pw, server)
        # streamed: shaded chunks are on the page while the stats still say it is generating
        send(page, "Tell me a long story about a dragon.")
        assert page.locator("#chat .chunk").count() >= 1
        # while a turn runs, nothing can start another (a click Gradio would drop, a prompt the turn would wipe)
        page.wait_for_function(LOCKED_JS, timeout=10_000)
        page.wait_for_function(DONE_JS % 1, timeout=300_000)
        # the header says whether compare mode ends with a llama.cpp row, or why not
        status = page.locator("#llamacpp-status").inner_text()
        assert ("Compare mode ends with llama.cpp (same GGUF)" in status) if HAVE_LLAMACPP else ("make peers" in status or "GGUF" in status)
        # the header names the tree sizes calibrated on this machine (the kernels path), with the expected speed
        if HAVE_DART and kernels.AVAILABLE:
            sizes = page.locator("#tree-sizes").inner_text()
            assert "DART: " in sizes and "drafted nodes: expected" in sizes and "tok/s" in sizes, sizes
        # the weights path: given here (--dtype), and the header says so
        assert f"given: --dtype {DTYPE}" in page.locator("#weights-choice").inner_text()
        # the "why" view: the forward cost by rows the tree size was chosen from, on this path, with DART's size
        if HAVE_DART and kernels.AVAILABLE:  # the tree sizes were calibrated at start, so the table is there
            why = page.locator("#verify-cost").inner_text()
            # the row that runs is the dtype given, named with its linears' form where it has one ("bfloat16
            # (BF16X16 linears)" where the CPU lacks AVX512-BF16)
            assert re.search(rf"^{DTYPE}( \([^)\n]*\))? \(runs\)\t", why, re.M), why
            assert " rows: " in why and "DART expected" in why, why
            assert page.locator("#verify-cost-plot .js-plotly-plot").count() == 1
        # a second turn, in compare mode, runs every method to the end (and then llama.cpp, where built),
        # DART at a tree size set on the page
        page.locator("#compare input").check()
        if HAVE_DART:
            page.locator("#tree-size-dart input[type=number]").fill("12")
            page.locator("#tree-size-dart input[type=number]").press("Enter")
        send_and_wait(page, "Now write a haiku about the sea.", n_runs=len(METHODS) + HAVE_LLAMACPP)
        assert page.locator("#chat .chunk").count() >= 2
        if len(METHODS) > 1:  # lossless at T=0: every method's text is AR's
            rows = page.locator("#summary tbody tr")
            assert rows.count() == len(METHODS) + HAVE_LLAMACPP
            assert rows.first.locator("td").first.inner_text() == "DART (≤12 nodes)"
            assert [rows.nth(i).locator("td").last.inner_text() for i in range(len(METHODS) - 1)] == ["yes"] * (len(METHODS) - 1)
        if HAVE_LLAMACPP:  # its row: llama.cpp's counts; "same text" marked, as it promises no bit-exactness
            row = page.locator("#summary tbody tr").last.locator("td")
            assert row.first.inner_text() == "llama.cpp (same GGUF)" and int(row.nth(1).inner_text()) >= 1
            assert row.last.inner_text() in ("yes*", "no*") and "not a bug" in page.locator("#summary").inner_text()
        page.wait_for_selector("#tree-plot .js-plotly-plot", timeout=60_000)
        if HAVE_DART:
            assert page.locator("#tree-plot .scatterlayer .point").count() > 1
            # scrub back to the first verified tree
            page.locator("#step input[type=number]").fill("1")
            page.locator("#step input[type=number]").press("Enter")
            page.wait_for_function("document.querySelector('#tree-plot .gtitle').textContent.includes('step 1:')", timeout=30_000)
        page.screenshot(path=str(tmp_path / "app.png"), full_page=True)
        browser.close()


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no Chromium: apt-get install chromium")
def test_browser_stop_then_next_turn(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # the longest answer the server allows: with 24 tokens the kernels could finish it before Stop lands
        browser, page = open_chat(pw, server, max_new=SERVER_MAX_NEW)
        send(page, "Tell me a long story about a dragon.")
        page.locator("#stop").click()
        page.wait_for_function("document.querySelector('#stats').innerText.includes('stopped by you')", timeout=30_000)
        stopped_at = int(page.locator("#stats").inner_text().split(" tokens")[0].split()[-1])
        assert stopped_at < SERVER_MAX_NEW
        send_and_wait(page, "Now write a haiku about the sea.", timeout_s=120)
        assert page.locator("#chat .chunk").count() >= 2
        browser.close()


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no Chromium: apt-get install chromium")
def test_browser_stop_reaches_a_turn_waiting_in_the_queue(server, client):
    """Stop pressed while the turn still waits behind another client's request: it never runs."""
    from playwright.sync_api import sync_playwright

    # the page is open and the prompt typed before the long request starts: on the fast kernels the
    # request can end within the seconds a browser takes to start
    with sync_playwright() as pw:
        browser, page = open_chat(pw, server)
        page.locator("#prompt textarea").fill("Name a colour.")
        job = client.submit("Tell me a long story about a dragon.", "ar", SERVER_MAX_NEW, 0.0, 1.0, 0, None, api_name="/generate")
        try:
            while len(job.outputs()) < 2:  # the engine is busy with it
                assert not job.done(), "the long request finished before the browser's turn could queue behind it"
                time.sleep(0.05)
            page.locator("#send").click()
            page.wait_for_timeout(300)
            assert not job.done(), "the long request finished before Stop: the turn was not queued behind it"
            page.locator("#stop").click()
            page.wait_for_function("document.querySelector('#stats').innerText.includes('stopped by you')", timeout=30_000)
            assert not job.done(), "the stop was shown only once the long request ended"
            job.cancel()
            # its place came: it ended without running, and says so in its own last frame
            page.wait_for_function("document.querySelector('#stats').innerText.includes(' 0 tokens')", timeout=60_000)
            assert "stopped by you" in page.locator("#stats").inner_text()
            browser.close()
        finally:
            job.cancel()
