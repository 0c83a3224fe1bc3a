"""No late writer (SGLang #24527): a slot a KV transfer may still write is not
reused until that transfer has ended or been cancelled.

Two real engines in one process, each with its own KV pool and transceiver thread, on loopback: a
context engine (KVSender) and a generation engine (KVReceiver) whose pool holds one long request and
little more. Each round prefills a long prompt on the context side, starts its pull on the
generation side, aborts the request once the first chunk landed (the sender's socket thread keeps
sending the rest), and at once admits another request of the same size on the generation engine:
it can only get the aborted request's slots. Its greedy output must equal transformers', 50 rounds.
Writes happen only on the engine thread and only for pulls still registered; cancel unregisters the
pull before the engine frees the blocks, so the chunks still arriving are dropped (counted here).
"""

from __future__ import annotations

import dataclasses
import random

import hf_reference
import torch
from engine_harness import blocks_in_use, greedy
from transformers import AutoTokenizer
from waiting import wait_until

from kvcache import KvCacheConfig, KVCacheManager
from server.engine.core import EngineCore
from server.engine.kv_connector import ContextConnector, GenerationConnector
from server.engine.scheduler import SchedulerConfig
from server.models.builtin import resolve_model
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner
from server.types import DisaggParams, GenerateRequest
from transceiver.config import TransceiverConfig
from transceiver.receiver import KVReceiver
from transceiver.sender import KVSender

MODEL = "builtin:tiny-llama"
TPB = 16
PROMPT_TOKENS = 32 * TPB  # 32 blocks of 32 KiB: 16 chunks of 64 KiB
NEW_TOKENS = 4
ROUNDS = 50
TRANSCEIVER = {"auth_token": "late-writer-test-token-0123456789", "max_chunk_bytes": 64 * 1024,
               "kv_transfer_timeout_ms": 20000}


def build(role: str, pool_tokens: int) -> EngineCore:
    model_dir = resolve_model(MODEL)
    spec = load_spec(model_dir)
    kv = KVCacheManager(KvCacheConfig(tokens_per_block=TPB, max_tokens=pool_tokens),
                        spec.cache_layout(2048, torch.float32, "cpu"), salt=spec.fingerprint)
    runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=2048,
                         max_batch_size=8)
    config = TransceiverConfig(**TRANSCEIVER)
    if role == "context":
        connector = ContextConnector(KVSender(kv, config, spec.fingerprint), kv)
    else:
        connector = GenerationConnector(KVReceiver(kv, config, spec.fingerprint), kv)
    return EngineCore(runner, kv, SchedulerConfig(2048, 8, 2048), AutoTokenizer.from_pretrained(model_dir),
                      connector=connector)


def prefill_on_context(ctx: EngineCore, rid: str, prompt: list[int]) -> DisaggParams:
    ctx.add_request(GenerateRequest(rid, prompt, greedy(NEW_TOKENS), DisaggParams("context_only")))
    for _ in range(200):
        for output in ctx.step():
            if output.request_id == rid and output.finished:
                assert output.disagg is not None, output
                return output.disagg
    raise AssertionError("no context answer")


def step_until(cores: list[EngineCore], predicate, what: str, timeout_s: float = 60.0) -> None:
    """Step the engines until `predicate` holds (their socket threads run beside)."""
    wait_until(predicate, timeout_s, what, step=lambda: [core.step() for core in cores])


def pull_state(receiver: KVReceiver, received: int) -> str:
    """"waiting" (no chunk written yet), "landed" (some written, more to come) or "ended", of the
    receiver's one pull (it had received `received` bytes before it)."""
    if receiver.num_pulls == 0:
        return "ended"
    return "landed" if receiver.stats.bytes_received > received else "waiting"


def generate(gen: EngineCore, ctx: EngineCore, rid: str, prompt: list[int]) -> list[int]:
    """Run an ordinary (prefill here) request on the generation engine to its end."""
    gen.add_request(GenerateRequest(rid, prompt, greedy(NEW_TOKENS)))
    tokens: list[int] = []
    for _ in range(2000):
        for output in gen.step():
            if output.request_id == rid:
                tokens += output.new_token_ids
                if output.finished:
                    return tokens
        ctx.step()
    raise AssertionError(f"{rid} did not finish")


def abort_mid_pull(gen: EngineCore, ctx: EngineCore, rid: str, prompt: list[int]) -> bool:
    """Abort `rid` once its pull wrote a first chunk; False if the whole pull landed in one engine
    step before that could be seen (the round does not count)."""
    params = prefill_on_context(ctx, f"ctx-{rid}", prompt)
    receiver = gen.connector.receiver
    received = receiver.stats.bytes_received
    gen.add_request(GenerateRequest(rid, prompt, greedy(NEW_TOKENS),
                                    dataclasses.replace(params, request_type="generation_only")))
    step_until([gen, ctx], lambda: receiver.num_pulls == 1, f"{rid}: its pull started")
    step_until([gen, ctx], lambda: pull_state(receiver, received) != "waiting", f"{rid}: the first chunk")
    mid_pull = pull_state(receiver, received) == "landed"
    gen.abort(rid)
    assert receiver.num_pulls == 0  # cancel unregistered the pull before the blocks were freed
    return mid_pull


def test_abort_mid_pull_then_same_size_request_gets_clean_slots():
    ctx = build("context", 8 * PROMPT_TOKENS)
    gen = build("generation", PROMPT_TOKENS + 6 * TPB)  # room for one such request, not two
    receiver: KVReceiver = gen.connector.receiver
    rng = random.Random(11)
    vocab = len(gen.tokenizer)
    model_dir = resolve_model(MODEL)
    try:
        rounds = 0
        for round_ in range(2 * ROUNDS):
            if rounds == ROUNDS:
                break
            prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]
            rounds += abort_mid_pull(gen, ctx, f"victim-{round_}", prompt)
            received = receiver.stats.bytes_received
            other = [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]
            assert generate(gen, ctx, f"next-{round_}", other) == hf_reference.hf_greedy(model_dir, other, NEW_TOKENS)
            assert receiver.stats.bytes_received == received  # nothing was written after the abort
            sender = ctx.connector.sender
            step_until([ctx, gen], lambda s=sender: s.num_leases == 0, f"round {round_}: the lease ended")
        assert rounds == ROUNDS
        assert blocks_in_use(gen.kv) == 0 and blocks_in_use(ctx.kv) == 0
        assert receiver.stats.late_chunks > 0  # chunks of aborted pulls did arrive, and were dropped
    finally:
        gen.connector.receiver.close()
        ctx.connector.sender.close()
