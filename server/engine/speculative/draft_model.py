"""The draft-model drafter: a small model of the same tokenizer proposes k tokens, greedily (a
deterministic drafter, so verification keeps the target's output or distribution: verify.py).

It owns a model runner and a private paged KV cache (no prefix reuse, no host tier), and per request
the ids whose K/V that cache holds (`_Draft.ids`). One `propose` first catches up: it computes every
known id after the longest common prefix of what the draft holds and what the request now knows
(accepted drafts stay; a rejected draft's K/V is overwritten), in chunks of at most the runner's
token budget, the last logits giving each request its first draft; then k - 1 decode steps over the
requests that want more. A request's draft K/V is released with the request (`weakref.finalize`),
or at once when the draft pool is full (that request gets no drafts this step).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

from kvcache import KvCacheConfig, KVCacheManager, OutOfBlocksError
from server.engine.request import Request
from server.models.builtin import resolve_model
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner, SeqChunk

TOKENS_PER_BLOCK = 16


@dataclass
class _Draft:
    rid: str  # its id in the draft cache
    ids: list[int]  # ids whose K/V the draft cache holds, in position order


class DraftModelDrafter:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.runner, self.kv = runner, kv
        self._drafts: weakref.WeakKeyDictionary[Request, _Draft] = weakref.WeakKeyDictionary()
        self._ids = itertools.count()

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        out: dict[Request, list[int]] = {r: [] for r in requests}
        wanted = {r: k for r, k in zip(requests, ks, strict=True) if k > 0 and self._room(r, k)}
        for request, token in self._catch_up(list(wanted)).items():
            out[request].append(token)
        for i in range(1, max(wanted.values(), default=0)):
            active = [r for r in wanted if wanted[r] > i]
            chunks = [SeqChunk([out[r][-1]], len(self._drafts[r].ids), self._tables(r), True) for r in active]
            for request, token in zip(active, self._argmax(chunks), strict=True):
                self._drafts[request].ids.append(out[request][-1])
                out[request].append(token)
        return [out[r] for r in requests]

    def _room(self, request: Request, k: int) -> bool:
        """Blocks for its known ids and k - 1 drafts; the pool full: this request drafts nothing."""
        draft = self._draft(request)
        try:
            self.kv.extend(draft.rid, request.num_known_tokens + k - 1)
        except OutOfBlocksError:
            return False
        return True

    def _catch_up(self, requests: list[Request]) -> dict[Request, int]:
        """Compute every request's ids the draft lacks; its first draft (from the last id's logits)."""
        pieces: list[tuple[Request, SeqChunk]] = []
        budget = self.runner.max_num_tokens
        for request in requests:
            draft, known = self._drafts[request], request.all_token_ids
            keep = _common_prefix(draft.ids, known, len(known) - 1)
            for start in range(keep, len(known), budget):
                end = min(start + budget, len(known))
                pieces.append((request, SeqChunk(known[start:end], start, self._tables(request), end == len(known))))
            draft.ids = list(known)
        firsts: dict[Request, int] = {}
        for step in _packed(pieces, budget, self.runner.max_batch_size):
            logits_of = [r for r, c in step if c.need_logits]
            for request, token in zip(logits_of, self._argmax([c for _, c in step]), strict=True):
                firsts[request] = token
        return firsts

    def _argmax(self, chunks: list[SeqChunk]) -> list[int]:
        return self.runner.execute(chunks).argmax(dim=-1).tolist()

    def _tables(self, request: Request) -> dict[int, list[int]]:
        rid = self._drafts[request].rid
        return {w: self.kv.slot_table(rid, w) for w in self.kv.window_sizes}

    def _draft(self, request: Request) -> _Draft:
        draft = self._drafts.get(request)
        if draft is None:
            draft = self._drafts[request] = _Draft(f"draft-{next(self._ids)}", [])
            self.kv.admit(draft.rid, [], num_tokens=0)
            weakref.finalize(request, self.kv.release, draft.rid)
        return draft


def _common_prefix(held: list[int], known: list[int], limit: int) -> int:
    """Leading ids equal in both, at most `limit` (the last known id is always computed again)."""
    n = 0
    while n < min(len(held), limit) and held[n] == known[n]:
        n += 1
    return n


def _packed(pieces: list[tuple[Request, SeqChunk]], budget: int, max_batch: int):
    """Consecutive runs of pieces whose tokens fit one step (a request's pieces stay in order)."""
    step: list[tuple[Request, SeqChunk]] = []
    used = 0
    for piece in pieces:
        n = len(piece[1].token_ids)
        if step and (used + n > budget or len(step) == max_batch or any(r is piece[0] for r, _ in step)):
            yield step
            step, used = [], 0
        step.append(piece)
        used += n
    if step:
        yield step


def build_draft_drafter(draft_model: str, target: ModelRunner, max_seq_len: int,
                        max_requests: int) -> DraftModelDrafter:
    """The draft model on the target's device, in its dtype and kernels (no CUDA graphs), with a pool
    of max_seq_len tokens for each of `max_requests` drafting requests."""
    model_dir = resolve_model(draft_model)
    spec = load_spec(model_dir)
    if spec.vocab_size != target.spec.vocab_size:
        raise ValueError(f"speculative.draft_model: {draft_model} has a vocabulary of {spec.vocab_size} tokens, "
                         f"the served model {target.spec.vocab_size}: a draft model needs the same tokenizer")
    config = KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, max_tokens=max_seq_len * max_requests,
                           enable_block_reuse=False)
    kv = KVCacheManager(config, spec.cache_layout(max_seq_len, target.dtype, target.device))
    runner = ModelRunner(model_dir, kv, dtype=target.dtype, device=target.device,
                         max_num_tokens=target.max_num_tokens, max_batch_size=target.max_batch_size,
                         kernels=target.kernels, cuda_graphs=False, max_seq_len=max_seq_len)
    runner.warm_up()
    return DraftModelDrafter(runner, kv)
