"""SSE through a real deployment whose every event carries U+2028 / U+2029 / U+0085.

The model is served from a directory whose name holds the three characters, so the `model` field
of every event has them: the router's own first events (made from the context answer) and the
generation server's relayed ones. httpx's `aiter_lines()` and the `openai` client must read whole
events, and the text must equal the non-streamed answer.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import deploy_harness as dh
import httpx
import openai

from server.models.builtin import resolve_model

ODD_NAME = "tiny\u2028llama\u2029odd\u0085name"
PROMPT = "Line separators must not cut a stream: "
BODY = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}


async def stream_lines(url: str, path: str, body: dict) -> list[str]:
    async with httpx.AsyncClient(timeout=60) as client, \
            client.stream("POST", url + path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return [line async for line in response.aiter_lines() if line]


def test_line_separators_in_events_reach_httpx_and_openai_whole(tmp_path):
    model_dir = tmp_path / ODD_NAME
    shutil.copytree(resolve_model("builtin:tiny-llama"), model_dir)
    with dh.launched("disagg.yaml", tmp_path, {"model": str(model_dir)}) as dep:
        whole = httpx.post(f"{dep.url}/v1/completions", json=BODY, timeout=60).json()
        assert whole["model"] == ODD_NAME

        lines = asyncio.run(stream_lines(dep.url, "/v1/completions", BODY))
        assert all(line.startswith("data: ") for line in lines), lines
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert {e["model"] for e in events} == {ODD_NAME}
        assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]

        client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model=ODD_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert {c.model for c in chunks} == {ODD_NAME}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole["choices"][0]["text"]
        messages = [{"role": "user", "content": PROMPT}]
        chat_whole = client.chat.completions.create(model=ODD_NAME, messages=messages, max_tokens=16,
                                                    temperature=0, extra_body={"ignore_eos": True})
        chat = list(client.chat.completions.create(model=ODD_NAME, messages=messages, max_tokens=16,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert {c.model for c in chat} == {ODD_NAME}
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == \
            chat_whole.choices[0].message.content
