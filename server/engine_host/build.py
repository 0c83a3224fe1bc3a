"""`build_core`: one server's engine core, built on the thread that will own it: weights, KV
manager, runner, the role's connector and transceiver, and a tensor-parallel server's other ranks."""

from __future__ import annotations

import logging

import torch

from kvcache import KVCacheManager
from server.auth import disk_tier_key
from server.config.schema import ServerConfig
from server.engine.core import EngineCore
from server.engine.kv_connector import AggregatedConnector, ContextConnector, GenerationConnector, KVConnector
from server.engine.scheduler import SchedulerConfig
from server.engine.speculative.decoder import build_spec
from server.models.builtin import resolve_model
from server.models.kv_format import kv_cache_layout, kv_dtype_name
from server.models.model_spec import load_spec, with_quantization
from server.models.runner import ModelRunner, load_weights, resolve_device, resolve_dtype
from server.telemetry.kv_events import KvEventPublisher
from server.telemetry.metrics import ServerMetrics
from server.tp.messages import Ready
from server.tp.ranks import Ranks, start_ranks
from server.tp.runner import RankedRunner
from server.tp.transfers import RankedReceiver, RankedSender
from transceiver.receiver import KVReceiver
from transceiver.sender import KVSender

log = logging.getLogger(__name__)


def build_core(cfg: ServerConfig, metrics: ServerMetrics | None, wake=None) -> EngineCore:
    """Everything tensor-owning is made here, on the engine thread (or the engine process); a
    tensor-parallel server's other ranks are started here too (this process is rank 0)."""
    from transformers import AutoTokenizer

    model_dir = resolve_model(cfg.model)
    spec = with_quantization(load_spec(model_dir), cfg.quantization)  # FP8 weights: a fingerprint of their own
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    ranks = start_ranks(cfg, model_dir, spec, device, dtype) if cfg.tensor_parallel_size > 1 else None
    shard, device = (ranks.shard, ranks.device) if ranks else (None, device)  # rank 0's share, cuda:0
    # first the weights: a GPU pool takes a share of what is left
    weights = load_weights(spec, dtype, device, cfg.quantization, shard)
    local = spec if shard is None else shard.local_spec(spec)  # a rank's pools hold its kv heads
    layout = kv_cache_layout(cfg.kv_cache_config, local, cfg.max_seq_len, dtype, device)  # dtype, FP8 scales
    kv = KVCacheManager(cfg.kv_cache_config, layout, salt=spec.fingerprint,
                        disk_key=disk_tier_key(cfg.cache_transceiver_config.auth_token))
    runner = ModelRunner(model_dir, kv, dtype=dtype, device=device, max_num_tokens=cfg.max_num_tokens,
                         max_batch_size=cfg.max_batch_size, tensors=weights, kernels=cfg.kernels,
                         cuda_graphs=cfg.cuda_graphs, max_seq_len=cfg.max_seq_len, shard=shard)
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
             runner.kernels, warm_s, kv.window_sizes, [kv.num_slots(w) for w in kv.window_sizes],
             kv.layout.format.dtype, core.async_scheduling, cfg.speculative.method)
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


def event_publisher(cfg: ServerConfig, epoch: str) -> KvEventPublisher | None:
    """KV events for the router's index, on the transceiver's interface; none without the token."""
    token = cfg.cache_transceiver_config.auth_token
    if not token:
        return None
    kv_dtype = kv_dtype_name(cfg.kv_cache_config, resolve_dtype(cfg.dtype, resolve_device(cfg.device)))
    return KvEventPublisher(token, epoch, cfg.cache_transceiver_config.host, kv_dtype)
