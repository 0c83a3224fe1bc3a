"""The KV hand-over between the engine and the transceiver, one connector per server role.

Decision side only (STYLE.md #7): which blocks a request needs and who frees them; the bytes move
in `transceiver/`. A connector is given requests and returns data (params, ids that arrived or
failed); it never holds the engine. `EngineCore.step` calls it in plain lines:

    arrived, failed = connector.poll()     # KV in: pulls that ended since the last step
    connector.start_pulls(admitted)        # KV in: ask for the blocks admitted requests lack
    params = connector.offer(prefilled)    # KV out: lease prefilled blocks, answer with where they are
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from kvcache import KVCacheManager
from server.engine.request import Request
from server.types import DisaggParams

if TYPE_CHECKING:
    from transceiver.receiver import KVReceiver
    from transceiver.sender import KVSender

# A pull refused for what the request named (a lease the context server does not hold, or one
# another pull is already taking) is the caller's error; anything else is the servers'.
PULL_FAILURE_STATUS = {"unknown_request": 404, "bad_request": 409}


class PullFailure(NamedTuple):
    request_id: str
    message: str  # for the client
    code: int  # HTTP status


class KVConnector:
    """What the engine step hands over; the defaults are the aggregated server's: nothing."""

    accepts: tuple[str, ...] = ("context_and_generation",)  # disaggregated_params.request_type served

    def poll(self) -> tuple[list[str], list[PullFailure]]:
        """Every engine tick, idle or not: (ids of requests whose prompt KV is now in place, failed pulls)."""
        return [], []

    def start_pulls(self, requests: list[Request]) -> None:
        """Generation side: admitted requests (blocks allocated, prefix reused) pull the rest."""
        raise AssertionError(f"{type(self).__name__} admits no generation_only request")

    def offer(self, requests: list[Request]) -> list[DisaggParams]:
        """Context side: lease the prompt blocks of prefilled requests (one answer each)."""
        raise AssertionError(f"{type(self).__name__} admits no context_only request")

    def release(self, request: Request) -> None:
        """`request` ends here (abort, rejection, failure, finished early): free what its KV holds elsewhere."""

    def drop_lease(self, ctx_request_id: str) -> None:
        """Context side: the generation leg will never pull this lease (no-op if unknown)."""

    def busy(self) -> bool:
        """Transfers in flight: the engine ticks fast."""
        return False


class AggregatedConnector(KVConnector):
    """Both phases of every request run on this server (the null connector)."""


class ContextConnector(KVConnector):
    """Prefill, sample the first token, then park the prompt's blocks under a lease for the pull."""

    accepts = ("context_only", "context_and_generation")

    def __init__(self, sender: KVSender, kv: KVCacheManager) -> None:
        self.sender = sender
        self.kv = kv

    def poll(self) -> tuple[list[str], list[PullFailure]]:
        self.sender.step()  # take back ended leases, reap expired ones, unpin
        return [], []

    def offer(self, requests: list[Request]) -> list[DisaggParams]:
        return [self._lease(r) for r in requests]

    def _lease(self, request: Request) -> DisaggParams:
        rid = request.request_id
        self.sender.add_lease(rid, {w: self.kv.block_ids(rid, w) for w in self.kv.window_sizes})
        return DisaggParams(
            request_type="context_only", ctx_request_id=rid, ctx_endpoint=self.sender.endpoint,
            ctx_epoch=self.sender.epoch, first_gen_tokens=tuple(request.output_token_ids),
            prompt_token_ids=tuple(request.prompt_token_ids), ctx_cached_tokens=request.num_cached_tokens,
            cache_salt=request.cache_salt,
        )

    def drop_lease(self, ctx_request_id: str) -> None:
        self.sender.drop_lease(ctx_request_id)

    def busy(self) -> bool:
        # Leases alone need no fast ticks: their pulls are served on the sender's socket thread,
        # whose `Ended` items wake the engine, and expiry is checked on every (idle) tick.
        return self.sender.busy


class GenerationConnector(KVConnector):
    """Reuse the local prefix cache, pull only the missing blocks, then decode."""

    accepts = ("generation_only", "context_and_generation")

    def __init__(self, receiver: KVReceiver, kv: KVCacheManager) -> None:
        self.receiver = receiver
        self.kv = kv
        self._local: list[str] = []  # everything was already cached here: nothing to pull

    def poll(self) -> tuple[list[str], list[PullFailure]]:
        arrived, self._local = self._local, []
        failed = []
        for result in self.receiver.step():
            if result.ok:
                arrived.append(result.request_id)
            else:
                failed.append(PullFailure(result.request_id,
                                          f"KV transfer from the context server failed: {result.error}",
                                          PULL_FAILURE_STATUS.get(result.reason, 502)))
        return arrived, failed

    def start_pulls(self, requests: list[Request]) -> None:
        for request in requests:
            wanted = blocks_to_pull(self.kv, request.request_id, request.num_prompt_tokens,
                                    request.num_computed_tokens)
            params = request.disagg
            if not any(slots for _, slots in wanted.values()):
                self.receiver.release_remote(params.ctx_endpoint, params.ctx_request_id, params.ctx_epoch)
                self._local.append(request.request_id)
                continue
            self.receiver.start_pull(request.request_id, params.ctx_endpoint, params.ctx_epoch,
                                     params.ctx_request_id, wanted)

    def release(self, request: Request) -> None:
        """A generation-only request that ends before its KV arrived frees the context side's lease;
        a running pull is cancelled first, so no chunk of it is written into freed blocks."""
        if request.is_generation_only and not request.kv_received and not self.receiver.cancel(request.request_id):
            params = request.disagg
            self.receiver.release_remote(params.ctx_endpoint, params.ctx_request_id, params.ctx_epoch)

    def busy(self) -> bool:
        return self.receiver.num_pulls > 0 or bool(self._local)


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
