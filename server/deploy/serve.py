"""`pdserve serve`: build one engine server (aggregated, context or generation) and serve HTTP.

The engine runs on a thread of this process (`AsyncEngine`) or in a child process of its own
(`EngineProcess`, server/engineproc/): the config's `engine_process` (auto: a child on CUDA)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch
import uvicorn

from kvcache import KVCacheManager
from server.api.app import create_app
from server.api.context_directory import ContextDirectory
from server.api.readiness import health_report
from server.api.routes.health import EPOCH
from server.api.routes.kv_cache import install_kv_routes
from server.auth import disk_tier_key
from server.config.checks import host_port
from server.config.schema import ServerConfig
from server.deploy.drain import Drain, DrainGate, DrainingServer
from server.deploy.logs import configure_logging
from server.deploy.ports import PORT_HINT, bind_http
from server.engine.core import EngineCore
from server.engine.engine_thread import AsyncEngine
from server.engine.kv_connector import AggregatedConnector, ContextConnector, GenerationConnector, KVConnector
from server.engine.scheduler import SchedulerConfig
from server.engine.speculative.build import build_spec
from server.engineproc.client import EngineProcess
from server.engineproc.front import EngineKvEvents
from server.models.builtin import resolve_model
from server.models.kv_format import kv_cache_layout, kv_dtype_name
from server.models.model_spec import load_spec, with_quantization
from server.models.runner import ModelRunner, load_weights, resolve_device, resolve_dtype
from server.telemetry.kv_events import KvEventPublisher
from server.telemetry.metrics import ServerMetrics
from server.tp.messages import Ready
from server.tp.ranks import RANK_DIED_EXIT, Ranks, start_ranks
from server.tp.runner import RankedRunner
from server.tp.transfers import RankedReceiver, RankedSender
from transceiver.receiver import KVReceiver
from transceiver.sender import KVSender

log = logging.getLogger(__name__)


def build_core(cfg: ServerConfig, metrics: ServerMetrics | None, wake=None) -> EngineCore:
    """Everything tensor-owning is made here, on the engine thread (in the engine process, if any;
    the engine loop gives the core its metrics recorder).
    A tensor-parallel server's other ranks are started here too: this thread's process is rank 0."""
    from transformers import AutoTokenizer

    model_dir = resolve_model(cfg.model)
    spec = with_quantization(load_spec(model_dir), cfg.quantization)  # FP8 weights: a fingerprint of their own
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    ranks = start_ranks(cfg, model_dir, spec, device, dtype) if cfg.tensor_parallel_size > 1 else None
    shard, device = (ranks.shard, ranks.device) if ranks else (None, device)  # rank 0's share, cuda:0
    # first the weights: a GPU pool takes a share of what is left
    weights = load_weights(spec, dtype, device, cfg.quantization) if shard is None else \
        shard.load(spec, dtype, device, cfg.quantization)
    local = spec if shard is None else shard.local_spec(spec)  # a rank's pools hold its kv heads
    layout = kv_cache_layout(cfg.kv_cache_config, local, cfg.max_seq_len, dtype, device)  # dtype, FP8 scales
    kv = KVCacheManager(cfg.kv_cache_config, layout, salt=spec.fingerprint,
                        disk_key=disk_tier_key(cfg.cache_transceiver_config.auth_token))
    runner = ModelRunner(model_dir, kv, dtype=dtype, device=device, max_num_tokens=cfg.max_num_tokens,
                         max_batch_size=cfg.max_batch_size, tensors=weights, kernels=cfg.kernels,
                         cuda_graphs=cfg.cuda_graphs, max_seq_len=cfg.max_seq_len, shard=shard,
                         quantization=cfg.quantization)
    if ranks:
        ranks.attach(kv)  # the other ranks build pools of the same slot counts and mirror its copies
    warm_s = runner.warm_up()  # before the first request: kernels compiled, decode graphs captured
    if ranks:
        ranks.wait_for(Ready)
        runner = RankedRunner(runner, ranks)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    limits = scheduler_limits(cfg, device)
    core = EngineCore(runner, kv, limits, tokenizer, metrics=metrics, connector=_role(cfg, kv, spec.fingerprint, wake,
                      ranks), async_scheduling=use_async_scheduling(cfg, device),
                      spec=build_spec(cfg.speculative, limits, runner))
    log.info("engine ready: %s on %s/%s, linear weights %s, %s kernels (warm-up %.1f s), KV windows %s, %s primary "
             "blocks of %s, async scheduling %s, speculative %s", model_dir, device, dtype, spec.quantization or dtype,
             runner.kernels, warm_s, kv.window_sizes, [kv.num_slots(w) for w in kv.window_sizes], kv.layout.dtype,
             core.async_scheduling,
             cfg.speculative.method)
    return core


# On a CPU a prefill step costs about the same per token for 1 to 8 prompts of 256 tokens
# (docs/BENCHMARKS.md), so batching more prompts only delays the first ones' first tokens.
CPU_PREFILL_BATCH_TOKENS = 256


def scheduler_limits(cfg: ServerConfig, device: torch.device) -> SchedulerConfig:
    """The engine's step limits; an unset max_prefill_batch_tokens takes the device's default."""
    prefill = cfg.max_prefill_batch_tokens
    if prefill is None and device.type == "cpu":
        prefill = CPU_PREFILL_BATCH_TOKENS
    return SchedulerConfig(cfg.max_num_tokens, cfg.max_batch_size, cfg.max_seq_len, prefill)


def use_async_scheduling(cfg: ServerConfig, device: torch.device) -> bool:
    """`async_scheduling: auto` is on where a forward runs asynchronously to the host (CUDA)."""
    if cfg.async_scheduling == "auto":
        return device.type == "cuda"
    return cfg.async_scheduling


def _role(cfg: ServerConfig, kv: KVCacheManager, fingerprint: str, wake, ranks: Ranks | None) -> KVConnector:
    """The connector of the server's role; a tensor-parallel server's KV endpoints span its ranks."""
    if cfg.role == "aggregated":
        return AggregatedConnector()
    transceiver = cfg.cache_transceiver_config
    if cfg.role == "context":
        sender = KVSender(kv, transceiver, fingerprint, on_message=wake) if ranks is None else \
            RankedSender(kv, transceiver, fingerprint, wake, ranks, ranks.shard.plan)
        return ContextConnector(sender, kv)
    receiver = KVReceiver(kv, transceiver, fingerprint, on_message=wake) if ranks is None else \
        RankedReceiver(kv, transceiver, fingerprint, wake, ranks, ranks.shard.plan)
    return GenerationConnector(receiver, kv)


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


def make_app(cfg: ServerConfig, on_fatal=None):
    """The server's app. `on_fatal()` is called if the engine cannot load, or its process dies
    (the server process should then exit non-zero); `on_fatal(RANK_DIED_EXIT)` when the engine
    process ended because one of its tensor-parallel ranks died."""
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
    app.state.kv_events = EngineKvEvents(engine, EPOCH)
    app.state.role = cfg.role  # the leg /health_generate names
    app.state.kv_stream_min_tokens = kv_stream_min_tokens(cfg)
    install_kv_routes(app)
    install_health(app, Drain(cfg.drain_timeout_s, lambda: engine_idle(app.state.engine)))
    if directory is not None:
        directory.on_refresh = lambda: probe_context_servers(app.state.engine, directory)
    return app


def _engine(cfg: ServerConfig, metrics: ServerMetrics, on_fatal) -> AsyncEngine | EngineProcess:
    """The engine on a thread of this process, or in a child process (server/engineproc/)."""
    if not engine_in_child(cfg):
        engine = AsyncEngine(lambda: build_core(cfg, None, engine.wake), served_name(cfg.model), cfg.max_seq_len,
                             metrics=metrics, publisher=event_publisher(cfg, EPOCH), epoch=EPOCH)
        return engine

    def died() -> None:
        if engine.exit_code == RANK_DIED_EXIT:  # a tensor-parallel rank died: the server says so too
            on_fatal(RANK_DIED_EXIT)
        else:
            on_fatal()

    engine = EngineProcess(cfg, served_name(cfg.model), metrics, EPOCH, None if on_fatal is None else died)
    return engine


def install_health(app, drain: Drain) -> None:
    """Drain on SIGTERM (server/deploy/drain.py) and /health's report (server/api/readiness.py)."""
    app.state.drain = drain
    app.state.health_report = lambda: health_report(app)
    app.add_middleware(DrainGate, drain=drain)


