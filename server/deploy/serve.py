"""`pdserve serve`: build one engine server (aggregated, context or generation) and serve HTTP.

The engine runs on a thread of this process (`AsyncEngine`) or in a child process of its own
(`EngineProcess`, server/engine_host/): the config's `engine_process` (auto: a child on CUDA)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from server.api.app import create_app
from server.api.context_directory import ContextDirectory
from server.api.routes.health import EPOCH
from server.api.routes.kv_cache import install_kv_routes
from server.config.schema import ServerConfig, host_port
from server.deploy.drain import Drain, DrainGate, DrainingServer
from server.deploy.logs import configure_logging
from server.deploy.ports import bind_or_say
from server.engine_host.build import build_core, event_publisher
from server.engine_host.process import EngineProcess
from server.engine_host.thread import AsyncEngine
from server.models.runner import resolve_device
from server.telemetry.metrics import ServerMetrics
from server.tp.ranks import RANK_DIED_EXIT

log = logging.getLogger(__name__)


def kv_stream_min_tokens(cfg: ServerConfig) -> int | None:
    """The shortest prompt whose KV a context server streams while it prefills it (None: none)."""
    if cfg.role != "context" or cfg.kv_stream == "off" or cfg.tensor_parallel_size > 1:
        return None
    return 1 if cfg.kv_stream == "on" else cfg.max_num_tokens + 1


def engine_in_child(cfg: ServerConfig) -> bool:
    """`engine_process`: true or false as set; auto: a process of its own on CUDA (the event loop's
    SSE writes and the engine's host work no longer share one GIL), the engine thread on a CPU."""
    if cfg.engine_process == "auto":
        return resolve_device(cfg.device).type == "cuda"
    return cfg.engine_process


def make_app(cfg: ServerConfig, on_fatal: Callable[..., None]):
    """The server's app. `on_fatal()` is called if the engine cannot load or its process dies;
    `on_fatal(RANK_DIED_EXIT)` when a tensor-parallel rank died."""
    metrics = ServerMetrics()
    token = cfg.cache_transceiver_config.auth_token
    engine = _engine(cfg, metrics, on_fatal)

    @asynccontextmanager
    async def engine_factory() -> AsyncIterator[AsyncEngine | EngineProcess]:
        engine.start()
        watcher = asyncio.create_task(_watch_load(engine, on_fatal))
        try:
            yield engine
        finally:
            watcher.cancel()
            await engine.stop()

    directory = ContextDirectory(cfg.context_urls, token) if cfg.role == "generation" else None
    app = create_app(engine_factory, metrics=metrics, auth_token=token, context_directory=directory,
                     max_n=cfg.max_n)
    app.state.role = cfg.role  # the leg /health_generate names
    app.state.kv_stream_min_tokens = kv_stream_min_tokens(cfg)
    install_kv_routes(app)
    # nothing left to finish: no request queued or running, no KV lease or pull
    install_health(app, Drain(cfg.drain_timeout_s, lambda: app.state.engine is None or app.state.engine.idle()))
    if directory is not None:  # shake hands with every known context server (the KV layouts must agree)
        directory.on_refresh = lambda: app.state.engine is not None and app.state.engine.probe(directory.endpoints)
    return app


def _engine(cfg: ServerConfig, metrics: ServerMetrics, on_fatal) -> AsyncEngine | EngineProcess:
    """The engine on a thread of this process, or in a child process (server/engine_host/)."""
    if not engine_in_child(cfg):
        engine = AsyncEngine(lambda: build_core(cfg, None, engine.wake), served_name(cfg.model), cfg.max_seq_len,
                             metrics=metrics, publisher=event_publisher(cfg, EPOCH), epoch=EPOCH)
        return engine

    def died() -> None:  # a tensor-parallel rank that died: the server says so too
        on_fatal(RANK_DIED_EXIT if engine.exit_code == RANK_DIED_EXIT else 1)

    engine = EngineProcess(cfg, served_name(cfg.model), metrics, EPOCH, died)
    return engine


def install_health(app, drain: Drain) -> None:
    """Drain on SIGTERM (server/deploy/drain.py); /health reports it."""
    app.state.drain = drain
    app.add_middleware(DrainGate, drain=drain)


async def _watch_load(engine: AsyncEngine | EngineProcess, on_fatal) -> None:
    """A model that cannot load ends the process (the launcher reports the exit code and log)."""
    while engine.load_error is None:
        await asyncio.sleep(0.2)
    log.error("exiting: the engine could not start: %s", engine.load_error)
    on_fatal()


def served_name(model: str) -> str:
    return model if model.startswith("builtin:") else Path(model).name


# The interpreter's GIL switch interval while the engine thread shares the process with the event
# loop (the default, 5 ms, is near a GPU decode step: SSE writes waited a step for the GIL).
IN_THREAD_SWITCH_INTERVAL_S = 0.001


def serve(cfg: ServerConfig, name: str | None = None, key: str = "--port") -> int:
    """Run the server until SIGTERM (drained), SIGINT or a fatal engine error: 0 on a stop, else the
    error's code. `name` and `key` name the server and what set its port if the port is in use (1)."""
    os.environ.update(cfg.env)  # the launcher sets them already; by hand, before CUDA reads them
    configure_logging()
    label = name or f"{cfg.role} server"
    if (sock := bind_or_say(cfg.host, cfg.port, "serve", f"for {label} ({key})")) is None:
        return 1
    if not engine_in_child(cfg):
        sys.setswitchinterval(IN_THREAD_SWITCH_INTERVAL_S)
    failed = []

    def on_fatal(code: int = 1) -> None:
        failed.append(code)
        server.should_exit = True

    app = make_app(cfg, on_fatal)
    line = f"pdserve: {label} listening on http://{host_port(cfg.host, cfg.port)} (model {cfg.model}, role {cfg.role})"
    announced: list[asyncio.Task] = []
    server = DrainingServer(app, cfg.host, cfg.port,
                            on_listening=lambda: announced.append(asyncio.ensure_future(announce(app, line))))
    server.run_on(sock)
    return failed[0] if failed else 0


async def announce(app, line: str) -> None:
    """Print `line` once the engine has loaded (the socket listens already): from then on requests are
    served. Nothing if the engine fails to load or the server stops first."""
    while (engine := getattr(app.state, "engine", None)) is not None and engine.info is None \
            and engine.load_error is None:
        await asyncio.sleep(0.05)
    if engine is not None and engine.info is not None:
        print(line, flush=True)
