"""A restarted server hits its disk tier (kv_cache_config.disk), on real processes.

One aggregated server with an 8-block primary pool, a 4-block host pool and a disk tier answers
four ~230-token prompts one by one, so the first ones' blocks go down to files; it stops (SIGTERM:
queued writes land). A new launch on the same directory, with the same model, layout and
deployment token, answers the same prompts: the first one reuses the KV it finds on disk
(cached_tokens > 0), and every text equals transformers `generate`.
"""

from __future__ import annotations

import deploy_harness as dh
import hf_reference
import httpx
from transformers import AutoTokenizer

from server.models.builtin import resolve_model

FILLER = "The system should keep the answer short, clear and correct, and it should cite the facts it uses. "
PROMPTS = [f"Topic: {t}. " + FILLER * 4 + " Now answer briefly:" for t in ("astronomy", "cooking", "music", "sailing")]
PAYLOAD = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
BLOCK_BYTES = 32 * 2048  # tiny-llama: 32 tokens x 2 KiB per token
TOKEN = "disk-tier-restart-test-token-0123456789"  # the disk files are sealed with a key from it


def _serial(url: str) -> list[dict]:
    with httpx.Client(timeout=180) as client:
        bodies = [client.post(f"{url}/v1/completions", json={"prompt": p, **PAYLOAD}) for p in PROMPTS]
    assert all(r.status_code == 200 for r in bodies), [r.text for r in bodies]
    return [r.json() for r in bodies]


def test_a_restarted_server_hits_its_disk_tier(tmp_path):
    model_dir = resolve_model("builtin:tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = [tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, tokenizer.encode(p), 16),
                                  skip_special_tokens=True) for p in PROMPTS]
    disk = {"path": str(tmp_path / "kv-disk"), "max_bytes": 64 * BLOCK_BYTES}
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    overrides = {"cache_transceiver_config": {"auth_token": TOKEN},
                 "kv_cache_config": {"max_tokens": 256, "host_cache_size": 4 * BLOCK_BYTES, "disk": disk}}
    with dh.launched("aggregated.yaml", tmp_path / "first", overrides) as dep:
        first = _serial(dep.url)
        assert [b["choices"][0]["text"] for b in first] == reference
        assert dep.metric(dep.url, "pdserve_kv_disk_offloaded_blocks_total") > 0
    assert list((tmp_path / "kv-disk" / "w2048").glob("*.kv"))

    with dh.launched("aggregated.yaml", tmp_path / "second", overrides) as dep:
        assert dep.metric(dep.url, "pdserve_kv_disk_restored_blocks_total") > 0
        again = _serial(dep.url)
        assert [b["choices"][0]["text"] for b in again] == reference
        assert again[0]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 7 * 32  # its 7 full blocks
        assert dep.metric(dep.url, "pdserve_kv_disk_onboarded_blocks_total") >= 7
        assert dep.metric(dep.url, "pdserve_kv_disk_dropped_blocks_total") == 0