def engine_idle(engine) -> bool:
    """Nothing left to finish: no request queued or running, no KV lease or pull."""
    return engine is None or engine.idle()


def probe_context_servers(engine, directory: ContextDirectory) -> None:
    """Generation side: shake hands with every known context server (the KV layouts must agree)."""
    if engine is not None:
        engine.probe(directory.endpoints)


def event_publisher(cfg: ServerConfig, epoch: str) -> KvEventPublisher | None:
    """KV events for the router's index, on the transceiver's interface; none without the token."""
    token = cfg.cache_transceiver_config.auth_token
    if not token:
        return None
    kv_dtype = kv_dtype_name(cfg.kv_cache_config, resolve_dtype(cfg.dtype, resolve_device(cfg.device)))
    return KvEventPublisher(token, epoch, cfg.cache_transceiver_config.host, kv_dtype)


async def _watch_load(engine: AsyncEngine | EngineProcess, on_fatal) -> None:
    """A model that cannot load ends the process (the launcher reports the exit code and log)."""
    while engine.load_error is None:
        await asyncio.sleep(0.2)
    log.error("exiting: the engine could not start: %s", engine.load_error)
    if on_fatal is not None:
        on_fatal()


def served_name(model: str) -> str:
    return model if model.startswith("builtin:") else Path(model).name


