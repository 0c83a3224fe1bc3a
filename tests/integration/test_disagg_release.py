"""A generation leg that fails before pulling makes the router release the context lease at once."""

from __future__ import annotations

import json
import time

import deploy_harness as dh
import httpx
from waiting import wait_until

TOKEN = "release-test-token-0123456789abcdef"
FILLER = "The system should keep the answer short, clear and correct, and it should cite the facts it uses. "


def test_rejected_generation_leg_releases_the_context_lease(tmp_path):
    # the generation pool cannot hold the prompt (another max_seq_len would be a layout skew, refused
    # at launch: docs/RELIABILITY.md), so the generation leg is refused before any pull
    overrides = {"cache_transceiver_config": {"auth_token": TOKEN},
                 "generation_servers": {"kv_cache_config": {"max_tokens": 128}}}
    with dh.launched("disagg.yaml", tmp_path, overrides) as dep:
        ctx = dep.context_urls[0]
        started = time.monotonic()
        body = {"prompt": FILLER * 6, "max_tokens": 8, "temperature": 0}  # ~300 tokens
        response = httpx.post(f"{dep.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert "KV cache" in response.json()["error"]["message"], response.text
        wait_until(lambda: dep.metric(ctx, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10,
                   what="context lease released")
        events = _streamed_events(dep.url, {**body, "stream": True})
        assert all("choices" in event for event in events[:-1])  # at most the router's first token
        error = events[-1]["error"]
        assert error["message"].startswith("generation leg failed (HTTP 400): "), error
        wait_until(lambda: dep.metric(ctx, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10,
                   what="context lease released after the streamed attempt")
        assert time.monotonic() - started < 20  # far below the 60 s lease
        assert dep.metric(ctx, "pdserve_kv_transfer_lease_expired_total") == 0
        denied = httpx.post(f"{ctx}/kv_cache/release", json={"ctx_request_id": "x"}, timeout=10)
        assert denied.status_code == 401
        allowed = httpx.post(f"{ctx}/kv_cache/release", json={"ctx_request_id": "x"}, timeout=10,
                             headers={"x-pdserve-token": TOKEN})
        assert allowed.status_code == 200


def _streamed_events(url: str, body: dict) -> list[dict]:
    """The JSON events of one streamed request, up to [DONE] (the status is 200 once streaming began)."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]
