"""Prometheus metrics of one pdserve server (engine, KV cache, KV transfer), in a registry of its own.

Cumulative counters (the KV manager's `KVCacheStats`, preemptions, `TransferStats`) are read at
scrape time (`ServerMetrics.collect`) from the engine's last state (`EngineFigures`), so a scrape
copies the owners' counters exactly. Events come through the `observe_*`/`add_*`/`set_*` methods, replayed from what
the engine loop recorded (server/telemetry/relay.py). The metric names are part of the acceptance
checks: keep them exactly."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvcache.stats import KVCacheStats

__all__ = ["CONTENT_TYPE_LATEST", "EngineFigures", "ServerMetrics", "SpecCounts", "TransferFigures"]

REQUEST_STATES = ("waiting", "running", "transferring")

# Upper bounds in seconds. Small buckets first: tiny models on CPU answer in milliseconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# vLLM's e2e / queue-time bounds, with small ones in front (tiny models answer in milliseconds)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                   20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# queue times: sub-millisecond ones in front of the latency bounds (an idle server admits at once)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding since start (server/engine/speculative/decoder.py `SpecDecoder.stats`)."""

    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens emitted by verify chunks (accepted + one each)
    verified: int = 0  # verify chunks (one request in one step)


class TransferFigures(msgspec.Struct, frozen=True):
    """A copy of one sender's or receiver's cumulative `TransferStats`."""

    failures_by_reason: dict[str, int]
    lease_expired: int
    rejected_messages: int
    phase_seconds: dict[str, float]
    streamed: int = 0

    @classmethod
    def of(cls, stats) -> TransferFigures:
        # copies: the transceiver's threads count on while this is read
        return cls(dict(stats.failures_by_reason), stats.lease_expired, stats.rejected_messages,
                   dict(stats.phase_seconds), stats.streamed)


class EngineFigures(msgspec.Struct, frozen=True):
    """What the collectors read at scrape time, as of the engine's last state."""

    kv: KVCacheStats | None = None
    request_counts: dict[str, int] = {}
    preemptions: int = 0
    transfers: list[TransferFigures] = []
    spec: SpecCounts = SpecCounts()
    expert_tokens: dict[int, list[int]] = {}  # a MoE model's layer -> tokens routed to each expert

# (exposed name without "_total", KVCacheStats field, help)
_KV_COUNTERS = (
    ("pdserve_kv_offloaded_blocks", "offloads", "Blocks moved from the primary to the host pool."),
    ("pdserve_kv_onboarded_blocks", "onboards", "Blocks moved from the host back to the primary pool."),
    ("pdserve_kv_evicted_blocks", "evictions", "Cached blocks evicted from the primary pool."),
    ("pdserve_prefix_cache_query_tokens", "prefix_query_tokens", "Prompt tokens looked up for reuse."),
    ("pdserve_prefix_cache_hit_tokens", "prefix_hit_tokens", "Prompt tokens found in the reuse tree."),
    ("pdserve_kv_offloaded_bytes", "bytes_offloaded", "Bytes copied primary -> host."),
    ("pdserve_kv_onboarded_bytes", "bytes_onboarded", "Bytes copied host -> primary."),
    ("pdserve_kv_copied_bytes", "bytes_copied_primary", "Bytes copied inside the primary pool."),
    ("pdserve_kv_disk_offloaded_blocks", "disk_offloads", "Blocks moved from the host pool to the disk tier."),
    ("pdserve_kv_disk_onboarded_blocks", "disk_onboards",
     "Blocks read back from the disk tier into the host pool (disk hits; their files checked)."),
    ("pdserve_kv_disk_written_bytes", "disk_bytes_written", "KV bytes that reached the disk tier's files."),
    ("pdserve_kv_disk_read_bytes", "disk_bytes_read", "KV bytes read back from the disk tier."),
    ("pdserve_kv_disk_write_errors", "disk_write_errors", "Disk tier writes that failed (file system errors)."),
    ("pdserve_kv_disk_restored_blocks", "disk_restored", "Blocks the disk tier found again at start."),
)


