"""A context server under many concurrent context_only requests (docs/DISAGG_LOAD.md): one step
prefills every queued prompt that fits `max_num_tokens` (the default on a GPU, where
`max_prefill_batch_tokens` is unset) and answers every one of them at once, each with its own lease;
a prompt that does not fit whole is chunked and answered in the step that completes it. Real engine
(tiny-llama), real KV sender; first tokens equal those of an aggregated engine."""

from __future__ import annotations

import engine_harness as eh
import pytest

from server.engine.kv_connector import ContextConnector
from server.types import DisaggParams
from transceiver.config import TransceiverConfig
from transceiver.sender import KVSender

CONTEXT_ONLY = DisaggParams(request_type="context_only")


def _prompts(count: int, length: int) -> list[list[int]]:
    return [[100 + 7 * p + i % 50 for i in range(length)] for p in range(count)]  # no shared prefix


@pytest.fixture
def context_core():
    core = eh.make_core(max_num_tokens=256, max_batch_size=16)
    sender = KVSender(core.kv, TransceiverConfig(auth_token="context-batch-token-0123456789"), "fp")
    core.connector = ContextConnector(sender, core.kv)
    yield core, sender
    sender.close()


def _first_tokens(prompts: list[list[int]]) -> list[int]:
    return [r.token_ids[0] for r in eh.generate(eh.make_core(), prompts, eh.greedy(1))]


def test_one_step_prefills_every_queued_prompt_and_answers_them_all(context_core) -> None:
    core, sender = context_core
    prompts = _prompts(8, 24)  # 192 tokens <= max_num_tokens 256
    ids = [eh.submit(core, p, eh.greedy(4), disagg=CONTEXT_ONLY) for p in prompts]
    outputs = core.step()
    assert [o.request_id for o in outputs] == ids
    assert all(o.finished and o.disagg is not None and o.disagg.ctx_request_id == o.request_id for o in outputs)
    assert [o.new_token_ids[0] for o in outputs] == _first_tokens(prompts)
    assert sender.num_leases == 8 and not core.scheduler.has_work()


def test_a_prompt_that_does_not_fit_is_chunked_and_answered_when_complete(context_core) -> None:
    core, sender = context_core
    prompts = _prompts(7, 40)  # 280 tokens: six whole prompts (240) and 16 of the seventh in step 1
    ids = [eh.submit(core, p, eh.greedy(4), disagg=CONTEXT_ONLY) for p in prompts]
    first = core.step()
    assert [o.request_id for o in first] == ids[:6] and sender.num_leases == 6
    assert core.scheduler.running[0].request_id == ids[6] and core.scheduler.running[0].num_computed_tokens == 16
    second = core.step()
    assert [o.request_id for o in second] == ids[6:] and second[0].disagg is not None
    assert [o.new_token_ids[0] for o in first + second] == _first_tokens(prompts)
    assert sender.num_leases == 7 and not core.scheduler.has_work()
