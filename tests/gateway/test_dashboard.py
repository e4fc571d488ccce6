"""The live A/B view: /v1/stats, its SSE stream, the key on reset only, the self-contained page, and the
page itself in headless Chromium against a live gateway (both arms shown, charts moving, reset button)."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.audit import AuditConfig
from gateway_util import API_KEY, MODEL, LiveServer, make_app, run_app, wait_until

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"model": MODEL, "prompt": "Hello", "temperature": 0, "max_tokens": 16, "ignore_eos": True}
ARMS = {"on/draft/adaptive": {}, "off/none/none": {"speculation": {"enabled": False}}}
BROWSER_ARMS = ARMS | {"on/exact/2x2x1": {"speculation": {"drafter": "exact", "tree": [2, 2, 1]}}}


def test_stats_are_readable_without_the_key_and_reset_needs_it(tokenizer) -> None:
    async def go(client, app):
        for extra in ARMS.values():
            assert (await client.post("/v1/completions", json=BODY | extra, headers=AUTH)).status_code == 200
        before = await client.get("/v1/stats")
        page = await client.get("/dashboard")
        refused = [await client.post("/v1/stats/reset", headers=h) for h in ({}, {"Authorization": "Bearer nope"})]
        done = await client.post("/v1/stats/reset", headers=AUTH)
        return before, page, refused, done, await client.get("/v1/stats")

    before, page, refused, done, after = run_app(tokenizer, go, api_key=API_KEY)
    snap = before.json()
    assert before.status_code == 200 and set(snap["arms"]) == set(ARMS) and snap["model"] == MODEL
    for key in ARMS:
        arm = snap["arms"][key]
        assert arm["requests"] == 1 and arm["tokens"] == 16 and arm["ttft_s"]["n"] == 1
        assert 0 < arm["per_token_s"]["n"] <= 15 and arm["mean_accepted_length"] >= 1  # the first token: TTFT
    off = snap["arms"]["off/none/none"]
    assert off["per_token_s"]["n"] == 15 and off["utilisation"] == 1.0 and off["steps"] == 16
    assert set(snap) >= {"arms", "series", "kv", "queue", "audit", "since_reset_s"}
    assert all(r.status_code == 401 for r in refused) and done.json() == {"status": "reset"}
    assert after.json()["arms"] == {} and after.json()["audit"]["checked"] == 0
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    html = page.text
    assert "EventSource(\"/v1/stats/stream\")" in html
    assert not re.search(r"https?:|//[a-z0-9.-]+\.[a-z]{2,}|<script[^>]+src=|<link[^>]+stylesheet", html, re.I)


def test_reset_is_open_without_a_configured_key_and_openapi_lists_the_routes(tokenizer) -> None:
    async def go(client, app):
        return await client.post("/v1/stats/reset"), (await client.get("/openapi.json")).json()

    reset, schema = run_app(tokenizer, go)
    assert reset.status_code == 200
    paths = schema["paths"]
    for path in ("/v1/stats", "/v1/stats/stream", "/dashboard"):
        assert paths[path]["get"]["security"] == []
    assert "security" not in paths["/v1/stats/reset"]["post"]  # the document's bearer default applies


def test_stats_stream_pushes_a_snapshot_every_interval(tokenizer) -> None:
    with LiveServer(make_app(tokenizer, api_key=API_KEY, stats_interval_s=0.05)) as live:
        httpx.post(live.url + "/v1/completions", json=BODY, headers=AUTH, timeout=30).raise_for_status()
        snaps = []
        with httpx.stream("GET", live.url + "/v1/stats/stream", timeout=30) as r:  # no key: a read-only GET
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    snaps.append(orjson.loads(line[len("data: "):]))
                if len(snaps) == 3:
                    break
    assert [s["arms"]["on/draft/adaptive"]["requests"] for s in snaps] == [1, 1, 1]
    assert snaps[0]["since_reset_s"] < snaps[1]["since_reset_s"] < snaps[2]["since_reset_s"]


# --- the page in a real browser -------------------------------------------------------------------


def browser_api():
    """playwright's sync API driving Debian's chromium; skipped without it unless SPECGATE_REQUIRE_BROWSER=1."""
    required = os.environ.get("SPECGATE_REQUIRE_BROWSER") == "1"
    missing = None if CHROMIUM.exists() else f"{CHROMIUM} is missing (apt-get install chromium)"
    try:
        from playwright import sync_api
    except ImportError:
        missing, sync_api = missing or "the playwright package is missing (pip install -e .[test])", None
    if missing:
        (pytest.fail if required else pytest.skip)(missing)
    return sync_api


class Traffic:
    """Both arms, one request after another, from a thread until stopped (bounded in count)."""

    def __init__(self, url: str) -> None:
        self.url, self.sent, self.stop = url, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=30) as client:
            while not self.stop.is_set() and self.sent < 400:
                for extra in BROWSER_ARMS.values():
                    client.post("/v1/completions", json=BODY | {"max_tokens": 24} | extra).raise_for_status()
                self.sent += 1

    def __enter__(self) -> "Traffic":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def points(page, chart: str) -> int:
    return int(page.get_attribute(f"#{chart}", "data-points") or 0)


def until(page, predicate, timeout_ms: int = 20_000) -> None:
    """Poll from Python: the page's CSP forbids the string evaluation ``wait_for_function`` relies on."""
    for _ in range(timeout_ms // 50):
        if predicate():
            return
        page.wait_for_timeout(50)
    raise AssertionError("the page never reached the expected state")


def test_dashboard_in_headless_chromium(tokenizer) -> None:
    sync_api = browser_api()
    app = make_app(tokenizer, api_key=API_KEY, stats_interval_s=0.2, audit=AuditConfig(fraction=1.0, idle_s=0.05))
    shot = ROOT / "bench" / "results" / "dashboard.png"
    with LiveServer(app) as live, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.set_default_timeout(20_000)
            elsewhere = []
            page.on("request", lambda req: req.url.startswith(live.url) or elsewhere.append(req.url))
            page.goto(live.url + "/dashboard")  # no key: the page and its stream are read-only
            page.wait_for_selector('#status[data-state="live"]')
            with Traffic(live.url):
                for key in BROWSER_ARMS:
                    page.wait_for_selector(f'tr[data-arm="{key}"]')
                until(page, lambda: points(page, "chart-tokens") > 0)
                first = {c: points(page, c) for c in ("chart-tokens", "chart-per-token", "chart-accepted")}
                for chart, n in first.items():  # a second completes with traffic in it: every chart gains a point
                    until(page, lambda: points(page, chart) > n)
                until(page, lambda: points(page, "chart-tokens") >= 5 * len(BROWSER_ARMS))  # a few seconds to show
            until(page, lambda: not page.inner_text("#audit-detail").startswith("0 checked"))
            rows = {key: row_text(page, key) for key in BROWSER_ARMS}
            page.wait_for_timeout(400)  # two more pushes, so the screenshot shows the last figures
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            audit_rate, kv = page.inner_text("#audit-rate"), page.inner_text("#kv")
            draws = int(page.get_attribute("#chart-kv", "data-draws"))
            refused = reset_with(page, "wrong-key")
            done = reset_with(page, API_KEY)
            page.wait_for_selector("#arms td.empty")
        finally:
            browser.close()
    for key, cells in rows.items():
        assert int(cells["requests"]) >= 2, cells
        for name in ("ttft", "per-token"):
            assert re.fullmatch(r"[\d.]+ / [\d.]+ / [\d.]+", cells[name]), cells
        assert float(cells["tokens-per-s"]) > 0 and float(cells["accepted-length"]) >= 1.0
    assert rows["off/none/none"]["accepted-length"] == "1.00" and rows["off/none/none"]["utilisation"] == "100.0%"
    exact = rows["on/exact/2x2x1"]  # the target as its own draft: all three depths kept (bar first and last steps)
    assert re.fullmatch(r"d1 \d+% · d2 \d+% · d3 \d+%", exact["depth"]) and float(exact["accepted-length"]) > 2
    assert audit_rate == "100.0%" and kv.endswith("%") and draws > 1
    assert "refused (HTTP 401)" in refused and "new experiment" in done
    assert elsewhere == []  # the page asked nothing of any other host
    assert shot.stat().st_size > 10_000


def row_text(page, key: str) -> dict[str, str]:
    cells = page.query_selector_all(f'tr[data-arm="{key}"] td')
    return {c.get_attribute("class"): c.inner_text().strip() for c in cells}


def reset_with(page, key: str) -> str:
    """Click the reset button, answer its key prompt, return the message it then shows."""
    before = page.inner_text("#reset-msg")
    page.once("dialog", lambda dialog: dialog.accept(key))
    page.click("#reset")
    until(page, lambda: page.inner_text("#reset-msg") not in ("", before))
    return page.inner_text("#reset-msg")
