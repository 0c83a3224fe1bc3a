"""One client process of `pdserve-bench load`: `python -m pdserve_bench.load_worker`.

Reads a `WorkerJob` line on stdin, says `ready`, reads `Go`, then runs its share of the load on one
asyncio loop with aiohttp (streamed completions, timed as `pdserve_bench.client` times them) and
writes one `Timing` line per request, then `Done` with its CPU time. It imports neither torch nor transformers, so
a worker is up in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import time
from collections.abc import Callable

import aiohttp
import msgspec

from pdserve_bench.client import apply_event, check_lengths, completion_body
from pdserve_bench.load_job import (
    READY,
    Arrival,
    Done,
    Go,
    Stream,
    Timing,
    Traffic,
    WorkerJob,
    encode_line,
    prompt_for,
)
from pdserve_bench.stats import RequestResult

Emit = Callable[[Timing], None]


async def _read_sse(response: aiohttp.ClientResponse, result: RequestResult) -> None:
    async for raw in response.content:  # one line per iteration
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        apply_event(result, data, time.perf_counter())
    result.error = result.error or "stream ended without [DONE]"


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                            max_tokens: int, extra: dict | None = None) -> RequestResult:
    """POST one streamed completion and time it; never raises for server or transport errors."""
    result = RequestResult(start=time.perf_counter(), end=0.0)
    body = completion_body(model, prompt, max_tokens, extra)
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text(errors='replace'))[:300]}"
            else:
                await _read_sse(response, result)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    check_lengths(result, max_tokens)
    return result


class Runner:
    """The worker's share of the run, from the common start time `t0`."""

    def __init__(self, job: WorkerJob, t0: float, session: aiohttp.ClientSession, emit: Emit) -> None:
        self.job, self.t0, self.session, self.emit = job, t0, session, emit
        self.traffic: dict[str, Traffic] = {t.name: t for t in job.traffic}
        self.deadline = None if job.duration_s is None else t0 + job.duration_s

    async def _send(self, traffic: Traffic, key: str) -> None:
        prompt = prompt_for(traffic, key, self.job.vocab)
        result = await stream_completion(self.session, self.job.url, self.job.model, prompt, traffic.output_len,
                                         traffic.body)
        self.emit(Timing.of(traffic.name, result))

    async def stream(self, s: Stream) -> None:
        await _sleep_until(self.t0 + s.start)
        sent = 0
        while (s.count is None or sent < s.count) and not self._past_deadline():
            await self._send(self.traffic[s.traffic], f"s{s.index}/{sent}")
            sent += 1

    async def arrival(self, a: Arrival) -> None:
        await _sleep_until(self.t0 + a.at)
        await self._send(self.traffic[a.traffic], f"a{a.index}")

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    async def run(self) -> None:
        await asyncio.gather(*(self.stream(s) for s in self.job.streams),
                             *(self.arrival(a) for a in self.job.arrivals))


async def _sleep_until(when: float) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def run_job(job: WorkerJob, t0: float, emit: Emit) -> None:
    timeout = aiohttp.ClientTimeout(total=job.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # as many connections as requests in flight
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await Runner(job, t0, session, emit).run()


def main() -> int:
    job = msgspec.json.decode(sys.stdin.buffer.readline(), type=WorkerJob)
    out = sys.stdout.buffer
    out.write(f"{READY}\n".encode())
    out.flush()
    go = msgspec.json.decode(sys.stdin.buffer.readline(), type=Go)

    def emit(timing: Timing) -> None:
        out.write(encode_line(timing))
        out.flush()

    cpu_before = _cpu_s()
    asyncio.run(run_job(job, go.t0, emit))
    out.write(encode_line(Done(_cpu_s() - cpu_before, time.perf_counter() - go.t0)))
    out.flush()
    return 0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    sys.exit(main())
