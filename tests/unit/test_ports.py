"""server/deploy/ports.py: every port a deployment listens on, named by its server and key, and the
ones in use found with a real listener on them."""

import socket

import yaml
from deploy_harness import free_ports

from server.config.schema import load_deployment
from server.deploy.ports import Listener, bind_http, busy_ports, listeners


def test_every_port_is_named_by_its_server_and_key(tmp_path):
    router, c0, c1, g0, kv = free_ports(5)
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({
        "model": "builtin:tiny-llama", "port": router,
        "context_servers": {"urls": [f"127.0.0.1:{c0}", f"127.0.0.1:{c1}"]},
        "generation_servers": {"urls": [f"127.0.0.1:{g0}"], "cache_transceiver_config": {"port": kv}}}))
    cfg = load_deployment(path)
    assert listeners(cfg) == [Listener("router", "port", "127.0.0.1", router),
                              Listener("context-0", "context_servers.urls[0]", "127.0.0.1", c0),
                              Listener("context-1", "context_servers.urls[1]", "127.0.0.1", c1),
                              Listener("generation-0", "generation_servers.urls[0]", "127.0.0.1", g0)]
    assert busy_ports(cfg) == []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", c1))
        taken.listen()
        assert busy_ports(cfg) == [f"port {c1} of context-1 (context_servers.urls[1] in {path}: 127.0.0.1:{c1}): "
                                   "Address already in use"]


def test_a_context_servers_fixed_kv_port_and_a_single_server(tmp_path):
    port, ctx, gen, kv = free_ports(4)
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({
        "model": "builtin:tiny-llama", "port": port, "context_servers": {
            "urls": [f"127.0.0.1:{ctx}"], "cache_transceiver_config": {"port": kv, "host": "127.0.0.2"}},
        "generation_servers": {"urls": [f"127.0.0.1:{gen}"]}}))
    assert listeners(load_deployment(path))[2] == Listener("context-0", "cache_transceiver_config.port of context-0",
                                                           "127.0.0.2", kv)
    single = tmp_path / "one.yaml"
    single.write_text(yaml.safe_dump({"model": "builtin:tiny-llama", "port": port}))
    assert listeners(load_deployment(single)) == [Listener("aggregated-0", "port", "127.0.0.1", port)]


def test_bind_http_binds_without_listening():
    sock = bind_http("127.0.0.1", 0)
    try:
        with socket.socket() as client:  # bound, not listening: refused, as a free port would be
            assert client.connect_ex(sock.getsockname()) != 0
    finally:
        sock.close()
