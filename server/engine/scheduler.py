"""Continuous-batching scheduler with chunked prefill, prefix reuse and preemption. Decisions only:
which requests run this step and how many tokens each computes (blocks are reserved through the KV
manager; tensors are never touched).

Invariants:
- a request `running` or `transferring` holds blocks for all its computed tokens and those scheduled
  this step; a `waiting` one holds none;
- a step schedules at most `max_num_tokens` tokens and `max_batch_size` requests, and starts no
  further waiting prompt once its prefill tokens reach `max_prefill_batch_tokens` (a started prompt
  goes on in chunks; decode tokens do not count);
- preemption picks the newest running request: its computed full blocks are committed to the reuse
  tree and released (with a host tier offloaded on eviction and onboarded on resume, else recomputed).

Async scheduling (request.py: a pending token is counted but its id is still on the device):
- a request whose pending token is certainly its last gets no row (it could produce nothing) and is
  never preempted;
- a request preempted with a pending token is recomputed from its ids, so it is not admitted again
  before the token has arrived; it holds the head of the queue meanwhile;
- commits cover only known ids (`committable`); the token arriving later commits the rest.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from kvcache import KVCacheManager, OutOfBlocksError
from server.engine.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_tokens: int = 2048
    max_batch_size: int = 64
    max_seq_len: int = 2048
    # Batching prompts pays where a step's cost grows slower than its tokens (a GPU); where it
    # grows in step with them (a CPU) it only makes every prompt of the batch wait for the last.
    max_prefill_batch_tokens: int | None = None  # None: max_num_tokens


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # drafts included
    drafts: tuple[int, ...] = ()  # speculative decoding: tokens after the last one to verify (speculative/)

    @property
    def need_logits(self) -> bool:
        return self.request.num_computed_tokens + self.num_new_tokens - len(self.drafts) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    to_pull: list[Request]  # generation side: admitted, KV must now be pulled
    rejected: list[Request]  # can never fit: finished with an error


def committable(request: Request) -> int:
    """Computed tokens whose ids are known: what `KVCacheManager.commit` may hash (a pending token's
    K/V may be computed already, its id is not on the host yet)."""
    return min(request.num_computed_tokens, request.num_known_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.transferring: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.transferring)

    def counts(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running),
                "transferring": len(self.transferring)}

    def live(self) -> list[Request]:
        """Every request running, waiting or pulling its KV."""
        return [*self.running, *self.waiting, *self.transferring.values()]

    def choices_of(self, output_id: str) -> list[Request]:
        """The live choices of the request whose outputs go out under `output_id`, in choice order."""
        return sorted((r for r in self.live() if r.output_id == output_id), key=lambda r: r.choice)

    def adopt(self, children: list[Request]) -> None:
        """Forked choices (server/engine/choices.py): those holding KV run from the next step; those
        that got none wait at the head of the queue, as preempted requests do."""
        self.running += [c for c in children if c.status == Status.RUNNING]
        self.waiting.extendleft(reversed([c for c in children if c.status == Status.WAITING]))

    def remove(self, request: Request) -> None:
        """Take a request out of every queue and free its blocks (finish, abort or failure)."""
        if request in self.waiting:
            self.waiting.remove(request)
            return
        if request in self.running:
            self.running.remove(request)
        self.transferring.pop(request.request_id, None)
        self.kv.release(request.request_id)

    def kv_arrived(self, request: Request) -> None:
        """Generation side: the prompt's KV is in place; the request decodes from its first token."""
        del self.transferring[request.request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        request.kv_received = True
        request.status = Status.RUNNING
        self.running.append(request)

    # ---- the decision
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_tokens
        out = SchedulerOutput(chunks=[], to_pull=[], rejected=[])
        budget = self._schedule_running(budget, out)
        self._schedule_waiting(budget, out)
        return out

    def _schedule_running(self, budget: int, out: SchedulerOutput) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.last_token_pending(self.config.max_seq_len):
                index += 1
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, request.num_computed_tokens + n):
                continue  # `request` itself was preempted; the list shrank
            out.chunks.append(ScheduledChunk(request, n))
            budget -= n
            index += 1
        return budget

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        while True:
            try:
                self.kv.extend(request.request_id, num_tokens)
                return True
            except OutOfBlocksError:
                victim = self._victim()
                self._preempt(victim)
                if victim is request:
                    return False

    def _victim(self) -> Request:
        """The newest running request, passing over those whose pending token ends them (they free
        their blocks at the next step anyway, and a context leg must still offer its blocks). The
        request being reserved is never passed over, so there is one."""
        limit = self.config.max_seq_len
        return next(r for r in reversed(self.running) if not r.last_token_pending(limit))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.commit(request.request_id, request.all_token_ids, committable(request))
        self.kv.release(request.request_id)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        prefill_limit = self.config.max_prefill_batch_tokens or self.config.max_num_tokens
        prefill = sum(c.num_new_tokens for c in out.chunks if c.num_new_tokens > 1)  # decode does not count
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if request.num_pending:  # preempted while its token was on the device: wait for it
                return
            problem = self._never_fits(request)
            if problem is not None:
                self.waiting.popleft()
                request.finish("error", problem, code=400)
                out.rejected.append(request)
                continue
            if not self._batch_has_room(request):
                return
            pulls_kv = request.is_generation_only and not request.admitted_once  # computes nothing here
            if (not pulls_kv and prefill >= prefill_limit) or not self._admit(request):
                return
            self.waiting.popleft()
            request.scheduled_time = request.scheduled_time or time.monotonic()
            request.admitted_once = True
            if pulls_kv:
                request.status = Status.WAITING_FOR_KV
                self.transferring[request.request_id] = request
                out.to_pull.append(request)
                continue
            request.status = Status.RUNNING
            self.running.append(request)
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            out.chunks.append(ScheduledChunk(request, n))
            budget -= n
            prefill += n if n > 1 else 0

    def _admit(self, request: Request) -> bool:
        """Allocate blocks, prefix reuse first. A generation-only request holds its first token: it
        reuses what it can of the prompt (all of it may match: no logits are needed), reserves room
        for that token, and pulls the rest by whole blocks, so a partly matching block is reused only
        if it completes the prompt (else the pull would overwrite the copy). A request that still
        needs its prompt logprobs reuses nothing (`Request.max_cached_tokens`)."""
        prompt_kv_only = request.is_generation_only and not request.admitted_once
        tokens = request.prompt_token_ids if prompt_kv_only else request.all_token_ids
        try:
            cached = self.kv.admit(
                request.request_id, tokens,
                num_tokens=request.num_tokens if prompt_kv_only else None,
                max_cached_tokens=len(tokens) if prompt_kv_only else request.max_cached_tokens,
                priority=request.kv_retention_priority, salt=request.cache_salt,
                partial_only_if_complete=prompt_kv_only,
            )
        except OutOfBlocksError:
            return False
        request.num_computed_tokens = cached
        if not request.admitted_once:
            request.num_cached_tokens = cached
        return True

    def _batch_has_room(self, request: Request) -> bool:
        """A request with choices still to fork takes a row for each (they join the batch at its first token)."""
        taken = sum(r.batch_slots for r in (*self.running, *self.transferring.values()))
        return taken + request.batch_slots <= self.config.max_batch_size

    def _never_fits(self, request: Request) -> str | None:
        if request.batch_slots > self.config.max_batch_size:
            return (f"n={request.sampling.n} choices need as many rows of a step, but max_batch_size is "
                    f"{self.config.max_batch_size}")
        slots = min(self.kv.num_slots(w) for w in self.kv.window_sizes)
        if math.ceil(request.num_tokens / self.kv.tokens_per_block) > slots:
            capacity = slots * self.kv.tokens_per_block
            return (f"request needs {request.num_tokens} tokens of KV cache but the primary pool holds "
                    f"{capacity} tokens (raise kv_cache_config.max_tokens)")
        return None
