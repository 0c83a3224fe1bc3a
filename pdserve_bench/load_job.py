"""What the load client's parent and its worker processes say to each other (msgspec JSON lines on
the workers' stdin and stdout: nothing is pickled, nothing from the network is decoded but JSON).

The parent writes a `WorkerJob`, waits for every worker's `ready` line, then writes one `Go` with
the common start time (`time.perf_counter()` is CLOCK_MONOTONIC on Linux: one clock for every
process of the machine). A worker answers one `Timing` line per finished request (a JSON array),
then one `Done` (a JSON object) with the CPU time it used: a worker near a whole core's worth
would be a client that limits the run.

A request's prompt is drawn by the worker from the traffic's seed and the request's key (stream
and turn, or arrival index): the same plan gives the same prompts in any number of processes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from pdserve_bench.stats import RequestResult

READY = "ready"


class Traffic(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One class of requests of a load run: closed loop (`concurrency` streams, each sending its next
    request when the last one ends) or open loop (`rate` requests/s, Poisson arrivals)."""

    name: str  # "main"; the mixed workload's "background" and "long"
    input_len: int
    output_len: int
    concurrency: int = 0
    rate: float = 0.0
    count: int | None = None  # at most this many requests (None: as many as the duration allows)
    seed: int = 0
    # more fields of every request's body (logprobs, penalties, response_format, ...): what they cost
    body: dict[str, object] = msgspec.field(default_factory=dict)

    @property
    def closed(self) -> bool:
        return self.concurrency > 0

    def check(self, duration_s: float | None) -> None:
        """ValueError naming what is wrong with this class of a run of `duration_s` seconds."""
        if (self.concurrency > 0) == (self.rate > 0):
            raise ValueError(f"traffic {self.name!r}: give a concurrency or a rate, exactly one of them")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"traffic {self.name!r}: input and output lengths must be >= 1")
        if duration_s is None and self.count is None:
            raise ValueError(f"traffic {self.name!r}: needs a request count or a duration")


class Stream(msgspec.Struct, frozen=True, array_like=True):
    """A closed-loop stream: starts at `start` s after the run's start, sends up to `count` requests."""

    traffic: str
    index: int
    start: float
    count: int | None


class Arrival(msgspec.Struct, frozen=True, array_like=True):
    """An open-loop request sent `at` s after the run's start."""

    traffic: str
    index: int
    at: float


class WorkerJob(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    url: str
    model: str
    vocab: list[int]  # prompt token ids are drawn from these
    traffic: list[Traffic]
    streams: list[Stream]
    arrivals: list[Arrival]
    duration_s: float | None  # no request starts later than this after the run's start
    request_timeout_s: float


class Go(msgspec.Struct, frozen=True):
    t0: float  # perf_counter() of the run's start, in the future when sent


class Done(msgspec.Struct, frozen=True):
    cpu_s: float  # user + system time of the worker during the run
    wall_s: float  # from the run's start to the worker's last request's end

    @property
    def busy(self) -> float:
        """The share of one core the worker used."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class Timing(msgspec.Struct, frozen=True, array_like=True):
    """One request's timeline (perf_counter seconds), as `RequestResult` holds it."""

    traffic: str
    start: float
    end: float
    first_token: float | None
    chunk_times: list[float]
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    error: str | None

    @classmethod
    def of(cls, traffic: str, r: RequestResult) -> Timing:
        return cls(traffic, r.start, r.end, r.first_token, r.chunk_times, r.output_tokens, r.prompt_tokens,
                   r.cached_tokens, r.error)

    def result(self) -> RequestResult:
        return RequestResult(start=self.start, end=self.end, first_token=self.first_token,
                             output_tokens=self.output_tokens, prompt_tokens=self.prompt_tokens,
                             cached_tokens=self.cached_tokens, chunk_times=list(self.chunk_times), error=self.error)


def prompt_for(traffic: Traffic, key: str, vocab: Sequence[int]) -> list[int]:
    """The prompt of request `key` ("s3/7": stream 3's 8th request; "a12": arrival 12) of `traffic`."""
    rng = random.Random(f"{traffic.seed}/{traffic.name}/{key}")  # a str seed is hashed with sha512: stable
    return [vocab[rng.randrange(len(vocab))] for _ in range(traffic.input_len)]


ENCODER = msgspec.json.Encoder()


def encode_line(message: msgspec.Struct) -> bytes:
    return ENCODER.encode(message) + b"\n"
