"""The engine's metrics, the same whichever host runs it, shown by the HTTP process's `ServerMetrics`.

On the engine's side nothing touches the registry: a `MetricsRecorder` keeps what is observed until
the loop's next `StepOut` takes it (`MetricsDelta`), and the scrape-time figures travel as
`EngineFigures` in the engine's state. `RelayedMetrics` replays each delta and serves the last figures."""

from __future__ import annotations

import threading

import msgspec

from server.telemetry.metrics import EngineFigures, Observer, ServerMetrics, TransferFigures


class MetricsDelta(msgspec.Struct, frozen=True):
    """What the engine observed since its previous message: seconds per HISTOGRAMS key, transfers as
    (bytes, seconds)."""

    seconds: dict[str, list[float]] = {}
    transfers: list[tuple[int, float]] = []
    generation_tokens: int = 0
    prompt_tokens: int = 0


class MetricsRecorder(Observer):
    """What the engine calls of `ServerMetrics` to observe, kept for the next message. Thread-safe:
    transfers end on the transceiver's socket threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._seconds: dict[str, list[float]] = {}
        self._transfers: list[tuple[int, float]] = []
        self._generation_tokens = 0
        self._prompt_tokens = 0

    def observe(self, key: str, seconds: float) -> None:
        with self._lock:
            self._seconds.setdefault(key, []).append(seconds)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self._transfers.append((num_bytes, seconds))

    def add_generation_tokens(self, n: int) -> None:
        with self._lock:
            self._generation_tokens += n

    def add_prompt_tokens(self, n: int) -> None:
        with self._lock:
            self._prompt_tokens += n

    def take(self) -> MetricsDelta | None:
        """What was observed since the last call; None if nothing was."""
        with self._lock:
            delta = MetricsDelta(self._seconds, self._transfers, self._generation_tokens, self._prompt_tokens)
            if delta == MetricsDelta():
                return None
            self._reset()
        return delta

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
        for key, values in delta.seconds.items():
            for seconds in values:
                m.observe(key, seconds)
        for num_bytes, seconds in delta.transfers:
            m.observe_transfer(num_bytes, seconds)
        if delta.generation_tokens:
            m.add_generation_tokens(delta.generation_tokens)
        if delta.prompt_tokens:
            m.add_prompt_tokens(delta.prompt_tokens)
