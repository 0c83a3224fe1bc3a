"""What the HTTP side asks the engine loop to do, and how the loop does it on its `EngineCore`.

The same typed commands feed both engine modes: the engine thread's queue (`AsyncEngine`) and the
engine process's socket (server/engine_host/, msgspec-encoded: they are tagged Structs). Either
loop applies them between steps, on the thread that owns the core.
"""

from __future__ import annotations

import logging

import msgspec

from server.types import GenerateRequest, RequestOutput

log = logging.getLogger(__name__)


class Add(msgspec.Struct, tag=True, frozen=True):
    """Queue a request (its outputs stream back under its request_id)."""

    request: GenerateRequest


class Abort(msgspec.Struct, tag=True, frozen=True):
    """End a request (every choice) now and free its blocks (no-op if it ended already)."""

    request_id: str


class Release(msgspec.Struct, tag=True, frozen=True):
    """Context side: drop a lease whose generation leg will never pull (no-op if unknown)."""

    ctx_request_id: str


Command = Add | Abort | Release


def apply(core, command: Command) -> list[RequestOutput]:
    """Run one command on the engine's thread; the outputs it ends a request with (one per choice), if any."""
    if isinstance(command, Add):
        return core.add_request(command.request)  # a request this role cannot take: answered at once
    if isinstance(command, Abort):
        return core.abort(command.request_id)
    core.connector.drop_lease(command.ctx_request_id)
    return []


def guarded_step(core) -> list[RequestOutput]:
    """One engine step; a broken step fails what was in flight instead of killing the loop."""
    try:
        return core.step()
    except Exception as exc:
        log.exception("engine step failed")
        return fail_all(core, f"engine error: {exc}")


def fail_all(core, message: str) -> list[RequestOutput]:
    scheduler = core.scheduler
    requests = [*scheduler.running, *scheduler.waiting, *scheduler.transferring.values()]
    return [o for r in requests for o in core.fail(r, message, code=500)]
