"""The router's phases of a request's time to first token (server/router/flow.py `Phases`): a
RequestFlow over scripted legs, on a fake clock, observes each phase once with the times the legs
took; a request one server serves alone, or that its context leg ends, or whose generation leg
answers JSON (after its decode), has no phases it did not go through; and /metrics shows every
phase from the start."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from test_router_streaming import _ctx, _events

from server.config.router import RouterConfig
from server.openai.sse import DONE
from server.router.app import _build_state
from server.router.backends import Backend
from server.router.flow import Ask, Phases, RequestFlow
from server.router.http_client import StreamResponse
from server.router.legs import Upstream
from server.router.policies import Prompt

START = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


class _Legs:
    """`Legs` as a RequestFlow sees them: the context leg books its server after 2 ms in the queue and
    answers `context` 50 ms later; the generation leg opens when `gate` is set (at the clock's time then)."""

    def __init__(self, clock: Clock, context: dict, generation) -> None:
        self.clock, self.context, self.generation_answer = clock, context, generation
        self.migration_limit, self.generation = 0, []
        self.gate, self.booked = asyncio.Event(), asyncio.Event()

    def require_generation(self) -> None:
        pass

    async def context_leg(self, *args, booked, **kwargs) -> Upstream:
        self.clock.now += 0.002
        booked()
        self.clock.now += 0.050
        return Upstream(Backend("http://ctx", "context"), json=self.context)

    async def generation_leg(self, *args, booked, **kwargs) -> Upstream:
        if self.clock.now == START:  # no context leg before it: its booking is the request's first
            self.clock.now += 0.004
        booked()  # a second booking changes nothing
        self.booked.set()
        await asyncio.wait_for(self.gate.wait(), 10)
        return self.generation_answer()


class _Body:
    async def chunks(self):
        yield b'data: {"choices": [{"text": "lo"}]}\n\n'
        yield DONE

    async def aclose(self) -> None:
        pass


def _stream() -> Upstream:
    body = _Body()
    return Upstream(Backend("http://gen", "generation"), stream=StreamResponse(200, body.chunks(), body.aclose))


class Observed(list):
    """(phase, milliseconds rounded to 1 us) in the order they were observed."""

    def __call__(self, phase: str, seconds: float) -> None:
        self.append((phase, round(seconds * 1e3, 3)))


def _flow(legs: _Legs, body: dict, local: bool = False) -> tuple[RequestFlow, Observed]:
    observed = Observed()
    phases = Phases(observed, legs.clock)
    ask = Ask("/v1/completions", {"prompt": "x", **body}, False, Prompt(lambda: None))
    return RequestFlow(legs, ask, local, phases), observed


async def _connected() -> dict:
    await asyncio.sleep(60)
    return {"type": "http.disconnect"}


def test_a_streamed_disaggregated_request_observes_each_router_phase_once():
    clock = Clock()
    legs = _Legs(clock, _ctx("first", chat=False), _stream)

    async def run() -> list[bytes]:
        flow, observed = _flow(legs, {"stream": True})
        response = await flow.respond(_connected)  # the context leg has answered at +52 ms
        clock.now = START + 0.060
        events = [await anext(response.events)]  # the router's own first token, sent at +60 ms
        assert observed == [("queue", 2.0), ("context", 50.0), ("first_event", 60.0)]
        clock.now = START + 0.075
        legs.gate.set()  # the generation leg's stream opens at +75 ms
        events += [e async for e in response.events]
        await response.on_close()
        # the generation leg, started at +52 ms, relays its first event at +75 ms
        assert observed == [("queue", 2.0), ("context", 50.0), ("first_event", 60.0), ("handoff", 23.0),
                            ("generation", 23.0)]
        return events

    events = asyncio.run(run())
    assert [e["choices"][0]["text"] for e in _events(events)] == ["first", "lo"] and events[-1] == DONE


def test_a_json_request_has_no_handoff_its_answer_comes_after_the_decode():
    clock = Clock()
    legs = _Legs(clock, _ctx("first", chat=False), lambda: Upstream(Backend("http://gen", "generation"),
                                                                    json={"choices": []}))

    async def run() -> Observed:
        flow, observed = _flow(legs, {})
        answering = asyncio.ensure_future(flow.respond(_connected))
        await asyncio.wait_for(legs.booked.wait(), 10)
        clock.now = START + 0.300
        legs.gate.set()
        await answering
        return observed

    assert asyncio.run(run()) == [("queue", 2.0), ("context", 50.0), ("first_event", 300.0)]


def test_a_json_request_served_alone_has_no_context_leg_and_no_handoff():
    clock = Clock()
    legs = _Legs(clock, {}, lambda: Upstream(Backend("http://agg", "aggregated"), json={"choices": []}))

    async def run() -> Observed:
        flow, observed = _flow(legs, {}, local=True)
        answering = asyncio.ensure_future(flow.respond(_connected))
        await asyncio.wait_for(legs.booked.wait(), 10)  # the leg was booked at +4 ms and waits for the gate
        clock.now = START + 0.030
        legs.gate.set()
        await answering  # the JSON answer is the first event
        return observed

    assert asyncio.run(run()) == [("queue", 4.0), ("first_event", 30.0)]


def test_a_request_its_context_leg_ends_has_no_handoff():
    clock = Clock()
    finished = _ctx("all", chat=False)
    finished["choices"][0] |= {"disaggregated_params": None, "finish_reason": "length"}
    legs = _Legs(clock, finished, _stream)

    async def run() -> Observed:
        flow, observed = _flow(legs, {})
        await flow.respond(_connected)
        return observed

    assert asyncio.run(run()) == [("queue", 2.0), ("context", 50.0), ("first_event", 52.0)]


def test_a_generation_leg_open_before_the_context_answer_hands_off_in_no_time():
    """Streamed KV: the generation leg starts at the early answer and may open first."""
    clock, observed = Clock(), Observed()
    phases = Phases(observed, clock)
    for event, at in (("booked", 0.001), ("opened", 0.030), ("answered", 0.040), ("answered", 0.9), ("sent", 0.041)):
        clock.now = START + at
        phases.stamp(event)
    assert observed == [("queue", 1.0), ("context", 39.0), ("handoff", 0.0), ("first_event", 41.0)]


def test_metrics_show_every_router_phase_before_any_request():
    state = _build_state(RouterConfig(context_urls=("127.0.0.1:1",), generation_urls=("127.0.0.1:2",)))
    text = generate_latest(state.registry).decode()
    for phase in ("queue", "context", "handoff", "first_event"):
        assert f'pdserve_router_phase_seconds_count{{phase="{phase}"}} 0.0' in text
    state.observe_phase("handoff", 0.003)
    text = generate_latest(state.registry).decode()
    assert 'pdserve_router_phase_seconds_bucket{le="0.0025",phase="handoff"} 0.0' in text
    assert 'pdserve_router_phase_seconds_bucket{le="0.005",phase="handoff"} 1.0' in text
