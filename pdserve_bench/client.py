"""Async streaming client for the OpenAI `/v1/completions` API (httpx), one `RequestResult` per request.

Every request is greedy, streamed, with `ignore_eos` and `stream_options.include_usage`; the final
usage chunk gives the token counts. A request whose completion_tokens differs from max_tokens is
recorded as an error: the throughput figures assume exact lengths. TTFT and the inter-token gaps
are the arrival times of the SSE events, as the client sees them.

Each of `concurrency` workers takes the next session of the workload and sends its prompts one after
the other (a conversation's turns); a session of one prompt is one request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx

from pdserve_bench.stats import RequestResult

if TYPE_CHECKING:  # workloads imports transformers; the load client's worker processes must stay light
    from pdserve_bench.workloads import Workload

REQUEST_TIMEOUT_S = 300.0


def completion_body(model: str, prompt: list[int], max_tokens: int, extra: dict | None = None) -> dict:
    """`extra`: more fields (or other values) of the body."""
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extra or {}),
    }


def apply_event(result: RequestResult, data: str, now: float) -> None:
    """Fold one SSE `data:` payload (a completion chunk) into `result`."""
    chunk = json.loads(data)
    if chunk.get("error"):
        result.error = str(chunk["error"])
        return
    choices = chunk.get("choices") or []
    if choices and choices[0].get("text"):
        if result.first_token is None:
            result.first_token = now
        result.chunk_times.append(now)
    usage = chunk.get("usage")
    if usage:
        result.output_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0


async def _read_stream(response: httpx.Response, result: RequestResult) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        apply_event(result, data, time.perf_counter())
    result.error = result.error or "stream ended without [DONE]"


def check_lengths(result: RequestResult, max_tokens: int) -> None:
    if result.error is None and result.output_tokens != max_tokens:
        result.error = f"completion_tokens {result.output_tokens} != max_tokens {max_tokens} (no usage?)"


async def stream_completion(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    """POST one streamed completion and time it; never raises for server or transport errors."""
    result = RequestResult(start=time.perf_counter(), end=0.0)
    try:
        async with client.stream("POST", "/v1/completions",
                                 json=completion_body(model, prompt, max_tokens)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
            else:
                await _read_stream(response, result)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    check_lengths(result, max_tokens)
    return result


async def _worker(client: httpx.AsyncClient, model: str, workload: Workload,
                  queue: asyncio.Queue[tuple[int, ...]], results: list[RequestResult | None]) -> None:
    while True:
        try:
            session = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        for index in session:  # a conversation's turns, in order
            results[index] = await stream_completion(client, model, workload.prompts[index], workload.max_tokens)


async def run_workload(
    base_url: str, model: str, workload: Workload, concurrency: int
) -> list[RequestResult]:
    """Every session of `workload` in order with at most `concurrency` in flight (no rate limit);
    the results in prompt order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    queue: asyncio.Queue[tuple[int, ...]] = asyncio.Queue()
    for session in workload.session_list():
        queue.put_nowait(session)
    results: list[RequestResult | None] = [None] * len(workload.prompts)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        workers = [_worker(client, model, workload, queue, results) for _ in range(concurrency)]
        await asyncio.gather(*workers)
    return [r for r in results if r is not None]


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The id of the first model `GET /v1/models` lists."""
    response = httpx.get(f"{base_url}/v1/models", timeout=timeout_s)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def bench(base_url: str, model: str, workload: Workload, concurrency: int) -> list[RequestResult]:
    return asyncio.run(run_workload(base_url, model, workload, concurrency))


def first_errors(results: Sequence[RequestResult], limit: int = 3) -> list[str]:
    return [r.error for r in results if r.error is not None][:limit]
