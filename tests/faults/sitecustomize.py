"""Fault injection for live-deployment tests, with no hook in pdserve itself.

A test that puts this folder on PYTHONPATH and names a folder in PDSERVE_TEST_FAULT_DIR makes every
process of the deployment import this module at start-up (Python's `site` imports `sitecustomize`).
It then wraps two methods of the real KV sender; each fault is on while its file exists in that
folder, so a test turns it on and off at run time:

- `suppress_unpin`: a lease that ends keeps its pins (what a lost lease release looks like): the
  blocks are stranded, held by no lease and no request;
- `drop_pulls`: the sender ignores pull requests, so the generation server's pull times out (a
  broken transfer between two otherwise healthy servers).

Without PDSERVE_TEST_FAULT_DIR nothing is imported or changed.
"""

import os

_FAULTS = os.environ.get("PDSERVE_TEST_FAULT_DIR")


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


if _FAULTS:
    _install()
