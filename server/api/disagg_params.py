"""The checks of a request's `disaggregated_params` that need the engine or span other fields."""

from __future__ import annotations

from server.api.errors import APIError
from server.api.vocab import check_in_vocab
from server.openai.protocol import ChatCompletionRequest, CompletionRequest, DisaggParams


def check_disagg(body: CompletionRequest | ChatCompletionRequest, vocab_size: int, prompts: int) -> DisaggParams | None:
    """The request's parameters, checked; a context or generation leg carries one prompt."""
    disagg = body.disaggregated_params
    if disagg is None:
        return None
    if disagg.first_text_streamed and (disagg.request_type != "generation_only" or not body.stream):
        raise APIError(400, "disaggregated_params.first_text_streamed is only for streamed generation_only "
                       "requests (the router sets it when it streamed the first token itself)",
                       param="disaggregated_params.first_text_streamed")
    if disagg.kv_stream and disagg.request_type == "generation_only" and disagg.first_gen_tokens:
        raise APIError(400, "disaggregated_params.first_gen_tokens: a kv_stream generation_only request takes its "
                       "first token from the KV transfer", param="disaggregated_params.first_gen_tokens")
    if disagg.request_type != "context_and_generation" and prompts > 1:
        raise APIError(400, f"'prompt': a {disagg.request_type} request carries one prompt, not {prompts}",
                       param="prompt")
    first = disagg.first_gen_tokens
    if first:
        check_in_vocab(first, vocab_size, "disaggregated_params.first_gen_tokens")
    if first and disagg.request_type == "generation_only" and len(first) != body.n:
        raise APIError(400, f"disaggregated_params.first_gen_tokens holds {len(first)} tokens; a generation_only "
                       f"request takes one first token per choice (n={body.n})",
                       param="disaggregated_params.first_gen_tokens")
    return disagg


def request_cache_salt(salt: str | None, disagg: DisaggParams | None) -> str | None:
    """The salt the prompt's blocks are hashed with. A generation_only request takes the context
    server's (it made the KV this server pulls), which must agree with the body's when both are set."""
    if disagg is None or disagg.request_type != "generation_only" or disagg.cache_salt is None:
        return salt
    if salt is not None and salt != disagg.cache_salt:
        raise APIError(400, "cache_salt differs from disaggregated_params.cache_salt (the salt the context "
                       "server hashed this prompt with)", param="cache_salt")
    return disagg.cache_salt
