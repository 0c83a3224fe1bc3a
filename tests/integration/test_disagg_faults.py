"""Fault injection on a real disaggregated deployment (`pdserve launch`, real processes on loopback).

One `disagg.yaml` deployment (fixed auth token, a 3 s context-side lease) serves every test here,
none of which breaks it: a generation server that never pulls, forged/truncated/replayed/
wrong-version transceiver messages, pulls for unknown, stale-epoch and expired leases, and a client
that disconnects mid-stream. The tests that kill servers are in test_disagg_fault_kills.py (they
use the helpers of this module).
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import deploy_harness as dh
import httpx
import msgspec
import pytest
import zmq
from waiting import wait_until

from transceiver.signed import Envelope, derive_key, mac
from transceiver.wire import PROTOCOL_VERSION, TO_RECEIVER, TO_SENDER, Body, Failed, Hello, Layout

TOKEN = "fault-injection-token-0123456789abcdef"
AUTHORISED = {"x-pdserve-token": TOKEN}  # what the router sends to its servers
LEASE_MS = 3000  # the shared deployment's context-side kv_transfer_timeout_ms
TPB = 32  # tokens_per_block of disagg.yaml
SHARED = {
    "cache_transceiver_config": {"auth_token": TOKEN},
    "context_servers": {"cache_transceiver_config": {"kv_transfer_timeout_ms": LEASE_MS}},
}
PROMPT = "Fault injection keeps the server honest: " + "every lease ends, every block comes back. " * 3
LONG_TOKENS = 1800  # a stream that cannot end on its own while a test watches it
FAST_S = 3.0  # a failure that does not wait for any timeout answers within this


# ---- helpers -------------------------------------------------------------------------------------

def in_use(dep: dh.Deployment, url: str) -> float:
    return dep.metric(url, "pdserve_kv_cache_blocks", 'state="in_use"')


def running(dep: dh.Deployment, url: str) -> float:
    return dep.metric(url, "pdserve_requests", 'state="running"')


def wait_idle(dep: dh.Deployment, urls: list[str], timeout_s: float) -> None:
    for url in urls:
        wait_until(lambda u=url: in_use(dep, u) == 0 and running(dep, u) == 0, timeout_s,
                   what=f"no block in use and nothing running on {url}")


def data_events(lines: Iterator[str]) -> Iterator[str]:
    """The payloads of an SSE stream's `data:` lines."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]


