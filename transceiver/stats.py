"""Cumulative transfer counters of one sender or receiver (the lead maps them to Prometheus)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TransferStats:
    """Counters only grow, each written by one thread (receiver: the engine's, but `rejected_*` and
    `ipc_open_failures`; sender: the socket thread). `on_transfer(seconds, nbytes)`: per success."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_ok: int = 0
    ipc_transfers: int = 0  # pulls answered (sender) or copied and verified (receiver) through CUDA IPC
    ipc_open_failures: int = 0  # receiver: offers of the same GPU that could not be opened (byte path used)
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    lease_expired: int = 0
    streamed: int = 0  # successful transfers of streamed leases (sent, or pulled) while the prompt was prefilled
    late_chunks: int = 0  # receiver: chunks of pulls that had ended (cancelled, failed): dropped unwritten
    rejected_messages: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    # receiver, successful pulls: seconds until the first answer ("wait"), checking and writing chunks
    # ("apply"; CUDA IPC: from queueing each copy until checked), and the "rest"
    phase_seconds: dict[str, float] = field(default_factory=dict)
    on_transfer: Callable[[float, int], None] | None = None

    def add_phases(self, **seconds: float) -> None:
        for phase, s in seconds.items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + s

    def count_failure(self, reason: str) -> None:
        self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1

    def count_rejected(self, reason: str) -> None:
        self.rejected_messages += 1
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1

    def count_ok(self, seconds: float, nbytes: int) -> None:
        self.transfers_ok += 1
        if self.on_transfer is not None:
            self.on_transfer(seconds, nbytes)
