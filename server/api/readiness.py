"""What /health reports beyond a loaded engine; any status but "ok" is a 503, in this precedence:
`draining` (SIGTERM), `unhealthy` (a transceiver socket thread died), `incompatible` (a handshake
found KV layouts that disagree; `detail` names the field). A generation server also lists each
context server's handshake state (`context_servers`)."""

from __future__ import annotations

from typing import Any

from server.types import LinkState
from transceiver.receiver.link import INCOMPATIBLE, PEER_COMPATIBLE

UNKNOWN_ENDPOINT = "unknown"


def health_report(app: Any) -> dict:
    drain = getattr(app.state, "drain", None)
    if drain is not None and drain.draining:
        return drain.report()
    engine = getattr(app.state, "engine", None)
    links: LinkState = engine.links() if engine is not None else LinkState()
    if links.dead:
        return {"status": "unhealthy",
                "detail": f"the transceiver socket thread {', '.join(links.dead)} died: no KV transfer can run"}
    directory = getattr(app.state, "context_directory", None)
    if directory is None or links.peers is None:
        return {}
    peers = {}  # context server URL -> the state of this server's handshake with its KV sender
    for url in directory.context_urls:
        endpoint = directory.endpoint_of(url)
        peers[url] = UNKNOWN_ENDPOINT if endpoint is None else links.peers.get(endpoint, "unchecked")
    if any(state != PEER_COMPATIBLE for state in peers.values()):
        directory.nudge()  # learn endpoints and shake hands now, not at the next interval
    bad = {url: state for url, state in peers.items() if state.startswith(INCOMPATIBLE)}
    if bad:
        detail = "; ".join(f"context server {url}: {state.removeprefix(INCOMPATIBLE + ': ')}"
                           for url, state in bad.items())
        return {"status": INCOMPATIBLE, "detail": detail, "context_servers": peers}
    return {"context_servers": peers}
