"""/health beyond a loaded engine (server/api/routes/health.py) with real transceivers in-process:
a dead socket thread makes the server unhealthy, naming the thread; a generation
server's background handshake names the layout field a context server disagrees on (item 6); a
draining server says so and refuses new requests (item 3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from kv_factories import make_manager
from test_api_engine_fake import FakeEngine, KnownEndpoints, deployment_app
from waiting import wait_until

from kvcache import KVCacheManager
from server.deploy.drain import Drain
from server.deploy.serve import install_health
from server.engine_host.loop import links_of
from transceiver.config import TransceiverConfig
from transceiver.receiver import KVReceiver
from transceiver.sender import KVSender

CONFIG = TransceiverConfig(auth_token="unit-health-token-0123456789")


def kv(dtype: torch.dtype = torch.float32, tokens_per_block: int = 4, heads: int = 2) -> KVCacheManager:
    return make_manager("cpu", tpb=tokens_per_block, primary_blocks=64 // tokens_per_block, windows=(64, 64),
                        heads=heads, dim=8, dtype=dtype)


class Directory(KnownEndpoints):
    """The ContextDirectory surface readiness reads: URLs, their endpoints, nudge."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        super().__init__(frozenset(endpoints.values()))
        self.context_urls = tuple(endpoints)
        self._by_url = endpoints
        self.nudged = 0

    def endpoint_of(self, url: str) -> str | None:
        return self._by_url.get(url)

    def nudge(self) -> None:
        self.nudged += 1


def app_with(engine: FakeEngine, directory=None, drain: Drain | None = None):
    app = deployment_app(lambda: engine, directory)
    install_health(app, drain or Drain(5.0))
    return app


def engine_with(sender=None, receiver=None) -> FakeEngine:
    """A fake engine whose /health reads these real transceivers as a loaded engine's are read."""
    engine = FakeEngine()
    core = SimpleNamespace(connector=SimpleNamespace(sender=sender, receiver=receiver))
    engine.links = lambda: links_of(core)
    return engine


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected death
def test_a_dead_socket_thread_makes_health_503_naming_it():
    sender = KVSender(kv(), CONFIG, "fp")
    try:
        with TestClient(app_with(engine_with(sender=sender))) as client:
            assert client.get("/health").status_code == 200

            def boom(*_args):
                raise RuntimeError("injected: the socket thread's loop breaks")

            sender._thread._read_ready = boom  # the next turn of its loop raises outside every guard
            wait_until(lambda: not sender.link_alive, 10, "the socket thread dead")
            response = client.get("/health")
            assert response.status_code == 503
            assert response.json()["status"] == "unhealthy"
            assert "kv-sender" in response.json()["detail"] and "died" in response.json()["detail"]
    finally:
        sender.close()


@pytest.mark.parametrize("skew, field", [
    (dict(tokens_per_block=8), "tokens_per_block differs: context 4 vs generation 8"),
    (dict(dtype=torch.bfloat16), "dtype differs: context 'float32' vs generation 'bfloat16'"),
    (dict(heads=4), "kv_heads differs: context 2 vs generation 4"),
])
def test_handshake_in_the_background_names_the_skewed_field(skew, field):
    sender = KVSender(kv(), CONFIG, "fp")
    receiver = KVReceiver(kv(**skew), CONFIG, "fp")
    same = KVSender(kv(**skew), CONFIG, "fp")  # a second context server that agrees
    urls = {"http://ctx-a:1": sender.endpoint, "http://ctx-b:2": same.endpoint}
    directory = Directory(urls)
    try:
        with TestClient(app_with(engine_with(receiver=receiver), directory)) as client:
            body = client.get("/health").json()
            assert body["context_servers"] == {"http://ctx-a:1": "unchecked", "http://ctx-b:2": "unchecked"}
            assert directory.nudged  # not yet known: look now, not at the next interval
            for endpoint in urls.values():
                receiver.probe(endpoint)
            wait_until(lambda: all(receiver.peer_status().get(e, "unchecked") != "unchecked" for e in urls.values()),
                       10, "every peer checked")
            response = client.get("/health")
            assert response.status_code == 503, response.text
            body = response.json()
            assert body["status"] == "incompatible"
            assert field in body["detail"] and "http://ctx-a:1" in body["detail"]
            assert body["context_servers"]["http://ctx-b:2"] == "compatible"
            assert body["context_servers"]["http://ctx-a:1"].startswith("incompatible: ")
    finally:
        for link in (receiver, sender, same):
            link.close()


def test_probes_do_not_repeat_a_done_handshake():
    sender, marker = KVSender(kv(), CONFIG, "fp"), KVSender(kv(), CONFIG, "fp")
    receiver = KVReceiver(kv(), CONFIG, "fp")
    try:
        for _ in range(5):
            receiver.probe(sender.endpoint)
        wait_until(lambda: receiver.peer_status().get(sender.endpoint) == "compatible", 10, "the handshake")
        for _ in range(3):
            receiver.probe(sender.endpoint)
        # the receiver's socket thread takes probes in order: once the marker's handshake is done, every
        # probe above was handled (and anything it sent went out before the marker's Hello)
        receiver.probe(marker.endpoint)
        wait_until(lambda: receiver.peer_status().get(marker.endpoint) == "compatible", 10, "the marker's handshake")
        assert sender.stats.rejected_messages == 0
        assert receiver.peer_status() == {sender.endpoint: "compatible", marker.endpoint: "compatible"}
    finally:
        receiver.close()
        sender.close()
        marker.close()


def test_draining_server_reports_it_and_refuses_new_requests():
    drain = Drain(5.0)
    with TestClient(app_with(FakeEngine(), drain=drain)) as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        drain.begin()
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert client.get("/v1/models").status_code == 200  # only admissions are refused
