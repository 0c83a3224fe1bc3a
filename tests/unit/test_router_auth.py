"""API keys at the router (server/router/auth.py): configuration from YAML, file and environment
with errors naming key and file, the 401 in OpenAI's shape, open paths, and the tenant salt the
router hands to its servers (checked on a recording server behind a real router app)."""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading
from pathlib import Path

import pytest
import uvicorn
import yaml
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from waiting import wait_until

from server.config.router import RouterConfig
from server.config.schema import AUTH_TOKEN_ENV, ConfigError, load_deployment
from server.router.app import create_router_app
from server.router.auth import API_KEYS_ENV, RouterAccess, effective_cache_salt, tenant_salt

TOKEN = "router-auth-test-token-0123456789"
KEYS = ("key-alpha", "key-beta")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)


def _deployment(tmp_path: Path, router: dict) -> Path:
    data = {"model": "builtin:tiny-llama", "router": router,
            "generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:8002"]}}
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_keys_come_from_the_yaml_a_file_and_the_environment(tmp_path, monkeypatch):
    (tmp_path / "keys.txt").write_text("# tenants\nkey-file-1\n\n  key-file-2  \n")
    monkeypatch.setenv(API_KEYS_ENV, "key-env-1, key-env-2,")
    cfg = load_deployment(_deployment(tmp_path, {"api_keys": ["key-yaml"], "api_keys_file": "keys.txt",
                                                 "tenant_salt_from_api_key": True}))
    access = cfg.router.access()
    assert access.api_keys == ("key-yaml", "key-file-1", "key-file-2", "key-env-1", "key-env-2")
    assert access.open_paths == ("/health", "/metrics") and access.tenant_salt_from_api_key
    assert "key-yaml" not in repr(cfg)  # keys never reach logs through the config's repr
    monkeypatch.delenv(API_KEYS_ENV)
    assert load_deployment(_deployment(tmp_path, {})).router.access() == RouterAccess()  # open, as before


@pytest.mark.parametrize("router, message", [
    ({"api_keys": "key-a"}, r"router\.api_keys: must be a non-empty list of keys"),
    ({"api_keys": ["ok", "has space"]}, r"router\.api_keys\[1\]: must be a key without spaces or commas"),
    ({"api_keys_file": "missing.txt"}, r"router\.api_keys_file: cannot read .*missing\.txt: No such file"),
    ({"api_keys_file": "empty.txt"}, r"router\.api_keys_file: .*empty\.txt holds no key"),
    ({"tenant_salt_from_api_key": True}, r"router\.tenant_salt_from_api_key: needs API keys"),
    ({"api_keys": ["k"], "open_paths": ["/metrics"]}, r"router\.open_paths: must include /health"),
    ({"api_keys": ["k"], "open_paths": "/health"}, r"router\.open_paths: must be a list of paths"),
    ({"api_keys": ["k"], "open_paths": ["/health", "/a*b"]}, r"router\.open_paths\[1\]: must be a path starting"),
    ({"api_key": ["k"]}, r"router\.api_key: unknown key \(did you mean 'api_keys'\?\)"),
])
def test_config_errors_name_the_file_and_the_key(tmp_path, router, message):
    (tmp_path / "empty.txt").write_text("# nobody\n\n")
    path = _deployment(tmp_path, router)
    with pytest.raises(ConfigError, match=rf"^{path}: {message}"):
        load_deployment(path)


def test_env_keys_that_are_only_commas_are_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEYS_ENV, " , ,")
    with pytest.raises(ConfigError, match=f"{API_KEYS_ENV}: holds no key"):
        load_deployment(_deployment(tmp_path, {}))


def test_keys_match_exactly():
    access = RouterAccess(KEYS)
    assert [access.match(k) for k in ("key-alpha", "key-beta")] == ["key-alpha", "key-beta"]
    assert [access.match(k) for k in (None, "", "key-alph", "key-alphaa", "KEY-ALPHA")] == [None] * 5


def test_tenant_salts_are_the_hmac_of_the_key_and_no_client_salt_reaches_another_tenant():
    access = RouterAccess(KEYS, tenant_salt_from_api_key=True)
    a = tenant_salt(TOKEN, "key-alpha")
    assert a == hmac.new(TOKEN.encode(), b"key-alpha", hashlib.sha256).hexdigest()
    assert effective_cache_salt(access, TOKEN, "key-alpha", None) == a
    assert effective_cache_salt(access, TOKEN, "key-alpha", "s1") == f"{a}:s1"
    b = tenant_salt(TOKEN, "key-beta")
    assert a != b and tenant_salt("another-deployment-token-0123", "key-alpha") != a
    assert effective_cache_salt(access, TOKEN, "key-alpha", b) != b  # naming B's salt gives B nothing
    assert effective_cache_salt(RouterAccess(KEYS), TOKEN, "key-alpha", "s1") == "s1"  # off: the client's


