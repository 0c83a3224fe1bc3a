"""The log setup of every pdserve process (`pdserve serve`, `pdserve router`): INFO to stderr, with
the HTTP client libraries' own INFO lines off. httpx logs one line per request at INFO, and a
generation server asks its context servers for their KV endpoints every few seconds
(server/api/context_directory.py): an idle server would log forever."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LOGGERS = ("httpx", "httpcore")  # their warnings and errors still show


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
