"""The router's /dashboard in a real browser: Debian's headless chromium (driven through selenium and
Debian's chromedriver) against a real deployment on loopback (configs/disagg_host_offload.yaml: 1 context
server with a small device pool and a host tier + 1 generation server + router, builtin:tiny-llama).
It checks the server rows and pool bars, sees the numbers move while load runs (and blocks offloaded
to the host tier) and the TTFT phases filled in, and sees a SIGKILLed generation server's row turn
red. A MoE deployment (configs/disagg.yaml, builtin:tiny-qwen3-moe) shows each server's expert load per
sparse layer (the dense deployment hides that section). Screenshots are kept in the test's tmp dir and
in test-artifacts/ (git-ignored).

Without chromium the test fails (`scripts/install.sh --test`, which .ci/run runs, installs it as
root); a developer may skip it with PDSERVE_ALLOW_NO_BROWSER=1, which CI (CI set) ignores.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import deploy_harness as dh
import httpx
import openai
import pytest
from waiting import wait_until

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = dh.ROOT / "test-artifacts"
LOAD_REQUESTS, LOAD_CONCURRENCY = 12, 4
RED_WITHIN_S = 5.0  # health is polled every second; a refused connection fences at once
PHASES = ["router_queue", "context_queue", "prefill", "context_leg", "handoff", "generation_queue", "kv_transfer",
          "generation_leg", "first_event"]
SECONDS = r"[\d.]+ m?s"

# One call reads everything the assertions need from the live DOM (no stale element handles).
READ_DOM = """
const text = (sel) => (document.querySelector(sel) || {}).textContent;
const rows = Array.from(document.querySelectorAll('#servers tr.server')).map((r) => ({
  url: r.dataset.url, health: r.dataset.health, role: r.querySelector('.role').textContent,
  status: r.querySelector('.status').textContent, epoch: r.querySelector('.epoch').title,
  restarts: r.querySelector('.restarts').textContent, transfers: r.querySelector('.transfers').textContent,
  dot: getComputedStyle(r.querySelector('.dot')).backgroundColor}));
const pools = Array.from(document.querySelectorAll('.pool')).map((p) => ({
  url: p.dataset.url,
  bars: Array.from(p.querySelectorAll('.bar')).map((b) => ({
    level: b.dataset.level, window: b.dataset.window, label: b.previousSibling.textContent,
    segs: Array.from(b.querySelectorAll('.seg')).map((s) => [s.classList[1], s.getBoundingClientRect().width])}))}));
const phases = Array.from(document.querySelectorAll('#phases tr.phase')).map((r) => ({
  name: r.dataset.phase, label: r.querySelector('.name').textContent, source: r.querySelector('.source').textContent,
  p50: r.querySelector('.p50').textContent, mean: r.querySelector('.mean').textContent,
  count: r.querySelector('.count').textContent}));
const experts = Array.from(document.querySelectorAll('#experts .experts')).map((c) => ({
  url: c.dataset.url,
  layers: Array.from(c.querySelectorAll('.layer')).map((l) => ({
    layer: l.dataset.layer, load: l.querySelector('.load').textContent,
    bars: Array.from(l.querySelectorAll('.expert')).map((b) => ({
      tokens: Number(b.dataset.tokens), height: b.getBoundingClientRect().height,
      hottest: b.classList.contains('hottest')}))}))}));
return {rows, pools, phases, experts, experts_hidden: document.getElementById('experts-section').hidden,
        overall: text('#overall'), requests: text('#requests-total'), rps: text('#rps'),
        xfer: text('#xfer-count'), ttft: text('#ttft-p50'), tpot: text('#tpot-p50'), offload: text('#offload-rate')};
