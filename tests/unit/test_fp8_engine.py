"""FP8 weights through the engine and the pair (`quantization: fp8`, CPU, float32): the aggregated
engine serves transformers' tokens of the model its FP8 weights stand for (tests/fp8_checkpoints.py
`write_quantized_at_load`), a disaggregated pair with FP8 weights on both sides (real KV sender and
receiver on loopback) serves the aggregated engine's tokens, and a pair whose servers' weights differ
is refused at the KV handshake (their model fingerprints differ)."""

from __future__ import annotations

from pathlib import Path

import engine_harness as eh
import hf_reference
import pytest
from fp8_checkpoints import write_quantized_at_load
from prompts import random_prompt
from waiting import wait_until

from kvcache import KvCacheConfig
from server.models.builtin import resolve_model
from server.models.model_spec import load_spec, with_quantization
from server.types import RequestOutput

MODELS = ("builtin:tiny-llama", "builtin:tiny-qwen3-swa")
PROMPTS = [random_prompt(60 + i, n) for i, n in enumerate([6, 33, 90])]  # 90: past tiny-qwen3-swa's window
NEW = 16


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-ref")
    return {m: write_quantized_at_load(resolve_model(m), root / m.split(":")[1]) for m in MODELS}


def _fingerprint(model: str, quantization: str | None) -> str:
    return with_quantization(load_spec(resolve_model(model)), quantization).fingerprint


def _pair(model: str, ctx_quantization: str | None, gen_quantization: str | None) -> eh.LoopbackPair:
    """A context and a generation engine with `quantization` each, their KV link keyed by each one's
    model fingerprint as `pdserve serve` keys it."""
    return eh.loopback_pair(model, kv=KvCacheConfig(tokens_per_block=16, max_tokens=4096),
                            ctx={"max_num_tokens": 64, "quantization": ctx_quantization},
                            gen={"quantization": gen_quantization},
                            fingerprints=(_fingerprint(model, ctx_quantization), _fingerprint(model, gen_quantization)))


def _serve(pair: eh.LoopbackPair, prompts: list[list[int]], n: int) -> tuple[list[RequestOutput], list[list[int]]]:
    """Each prompt through the pair: the generation legs' final outputs, and their tokens."""
    gens = pair.serve(prompts, eh.greedy(n))
    return [pair.final(rid) for rid in gens], [pair.tokens(rid) for rid in gens]


@pytest.mark.parametrize("model", MODELS)
def test_aggregated_fp8_engine_serves_transformers_tokens_of_its_weights(references, model: str) -> None:
    core = eh.make_core(model, quantization="fp8")
    results = eh.generate(core, PROMPTS, eh.greedy(NEW))
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == hf_reference.hf_greedy(references[model], prompt, NEW)


@pytest.mark.parametrize("model", MODELS)
def test_a_pair_with_fp8_weights_serves_the_aggregated_tokens(references, model: str) -> None:
    aggregated = [r.token_ids for r in eh.generate(eh.make_core(model, quantization="fp8"), PROMPTS, eh.greedy(NEW))]
    with _pair(model, "fp8", "fp8") as pair:
        finals, tokens = _serve(pair, PROMPTS, NEW)
        assert [f.finish_reason for f in finals] == ["length"] * len(PROMPTS)
        assert tokens == aggregated
        assert tokens == [hf_reference.hf_greedy(references[model], p, NEW) for p in PROMPTS]
        wait_until(lambda: pair.sender.num_leases == 0, 30, "the leases to end", step=pair.step)
        for core in pair.cores:
            assert eh.blocks_in_use(core.kv) == 0


def test_a_pair_whose_weights_differ_is_refused_at_the_handshake() -> None:
    """FP8 weights on the context server, float ones on the generation server: the KV each computes
    differs, so the generation leg fails instead of decoding from the other weights' KV."""
    with _pair("builtin:tiny-llama", "fp8", None) as pair:
        finals, tokens = _serve(pair, PROMPTS[:1], NEW)
        assert finals[0].finish_reason == "error" and len(tokens[0]) <= 1  # at most the context's first token
        [status] = pair.receiver.peer_status().values()
        assert status.startswith("incompatible") and "model fingerprint differs" in status


def test_a_server_built_with_quantization_fp8(references) -> None:
    """`pdserve serve`'s own build (server/engine_host/build.py): FP8 linears, the FP8 fingerprint as the
    prefix-cache namespace, transformers' tokens of the weights they stand for."""
    from server.config.schema import server_config_from_dict
    from server.engine_host.build import build_core
    from server.models.fp8.weight import Fp8Weight

    model = "builtin:tiny-llama"
    core = build_core(server_config_from_dict({"model": model, "quantization": "fp8", "device": "cpu",
                                               "max_seq_len": 512}), None)
    assert isinstance(core.runner.model.layers[0].mlp.gate_up, Fp8Weight)
    assert core.kv.salt == _fingerprint(model, "fp8") != _fingerprint(model, None)
    results = eh.generate(core, PROMPTS, eh.greedy(NEW))
    assert [r.token_ids for r in results] == [hf_reference.hf_greedy(references[model], p, NEW) for p in PROMPTS]
