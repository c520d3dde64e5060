"""The router's live cluster page in headless Chromium (selenium, the system's chromedriver):
it renders every worker of a real 1P1D cluster with its numbers, and shows a killed worker down
by the refresh after the kill. With PDSERVE_SCREENSHOT_DIR set, PNG screenshots go there.
The page's data helpers are checked on their own at the end (no browser)."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pdcore.router.dashboard import SpeedWindow, summarize_load, transfer_totals
from pdcore.testing.processes import PDCluster

from .obs_helpers import restart_worker, send_load

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                "google-chrome"))), None)
CHROMEDRIVER = shutil.which("chromedriver")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no chromium/chromedriver on PATH: apt-get install chromium chromium-driver "
           "(scripts/setup.sh --apt does)")
WAIT_S = 60.0  # bound on every wait for the page; the page itself refreshes every 2 s


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--disable-gpu", "--window-size=1700,600"):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(what: str, check: Callable[[], object]) -> object:
    deadline = time.monotonic() + WAIT_S
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the page did not show {what} within {WAIT_S}s")
        time.sleep(0.1)


def refreshes(driver) -> int:  # type: ignore[no-untyped-def]
    return int(driver.find_element("tag name", "body").get_attribute("data-refreshes") or 0)


def rows(driver) -> dict[str, dict[str, str]]:  # type: ignore[no-untyped-def]
    """url -> {status, role, text} of every worker row the page shows now. A refresh that
    replaces the table between finding a row and reading it leaves a stale element (a CI run
    failed so): the table is read again, a bounded number of times."""
    from selenium.common.exceptions import StaleElementReferenceException

    for attempt in range(20):
        try:
            out = {}
            for role in ("prefill", "decode"):
                for tr in driver.find_elements("css selector", f"table#{role} tr[data-url]"):
                    out[tr.get_attribute("data-url")] = {
                        "status": tr.get_attribute("data-status"), "role": role,
                        "text": tr.text}
            return out
        except StaleElementReferenceException:
            if attempt == 19:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


def screenshot(driver, name: str) -> None:  # type: ignore[no-untyped-def]
    folder = os.environ.get("PDSERVE_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(Path(folder) / name))


@needs_chromium
def test_page_shows_every_worker_and_a_worker_going_down(
        obs_cluster: PDCluster, browser) -> None:  # type: ignore[no-untyped-def]
    c = obs_cluster
    send_load(c, 8)  # transfers happened: the transfer columns have numbers
    browser.get(c.url + "/dashboard")
    assert browser.title == "pdserve cluster"
    prefill, decode = c.prefills[0].url, c.decodes[0].url
    shown = wait_for("both workers up", lambda: (r := rows(browser))
                     and all(r.get(u, {}).get("status") == "up" for u in (prefill, decode))
                     and r)
    assert shown[prefill]["role"] == "prefill" and shown[decode]["role"] == "decode"
    for url in (prefill, decode):
        text = shown[url]["text"]
        pages = httpx.get(url + "/get_load", timeout=30).json()[0]["num_pages_total"]
        assert f"/{pages})" in text, text  # KV pool used/total pages
        assert "MB/s" in text or "GB/s" in text, text  # a transfer speed
        assert re.search(r"\d+ \([\d.]+ [KMG]?B\), \d+ failed", text), text  # transfers
    assert "bootstrap 0" in shown[prefill]["text"] and "prealloc 0" in shown[decode]["text"]
    summary = browser.find_element("id", "summary").text
    assert "2/2 workers up" in summary and "ready" in summary, summary
    screenshot(browser, "dashboard-cluster-up.png")

    c.decodes[0].kill()
    try:
        at_kill = refreshes(browser)
        # the refresh in progress at the kill may have read the worker before it died; the
        # one after it started after the kill, so it must show the worker down
        wait_for("two more refreshes", lambda: refreshes(browser) >= at_kill + 2)
        now = rows(browser)
        assert now[decode]["status"] == "down", now
        assert now[prefill]["status"] == "up", now
        assert "0/2" not in browser.find_element("id", "summary").text
        assert "1/2 workers up" in browser.find_element("id", "summary").text
        screenshot(browser, "dashboard-decode-down.png")
    finally:
        restart_worker(c, c.decodes[0])
    wait_for("the restarted worker up", lambda: rows(browser).get(decode, {}).get("status")
             == "up")


def test_dashboard_data_answers_without_a_browser(obs_cluster: PDCluster) -> None:
    r = httpx.get(obs_cluster.url + "/dashboard/data", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    roles = sorted(w["role"] for w in body["workers"])
    assert roles == ["decode", "prefill"]
    for w in body["workers"]:
        pages = httpx.get(w["url"] + "/get_load", timeout=30).json()[0]["num_pages_total"]
        assert w["reachable"] and w["load"]["pages_total"] == pages > 0, w
        assert w["transfer"] is not None and w["transfer"]["backend"] == "tcp", w


def test_load_summary_sums_dp_ranks_and_queues() -> None:
    ranks = [{"num_running_reqs": 2, "num_waiting_reqs": 1, "num_pages_total": 100,
              "num_pages_used": 30, "disagg_prealloc_queue": 3, "disagg_transfer_queue": 1,
              "prompt_tokens_total": 10, "cache_hit_tokens_total": 5},
             {"num_running_reqs": 1, "num_pages_total": 100, "num_pages_used": 10,
              "disagg_prealloc_queue": 2, "prompt_tokens_total": 10}]
    s = summarize_load(ranks)
    assert (s["running"], s["waiting"], s["pages_used"], s["pages_total"]) == (3, 1, 40, 200)
    assert s["pool_usage"] == pytest.approx(0.2)
    assert s["queues"] == {"prealloc": 5, "transfer": 1}
    assert s["cache_hit_rate"] == pytest.approx(0.25)
    assert transfer_totals(ranks) is None  # no KV manager: a unified server
    # #46: the router reads a rank's load as a typed RankLoad, field by field: a value that is
    # no count is 0, and only the PD queues a server reports (messages/stats.PD_QUEUES) count
    odd = [{"num_running_reqs": "7", "num_waiting_reqs": True, "num_pages_used": -3,
            "num_pages_total": float("nan"), "disagg_prealloc_queue": 1,
            "disagg_anything_queue": 9}]
    s = summarize_load(odd)
    assert (s["running"], s["waiting"], s["pages_used"], s["pages_total"]) == (0, 0, 0, 0)
    assert s["queues"] == {"prealloc": 1}


def test_speed_window_means_the_transfers_inside_it() -> None:
    w = SpeedWindow(window_s=30)
    assert w.recent("u", 0.0, 0, now=0.0) is None
    assert w.recent("u", 3.0, 2, now=1.0) == pytest.approx(1.5)  # two transfers, 1 and 2 GB/s
    assert w.recent("u", 3.0, 2, now=2.0) == pytest.approx(1.5)
    # the first snapshots leave the window: only the transfer since then counts
    assert w.recent("u", 7.0, 3, now=31.5) == pytest.approx(4.0)
    assert w.recent("u", 1.0, 1, now=32.0) is None  # counters went back: the worker restarted
    assert w.recent("u", 3.0, 2, now=33.0) == pytest.approx(2.0)


def test_with_api_key_the_page_is_public_and_its_data_wants_the_key() -> None:
    from fastapi.testclient import TestClient

    from pdcore.router.app import create_app
    from pdcore.router.config import RouterConfig

    # workers on ports nothing listens on: they show as starting/unreachable, never up
    cfg = RouterConfig(prefill=[("http://127.0.0.1:9", None)], decode=["http://127.0.0.1:7"],
                       api_key="secret")
    with TestClient(create_app(cfg)) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and "dashboard/data" in page.text
        assert client.get("/dashboard/data").status_code == 401
        data = client.get("/dashboard/data", headers={"authorization": "Bearer secret"})
        assert data.status_code == 200, data.text
        assert {w["status"] for w in data.json()["workers"]} <= {"starting", "down"}
        assert all(not w["reachable"] and w["error"] for w in data.json()["workers"])


def test_transfer_totals_sum_ranks_and_failure_rows() -> None:
    def rank(n: int, speed_sum: float, fails: list) -> dict:  # type: ignore[type-arg]
        return {"kv_transfer": {"backend": "tcp", "totals": {"bytes": 1000 * n, "transfers": n},
                                "failures": fails,
                                "hist": {"speed_gb_s": {"counts": [n, 0], "sum": speed_sum}},
                                "last": {"speed_gb_s": 0.5, "latency_ms": 2.0}}}

    t = transfer_totals([rank(2, 1.0, [["transfer", "timeout", 3]]),
                         rank(1, 0.5, [["bootstrap", "peer_unreachable", 1]])])
    assert t is not None
    assert (t.transfers, t.bytes, t.failures) == (3, 3000, 4)
    assert (t.speed_count, t.speed_sum) == (3, 1.5)
    assert t.last is not None and t.last.speed_gb_s == 0.5 and t.backend == "tcp"
    # #46: read field by field (messages/stats.TransferTotals): what is no number counts 0,
    # a malformed part is skipped, never a KeyError or TypeError on the router
    odd = transfer_totals([{"kv_transfer": {"backend": 7, "totals": {"bytes": "9",
                                                                     "transfers": True},
                                            "failures": [["x"], "row", []],
                                            "hist": {"speed_gb_s": {"counts": "3"}},
                                            "last": {"speed_gb_s": "fast"}}},
                           {"kv_transfer": {"totals": [1], "hist": [], "failures": None}}])
    assert odd is not None and (odd.transfers, odd.bytes, odd.failures) == (0, 0, 0)
    assert (odd.backend, odd.speed_count, odd.speed_sum) == (None, 0, 0.0)
    assert odd.last is not None and odd.last.speed_gb_s is None
