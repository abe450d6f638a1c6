"""Drive the running app in headless Chromium: send a prompt, wait for the answer, take a screenshot.

    dart-screenshot http://127.0.0.1:7860/ docs/screenshot.png --compare

Used to make docs/screenshot.png and by the browser test. Needs Debian's chromium (/usr/bin/chromium)
and the playwright Python package (its bundled driver; no `playwright install`).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
VIEWPORT = {"width": 1400, "height": 1000}
STATS_JS = "(document.querySelector('#stats') || {innerText: ''}).innerText"
STARTED_JS = f"{STATS_JS}.includes('generating')"
# a turn runs: the app locks the prompt box and Send from its first frame (app/ui.py)
# Gradio can re-mount a component when its props change, so an element may be missing for a frame: a
# missing one counts as neither locked nor ready, and the wait goes on instead of raising in the page
_SEND = "document.querySelector('#send')"
_BOX = "document.querySelector('#prompt textarea')"
LOCKED_JS = f"(!!{_SEND} && !!{_BOX} && {_SEND}.disabled && {_BOX}.disabled)"
# the turn is over in the browser too: the app unlocks them only then
READY_JS = f"(!!{_SEND} && !!{_BOX} && !{_SEND}.disabled && !{_BOX}.disabled)"
# every run finished: its stats line gives the stop reason ("stopped: eos"); none is still generating
DONE_JS = (
    "[...document.querySelectorAll('#stats .stat')].filter(e => e.innerText.includes('stopped:')).length >= %d"
    f" && !{STATS_JS}.includes('generating') && {READY_JS}"
)


def launch(pw):
    return pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def open_app(page, url: str, compare: bool = False) -> int:
    """Load the page, optionally tick compare mode; returns how many runs a prompt will make."""
    page.goto(url, timeout=60_000)
    page.wait_for_selector("#prompt textarea", timeout=60_000)
    page.wait_for_selector("#send", timeout=60_000)
    if not compare:
        return 1
    box = page.locator("#compare input")
    if not box.is_checked():
        box.check()
    return page.locator("#method input").count()


def send(page, prompt: str, timeout_s: float = 120) -> None:
    """Send `prompt` once the app takes input, and wait until its first tokens are on the page."""
    page.wait_for_function(READY_JS, timeout=timeout_s * 1000)
    page.locator("#prompt textarea").fill(prompt)
    page.locator("#send").click()
    page.wait_for_function(STARTED_JS, timeout=timeout_s * 1000)


def send_and_wait(page, prompt: str, n_runs: int = 1, timeout_s: float = 300) -> None:
    """Send `prompt` and wait until all `n_runs` runs finished."""
    send(page, prompt, timeout_s)
    page.wait_for_function(DONE_JS % n_runs, timeout=timeout_s * 1000)


def chat_once(page, url: str, prompt: str, compare: bool = False, timeout_s: float = 300) -> None:
    send_and_wait(page, prompt, open_app(page, url, compare), timeout_s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dart-screenshot", description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("out", type=Path)
    p.add_argument("--prompt", default="Write a short poem about the sea.")
    p.add_argument("--compare", action="store_true", help="tick compare mode first")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the answer")
    args = p.parse_args(argv)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch(pw)
        page = browser.new_page(viewport=VIEWPORT)
        chat_once(page, args.url, args.prompt, args.compare, args.timeout)
        page.wait_for_timeout(1500)  # let the last plot redraw settle
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out), full_page=True)
        browser.close()
    print(args.out)
    return 0
