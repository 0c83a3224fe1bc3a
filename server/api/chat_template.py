"""Chat messages -> prompt token ids, through the model's own chat template (messages shaped as
transformers' templates expect them; tool call arguments as objects)."""

from __future__ import annotations

import json

from jinja2 import TemplateError

from server.openai.chat_messages import ChatMessage
from server.openai.errors import APIError, bad_field
from server.openai.protocol import ChatCompletionRequest


def _message_text(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"only text content is supported (messages.{index} has '{part.type}')",
                           param=f"messages.{index}.content")
        texts.append(part.text)
    return "".join(texts)


def _tool_calls(message: ChatMessage, index: int) -> list[dict]:
    if message.role != "assistant":
        raise bad_field(f"messages.{index}.tool_calls", "only assistant messages carry tool calls")
    calls = []
    for j, call in enumerate(message.tool_calls):
        param = f"messages.{index}.tool_calls.{j}.function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            raise bad_field(param, "not JSON text") from None
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls


def template_message(message: ChatMessage, index: int) -> dict:
    out = {"role": message.role, "content": _message_text(message.content, index)}
    if message.tool_calls:
        out["tool_calls"] = _tool_calls(message, index)
    if message.role == "tool":
        if not message.tool_call_id:
            raise bad_field(f"messages.{index}.tool_call_id", "a tool message names the call it answers")
        out["tool_call_id"] = message.tool_call_id
    return out


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """Render the messages (and `tools`) with the tokenizer's chat template (generation prompt added), tokenise."""
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError, TypeError) as exc:
        raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
    # The template already wrote any special tokens (BOS) it wants.
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    return ids
