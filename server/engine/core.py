"""The engine step: receive -> schedule -> run -> postprocess -> transfer -> send.

Async scheduling pipelines two steps: step k is launched while step k-1 runs on the
GPU, then step k-1 is postprocessed (one event wait). A row whose input is step k-1's token reads
it on the device (runner.PendingTokens); the scheduler counts that token as pending (request.py).
A request that ends at step k-1 while in step k discards its step-k token, and its blocks are
released at once: what touches KV later runs after step k on the engine's stream (the next steps,
a pull's scatter, the host tier's copies, which wait for that stream) or after an event recorded
there later (a lease's reads). A step that prefilled context legs is postprocessed before the next
is scheduled, so their KV is offered right after the step that wrote it (the next may be a long
prefill). Without async scheduling, every step is postprocessed in the same step.
"""

from __future__ import annotations

from kvcache import KVCacheManager
from server.engine import logprobs as lp
from server.engine.choices import fork_children, fork_rows, unforked_finals
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.inflight import SampledStep, TokenStaging
from server.engine.kv_connector import AggregatedConnector, Arrived, KVConnector, PullFailure
from server.engine.penalties import TokenCounts
from server.engine.request import Request, Status
from server.engine.sampler import sample_on_device
from server.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, committable
from server.engine.speculative.decoder import NoSpeculation, SpecDecoder
from server.engine.structured.engine_hook import StructuredOutput
from server.engine.timings import TokenTimings
from server.models.runner import ModelRunner, PendingTokens, SeqChunk
from server.types import DisaggParams, GenerateRequest, RequestOutput, TokenLogprob

IDLE_WAIT_S = 0.02  # nothing to do: leases are still reaped at least this often
BUSY_WAIT_S = 0.002  # transfers in flight or requests waiting for blocks


