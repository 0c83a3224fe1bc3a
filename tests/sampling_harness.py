"""What the sampling and log-probability tests share: every output of a request kept (its logprobs
are per output), and a context + generation pair of in-process engines on loopback.

Imported as `import sampling_harness` (tests/ is on sys.path, as for engine_harness).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import engine_harness as eh

from server.engine.core import EngineCore
from server.engine.kv_connector import ContextConnector, GenerationConnector
from server.types import DisaggParams, RequestOutput, TokenLogprob
from transceiver.config import TransceiverConfig
from transceiver.receiver import KVReceiver
from transceiver.sender import KVSender

TOKEN = "sampling-test-token-0123456789abcdef"


def outputs_of(core: EngineCore, ids: list[str], max_steps: int = 3000) -> dict[str, list[RequestOutput]]:
    """Every output of each request, in order, stepping until all finished."""
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    for _ in range(max_steps):
        for output in core.step():
            outs.setdefault(output.request_id, []).append(output)
        if all(o and o[-1].finished for o in outs.values()) and not core.has_work():
            return outs
    raise AssertionError(f"requests did not finish within {max_steps} steps")


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def logprobs_of(outs: list[RequestOutput]) -> list[TokenLogprob]:
    """The outputs' logprobs, checked to be one per new token."""
    entries: list[TokenLogprob] = []
    for o in outs:
        assert o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids), o
        entries += o.logprobs
    return entries


def generation_params(answer: RequestOutput, **extra) -> DisaggParams:
    """The generation leg's parameters from a context leg's answer."""
    p = answer.disagg
    assert p is not None, answer
    return DisaggParams("generation_only", p.ctx_request_id, p.ctx_endpoint, p.ctx_epoch, p.first_gen_tokens,
                        p.prompt_token_ids, **extra)


@contextlib.contextmanager
def pair_cores(model: str, ctx_kwargs: dict | None = None, gen_kwargs: dict | None = None
               ) -> Iterator[tuple[EngineCore, EngineCore]]:
    """A context and a generation engine joined by a real KV sender and receiver on loopback."""
    cfg = TransceiverConfig(auth_token=TOKEN)
    ctx, gen = eh.make_core(model, **(ctx_kwargs or {})), eh.make_core(model, **(gen_kwargs or {}))
    sender, receiver = KVSender(ctx.kv, cfg, "fp"), KVReceiver(gen.kv, cfg, "fp")
    ctx.connector, gen.connector = ContextConnector(sender, ctx.kv), GenerationConnector(receiver, gen.kv)
    try:
        yield ctx, gen
    finally:
        receiver.close()
        sender.close()