def _router(access: RouterAccess, generation_url: str = "127.0.0.1:9") -> TestClient:
    settings = RouterConfig(generation_urls=(generation_url,), health_interval_s=60, auth_token=TOKEN,
                            api_keys=access.api_keys or None, open_paths=access.open_paths,
                            tenant_salt_from_api_key=access.tenant_salt_from_api_key)
    return TestClient(create_router_app(settings))


def _assert_401(response, code: str) -> None:
    assert response.status_code == 401, response.text
    assert response.json() == {"error": {"message": response.json()["error"]["message"],
                                         "type": "authentication_error", "param": None, "code": code}}
    assert response.headers["www-authenticate"] == "Bearer"
    assert "key-alpha" not in response.text


def test_requests_without_a_valid_key_get_401_and_open_paths_stay_open():
    with _router(RouterAccess(KEYS)) as client:
        body = {"prompt": "hi", "max_tokens": 1}
        _assert_401(client.post("/v1/completions", json=body), "missing_api_key")
        _assert_401(client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}),
                    "invalid_api_key")
        _assert_401(client.post("/v1/completions", json=body, headers={"Authorization": "Basic key-alpha"}),
                    "missing_api_key")
        _assert_401(client.get("/v1/models"), "missing_api_key")
        _assert_401(client.get("/health_generate"), "missing_api_key")
        assert client.get("/health").status_code == 503  # open: it answers (no healthy server here)
        assert client.get("/metrics").status_code == 200
        ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer key-beta"})
        assert ok.status_code == 503, ok.text  # past the key check: no healthy server to route to
    with _router(RouterAccess(KEYS, open_paths=("/health",))) as client:
        _assert_401(client.get("/metrics"), "missing_api_key")
    with _router(RouterAccess(KEYS, open_paths=("/health", "/v1/mod*"))) as client:  # a prefix
        assert client.get("/v1/models").status_code == 503  # open: no healthy server to ask
        _assert_401(client.get("/metrics"), "missing_api_key")
    with _router(RouterAccess()) as client:  # no keys configured: open as before
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 503


class RecordingServer:
    """An aggregated server stand-in that records the bodies the router sends it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

        async def completions(request: Request) -> JSONResponse:
            self.bodies.append(await request.json())
            return JSONResponse({"id": "x", "object": "text_completion", "choices": [{"text": "!"}]})

        app = Starlette(routes=[Route("/health", lambda r: JSONResponse({"status": "ok"})),
                                Route("/v1/completions", completions, methods=["POST"])])
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.url = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self) -> RecordingServer:
        self.thread.start()
        wait_until(lambda: self.server.started, 20, "the recording server started")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


def test_the_router_hands_its_servers_the_tenant_salt():
    access = RouterAccess(KEYS, tenant_salt_from_api_key=True)
    with RecordingServer() as backend, _router(access, backend.url) as client:
        def send(key: str, **extra) -> str | None:
            response = client.post("/v1/completions", json={"prompt": "hi", **extra},
                                   headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
            return backend.bodies[-1].get("cache_salt")

        a, b = tenant_salt(TOKEN, "key-alpha"), tenant_salt(TOKEN, "key-beta")
        assert send("key-alpha") == a
        assert send("key-beta") == b
        assert send("key-alpha", cache_salt="s1") == f"{a}:s1"
        assert send("key-beta", cache_salt=a) == f"{b}:{a}"
        bad = client.post("/v1/completions", json={"prompt": "hi", "cache_salt": ""},
                          headers={"Authorization": "Bearer key-alpha"})
        assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
        probe = client.get("/health_generate", headers={"Authorization": "Bearer key-beta"})
        assert probe.status_code == 200 and probe.json()["generation"] == f"http://{backend.url}", probe.text
        sent = backend.bodies[-1]  # an aggregated server runs the whole probe, under a salt of its own
        assert sent["max_tokens"] == 2 and sent["cache_salt"].startswith("health-")
        assert "disaggregated_params" not in sent