"""


@pytest.fixture
def browser():
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        if os.environ.get("PDSERVE_ALLOW_NO_BROWSER") == "1" and not os.environ.get("CI"):
            pytest.skip(f"{missing} missing and PDSERVE_ALLOW_NO_BROWSER=1")
        pytest.fail(f"{missing} missing: install Debian's browser (apt-get install chromium chromium-driver, as "
                    "scripts/install.sh --test does), or set PDSERVE_ALLOW_NO_BROWSER=1 to skip this test outside CI")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # a driver path: no download
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait_dom(driver, predicate, timeout_s: float, what: str) -> dict:
    """The DOM reading once `predicate(dom)` holds (fails with the last reading otherwise)."""
    return wait_until(lambda: driver.execute_script(READ_DOM), timeout_s, what, check=predicate, interval_s=0.2)


def row(dom: dict, url: str) -> dict:
    [found] = [r for r in dom["rows"] if r["url"] == url]
    return found


def screenshot(driver, tmp_path, name: str) -> None:
    path = tmp_path / name
    assert driver.save_screenshot(str(path)), "chromium took no screenshot"
    assert path.stat().st_size > 10_000
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copyfile(path, ARTIFACTS / name)


def run_load(url: str, errors: list) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def one(i: int) -> None:
        prompt = f"Request {i}: " + " ".join(f"fox {i * 1000 + j} jumps" for j in range(40))  # 246 tokens, 8 blocks
        stream = i % 2 == 1  # a JSON answer has no handoff phase (it comes after the decode): half are streamed
        answer = client.completions.create(model="builtin:tiny-llama", prompt=prompt, max_tokens=24, temperature=0,
                                           stream=stream, stream_options={"include_usage": True} if stream else None)
        usage = list(answer)[-1].usage if stream else answer.usage
        assert usage.completion_tokens > 0

    with ThreadPoolExecutor(LOAD_CONCURRENCY) as pool:
        for future in [pool.submit(one, i) for i in range(LOAD_REQUESTS)]:
            try:
                future.result()
            except Exception as exc:  # reported by the test thread
                errors.append(exc)


def test_dashboard_shows_the_deployment_live(tmp_path, browser):
    with dh.launched("disagg_host_offload.yaml", tmp_path) as dep:
        ctx, gen = dep.context_urls[0], dep.generation_urls[0]
        epochs = {u: httpx.get(f"{u}/health", timeout=10).json()["epoch"] for u in (ctx, gen)}
        browser.get(f"{dep.url}/dashboard")
        assert browser.title == "pdserve deployment"

        # every server: its role, healthy (green), its epoch from /health, no restarts; its pool bars
        dom = wait_dom(browser, lambda d: len(d["rows"]) == 2 and all(r["health"] == "ok" for r in d["rows"])
                       and all(p["bars"] for p in d["pools"]), 15, "two healthy rows with pool bars")
        assert [(r["url"], r["role"], r["status"], r["restarts"]) for r in dom["rows"]] == [
            (ctx, "context", "ok", "0"), (gen, "generation", "ok", "0")]
        assert {r["url"]: r["epoch"] for r in dom["rows"]} == epochs
        assert {r["dot"] for r in dom["rows"]} == {"rgb(31, 157, 85)"}  # green
        assert dom["overall"] == "2 of 2 servers healthy"
        pools = {p["url"]: p["bars"] for p in dom["pools"]}
        assert [(b["level"], b["window"]) for b in pools[ctx]] == [("primary", "2048"), ("secondary", "2048")]
        assert [(b["level"], b["window"]) for b in pools[gen]] == [("primary", "2048")]  # no host tier
        assert pools[ctx][0]["label"].endswith("free 32 of 32 blocks")  # max_tokens 1024 / 32 per block
        for bar in pools[ctx] + pools[gen]:
            segs = dict(bar["segs"])
            assert sorted(segs) == ["cached", "free", "in_use"] and segs["free"] > 0
        requests_before, xfer_before = int(dom["requests"]), int(dom["xfer"])
        assert [p["name"] for p in dom["phases"]] == PHASES  # every phase, nothing observed yet
        assert {(p["p50"], p["mean"], p["count"]) for p in dom["phases"]} == {("–", "–", "0")}
        assert dom["experts_hidden"] and dom["experts"] == []  # a dense model: no expert load

        # load: the numbers move on the open page
        errors: list = []
        load = threading.Thread(target=run_load, args=(dep.url, errors))
        load.start()
        try:
            wait_dom(browser, lambda d: d["rps"] not in ("–", "0.00"), 30, "requests per second above 0 under load")
            dom = wait_dom(browser, lambda d: int(d["requests"]) >= requests_before + LOAD_REQUESTS
                           and int(d["xfer"]) >= xfer_before + LOAD_REQUESTS, 60, "the load's requests and transfers")
        finally:
            load.join(timeout=120)
        assert errors == []
        assert re.fullmatch(SECONDS, dom["ttft"]) and re.fullmatch(SECONDS, dom["tpot"]), dom
        # every phase of the load's requests: its p50 and mean as times, over the requests it counted
        dom = wait_dom(browser, lambda d: all(int(p["count"]) > 0 for p in d["phases"]), 10, "every TTFT phase")
        for phase in dom["phases"]:
            assert re.fullmatch(SECONDS, phase["p50"]) and re.fullmatch(SECONDS, phase["mean"]), phase
            assert int(phase["count"]) <= (LOAD_REQUESTS // 2 if phase["name"] == "handoff" else LOAD_REQUESTS), phase
        sources = {p["name"]: p["source"] for p in dom["phases"]}
        assert (sources["prefill"], sources["kv_transfer"], sources["handoff"]) == (
            "context / aggregated servers", "generation servers", "router")
        assert [p["label"] for p in dom["phases"]][:2] == ["router queue", "context queue"]
        assert row(dom, gen)["transfers"] == f"{LOAD_REQUESTS} (0 failed)"
        host = [b for b in next(p["bars"] for p in dom["pools"] if p["url"] == ctx) if b["level"] == "secondary"]
        assert int(re.search(r"cached (\d+)", host[0]["label"]).group(1)) > 0, host  # evicted blocks went to the host
        assert float(dom["offload"]) > 0, dom  # blocks/s over the last 10 s
        screenshot(browser, tmp_path, "dashboard.png")

        # a killed generation server turns red within seconds; the context server stays green
        [gen_pid] = dep.server_pids("generation")
        os.kill(gen_pid, signal.SIGKILL)
        killed = time.monotonic()
        dom = wait_dom(browser, lambda d: row(d, gen)["health"] == "down", RED_WITHIN_S, "the killed server's red row")
        print(f"generation server shown down {time.monotonic() - killed:.1f} s after SIGKILL")
        assert row(dom, gen)["dot"] == "rgb(214, 69, 69)"  # red
        assert row(dom, gen)["status"].startswith("unreachable")
        assert row(dom, ctx)["health"] == "ok"
        assert dom["overall"] == "1 of 2 servers healthy"
        screenshot(browser, tmp_path, "dashboard-server-killed.png")


def test_dashboard_shows_a_moe_deployments_expert_load(tmp_path, browser):
    with dh.launched("disagg.yaml", tmp_path, {"model": "builtin:tiny-qwen3-moe"}) as dep:
        ctx, gen = dep.context_urls[0], dep.generation_urls[0]
        browser.get(f"{dep.url}/dashboard")
        wait_dom(browser, lambda d: len(d["rows"]) == 2 and all(r["health"] == "ok" for r in d["rows"]), 15,
                 "two healthy rows")
        prompt = "The quick brown fox jumps over the lazy dog. " * 3
        for _ in range(3):
            response = httpx.post(f"{dep.url}/v1/completions", timeout=120,
                                  json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
        loaded = lambda d: len(d["experts"]) == 2 and all(  # noqa: E731
            sum(b["tokens"] for b in layer["bars"]) > 0 for card in d["experts"] for layer in card["layers"])
        dom = wait_dom(browser, loaded, 15, "both servers' expert load")
        assert not dom["experts_hidden"]
        assert sorted(card["url"] for card in dom["experts"]) == sorted([ctx, gen])
        for card in dom["experts"]:
            assert [layer["layer"] for layer in card["layers"]] == ["0", "2", "3"]  # layer 1 is dense
            for layer in card["layers"]:
                tokens = [b["tokens"] for b in layer["bars"]]
                assert len(tokens) == 8 and sum(tokens) % 2 == 0  # top-2: each token counted twice
                imbalance = max(tokens) / (sum(tokens) / 8)
                assert re.fullmatch(rf"{sum(tokens)} tokens · max / mean {imbalance:.2f} \(expert \d\)",
                                    layer["load"]), layer
                [hottest] = [b for b in layer["bars"] if b["hottest"]]
                assert hottest["tokens"] == max(tokens)
                assert hottest["height"] == max(b["height"] for b in layer["bars"]) > 0
        browser.execute_script("document.getElementById('experts-section').scrollIntoView()")
        screenshot(browser, tmp_path, "dashboard-experts.png")
