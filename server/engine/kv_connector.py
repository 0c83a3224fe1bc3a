"""The KV hand-over between the engine and the transceiver, one connector per server role: which
blocks a request needs and who frees them (the bytes move in `transceiver/`). A connector is given
requests and returns data; it never holds the engine (`EngineCore.step` calls it).

Streamed KV (`disaggregated_params.kv_stream`, transceiver/sender/stream.py): a context request's
lease opens at its first prefill step, every step's completed blocks are offered at once, and the
offer after its first token adds the rest and that token (one per choice). Its generation request
pulls from the start and learns its first token(s) when the pull ends (`Arrived.first_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvcache import KVCacheManager
from server.engine.request import Request, Status
from server.types import DisaggParams

if TYPE_CHECKING:
    from transceiver.receiver import KVReceiver
    from transceiver.sender import KVSender

# A pull refused for what the request named (a lease the context server does not hold, or one
# another pull is already taking) is the caller's error; anything else is the servers'.
PULL_FAILURE_STATUS = {"unknown_request": 404, "bad_request": 409}


class Arrived(NamedTuple):
    request_id: str
    first_tokens: tuple[int, ...] = ()  # a streamed pull: the context server's first token of each choice
    cached_tokens: int = 0  # a streamed pull: the context server's prefix hit


class PullFailure(NamedTuple):
    request_id: str
    message: str  # for the client
    code: int  # HTTP status


class KVConnector:
    """What the engine step hands over; the defaults are the aggregated server's: nothing."""

    accepts: tuple[str, ...] = ("context_and_generation",)  # disaggregated_params.request_type served

    def poll(self) -> tuple[list[Arrived], list[PullFailure]]:
        """Every engine tick, idle or not: (requests whose prompt KV is now in place, failed pulls)."""
        return [], []

    def progress(self, requests: list[Request]) -> None:
        """Context side, after each step: offer the blocks its prefill completed of streamed requests."""

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
        self._streams: dict[str, Streamed] = {}  # streamed requests whose lease is open, by id

    def poll(self) -> tuple[list[Arrived], list[PullFailure]]:
        self.sender.step()  # take back ended leases, reap expired ones, unpin
        for rid, st in list(self._streams.items()):  # ended without a hand-over (the first token was its last)
            if st.request.status == Status.FINISHED:
                del self._streams[rid]
                self.sender.drop_lease(rid)
        return [], []

    def progress(self, requests: list[Request]) -> None:
        for request in requests:
            if request.is_context_only and request.disagg.kv_stream:
                self._publish(request)

    def _publish(self, request: Request) -> None:
        """Open the request's lease at its first step, then offer the full blocks computed since."""
        rid, total = request.request_id, request.num_prompt_tokens
        st = self._streams.get(rid)
        if st is None:
            blocks = math.ceil(total / self.kv.tokens_per_block)
            self.sender.open_stream(rid, {w: blocks for w in self.kv.window_sizes})
            st = self._streams[rid] = Streamed(request)
        full = min(request.num_computed_tokens, total) // self.kv.tokens_per_block
        if full > st.published:
            self.sender.extend_stream(rid, self._blocks(rid, total, st.published, full))
            st.published = full

    def _blocks(self, rid: str, total: int, start: int, end: int) -> dict[int, tuple[int, list[int]]]:
        """Per window, blocks [start, end) of the request, less those the generation side's first
        decode step will not see (sliding windows: they are never pulled)."""
        out = {}
        for window in self.kv.window_sizes:
            first = max(start, max(0, total - window + 1) // self.kv.tokens_per_block)
            if first < end:
                out[window] = (first, self.kv.block_ids(rid, window)[first:end])
        return out

    def offer(self, requests: list[Request]) -> list[DisaggParams]:
        return [self._lease(r) for r in requests]

    def _lease(self, request: Request) -> DisaggParams:
        rid = request.request_id
        st = self._streams.pop(rid, None)
        if st is None:
            self.sender.add_lease(rid, {w: self.kv.block_ids(rid, w) for w in self.kv.window_sizes})
        else:  # the rest of the prompt and the first token; a lease that ended meanwhile takes nothing
            end = math.ceil(request.num_prompt_tokens / self.kv.tokens_per_block)
            self.sender.extend_stream(rid, self._blocks(rid, request.num_prompt_tokens, st.published, end),
                                      final=True, first_tokens=request.choice_first_tokens(),
                                      cached_tokens=request.num_cached_tokens)
        return DisaggParams(
            request_type="context_only", ctx_request_id=rid, ctx_endpoint=self.sender.endpoint,
            ctx_epoch=self.sender.epoch, first_gen_tokens=request.choice_first_tokens(),
            prompt_token_ids=tuple(request.prompt_token_ids), ctx_cached_tokens=request.num_cached_tokens,
            cache_salt=request.cache_salt, kv_stream=st is not None,
        )

    def release(self, request: Request) -> None:
        """A streamed request that ends here (abort, rejection) ends its lease, or refuses the pull
        that waits for a lease it never opened."""
        if request.is_context_only and request.disagg.kv_stream:
            self._streams.pop(request.request_id, None)
            self.sender.drop_lease(request.request_id)

    def drop_lease(self, ctx_request_id: str) -> None:
        self.sender.drop_lease(ctx_request_id)

    def busy(self) -> bool:
        # Leases alone need no fast ticks: their pulls are served on the sender's socket thread,
        # whose `Ended` items wake the engine, and expiry is checked on every (idle) tick.
        return self.sender.busy


@dataclass
class Streamed:
    """A context request whose lease is open while it prefills: its first `published` blocks are offered."""

    request: Request
    published: int = 0


class GenerationConnector(KVConnector):
    """Reuse the local prefix cache, pull only the missing blocks, then decode."""

    accepts = ("generation_only", "context_and_generation")

    def __init__(self, receiver: KVReceiver, kv: KVCacheManager) -> None:
        self.receiver = receiver
        self.kv = kv
        self._local: list[str] = []  # everything was already cached here: nothing to pull

    def poll(self) -> tuple[list[Arrived], list[PullFailure]]:
        arrived, self._local = [Arrived(rid) for rid in self._local], []
        failed = []
        for result in self.receiver.step():
            if result.ok:
                arrived.append(Arrived(result.request_id, result.first_tokens, result.cached_tokens))
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
            if not params.kv_stream and not any(slots for _, slots in wanted.values()):
                self.receiver.release_remote(params.ctx_endpoint, params.ctx_request_id, params.ctx_epoch)
                self._local.append(request.request_id)
                continue
            # streamed: pulled even when every block is here, for the first token that comes with it
            self.receiver.start_pull(request.request_id, params.ctx_endpoint, params.ctx_epoch,
                                     params.ctx_request_id, wanted, stream=params.kv_stream)

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
    Blocks before the local prefix hit are reused; in sliding-window groups, blocks the first decode
    step can no longer see are released here and not pulled either. The hit ends on a block boundary
    unless a partly matching block completed the prompt (`partial_only_if_complete`): then nothing is
    pulled, where a pull of the last block would only bring its tokens again."""
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
