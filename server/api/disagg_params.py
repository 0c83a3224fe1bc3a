"""The checks of a request's `disaggregated_params` that need the engine or span other fields."""

from __future__ import annotations

from server.api.errors import APIError
from server.api.vocab import check_in_vocab, token_ids
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


def check_generation_params(disagg: DisaggParams, prompt_len: int, logprobs: bool, echo: bool) -> None:
    """A generation_only request that asks for logprobs brings the context server's."""
    if disagg.first_text_streamed or disagg.kv_stream:
        return  # the router sent the first token's; with streamed KV it comes with the KV
    first = disagg.first_gen_logprobs
    tokens = disagg.first_gen_tokens or ()
    if logprobs and tokens:
        param = "disaggregated_params.first_gen_logprobs"
        if first is None or len(first) != len(tokens) or any(e[0] != t for e, t in zip(first, tokens, strict=False)):
            raise APIError(400, f"'{param}': logprobs are asked: one entry per first_gen_tokens token, that token's",
                           param=param)
    if logprobs and echo and (disagg.prompt_logprobs is None or len(disagg.prompt_logprobs) != prompt_len):
        param = "disaggregated_params.prompt_logprobs"
        raise APIError(400, f"'{param}': echo with logprobs needs the context server's, one per prompt token",
                       param=param)


def prompt_and_prior(prompt_ids: list[int], disagg: DisaggParams | None, vocab_size: int) -> tuple[list[int], int]:
    """The prompt's ids and how many of the last are a moved stream's output so far (`prior_output_tokens`).
    A leg's `prompt_token_ids` win over re-tokenising: the KV the context server made is for exactly
    those (a moved stream's context leg prefills the prompt and the output so far)."""
    prior = disagg.prior_output_tokens if disagg is not None else 0
    if disagg is not None and disagg.prompt_token_ids and (disagg.request_type == "generation_only" or prior):
        prompt_ids = token_ids(list(disagg.prompt_token_ids), vocab_size, "disaggregated_params.prompt_token_ids")
    if prior >= len(prompt_ids):
        raise APIError(400, "disaggregated_params.prior_output_tokens must be less than the number of "
                       "prompt_token_ids", param="disaggregated_params.prior_output_tokens")
    return prompt_ids, prior


def request_cache_salt(salt: str | None, disagg: DisaggParams | None) -> str | None:
    """The salt the prompt's blocks are hashed with. A generation_only request takes the context
    server's (it made the KV this server pulls), which must agree with the body's when both are set."""
    if disagg is None or disagg.request_type != "generation_only" or disagg.cache_salt is None:
        return salt
    if salt is not None and salt != disagg.cache_salt:
        raise APIError(400, "cache_salt differs from disaggregated_params.cache_salt (the salt the context "
                       "server hashed this prompt with)", param="cache_salt")
    return disagg.cache_salt
