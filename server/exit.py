"""How a pdserve process ends once everything it owns is closed, and how its end is told."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush the logs and the standard streams, then skip the interpreter's teardown: its final
    garbage collection of torch, the model and the caches takes about a second of CPU, which every
    stop and every restart of a server would otherwise wait for. Callers close what they own first
    (sockets, the disk tier's writes, child processes): nothing here runs atexit handlers."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_text(returncode: int) -> str:
    """A child's end as words: `exit code N`, or the signal that killed it."""
    return f"signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"