@contextmanager
def long_stream(url: str) -> Iterator[Iterator[str]]:
    """A streaming completion through `url` too long to end by itself; yields its event payloads
    once 3 have arrived. Leaving the block closes the connection."""
    body = {"prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=httpx.Timeout(10.0)) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = data_events(response.iter_lines())
        for _ in range(3):
            assert json.loads(next(events))["choices"][0]["text"] is not None
        yield events


def fresh_prompt(tag: str) -> str:
    """A prompt no server has cached (a local prefix hit on the generation server skips the pull)."""
    return f"[{tag} {secrets.token_hex(4)}] {PROMPT}"


def context_only(url: str, prompt: str = PROMPT) -> tuple[dict, float]:
    """A `context_only` answer straight from a context server, and when it arrived (monotonic)."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "disaggregated_params": {"request_type": "context_only"}}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTHORISED, timeout=60)
    arrived = time.monotonic()
    assert response.status_code == 200, response.text
    return response.json(), arrived


def complete(url: str, prompt: str = PROMPT, max_tokens: int = 8) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == max_tokens
    return answer


def generation_only(url: str, prompt: str, params: dict) -> tuple[httpx.Response, float]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "disaggregated_params": {**params, "request_type": "generation_only"}}
    start = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTHORISED, timeout=60)
    return response, time.monotonic() - start


def assert_transfer_failed(response: httpx.Response, seconds: float, detail: str,
                           limit_s: float = FAST_S, status: int = 502) -> None:
    assert seconds < limit_s, f"the failure took {seconds:.1f} s"
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"].startswith("KV transfer from the context server failed: "), error
    assert detail in error["message"], error


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[dh.Deployment]:
    with dh.launched("disagg.yaml", tmp_path_factory.mktemp("faults"), SHARED) as dep:
        yield dep


# ---- 3. a generation server that never pulls ----------------------------------------------------

def test_lease_expires_when_nobody_pulls(shared):
    ctx = shared.context_urls[0]
    expired_before = shared.metric(ctx, "pdserve_kv_transfer_lease_expired_total")
    answer, arrived = context_only(ctx, fresh_prompt("lease"))
    params = answer["choices"][0]["disaggregated_params"]
    assert params["ctx_request_id"] and params["ctx_endpoint"].startswith("tcp://127.0.0.1:")
    leased = math.ceil(answer["usage"]["prompt_tokens"] / TPB)
    wait_until(lambda: in_use(shared, ctx) == leased, 1.0, what=f"{leased} blocks pinned by the lease")
    wait_until(lambda: in_use(shared, ctx) == 0, LEASE_MS / 1000 + 3, what="lease reaped")
    held_s = time.monotonic() - arrived
    assert held_s >= 0.8 * LEASE_MS / 1000, f"released after {held_s:.2f} s, before the lease ended"
    assert shared.metric(ctx, "pdserve_kv_transfer_lease_expired_total") == expired_before + 1
    wait_idle(shared, shared.context_urls + shared.generation_urls, 5)


# ---- 4. forged, truncated, replayed, wrong-version transceiver messages ------------------------

BOGUS_LAYOUT = Layout(tokens_per_block=TPB, windows=[], fingerprint="fault-injection")
REPLY_WAIT_MS = 300


def seal(body: Body, *, token: str = TOKEN, version: int = PROTOCOL_VERSION) -> list[bytes]:
    """[header, mac] as a receiver would send it (transceiver/signed.py's layout, built here)."""
    env = Envelope(version=version, epoch="fault-injection", seq=secrets.randbits(64), ts=time.time(),
                   body=msgspec.Raw(msgspec.msgpack.encode(body)))
    header = msgspec.msgpack.encode(env)
    return [header, _mac(header, token)]


def _mac(header: bytes, token: str = TOKEN, direction: str = TO_SENDER) -> bytes:
    return mac(derive_key(token.encode(), "kv-link", direction), header)


def reply(sock: zmq.Socket) -> Body | None:
    """The authenticated answer on `sock` within REPLY_WAIT_MS, or None."""
    if not sock.poll(REPLY_WAIT_MS):
        return None
    header, tag = sock.recv_multipart()
    assert hmac.compare_digest(_mac(header, direction=TO_RECEIVER), tag)
    env = msgspec.msgpack.decode(header, type=Envelope)
    return msgspec.msgpack.decode(env.body, type=Body)


def test_bad_transceiver_messages_are_dropped_and_counted(shared):
    ctx = shared.context_urls[0]
    endpoint = context_only(ctx)[0]["choices"][0]["disaggregated_params"]["ctx_endpoint"]
    hello = seal(Hello(layout=BOGUS_LAYOUT))
    good_mac = hello[1]
    undecodable = b"\x93not-an-envelope"
    bad = {
        "forged (wrong token)": seal(Hello(layout=BOGUS_LAYOUT), token="an-attackers-guess-0123456789"),
        "truncated header": [hello[0][: len(hello[0]) // 2], good_mac],
        "truncated multipart (no mac)": [hello[0]],
        "authentic but undecodable": [undecodable, _mac(undecodable)],
        "wrong protocol version": seal(Hello(layout=BOGUS_LAYOUT), version=PROTOCOL_VERSION + 1),
        "replayed": hello,
    }
    rejected = shared.metric(ctx, "pdserve_kv_transfer_rejected_messages_total")
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(hello)  # the original of the replay: authentic, so it is answered
        answer = reply(sock)
        assert isinstance(answer, Failed) and answer.reason == "incompatible", answer
        for what, frames in bad.items():
            sock.send_multipart(frames)
            rejected += 1
            assert reply(sock) is None, f"{what}: answered"
            wait_until(lambda r=rejected: shared.metric(ctx, "pdserve_kv_transfer_rejected_messages_total") == r,
                       3, what=f"{what}: counted once")
        sock.send_multipart(seal(Hello(layout=BOGUS_LAYOUT)))  # the link still answers fresh messages
        assert isinstance(reply(sock), Failed)
    finally:
        sock.close()
        zctx.term()
    assert httpx.get(f"{ctx}/health", timeout=5).status_code == 200
    complete(shared.url)
    assert shared.metric(ctx, "pdserve_kv_transfer_rejected_messages_total") == rejected
    wait_idle(shared, shared.context_urls + shared.generation_urls, LEASE_MS / 1000 + 3)


# ---- 5. pulls for unknown, stale-epoch and expired leases ---------------------------------------

def test_pull_for_unknown_stale_or_expired_lease_fails_fast(shared):
    ctx, gen = shared.context_urls[0], shared.generation_urls[0]
    failures = lambda reason: shared.metric(gen, "pdserve_kv_transfer_failures_total", f'reason="{reason}"')
    unknown_before, stale_before = failures("unknown_request"), failures("epoch_mismatch")
    prompt = fresh_prompt("pull")
    params = context_only(ctx, prompt)[0]["choices"][0]["disaggregated_params"]
    rid = params["ctx_request_id"]

    response, seconds = generation_only(gen, prompt, {**params, "ctx_request_id": "no-such-request"})
    assert_transfer_failed(response, seconds, "no lease for ctx_request_id 'no-such-request'", status=404)
    response, seconds = generation_only(gen, prompt, {**params, "ctx_epoch": "0" * 32})
    assert_transfer_failed(response, seconds, f"the request was prefilled by epoch {'0' * 32}")
    wait_until(lambda: in_use(shared, ctx) == 0, LEASE_MS / 1000 + 3, what="the real lease expired")
    response, seconds = generation_only(gen, prompt, params)
    assert_transfer_failed(response, seconds, f"no lease for ctx_request_id '{rid}'", status=404)

    wait_until(lambda: (failures("unknown_request"), failures("epoch_mismatch"))
                  == (unknown_before + 2, stale_before + 1), 2, what="each failure counted once by reason")
    wait_idle(shared, [ctx, gen], 5)
    complete(shared.url)


# ---- 6. a client that disconnects mid-stream ----------------------------------------------------

def test_client_disconnect_mid_stream_cancels_both_legs(shared):
    ctx, gen = shared.context_urls[0], shared.generation_urls[0]
    tokens = lambda: shared.metric(gen, "pdserve_generation_tokens_total")
    before = tokens()
    with long_stream(shared.url):
        wait_until(lambda: running(shared, gen) == 1, 2, what="the stream decoding")
    # leaving the block closed the connection mid-stream
    wait_idle(shared, [ctx, gen], 5)
    produced = tokens() - before
    assert 3 <= produced < LONG_TOKENS
    # A later request of 8 tokens: while it decodes, a stream that had kept going would decode beside
    # it, one token a step, and the generation server would count far more than 8 new tokens.
    complete(shared.url, max_tokens=8)
    assert tokens() - before - produced <= 8, "decoding went on after the client left"


# ---- 7. only the deployment drives the KV plane -------------------------------------------------

def prefix_queries(dep: dh.Deployment, url: str) -> float:
    """Prompt tokens the server looked up in its prefix cache: moves for every request it admits."""
    return dep.metric(url, "pdserve_prefix_cache_query_tokens_total")


@contextmanager
def listener() -> Iterator[tuple[str, socket.socket]]:
    """A TCP port nobody should connect to: (its tcp:// address, the listening socket)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        sock.settimeout(1.0)
        yield f"tcp://127.0.0.1:{sock.getsockname()[1]}", sock


def assert_no_connection(sock: socket.socket) -> None:
    try:
        peer = sock.accept()
    except TimeoutError:
        return
    peer[0].close()
    raise AssertionError(f"a server connected to the client-named address from {peer[1]}")


def test_unauthenticated_context_only_pins_nothing(shared):
    ctx = shared.context_urls[0]
    wait_idle(shared, [ctx], 5)  # the lease of the last test's request ends once its Release lands
    queried = prefix_queries(shared, ctx)
    body = {"prompt": fresh_prompt("pin"), "max_tokens": 8, "disaggregated_params": {"request_type": "context_only"}}
    for headers in ({}, {"x-pdserve-token": "an-attackers-guess-0123456789"}):
        response = httpx.post(f"{ctx}/v1/completions", json=body, headers=headers, timeout=10)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "authentication_error"
    assert in_use(shared, ctx) == 0
    assert prefix_queries(shared, ctx) == queried, "the refused requests reached the engine"
    for path in ("/kv_cache/hashes", "/kv_cache/endpoint"):
        assert httpx.get(ctx + path, timeout=10).status_code == 401


def test_generation_server_never_connects_where_a_request_says(shared):
    ctx, gen = shared.context_urls[0], shared.generation_urls[0]
    prompt = fresh_prompt("ssrf")
    params = context_only(ctx, prompt)[0]["choices"][0]["disaggregated_params"]
    with listener() as (address, sock):
        forged = {**params, "ctx_endpoint": address, "request_type": "generation_only"}
        body = {"prompt": prompt, "max_tokens": 8, "disaggregated_params": forged}
        unauthenticated = httpx.post(f"{gen}/v1/completions", json=body, timeout=10)
        assert unauthenticated.status_code == 401, unauthenticated.text
        response, seconds = generation_only(gen, prompt, forged)
        assert response.status_code == 403, response.text
        assert response.json()["error"]["param"] == "disaggregated_params.ctx_endpoint"
        assert seconds < FAST_S
        assert_no_connection(sock)
    ok, _ = generation_only(gen, prompt, params)  # the real lease is still there and still served
    assert ok.status_code == 200, ok.text
    wait_idle(shared, [ctx, gen], 5)


def test_router_refuses_client_disaggregated_params(shared):
    ctx = shared.context_urls[0]
    queried = prefix_queries(shared, ctx)
    for params in ({"request_type": "context_only"},
                   {"request_type": "generation_only", "ctx_endpoint": "tcp://127.0.0.1:1"}):
        body = {"prompt": "hi", "max_tokens": 4, "disaggregated_params": params}
        response = httpx.post(f"{shared.url}/v1/completions", json=body, timeout=10)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "disaggregated_params_not_allowed")
    assert prefix_queries(shared, ctx) == queried
    complete(shared.url)


def test_duplicate_and_spent_transfer_ids_get_4xx_and_disturb_nothing(shared):
    ctx, gen = shared.context_urls[0], shared.generation_urls[0]
    prompt = fresh_prompt("dup")
    params = context_only(ctx, prompt)[0]["choices"][0]["disaggregated_params"]
    reference = complete(shared.url, prompt, max_tokens=40)["choices"][0]["text"]
    # the first request cannot end on its own while the test watches it: the duplicate meets it live
    body = {"prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "disaggregated_params": {**params, "request_type": "generation_only"}}
    with httpx.Client(timeout=httpx.Timeout(30.0)) as client, \
            client.stream("POST", f"{gen}/v1/completions", json=body, headers=AUTHORISED) as first:
        assert first.status_code == 200
        events = data_events(first.iter_lines())
        text = json.loads(next(events))["choices"][0]["text"]
        duplicate, _ = generation_only(gen, prompt, params)
        assert duplicate.status_code == 409, duplicate.text
        while len(text) < len(reference):
            text += json.loads(next(events))["choices"][0]["text"]
    assert text.startswith(reference)  # the first request went on undisturbed (it is aborted on leaving)
    # its lease was released by the Ack. The generation server now holds the whole prompt and would
    # pull nothing for it (only missing blocks are pulled), so ask under a salt it holds
    # nothing for: then it must pull, and the spent lease is refused
    spent, seconds = generation_only(gen, prompt, {**params, "cache_salt": "nothing-cached-under-this"})
    assert_transfer_failed(spent, seconds, f"no lease for ctx_request_id '{params['ctx_request_id']}'", status=404)
    wait_idle(shared, [ctx, gen], 5)
