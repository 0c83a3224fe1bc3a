"""The n choices of one request (`SamplingParams.n`): one prompt computed once, n continuations.

Until its first token is due, a request with n > 1 runs as one request (choice 0) that takes n rows
of a step's batch (`Request.batch_slots`). Then it forks n - 1 children (`child_id`, `choice` i)
that hold its prompt's KV through `KVCacheManager.fork` (full blocks shared, the partly filled one
copied) and from then on run as any request does. The fork happens on aggregated and context
servers in the step that computes the prompt's last token, each child sampling its first token from
a copy of its parent's logits row (`EngineCore._launch`); on generation servers when the prompt's KV
has arrived, child i taking the context server's first token i (`Request.take_first_tokens`). A
child for whose copy no block is left starts as a preempted request does: waiting, its prompt to be
recomputed (from the prefix cache, where its parent committed the full blocks).

Outputs of child i go out under the parent's request id with index i. A context server hands all n
choices over under the parent's one lease (`Request.choice_first_tokens`) and releases the
children's blocks at once, applying no stop rule to their first tokens (the generation server does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kvcache import KVCacheManager, OutOfBlocksError
from server.engine.request import Request, Status
from server.engine.scheduler import ScheduledChunk
from server.types import RequestOutput


def child_id(request_id: str, choice: int) -> str:
    """The engine's (and the KV manager's) id of a forked choice."""
    return f"{request_id}/{choice}"


def fork_children(parent: Request, kv: KVCacheManager, num_tokens: int) -> list[Request]:
    """Choices 1..n-1 of `parent`, holding its KV of its first `num_tokens` tokens (RUNNING, that many
    tokens computed), or none when no block is left for their copy (WAITING, nothing computed)."""
    children = []
    for choice in range(1, parent.sampling.n):
        child = _child(parent, choice)
        try:
            kv.fork(parent.request_id, child.request_id, num_tokens)
        except OutOfBlocksError:
            child.status = Status.WAITING
        else:
            child.status, child.num_computed_tokens = Status.RUNNING, num_tokens
        children.append(child)
    parent.children = children
    return children


def fork_rows(logits: torch.Tensor, sampled: list[ScheduledChunk],
              fork: Callable[[Request, int], list[Request]]) -> tuple[torch.Tensor, list[Request]]:
    """A step's logits (rows of `sampled`, in order) and the children `fork` made of the requests whose
    first token is due: the logits gain a copy of the parent's row for each child, in the children's
    order (a view and a concatenation on the device: nothing waits for it)."""
    copies, children, row = [logits], [], 0
    for chunk in sampled:
        request = chunk.request
        if request.forks_pending and not request.is_generation_only:  # a generation server forks on arrival
            forked = fork(request, request.num_tokens)
            copies.append(logits[row:row + 1].expand(len(forked), -1))
            children += forked
        row += 1 + len(chunk.drafts)
    return torch.cat(copies), children


def unforked_finals(request: Request, final: RequestOutput) -> list[RequestOutput]:
    """A request that ended before it forked ends its other choices with it: a final output for each
    (every choice's stream ends with its own), like its own `final` but empty."""
    others = range(1, request.sampling.n) if request.forks_pending else ()
    return [replace(final, new_token_ids=[], new_text="", completion_tokens=0, index=i) for i in others]


def _child(parent: Request, choice: int) -> Request:
    child = Request(child_id(parent.request_id, choice), list(parent.prompt_token_ids), parent.sampling,
                    parent.eos_token_ids, parent.arrival_time, parent.disagg, parent.cache_salt,
                    parent.kv_retention_priority, choice=choice, parent=parent)
    child.num_cached_tokens = parent.num_cached_tokens
    child.admitted_once, child.kv_received = True, parent.kv_received
    child.scheduled_time = parent.scheduled_time
    child.grammar = parent.grammar.fork() if parent.grammar is not None else None  # its own place in it
    return child
