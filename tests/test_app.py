"""The Gradio app end to end: the /generate API through gradio_client, bad requests, concurrent
clients, and a real headless-Chromium session that chats and sees the draft tree."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MAX_NEW = 12
START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    log = open(ROOT / ".pytest_cache" / "app-server.log", "w") if (ROOT / ".pytest_cache").is_dir() else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--dtype", "float32", "--server-port", str(port), "--max-new-tokens", "64", "--no-warmup"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"},
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        raise RuntimeError("the app did not start in time")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client

    return Client(server, verbose=False)


def methods(client) -> list[str]:
    return ["dart", "ar"] if (ROOT / "assets" / "dart" / "config.json").exists() else ["ar"]


def test_generate_endpoint(client):
    for method in methods(client):
        r = client.predict("Name a colour.", method, MAX_NEW, 0.0, 1.0, 0, api_name="/generate")
        assert set(r) == {"text", "new_tokens", "tau", "tokens_per_s", "speedup_vs_ar"}
        assert r["text"].strip() and 1 <= r["new_tokens"] <= MAX_NEW and r["tau"] >= 1.0 and r["tokens_per_s"] > 0


def test_dart_and_ar_agree_in_float32(client):
    outs = {m: client.predict("Write one sentence about rivers.", m, MAX_NEW, 0.0, 1.0, 0, api_name="/generate")["text"] for m in methods(client)}
    assert len(set(outs.values())) == 1, outs


@pytest.mark.parametrize(
    "args, match",
    [
        (("", "ar", MAX_NEW, 0.0, 1.0, 0), "empty"),
        (("hi", "nope", MAX_NEW, 0.0, 1.0, 0), "unknown method"),
        (("hi", "ar", MAX_NEW, -1.0, 1.0, 0), "temperature"),
        (("hi", "ar", MAX_NEW, 0.0, 0.0, 0), "top_p"),
        (("hi", "ar", 0, 0.0, 1.0, 0), "max_new_tokens"),
        (("word " * 6000, "ar", MAX_NEW, 0.0, 1.0, 0), "context limit|characters"),
    ],
)
def test_bad_requests_are_rejected_and_the_app_keeps_serving(client, args, match):
    with pytest.raises(Exception, match=match):
        client.predict(*args, api_name="/generate")
    assert client.predict("Say yes.", "ar", 4, 0.0, 1.0, 0, api_name="/generate")["new_tokens"] >= 1


def test_two_clients_at_once(server):
    from gradio_client import Client

    prompts = ["Name a fruit.", "Name an animal."]
    solo = [Client(server, verbose=False).predict(p, "ar", MAX_NEW, 0.0, 1.0, 0, api_name="/generate")["text"] for p in prompts]
    method = methods(None)[0]
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(lambda p: Client(server, verbose=False).predict(p, method, MAX_NEW, 0.0, 1.0, 0, api_name="/generate")["text"], p) for p in prompts]
        together = [j.result(timeout=300) for j in jobs]
    assert together == solo


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (CI's .ci/run installs it)")
def test_browser_chat_streams_and_draws_the_tree(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        page.goto(server, timeout=60_000)
        page.locator("#prompt textarea").fill("Write a haiku about the sea.")
        page.locator("#send").click()
        # streamed text: assistant chunks appear as shaded spans
        page.wait_for_selector(".chunk0", timeout=180_000)
        page.wait_for_function("document.querySelector('#stats') && document.querySelector('#stats').innerText.includes('stopped')", timeout=180_000)
        assert page.locator(".chunk0").count() >= 1
        if "dart" in methods(None):
            page.wait_for_selector("#tree-plot .js-plotly-plot", timeout=60_000)
            assert "step" in page.locator("#tree-plot").inner_text()
        page.screenshot(path=str(tmp_path / "app.png"), full_page=True)
        browser.close()
