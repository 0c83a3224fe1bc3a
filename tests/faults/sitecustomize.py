"""Fault injection for live-deployment tests, with no hook in pdserve itself.

A test that puts this folder on PYTHONPATH and names a folder in PDSERVE_TEST_FAULT_DIR makes every
process of the deployment import this module at start-up (Python's `site` imports `sitecustomize`).
It then wraps two methods of the real KV sender; each fault is on while its file exists in that
folder, so a test turns it on and off at run time:

- `suppress_unpin`: a lease that ends keeps its pins (what a lost lease release looks like): the
  blocks are stranded, held by no lease and no request;
- `drop_pulls`: the sender ignores pull requests, so the generation server's pull times out (a
  broken transfer between two otherwise healthy servers);
- `slow_first_event`: a generation server holds each pull that has arrived for SLOW_FIRST_EVENT_S
  before its engine sees it, so its first event comes that much later (a generation server that is
  slow to speak after the handoff).

Without PDSERVE_TEST_FAULT_DIR nothing is imported or changed.
"""

import os
import time

_FAULTS = os.environ.get("PDSERVE_TEST_FAULT_DIR")
SLOW_FIRST_EVENT_S = 1.5


def _on(name: str) -> bool:
    return os.path.exists(os.path.join(_FAULTS, name))


def _install() -> None:
    from transceiver.sender.kv_sender import KVSender
    from transceiver.sender.serve import PullServer

    unpin = KVSender._unpin
    pull = PullServer.pull

    def _unpin(self, pinned):
        if not _on("suppress_unpin"):
            unpin(self, pinned)

    def _pull(self, io, peer, req):
        if not _on("drop_pulls"):
            pull(self, io, peer, req)

    KVSender._unpin = _unpin
    PullServer.pull = _pull
    _slow_arrivals()


def _slow_arrivals() -> None:
    from server.engine.kv_connector import GenerationConnector

    poll = GenerationConnector.poll

    def _poll(self):
        arrived, failed = poll(self)
        held = self.__dict__.setdefault("_fault_held", [])
        now = time.monotonic()
        held += [(now, a) for a in arrived]
        wait = SLOW_FIRST_EVENT_S if _on("slow_first_event") else 0.0
        ready = [a for at, a in held if now - at >= wait]
        held[:] = [(at, a) for at, a in held if now - at < wait]
        return ready, failed

    GenerationConnector.poll = _poll


if _FAULTS:
    _install()