class EngineCore:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, config: SchedulerConfig, tokenizer,
                 *, metrics=None, connector: KVConnector | None = None, async_scheduling: bool = False,
                 spec: SpecDecoder | None = None) -> None:
        self.runner = runner
        self.kv = kv
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, kv)
        self.timings = TokenTimings(metrics)  # TTFT, TPOT, e2e and queue time for `metrics`
        self.connector = connector or AggregatedConnector()  # the KV hand-over of this server's role
        self.eos_token_ids = frozenset(runner.spec.eos_token_ids)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._deferred: list[tuple[Request, int]] = []  # accepted tokens whose text and output wait
        self.did_work = False
        self._sliding = min(kv.window_sizes) < config.max_seq_len  # some layers use a sliding window
        self.async_scheduling = async_scheduling  # may change between steps (a benchmark compares both)
        self.inflight: SampledStep | None = None  # async: the launched step whose tokens are unread
        self._staging = TokenStaging(runner.device, runner.max_batch_size)
        self.spec = spec or NoSpeculation()  # speculative decoding (server/engine/speculative/)
        self.counts = TokenCounts(runner.device)  # penalised requests' token counts, on the device
        # structured output: grammars of constrained requests, their step's bitmask (server/engine/structured/)
        self.structured = StructuredOutput(tokenizer, runner.spec.vocab_size, self.eos_token_ids, runner.device)

    # ---- receive
    def add_request(self, gen: GenerateRequest) -> list[RequestOutput]:
        """Queue a request; a request this server's role cannot run, or whose output constraint does
        not compile, is answered at once (400: a final output for each of its choices)."""
        request = Request(gen.request_id, list(gen.prompt_token_ids), gen.sampling,
                          self.eos_token_ids, gen.arrival_time, gen.disagg, gen.cache_salt,
                          gen.kv_retention_priority)
        if request.is_generation_only and not request.first_tokens_with_kv:
            request.output_token_ids = list(gen.disagg.first_gen_tokens or ())
            request.all_token_ids = request.prompt_token_ids + request.output_token_ids
        problem = self._role_problem(gen) or self.structured.attach(request)
        if problem is not None:
            message, code = problem
            return [RequestOutput(gen.request_id, [], "", finished=True, finish_reason="error",
                                  prompt_tokens=len(gen.prompt_token_ids), error=message, error_code=code, index=i)
                    for i in range(gen.sampling.n)]
        self._detok[request.request_id] = self._detokenizer(request)
        self.scheduler.add(request)
        return []

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        """A moved stream (`prior_output_tokens`) goes on from the output it had: its text so far is
        decoded (and held back) exactly as before, and only what follows is reported."""
        detok = IncrementalDetokenizer(self.tokenizer, request.sampling.stop)
        for token in request.prompt_token_ids[request.num_prompt_tokens - request.num_prior_output:]:
            detok.add(token)
        detok.take(False)  # streamed already
        return detok

    def _role_problem(self, gen: GenerateRequest) -> tuple[str, int] | None:
        """(message, HTTP status) when this server cannot take the request."""
        kind = gen.disagg.request_type if gen.disagg is not None else "context_and_generation"
        if kind not in self.connector.accepts:
            accepted = list(self.connector.accepts)
            return f"disaggregated_params.request_type {kind!r} is not served here (accepted: {accepted})", 400
        if kind == "generation_only":
            params = gen.disagg
            first = () if params.kv_stream else ("first_gen_tokens",)  # streamed: it comes with the KV
            needed = ("ctx_request_id", "ctx_endpoint", "ctx_epoch", *first)
            missing = [name for name in needed if not getattr(params, name)]
            if missing:
                return f"disaggregated_params of a generation_only request lacks {', '.join(missing)}", 400
            if first and len(params.first_gen_tokens) != gen.sampling.n:
                return (f"disaggregated_params.first_gen_tokens holds {len(params.first_gen_tokens)} tokens, but a "
                        f"generation_only request takes one first token per choice (n={gen.sampling.n})"), 400
            if self._pulls_same_lease(params):
                return (f"the KV of ctx_request_id {params.ctx_request_id!r} is already being taken over by "
                        "another request on this server"), 409
        return None

    def _pulls_same_lease(self, params: DisaggParams) -> bool:
        """Another live generation_only request here names the same context lease."""
        key = (params.ctx_endpoint, params.ctx_request_id)
        return any(r.is_generation_only and (r.disagg.ctx_endpoint, r.disagg.ctx_request_id) == key
                   for r in self.scheduler.live())

    def abort(self, request_id: str) -> list[RequestOutput]:
        """End every live choice of the request (none: it ended already)."""
        outputs = []
        for request in self.scheduler.choices_of(request_id):
            self._release_remote(request)
            self.scheduler.remove(request)
            request.finish("abort")
            outputs += self._finals(request)
        return outputs

    def has_work(self) -> bool:
        """Requests to run, outputs still to make (`_deferred`, a step in flight), or transfers in flight."""
        return (self.scheduler.has_work() or bool(self._deferred) or self.inflight is not None
                or self.connector.busy())

    def idle_wait_s(self) -> float:
        """How long the loop may sleep before the next tick: not at all after a productive step,
        briefly while transfers or blocked requests are pending, longer when there is nothing."""
        if self.did_work:
            return 0.0
        return BUSY_WAIT_S if self.has_work() else IDLE_WAIT_S

    # ---- the step
    def step(self) -> list[RequestOutput]:
        arrived, failed = self.connector.poll()  # KV in: pulls that ended since the last step
        outputs = self._pulls_ended(arrived, failed)
        if self.inflight is not None and (self.inflight.hands_over  # its KV is offered without delay
                                          or self.spec.wants_tokens(self.inflight.requests)  # drafts need them
                                          or not self.async_scheduling):  # async was turned off meanwhile
            outputs += self._postprocess(self.inflight)
            self.inflight = None
        plan = self.scheduler.schedule()
        self.did_work = bool(outputs or plan.chunks or plan.to_pull or plan.rejected or self._deferred
                             or self.inflight)
        for request in plan.rejected:
            self._release_remote(request)
            outputs += self._finals(request)
        if plan.to_pull:  # a streamed pull, or n > 1, takes the first tokens with the KV (`_pulls_ended`)
            outputs += [self._emit_first_tokens(r) for r in plan.to_pull if not r.first_tokens_with_kv]
            self.connector.start_pulls([r for r in plan.to_pull if r.status != Status.FINISHED])  # KV in: ask
        chunks = self.spec.draft(plan.chunks, self.kv)  # decode chunks that verify drafts too
        launched = self._launch(chunks) if chunks else None  # a GPU runs it from now on
        self.connector.progress([c.request for c in chunks])  # KV out, streamed: the blocks just computed
        outputs += self._flush_text()  # the last step's text, made while the GPU computes this one
        steps = [self.inflight, launched]  # async: the step before is postprocessed, this one waits
        verifies = launched is not None and launched.drafts is not None  # its tokens decide the next step
        self.inflight = steps.pop() if self.async_scheduling and not verifies else None
        for done in filter(None, steps):
            outputs += self._postprocess(done)
        return outputs

    def _launch(self, chunks: list[ScheduledChunk]) -> SampledStep | None:
        """Queue the step's forward, sampling and logprobs on the device; its tokens (and logprobs)
        come back as a SampledStep. A request whose first token of n > 1 is due forks its other
        choices here, each sampling its own first token from a copy of its logits row
        (server/engine/choices.py). Constrained rows' bitmask is filled on the CPU meanwhile."""
        prompt_rows = [lp.prompt_rows(c) for c in chunks]  # before the computed counts move
        seqs = [self._seq_chunk(c, n) for c, n in zip(chunks, prompt_rows, strict=True)]
        logits = self.runner.execute(seqs, self._pending_inputs(chunks))
        if self.inflight is not None:  # its tokens, to the grammars, while the device computes this step
            self.structured.feed_ahead(self.inflight)
        sampled = [c for c in chunks if c.need_logits]
        layout, rows, children = lp.StepRows.of(chunks, prompt_rows), self.spec.rows(sampled), []
        scores = layout.sampler_logits(logits)
        if any(c.request.forks_pending for c in sampled):
            scores, children = fork_rows(scores, sampled, self._fork)
        mask = self.structured.mask(rows + children)  # structured output: filled while the device computes
        picked = sample_on_device(scores, rows + children, self.counts, mask) if sampled else None
        logprobs = lp.launch(logits, layout, scores, rows + children, picked)
        self._advance(chunks)
        requests = [c.request for c in sampled] + children
        for request in requests:
            request.num_pending += 1
        if not sampled and logprobs is None:
            return None
        drafts = [c.drafts for c in sampled] + [()] * len(children) if any(c.drafts for c in sampled) else None
        return SampledStep(requests, picked, self._staging, drafts, logprobs)

    def _fork(self, parent: Request, num_tokens: int) -> list[Request]:
        children = fork_children(parent, self.kv, num_tokens)
        for child in children:
            self._detok[child.request_id] = self._detokenizer(child)
        self.scheduler.adopt(children)
        return children

    def _pending_inputs(self, chunks: list[ScheduledChunk]) -> PendingTokens | None:
        """Rows whose input is a pending token read it from the step in flight, on the device."""
        rows = {i: self.inflight.rows[c.request] for i, c in enumerate(chunks) if c.request.num_pending}
        return PendingTokens(self.inflight.picked, rows) if rows else None

    def _postprocess(self, step: SampledStep) -> list[RequestOutput]:
        """Accept a step's tokens (waiting for them); a request that ended meanwhile (a stop at the
        step before, an abort, a failure) discards its token. Context legs hand over their KV."""
        outputs, live = [], []
        drafts = step.drafts or [()] * len(step.requests)
        logprobs, prompt_pieces = step.logprobs()
        for piece, entries in prompt_pieces:  # before the first token's output, which carries them
            lp.fill_prompt(piece, entries)
        for request, tokens, drafted, scores in zip(step.requests, step.runs(), drafts, logprobs, strict=True):
            request.num_pending -= 1
            if request.status != Status.FINISHED:
                live.append(request)
                outputs.append(self._accept_run(request, drafted, tokens, scores) if drafted
                               else self._accept_token(request, tokens[0], scores[0]))
        prefilled = [r for r in live if r.is_context_only and r.status != Status.FINISHED and r.parent is None]
        if prefilled:
            params = self.connector.offer(prefilled)  # KV out: lease the blocks, say where they are
            outputs += [self._handed_over(c, p) for r, p in zip(prefilled, params, strict=True)
                        for c in (r, *r.children) if c.status != Status.FINISHED]  # every choice, one lease
        return [o for o in outputs if o is not None]

    def _pulls_ended(self, arrived: list[Arrived], failed: list[PullFailure]) -> list[RequestOutput]:
        """Generation side: an arrived prompt's KV is in place, so the request decodes from the next
        schedule (a streamed one first streams the first token that came with it); a failed pull ends
        its request (one aborted meanwhile is gone already)."""
        transferring, outputs = self.scheduler.transferring, []
        for done in [a for a in arrived if a.request_id in transferring]:
            request = transferring[done.request_id]
            self.scheduler.kv_arrived(request)
            self.kv.commit(request.request_id, request.all_token_ids, request.num_computed_tokens)
            if request.first_tokens_with_kv:
                outputs += self._first_tokens_arrived(request, done)
        # the receiver ended those pulls and told the context side where it had to: no second Cancel
        # (one for a refused duplicate pull would end the lease the running pull reads)
        return outputs + [o for f in failed if f.request_id in transferring
                          for o in self.fail(transferring[f.request_id], f.message, f.code, release=False)]

    def _first_tokens_arrived(self, request: Request, done: Arrived) -> list[RequestOutput]:
        """Generation side, the KV in place: each choice takes its first token (a streamed pull brought
        them), the choices after the first forking off now, and streams it."""
        params, n = request.disagg, request.sampling.n
        tokens, cached = ((done.first_tokens, done.cached_tokens) if params.kv_stream
                          else (params.first_gen_tokens, params.ctx_cached_tokens))
        if len(tokens) != n:
            return self.fail(request, f"the context server sent {len(tokens)} first tokens for n={n} choices",
                             release=False)
        choices = [request, *(self._fork(request, request.num_computed_tokens) if n > 1 else ())]
        for choice in choices:
            choice.take_first_tokens(tokens, cached)
        return [self._emit_first_tokens(c) for c in choices]

    def _seq_chunk(self, chunk: ScheduledChunk, prompt_rows: int) -> SeqChunk:
        request, start = chunk.request, chunk.request.num_computed_tokens
        slots = {w: self.kv.slot_table(request.request_id, w) for w in self.kv.window_sizes}
        if request.num_pending:
            tokens = [0]  # read on the device (`_pending_inputs`)
        else:
            tokens = request.all_token_ids[start:start + chunk.num_new_tokens - len(chunk.drafts)] + list(chunk.drafts)
        return SeqChunk(tokens, start, slots, *lp.logit_span(chunk, prompt_rows))

    def _advance(self, chunks: list[ScheduledChunk]) -> None:
        """The step's tokens are computed: move the counts and commit full blocks for reuse."""
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_new_tokens
            self.kv.commit(request.request_id, request.all_token_ids, committable(request))
            if self._sliding:  # drafts may be rejected: only what surely stays computed moves the window
                self.kv.release_out_of_window(request.request_id, request.num_computed_tokens - len(chunk.drafts))

    def _accept_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput | None:
        """Everything the next step depends on happens here (the token, stop conditions, freeing a
        finished request). Sync: the text of a request without stop strings, its output and its
        timing metrics wait for `_flush_text`, which the next step runs while the GPU computes (async
        postprocessing runs while the GPU computes already)."""
        request.append_token(token)
        if logprob is not None:
            request.logprob_queue.append(logprob)
        self.timings.stamp(request)
        if request.num_computed_tokens == request.num_known_tokens:  # async: its K/V is computed already
            self.kv.commit(request.request_id, request.all_token_ids, request.num_computed_tokens)
        if request.is_context_only and request.sampling.n > 1:  # every choice is handed over (choices.py)
            self._detok[request.request_id].add(token)
            return None
        if not self.async_scheduling and not request.sampling.stop and not request.is_context_only:
            self._stop_without_text(request, token, False)
            if request.status == Status.FINISHED:
                self.scheduler.remove(request)
            self._deferred.append((request, token))
            return None
        self._check_stop(request, token)
        if request.status != Status.FINISHED and request.is_context_only:
            return None  # handed over in `_postprocess` (its KV is offered first)
        if request.status == Status.FINISHED:
            self.scheduler.remove(request)
        return self._output(request, [token])

    def _accept_run(self, request: Request, drafts: tuple[int, ...], targets: list[int],
                    logprobs: list[TokenLogprob | None]) -> RequestOutput | None:
        """A verify chunk's tokens: the accepted drafts and one more, cut at a stop (server/engine/speculative/),
        each with its row's logprobs. The computed count rolls back over the rejected drafts (their
        K/V is overwritten later); the penalty counts take the emitted tokens."""
        run = self.spec.accept(request, drafts, targets)
        request.num_computed_tokens -= len(drafts) + 1 - len(run)
        if self._sliding:
            self.kv.release_out_of_window(request.request_id, request.num_computed_tokens)
        new: list[int] = []
        for token, logprob in zip(run, logprobs, strict=False):
            request.append_token(token)
            if logprob is not None:
                request.logprob_queue.append(logprob)
            self.timings.stamp(request)
            new.append(token)
            self._check_stop(request, token)
            if request.status == Status.FINISHED:
                break
        self.kv.commit(request.request_id, request.all_token_ids, committable(request))
        self.counts.add(request, new)
        if request.status == Status.FINISHED:
            self.scheduler.remove(request)
        return self._output(request, new)

    def _flush_text(self) -> list[RequestOutput]:
        """Outputs of the tokens `_accept_token` deferred (a request aborted meanwhile is skipped)."""
        deferred, self._deferred = self._deferred, []
        self.timings.observe()
        outputs = []
        for request, token in deferred:
            detok = self._detok.get(request.request_id)
            if detok is not None:
                detok.add(token)
                outputs.append(self._output(request, [token]))
        return outputs

    def _handed_over(self, request: Request, params: DisaggParams) -> RequestOutput:
        """Context side: the KV is offered; the context leg is over and generation goes on elsewhere."""
        self.scheduler.remove(request)
        request.finish(None)
        return self._output(request, request.output_token_ids[-1:], disagg=params)

    def _emit_first_tokens(self, request: Request) -> RequestOutput:
        """Generation side: stream the context server's first token at once; the KV pull runs meanwhile."""
        self.timings.stamp(request)
        self.timings.observe()
        for token in request.output_token_ids:
            self._check_stop(request, token)
        if request.disagg.first_text_streamed:  # the router sent this text already: skip it
            self._detok[request.request_id].take(False)
        if request.status == Status.FINISHED:  # nothing to decode: free the lease, pull nothing
            self._release_remote(request)
            self.scheduler.remove(request)
        return self._output(request, list(request.output_token_ids), scored=False)

    def fail(self, request: Request, message: str, code: int = 502, *, release: bool = True) -> list[RequestOutput]:
        """End `request` (one choice; all of them before they fork) with an error; `release=False`
        when its pull has ended already."""
        if release and request.status == Status.WAITING_FOR_KV:  # no late writer: end its pull before its blocks go
            self._release_remote(request)
        self.scheduler.remove(request)
        request.finish("error", message, code)
        return self._finals(request)

    def _release_remote(self, request: Request) -> None:
        """Free what the request's KV holds elsewhere (a lease, a pull): choice 0's, shared by all."""
        if request.parent is None:
            self.connector.release(request)

    def _finals(self, request: Request) -> list[RequestOutput]:
        """The final output of a request that ended (with its other choices' before its fork)."""
        final = self._output(request, [])
        return [final, *unforked_finals(request, final)]

    # ---- postprocess helpers
    def _check_stop(self, request: Request, token: int) -> None:
        self._stop_without_text(request, token, self._detok[request.request_id].add(token))

    def _stop_without_text(self, request: Request, token: int, hit_stop_string: bool) -> None:
        params, produced = request.sampling, len(request.output_token_ids)
        ending = request.grammar.ending() if request.grammar is not None else None
        stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if ending is not None:  # structured output: the grammar is complete ("stop"), or was left ("error")
            request.finish(*ending)
        elif hit_stop_string or (produced >= params.min_tokens and stop_token):
            request.finish("stop")
        elif produced >= params.max_tokens or request.num_known_tokens >= self.config.max_seq_len:
            request.finish("length")

    def _output(self, request: Request, new_tokens: list[int], disagg: DisaggParams | None = None,
                scored: bool = True) -> RequestOutput:
        """One output of `request`: `new_tokens` with their logprobs when asked (`scored`: they were
        sampled here; a generation leg's first tokens were not, and have none), the prompt's logprobs
        on its first output once complete."""
        finished = request.status == Status.FINISHED
        # A context leg hands over (`disagg`): the text goes on elsewhere, so no flush and no release
        # of held-back text; its text is exactly what the generation side streams for those tokens.
        final_text = finished and disagg is None
        detok = self._detok[request.request_id]
        if final_text:
            detok.flush_partial()
        if finished:
            self._detok.pop(request.request_id)
            self.timings.finished(request)
            self.counts.release(request)
        prior = request.num_prior_output  # usage counts it as output
        # honest usage: the generation leg reports the context server's hit; transfers are not hits
        cached = request.disagg.ctx_cached_tokens if request.is_generation_only else request.num_cached_tokens
        return RequestOutput(
            request_id=request.output_id, index=request.choice, new_token_ids=new_tokens,
            new_text=detok.take(final_text),
            finished=finished, finish_reason=request.finish_reason,
            prompt_tokens=request.num_prompt_tokens - prior, completion_tokens=len(request.output_token_ids) + prior,
            cached_tokens=min(cached, request.num_prompt_tokens - prior),
            error=request.error, error_code=request.error_code, disagg=disagg,
            logprobs=lp.take_sampled(request, len(new_tokens)) if scored else None,
            prompt_logprobs=lp.take_prompt(request),
        )
