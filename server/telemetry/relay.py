"""The engine's metrics, the same whichever host runs it, shown by the HTTP process's `ServerMetrics`.

On the engine's side nothing touches the registry: a `MetricsRecorder` keeps what is observed until
the loop's next `StepOut` takes it (`MetricsDelta`), and the scrape-time figures travel as
`EngineFigures` in the engine's state. `RelayedMetrics` replays each delta and serves the last figures."""

from __future__ import annotations

import threading

import msgspec

from server.telemetry.metrics import HISTOGRAMS, EngineFigures, Observer, ServerMetrics, TransferFigures


class MetricsDelta(msgspec.Struct, frozen=True):
    """What the engine observed since its previous message (seconds; transfers as (bytes, seconds))."""

    ttft: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    queue_time: list[float] = []
    generation_tokens: int = 0
    prompt_tokens: int = 0
    transfers: list[tuple[int, float]] = []
    prefill: list[float] = []


_SECONDS = tuple(HISTOGRAMS)  # each observed as `observe_<name>(seconds)`
_LISTS = (*_SECONDS, "transfers")


class MetricsRecorder(Observer):
    """What the engine calls of `ServerMetrics` to observe, kept for the next message. Thread-safe:
    transfers end on the transceiver's socket threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._lists: dict[str, list] = {name: [] for name in _LISTS}
        self._generation_tokens = 0
        self._prompt_tokens = 0

    def _observe(self, key: str, value) -> None:
        with self._lock:
            self._lists[key].append(value)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        self._observe("transfers", (num_bytes, seconds))

    def add_generation_tokens(self, n: int) -> None:
        with self._lock:
            self._generation_tokens += n

    def add_prompt_tokens(self, n: int) -> None:
        with self._lock:
            self._prompt_tokens += n

    def take(self) -> MetricsDelta | None:
        """What was observed since the last call; None if nothing was."""
        with self._lock:
            lists, generated, prompts = self._lists, self._generation_tokens, self._prompt_tokens
            if not (generated or prompts or any(lists.values())):
                return None
            self._reset()
        return MetricsDelta(generation_tokens=generated, prompt_tokens=prompts, **lists)

    def watch_transfers(self, core) -> None:
        """Observe every transfer of the core's KV sender or receiver as it ends (on its thread)."""
        for stats in transfer_stats(core):
            stats.on_transfer = lambda seconds, nbytes: self.observe_transfer(nbytes, seconds)


def transfer_stats(core) -> list:
    endpoint = getattr(core.connector, "sender", None) or getattr(core.connector, "receiver", None)
    return [endpoint.stats] if endpoint is not None else []


def engine_figures(core) -> EngineFigures:
    """The scrape-time figures, read from their owners (on the engine's thread)."""
    load = getattr(core.runner, "expert_load", None)
    return EngineFigures(core.kv.stats(), core.scheduler.counts(), core.scheduler.num_preemptions,
                         [TransferFigures.of(s) for s in transfer_stats(core)], core.spec.stats,
                         load.read() if load is not None else {})


class RelayedMetrics:
    """The HTTP process's side: replays deltas into `metrics` and serves the last figures to it."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._figures = EngineFigures()
        metrics.figures = lambda: self._figures

    def update(self, figures: EngineFigures) -> None:
        self._figures = figures
        self.metrics.set_request_counts(figures.request_counts)

    def replay(self, delta: MetricsDelta) -> None:
        m = self.metrics
        for name in _SECONDS:
            observe = getattr(m, f"observe_{name}")
            for seconds in getattr(delta, name):
                observe(seconds)
        for num_bytes, seconds in delta.transfers:
            m.observe_transfer(num_bytes, seconds)
        if delta.generation_tokens:
            m.add_generation_tokens(delta.generation_tokens)
        if delta.prompt_tokens:
            m.add_prompt_tokens(delta.prompt_tokens)
