"""A request's stream of outputs (server/engine_host/streams.py): folding keeps each choice's outputs
apart, and the stream ends only once every choice has had its final output; with the real engine
thread (`AsyncEngine.generate`) too."""

from __future__ import annotations

import asyncio
import random

import engine_harness as eh
import hf_reference
import pytest
from waiting import wait_until_async

from server.engine_host.streams import ChoiceStream, merged
from server.engine_host.thread import AsyncEngine
from server.models.builtin import resolve_model
from server.types import GenerateRequest, RequestOutput, TokenLogprob


def _out(index: int, tokens: list[int], finished: bool = False, **kw) -> RequestOutput:
    return RequestOutput("r", tokens, "".join(f"<{t}>" for t in tokens), finished, index=index, **kw)


def test_merged_folds_each_choice_up_to_its_final_output():
    lp = [TokenLogprob(1, -0.5), TokenLogprob(2, -0.25), TokenLogprob(5, -1.0)]
    outputs = [_out(0, [1], logprobs=lp[:1]), _out(1, [5]), _out(0, [2], logprobs=lp[1:2]),
               _out(1, [6], True, finish_reason="stop"), _out(1, [7]), _out(0, [3], True, finish_reason="length"),
               _out(2, [4])]
    folded = merged(outputs)
    assert [(o.index, o.new_token_ids, o.new_text, o.finished) for o in folded] == [
        (0, [1, 2, 3], "<1><2><3>", True), (1, [5, 6], "<5><6>", True), (1, [7], "<7>", False),
        (2, [4], "<4>", False)]
    assert folded[0].logprobs == lp[:2] and folded[0].finish_reason == "length"
    assert folded[1].logprobs is None


def test_the_stream_is_done_after_every_choice_s_final_output():
    async def scenario():
        stream = ChoiceStream("r", 3)
        stream.put(_out(1, [5], True, finish_reason="length"))
        stream.put(_out(0, [1]))
        assert [(o.index, o.finished) for o in await stream.take()] == [(1, True), (0, False)]
        assert not stream.done
        stream.put(_out(0, [2], True, finish_reason="length"))
        assert [o.new_token_ids for o in await stream.take()] == [[2]]
        assert not stream.done  # choice 2 is still open
        stream.fail("the engine process exited", 503)  # ends only the choices without their final output
        [failed] = await stream.take()
        assert (failed.index, failed.finish_reason, failed.error_code) == (2, "error", 503)
        assert stream.done

    asyncio.run(scenario())


@pytest.mark.anyio
async def test_the_engine_thread_streams_until_every_choice_ended():
    engine = AsyncEngine(lambda: eh.make_core(), "tiny-llama", 512)
    engine.start()
    try:
        prompt = [random.Random(1).randrange(10, 500) for _ in range(29)]
        outputs = [o async for o in engine.generate(GenerateRequest("r", prompt, eh.greedy(7, n=3)))]
        finals = [o for o in outputs if o.finished]
        assert sorted(o.index for o in finals) == [0, 1, 2] and outputs[-1].finished
        want = hf_reference.hf_greedy(resolve_model("builtin:tiny-llama"), prompt, 7)
        for i in range(3):
            assert [t for o in outputs if o.index == i for t in o.new_token_ids] == want
        stream = engine.generate(GenerateRequest("s", prompt, eh.greedy(400, n=2)))
        first = await anext(stream)
        await stream.aclose()  # the client left: every choice is aborted, every block comes back
        assert first.request_id == "s"
        core = engine.core
        await wait_until_async(lambda: not core.has_work(), 30, "the abort")
    finally:
        await asyncio.to_thread(engine.shutdown)
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()
