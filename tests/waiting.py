"""The tests' one way to wait for something: poll a predicate until it holds, with a timeout.

Tests wait for the event they need (a metric moved, a line was logged, a thread started), never for a
fixed time. `wait_until` returns the predicate's last truthy value, so a test can wait for a reading
and use it; on timeout it fails naming what it waited for and the last value seen.

    import waiting
    state = waiting.wait_until(lambda: rx.state(), 10, what="the pull to end", check=lambda s: s.done)

Imported as `import waiting` (pytest puts tests/ on sys.path: tests/conftest.py is a rootdir conftest).
`wait_until_async` is the same for coroutines on an event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


def _is_true(value: Any) -> bool:
    return bool(value)


def _message(what: str, timeout_s: float, last: Any, extra: Callable[[], str] | None) -> str:
    message = f"{what}: not within {timeout_s:g} s (last reading: {last!r:.500})"
    return f"{message}\n{extra()}" if extra is not None else message


def wait_until(probe: Callable[[], T], timeout_s: float, what: str = "the condition", *, interval_s: float = 0.05,
               check: Callable[[T], bool] = _is_true, step: Callable[[], Any] | None = None,
               on_timeout: Callable[[], str] | None = None) -> T:
    """Call `probe` (and `step` between calls, e.g. an engine step, instead of sleeping when given)
    until `check(probe())` holds; return that reading. AssertionError after `timeout_s`, naming
    `what`, the last reading and `on_timeout()` (e.g. server logs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = probe()
        if check(last):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(_message(what, timeout_s, last, on_timeout))
        if step is not None:
            step()
        else:
            time.sleep(interval_s)


async def wait_until_async(probe: Callable[[], T], timeout_s: float, what: str = "the condition", *,
                           interval_s: float = 0.01,
                           check: Callable[[T], bool] = _is_true) -> T:
    """`wait_until` on an event loop: the loop keeps running between readings."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = probe()
        if check(last):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(_message(what, timeout_s, last, None))
        await asyncio.sleep(interval_s)


@contextmanager
def uvicorn_in_thread(app, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve the ASGI `app` with uvicorn on a free loopback port in a daemon thread; yields its base
    URL once uvicorn has started, and stops it (and fails if it does not stop) on leaving."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race with other tests
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), timeout_s, "uvicorn to start")
        assert thread.is_alive(), "uvicorn exited at startup"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)
        sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"