def _summed(maps: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for counts in maps:
        for key, value in dict(counts).items():  # a copy: another thread counts
            out[key] = out.get(key, 0) + value
    return out


def _kv_families(stats: KVCacheStats | None) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(
        "pdserve_kv_cache_blocks", "KV cache blocks per window group, pool level and state.",
        labels=["window", "level", "state"],
    )
    for (window, level, state), count in sorted((stats.blocks if stats else {}).items()):
        blocks.add_metric([str(window), level, state], count)
    yield blocks
    for name, field, help_text in _KV_COUNTERS:
        family = CounterMetricFamily(name, help_text)
        if stats is not None:
            family.add_metric([], getattr(stats, field))
        yield family
    dropped = CounterMetricFamily(
        "pdserve_kv_disk_dropped_blocks", "Disk tier blocks dropped because their bytes were lost: the file "
        "failed its check (corrupt, truncated, stale, format, missing, timeout, io_error) or the write queue was full "
        "(queue_full).", labels=["reason"])
    for reason, count in sorted((stats.disk_dropped if stats else {}).items()):
        dropped.add_metric([reason], count)
    yield dropped
    queued = GaugeMetricFamily("pdserve_kv_disk_write_queue_bytes", "KV bytes waiting for their disk tier write.")
    if stats is not None:
        queued.add_metric([], stats.disk_queued_bytes)
    yield queued


# observe_<key>(seconds) -> (name, help, buckets); e2e and queue time are vLLM's
# (vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds) with the pdserve_ prefix
HISTOGRAMS = {
    "ttft": ("pdserve_time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS),
    "tpot": ("pdserve_time_per_output_token_seconds", "Time between output tokens.", TPOT_BUCKETS),
    "e2e": ("pdserve_e2e_request_latency_seconds", "Arrival to the request's end on this server (a context "
            "server: to the hand-over).", LATENCY_BUCKETS),
    "queue_time": ("pdserve_request_queue_time_seconds", "Arrival to first admission (blocks allocated), once "
                   "per request.", QUEUE_BUCKETS),
    "prefill": ("pdserve_prefill_seconds", "First admission to the first token sampled, once per request whose "
                "prompt is computed here (context or aggregated).", TTFT_BUCKETS),
}


def _observing(key: str) -> Callable[[Observer, float], None]:
    def observe(self: Observer, seconds: float) -> None:
        self.observe(key, seconds)
    return observe


class Observer(ABC):
    """`observe_<key>(seconds)` for each of HISTOGRAMS, as `observe(key, seconds)`: into the histogram
    (`ServerMetrics`), or kept for the engine's next message (server/telemetry/relay.py)."""

    @abstractmethod
    def observe(self, key: str, seconds: float) -> None: ...

    observe_ttft = _observing("ttft")
    observe_tpot = _observing("tpot")
    observe_e2e = _observing("e2e")
    observe_queue_time = _observing("queue_time")
    observe_prefill = _observing("prefill")


class ServerMetrics(Observer):
    """All metrics of one server, in a private registry whose custom collector it is. Thread-safe."""

    def __init__(self, figures: Callable[[], EngineFigures] = EngineFigures) -> None:
        self.figures = figures  # the engine's last figures (server/telemetry/relay.py `RelayedMetrics`)
        self.created = time.time()  # the `_created` sample a pushed prometheus_client Counter has
        self.registry = reg = CollectorRegistry(auto_describe=True)
        reg.register(self)
        self._requests = Gauge("pdserve_requests", "Requests per scheduler state.", ["state"], registry=reg)
        for state in REQUEST_STATES:
            self._requests.labels(state).set(0)
        self._known_states: set[str] = set(REQUEST_STATES)
        self._histograms = {key: Histogram(name, help_text, buckets=buckets, registry=reg)
                            for key, (name, help_text, buckets) in HISTOGRAMS.items()}
        self._gen_tokens = Counter("pdserve_generation_tokens", "Generated tokens.", registry=reg)
        # vllm:prompt_tokens_total with the pdserve_ prefix
        self._prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens prefilled here (a "
                                      "generation server's pulled prompts are not counted).", registry=reg)
        self._xfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved by the transceiver.",
                                   registry=reg)
        self._xfer_seconds = Histogram("pdserve_kv_transfer_seconds", "One request's KV transfer time.",
                                       buckets=TRANSFER_BUCKETS, registry=reg)

    def describe(self) -> Iterator[Metric]:
        yield from _kv_families(None)
        yield from self._counter_families(EngineFigures())

    def collect(self) -> Iterator[Metric]:
        figures = self.figures()
        yield from _kv_families(figures.kv)
        yield from self._counter_families(figures)

    def _counter_families(self, counters: EngineFigures) -> Iterator[Metric]:
        transfers = list(counters.transfers)
        for name, help_text, label, field in (
            ("pdserve_kv_transfer_failures", "Failed KV transfers by reason.", "reason", "failures_by_reason"),
            ("pdserve_kv_transfer_phase_seconds", "Successful KV pulls' time by phase: wait (until the first "
             "answer arrives), apply (checking and writing chunks), rest.", "phase", "phase_seconds"),
        ):
            family = CounterMetricFamily(name, help_text, labels=[label])
            for key, value in _summed(getattr(stats, field) for stats in transfers).items():
                family.add_metric([key], value, created=self.created)
            yield family
        spec = counters.spec
        for name, help_text, value in (
            ("pdserve_kv_transfer_lease_expired",
             "Context-side block leases that expired before the transfer ended.",
             sum(s.lease_expired for s in transfers)),
            ("pdserve_kv_transfer_streamed",
             "KV transfers that ran while the prompt was prefilled (kv_stream), sent or pulled.",
             sum(s.streamed for s in transfers)),
            ("pdserve_kv_transfer_rejected_messages",
             "Transceiver messages dropped (bad MAC, version or encoding).",
             sum(s.rejected_messages for s in transfers)),
            ("pdserve_num_preemptions", "Requests preempted (blocks released, resumed later).",
             counters.preemptions),
            ("pdserve_spec_draft_tokens", "Speculative decoding: draft tokens verified.", spec.proposed),
            ("pdserve_spec_accepted_tokens", "Speculative decoding: draft tokens accepted.", spec.accepted),
            ("pdserve_spec_emitted_tokens", "Speculative decoding: tokens emitted by verify steps "
             "(accepted drafts and one more each).", spec.emitted),
            ("pdserve_spec_verify_steps", "Speculative decoding: verify steps (one request in one step).",
             spec.verified),
        ):
            yield CounterMetricFamily(name, help_text, value, created=self.created)
        yield GaugeMetricFamily("pdserve_spec_acceptance_rate", "Speculative decoding since start: accepted "
                                "draft tokens / draft tokens verified (0 before any).",
                                spec.accepted / spec.proposed if spec.proposed else 0.0)
        yield GaugeMetricFamily("pdserve_spec_tokens_per_step", "Speculative decoding since start: tokens a "
                                "request emits per verify step (1 + accepted drafts; 0 before any).",
                                spec.emitted / spec.verified if spec.verified else 0.0)
        family = CounterMetricFamily("pdserve_moe_expert_tokens", "Mixture-of-experts models: tokens routed "
                                     "to each expert of each sparse layer (each token counts top_k times).",
                                     labels=["layer", "expert"])
        for layer, tokens in sorted(counters.expert_tokens.items()):
            for expert, count in enumerate(tokens):
                family.add_metric([str(layer), str(expert)], count, created=self.created)
        yield family

    def observe(self, key: str, seconds: float) -> None:
        self._histograms[key].observe(seconds)

    def add_generation_tokens(self, n: int) -> None:
        self._gen_tokens.inc(n)

    def add_prompt_tokens(self, n: int) -> None:
        self._prompt_tokens.inc(n)

    def set_request_counts(self, counts: Mapping[str, int]) -> None:
        """Set the number of requests per state; a state seen before but absent from `counts` is 0."""
        self._known_states.update(counts)
        for state in self._known_states:
            self._requests.labels(state).set(counts.get(state, 0))

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        """One request's completed KV transfer."""
        self._xfer_bytes.inc(num_bytes)
        self._xfer_seconds.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (content type `CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)
