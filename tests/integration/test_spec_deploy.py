"""Speculative decoding in real deployments (`speculative:` in the YAML), through the router with
the real `openai` client: the output equals transformers generate token for token, and /metrics
counts the verify steps."""

from __future__ import annotations

import deploy_harness as dh
import hf_reference
import openai
from waiting import wait_until

from server.models.builtin import resolve_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1, "ngram_max": 3}
FILLER = "The system should keep the answer short, clear and correct, and it should cite the facts it uses. "
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "Topic: bridges. " + FILLER * 2 + "Now answer briefly:",
           "red green blue red green blue red green blue red green"]
STORY_PROMPTS = ["When an exception is raised,", "The following example shows how to use the with statement:"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _hf_text(model: str, prompt: str, n: int) -> str:
    return hf_reference.hf_text_ignore_eos(resolve_model(model), prompt, n)


def _complete(client: openai.OpenAI, model: str, prompt: str, n: int, **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True}, **extra)


def _no_blocks_in_use(dep: dh.Deployment) -> None:
    for url in dep.context_urls + dep.generation_urls:
        wait_until(lambda u=url: dep.metric(u, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10)


def test_generation_server_of_a_vswa_pair_speculates_exactly(tmp_path):
    """Sliding windows (64 tokens) and prompts past them; only the generation server speculates."""
    model = "builtin:tiny-qwen3-swa"
    with dh.launched("disagg_vswa.yaml", tmp_path, {"generation_servers": {"speculative": NGRAM}}) as dep:
        logs = "".join(p.read_text(errors="replace") for p in dep.log_dir.glob("*.log"))
        assert logs.count("speculative ngram") == 1 and logs.count("speculative off") == 1, dep.logs()
        client = _client(dep.url)
        for prompt in PROMPTS:
            whole = _complete(client, model, prompt, 48)
            assert whole.choices[0].text == _hf_text(model, prompt, 48)
            stream = _complete(client, model, prompt, 48, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
        [ctx], [gen] = dep.context_urls, dep.generation_urls
        assert dep.metric(gen, "pdserve_spec_verify_steps_total") > 0
        assert dep.metric(gen, "pdserve_spec_draft_tokens_total") >= dep.metric(gen, "pdserve_spec_verify_steps_total")
        assert dep.metric(ctx, "pdserve_spec_verify_steps_total") == 0
        _no_blocks_in_use(dep)


def test_aggregated_server_speculates_exactly_and_drafts_get_accepted(tmp_path):
    """The trained tiny-story model repeats itself enough over 160 tokens for some drafts to land. The
    engine runs in a process of its own: its figures reach /metrics through the engine link."""
    model = "builtin:tiny-story"
    overrides = {"model": model, "speculative": NGRAM, "engine_process": True}
    with dh.launched("aggregated.yaml", tmp_path, overrides) as dep:
        client = _client(dep.url)
        for prompt in PROMPTS[:1] + STORY_PROMPTS:  # a prompt with no accepted draft, two with some
            assert _complete(client, model, prompt, 160).choices[0].text == _hf_text(model, prompt, 160)
        stopped = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=160, temperature=0,
                                            stop=["\n\n"], extra_body={"ignore_eos": True})
        assert "\n\n" not in stopped.choices[0].text
        assert _hf_text(model, PROMPTS[0], 160).startswith(stopped.choices[0].text)
        assert dep.metric(dep.url, "pdserve_spec_accepted_tokens_total") > 0
        rate = dep.metric(dep.url, "pdserve_spec_acceptance_rate")
        assert 0 < rate <= 1
        wait_until(lambda: dep.metric(dep.url, "pdserve_kv_cache_blocks", 'state="in_use"') == 0, 10)


def test_aggregated_server_with_a_draft_model(tmp_path):
    """The served model as its own draft (`speculative.draft_model`): every draft is accepted."""
    model = "builtin:tiny-llama"
    speculative = {"method": "draft_model", "draft_model": model, "num_speculative_tokens": 3}
    with dh.launched("aggregated.yaml", tmp_path, {"model": model, "speculative": speculative}) as dep:
        client = _client(dep.url)
        for prompt in PROMPTS[:2]:
            assert _complete(client, model, prompt, 40).choices[0].text == _hf_text(model, prompt, 40)
        assert dep.metric(dep.url, "pdserve_spec_acceptance_rate") == 1.0
        assert dep.metric(dep.url, "pdserve_spec_tokens_per_step") > 3