# The interpreter's GIL switch interval while the engine thread shares the process with the event
# loop (the default, 5 ms, is near a GPU decode step: SSE writes waited a step for the GIL).
IN_THREAD_SWITCH_INTERVAL_S = 0.001


def serve(cfg: ServerConfig, name: str | None = None, key: str = "--port") -> int:
    """Run the server until SIGTERM (drained), SIGINT (at once) or a fatal engine error: 0 on a stop,
    the error's code otherwise. `name` is the server's in its deployment (context-0), `key` what set
    its port: both name it when the port is in use, which ends it before anything is loaded (1)."""
    os.environ.update(cfg.env)  # the launcher sets them already; by hand, before CUDA reads them
    configure_logging()
    label = name or f"{cfg.role} server"
    try:
        sock = bind_http(cfg.host, cfg.port)
    except OSError as exc:
        print(f"pdserve serve: cannot listen on {host_port(cfg.host, cfg.port)} for {label} ({key}): "
              f"{exc.strerror or exc}; nothing was started. {PORT_HINT}", file=sys.stderr, flush=True)
        return 1
    if not engine_in_child(cfg):
        sys.setswitchinterval(IN_THREAD_SWITCH_INTERVAL_S)
    failed = []

    def on_fatal(code: int = 1) -> None:
        failed.append(code)
        server.should_exit = True

    app = make_app(cfg, on_fatal)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", ws="none",
                            timeout_graceful_shutdown=5, access_log=False)
    line = f"pdserve: {label} listening on http://{host_port(cfg.host, cfg.port)} (model {cfg.model}, role {cfg.role})"
    announced: list[asyncio.Task] = []
    server = DrainingServer(config, app.state.drain,
                            on_listening=lambda: announced.append(asyncio.ensure_future(announce(app, line))))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it handled again, after its clean shutdown
        pass
    return failed[0] if failed else 0


async def announce(app, line: str) -> None:
    """Print `line` once the engine has loaded (the socket listens already): from then on requests are
    served. Nothing if the engine fails to load or the server stops first."""
    while (engine := getattr(app.state, "engine", None)) is not None and engine.info is None \
            and engine.load_error is None:
        await asyncio.sleep(0.05)
    if engine is not None and engine.info is not None:
        print(line, flush=True)
