"""What `EngineCore` asks of structured output: attach a request's grammar, say which in-flight
steps must be postprocessed before the next schedule, and fill a step's bitmask."""

from __future__ import annotations

import threading
from contextlib import suppress

import torch

from server.engine.inflight import SampledStep
from server.engine.request import Request, Status
from server.engine.structured.bitmask import StepMask
from server.engine.structured.compiler import GrammarCompiler, compiler_for


class StructuredOutput:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, device: torch.device) -> None:
        self.tokenizer, self.vocab_size, self.device = tokenizer, vocab_size, device
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        # llguidance's view of the tokenizer takes ~1-2 s for a 128k vocabulary: built beside the
        # engine's start rather than on the engine thread at the first constrained request
        threading.Thread(target=self._warm, name="grammar-tokenizer", daemon=True).start()

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._compiler

    def _warm(self) -> None:
        with suppress(ValueError):  # a slow tokenizer: each constrained request is refused with the reason
            _ = self.compiler

    def attach(self, request: Request) -> tuple[str, int] | None:
        """Give a constrained request its grammar, fed the output it has already (a generation leg's
        first token(s), a moved stream's prior output: the last `prior_output_tokens` of its prompt);
        (message, HTTP status) when the spec does not compile or that output does not match it."""
        spec = request.sampling.structured
        if spec is None:
            return None
        try:
            grammar = self.compiler.compile(spec).matcher()
        except ValueError as error:
            return str(error), 400
        for token in request.counted_output():
            if not grammar.accept(token):
                return f"disaggregated_params: the output so far does not match the {spec.kind}", 400
        request.grammar = grammar
        return None

    @staticmethod
    def feed_ahead(inflight: SampledStep) -> None:
        """Async scheduling: a constrained request's next mask needs the token of the step in flight.
        Once the next step's forward is queued, that token is read (its sampling ran before this
        forward) and fed to the grammar ahead of the step's postprocessing, which then finds it fed
        (`RequestGrammar.accept`): the host's work still overlaps the device's."""
        live = [(i, r) for i, r in enumerate(inflight.requests)
                if r.grammar is not None and r.status != Status.FINISHED]
        if live and inflight.drafts is None:  # (constrained requests do not draft)
            tokens = inflight.tokens()
            for i, request in live:
                request.grammar.feed_ahead(tokens[i])

    def mask(self, rows: list) -> StepMask | None:
        """The bitmask of a step's sampler rows (requests, or a verify chunk's rows: never constrained,
        constrained requests do not draft); None when no row is constrained."""
        constrained = {i: row.grammar for i, row in enumerate(rows)  # one whose grammar ended drops its token
                       if isinstance(row, Request) and row.grammar is not None and row.grammar.open}
        if not constrained:
            return None
        return StepMask.fill(constrained, len(rows), self.vocab_size, self.device)
