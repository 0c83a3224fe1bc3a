"""The disaggregated roles as engine hooks: the context side leases and sends, the generation side pulls.

Decision side only (STYLE.md #7): which blocks a request needs and who frees them. The byte
movement lives in `transceiver/`.
"""

from __future__ import annotations

import math

from kvcache import KVCacheManager
from server.engine.request import Request
from server.types import DisaggParams, RequestOutput

# A pull refused for what the request named (a lease the context server does not hold, or one
# another pull is already taking) is the caller's error; anything else is the servers'.
PULL_FAILURE_STATUS = {"unknown_request": 404, "bad_request": 409}


class ContextRole:
    """Prefill, sample the first token, then park the prompt's blocks under a lease for the pull."""

    accepts = ("context_only", "context_and_generation")

    def __init__(self, sender, kv: KVCacheManager) -> None:
        self.sender = sender
        self.kv = kv

    def step(self, core) -> list[RequestOutput]:
        self.sender.step()
        return []

    def start_pulls(self, requests: list[Request]) -> None:
        raise AssertionError("a context server never admits generation_only requests")

    def after_prefill(self, request: Request) -> DisaggParams:
        rid = request.request_id
        blocks = {w: self.kv.block_ids(rid, w) for w in self.kv.window_sizes}
        self.sender.add_lease(rid, blocks, request.num_prompt_tokens)
        return DisaggParams(
            request_type="context_only", ctx_request_id=rid, ctx_endpoint=self.sender.endpoint,
            ctx_epoch=self.sender.epoch, first_gen_tokens=tuple(request.output_token_ids),
            prompt_token_ids=tuple(request.prompt_token_ids), ctx_cached_tokens=request.num_cached_tokens,
            cache_salt=request.cache_salt,
        )

    def on_abort(self, request: Request) -> None:
        return None

    def release_lease(self, ctx_request_id: str) -> None:
        self.sender.drop_lease(ctx_request_id)

    def busy(self) -> bool:
        # Leases alone need no fast ticks: their pulls are served on the sender's socket thread,
        # whose `Ended` items wake the engine, and expiry is checked on every (idle) tick.
        return self.sender.busy


class GenerationRole:
    """Reuse the local prefix cache, pull only the missing blocks, then decode."""

    accepts = ("generation_only", "context_and_generation")

    def __init__(self, receiver, kv: KVCacheManager) -> None:
        self.receiver = receiver
        self.kv = kv
        self._pulling: set[str] = set()
        self._local: list[str] = []  # everything was already cached here: nothing to pull

    def step(self, core) -> list[RequestOutput]:
        outputs = []
        for rid in self._local:
            request = core.scheduler.transferring.get(rid)
            if request is not None:
                core.kv_arrived(request)
        self._local.clear()
        for result in self.receiver.step():
            self._pulling.discard(result.request_id)
            request = core.scheduler.transferring.get(result.request_id)
            if request is None:
                continue  # aborted meanwhile
            if result.ok:
                core.kv_arrived(request)
            else:
                message = f"KV transfer from the context server failed: {result.error}"
                outputs.append(core.fail(request, message, code=PULL_FAILURE_STATUS.get(result.reason, 502)))
        return outputs

    def start_pulls(self, requests: list[Request]) -> None:
        for request in requests:
            wanted = blocks_to_pull(self.kv, request.request_id, request.num_prompt_tokens,
                                    request.num_computed_tokens)
            params = request.disagg
            if not any(slots for _, slots in wanted.values()):
                self.receiver.release_remote(params.ctx_endpoint, params.ctx_request_id)
                self._local.append(request.request_id)
                continue
            self.receiver.start_pull(request.request_id, params.ctx_endpoint, params.ctx_epoch,
                                     params.ctx_request_id, wanted)
            self._pulling.add(request.request_id)

    def on_abort(self, request: Request) -> None:
        params = request.disagg
        if request.request_id in self._pulling:
            self._pulling.discard(request.request_id)
            self.receiver.cancel(request.request_id)
        else:
            self.receiver.release_remote(params.ctx_endpoint, params.ctx_request_id)

    def release_lease(self, ctx_request_id: str) -> None:
        return None  # leases live on context servers

    def busy(self) -> bool:
        return bool(self._pulling or self._local)


def blocks_to_pull(kv: KVCacheManager, request_id: str, num_prompt_tokens: int,
                   cached_tokens: int) -> dict[int, tuple[int, list[int]]]:
    """Per window: (first block index, destination slots) of the prompt blocks not held locally.

    Blocks before the local prefix hit are reused; in sliding-window groups, blocks the first
    decode step can no longer see are released here and not pulled either. The hit ends on a block
    boundary unless a partly matching block completed the prompt (the scheduler admits generation
    requests so: `partial_only_if_complete`): then every prompt token is local and nothing is
    pulled, where a pull of the last block would only bring its tokens again.
    """
    tpb = kv.tokens_per_block
    kv.release_out_of_window(request_id, num_prompt_tokens)
    num_blocks = math.ceil(num_prompt_tokens / tpb)
    missing_from = num_blocks if cached_tokens >= num_prompt_tokens else cached_tokens // tpb
    wanted = {}
    for window in kv.window_sizes:
        ids = kv.block_ids(request_id, window)[:num_blocks]
        first_held = next((i for i, b in enumerate(ids) if b >= 0), num_blocks)
        first = max(missing_from, first_held)
        wanted[window] = (first, kv.slot_table(request_id, window)[first:num_blocks])
    return wanted
