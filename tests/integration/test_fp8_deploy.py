"""FP8 weights in real deployments (`pdserve launch` with `quantization: fp8` at the top level, CPU):
the aggregated server and the disaggregated pair answer the same texts, and those are transformers'
texts of the float32 model the FP8 weights stand for (tests/fp8_checkpoints.py). Every server says
in its log that its linear weights are FP8."""

from __future__ import annotations

import asyncio

import deploy_harness as dh
import hf_reference
import httpx
from fp8_checkpoints import write_quantized_at_load
from transformers import AutoTokenizer

from server.models.builtin import resolve_model

PROMPTS = ["The quick brown fox", "When an exception is raised,", "Topic: sailing. Now answer briefly:"]
PAYLOAD = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


async def _texts(url: str) -> list[str]:
    async with httpx.AsyncClient() as client:
        bodies = []
        for prompt in PROMPTS:
            response = await client.post(f"{url}/v1/completions", json={"prompt": prompt, **PAYLOAD}, timeout=180)
            assert response.status_code == 200, response.text
            bodies.append(response.json()["choices"][0]["text"])
        return bodies


def test_fp8_pair_answers_the_aggregated_texts_of_the_fp8_weights(tmp_path_factory) -> None:
    model_dir = resolve_model(dh.TEST_MODELS["builtin:tiny-story"])
    reference = write_quantized_at_load(model_dir, tmp_path_factory.mktemp("ref") / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = [tokenizer.decode(hf_reference.hf_greedy_ignore_eos(reference, tokenizer.encode(p), 16),
                           skip_special_tokens=True) for p in PROMPTS]
    texts = {}
    for config in ("aggregated.yaml", "disagg.yaml"):
        with dh.launched(config, tmp_path_factory.mktemp(config.split(".")[0]), {"quantization": "fp8"}) as dep:
            texts[config] = asyncio.run(_texts(dep.url))
            servers = [p for p in dep.log_dir.glob("*.log") if "launcher" not in p.name and "router" not in p.name]
            assert servers and all("linear weights fp8" in p.read_text(errors="replace") for p in servers), dep.logs()
    assert texts["aggregated.yaml"] == texts["disagg.yaml"] == hf
