"""Builds an in-process EngineCore on a real model directory and runs requests to completion; joins
two of them, a context and a generation engine, by a real KV link on loopback (`loopback_pair`).

Shared by engine tests (imported as `import engine_harness`, like `hf_reference`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from kv_factories import kv_link
from runner_harness import no_host_syncs
from transformers import AutoTokenizer
from waiting import wait_until

from kvcache import KvCacheConfig, KVCacheManager
from server.engine.core import EngineCore
from server.engine.kv_connector import ContextConnector, GenerationConnector
from server.engine.scheduler import SchedulerConfig
from server.engine.speculative.config import SpeculativeConfig
from server.engine.speculative.decoder import SpecDecoder, build_spec
from server.models.builtin import resolve_model
from server.models.kv_format import kv_cache_layout
from server.models.model_spec import load_spec, with_quantization
from server.models.runner import ModelRunner
from server.types import DisaggParams, GenerateRequest, RequestOutput, SamplingParams

_ids = itertools.count()


def make_core(model: str = "builtin:tiny-llama", *, kv: KvCacheConfig | None = None, max_seq_len: int = 512,
              max_num_tokens: int = 256, max_batch_size: int = 16, connector=None,
              async_scheduling: bool = False, device: str = "cpu", kernels: str = "torch",
              speculative: SpeculativeConfig | None = None, quantization: str | None = None) -> EngineCore:
    """float32 (the KV cache too, unless `kv` says fp8); on CUDA with kernels="triton" the decode
    graphs are captured before it returns. `quantization`: "fp8" quantizes the linears' weights at
    load (server/models/fp8/)."""
    model_dir = resolve_model(model)
    spec = with_quantization(load_spec(model_dir), quantization)
    kv_config = kv or KvCacheConfig(tokens_per_block=16, max_tokens=4096)
    manager = KVCacheManager(kv_config, kv_cache_layout(kv_config, spec, max_seq_len, torch.float32, device),
                             salt=spec.fingerprint)
    runner = ModelRunner(model_dir, manager, dtype=torch.float32, device=torch.device(device),
                         max_num_tokens=max_num_tokens, max_batch_size=max_batch_size, kernels=kernels,
                         max_seq_len=max_seq_len, quantization=quantization)
    runner.warm_up()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    limits = SchedulerConfig(max_num_tokens, max_batch_size, max_seq_len)
    return EngineCore(runner, manager, limits, tokenizer, connector=connector, async_scheduling=async_scheduling,
                      spec=build_spec(speculative, limits, runner) if speculative else None)


class ReplayDrafter:
    """Proposes each request's known continuation (`expected`, keyed by prompt) with every output
    position p where p % wrong == wrong - 1 changed: verify steps accept, reject and roll back."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], wrong: int = 0) -> None:
        self.expected, self.wrong = expected, wrong

    def propose(self, requests, ks):
        out = []
        for request, k in zip(requests, ks, strict=True):
            at = len(request.output_token_ids)
            drafts = self.expected[tuple(request.prompt_token_ids)][at:at + k]
            out.append([t ^ 1 if self.wrong and (at + i) % self.wrong == self.wrong - 1 else t
                        for i, t in enumerate(drafts)])
        return out


def with_replay_drafts(core: EngineCore, expected: dict[tuple[int, ...], list[int]], wrong: int = 0,
                       k: int = 4) -> EngineCore:
    """`core` speculating with a `ReplayDrafter` (k drafts per step)."""
    core.spec = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=k), core.config,
                            ReplayDrafter(expected, wrong))
    return core


def greedy(max_tokens: int, **extra) -> SamplingParams:
    """Greedy with EOS masked for max_tokens tokens: the same rule as hf_reference.hf_greedy."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, min_tokens=max_tokens, **extra)


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: RequestOutput | None = None


def submit(core: EngineCore, prompt: list[int], params: SamplingParams, **kwargs) -> str:
    request_id = f"req-{next(_ids)}"
    core.add_request(GenerateRequest(request_id, list(prompt), params, **kwargs))
    return request_id


def run_to_completion(core: EngineCore, request_ids: list[str], max_steps: int = 5000) -> dict[str, Result]:
    results = {rid: Result() for rid in request_ids}
    for _ in range(max_steps):
        for output in core.step():
            result = results.setdefault(output.request_id, Result())
            result.token_ids += output.new_token_ids
            result.text += output.new_text
            if output.finished:
                result.final = output
        if all(r.final is not None for r in results.values()) and not core.has_work():
            return results
    raise AssertionError(f"requests did not finish within {max_steps} steps: {core.scheduler.counts()}")


def run_choices(core, rids: list[str], max_steps: int = 2000) -> dict[tuple[str, int], Result]:
    """Outputs per (request id, choice: `RequestOutput.index`) until every request ended; the async
    invariants are checked after each step, and no choice has an output after its final one."""
    results: dict[tuple[str, int], Result] = {}
    for _ in range(max_steps):
        for output in core.step():
            result = results.setdefault((output.request_id, output.index), Result())
            assert result.final is None, f"{output.request_id} choice {output.index}: output after its last one"
            result.token_ids += output.new_token_ids
            result.text += output.new_text
            result.final = output if output.finished else None
        check_pipeline(core)
        if not core.has_work():
            assert all(r.final is not None for r in results.values())
            return results
    raise AssertionError(f"requests {rids} did not finish within {max_steps} steps: {core.scheduler.counts()}")


def generate(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[Result]:
    ids = [submit(core, p, params) for p in prompts]
    results = run_to_completion(core, ids)
    return [results[i] for i in ids]


def decoding(core: EngineCore, cases: list[tuple[list[int], SamplingParams]]) -> list[str]:
    """Submit `cases` and step until every request only decodes (graph steps); their ids."""
    ids = [submit(core, p, s) for p, s in cases]
    for _ in range(100):
        running = core.scheduler.running
        if len(running) == len(ids) and all(r.num_computed_tokens + 1 == r.num_tokens for r in running):
            return ids
        core.step()
    raise AssertionError("the requests never reached decode")


def event_waits(core: EngineCore, monkeypatch, steps: int = 20) -> int:
    """`steps` steps of `core` under `no_host_syncs` (CUDA); how many waits on a CUDA event they made
    (a spy on torch.cuda.Event.synchronize)."""
    waits = []
    real = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: (waits.append(event), real(event))[1])
    with no_host_syncs():
        for _ in range(steps):
            core.step()
    return len(waits)


def live_request(core: EngineCore, request_id: str):
    """The live `Request` of that id (running, waiting or pulling its KV), or None once it ended."""
    return next((r for r in core.scheduler.live() if r.request_id == request_id), None)


def blocks_in_use(kv: KVCacheManager) -> int:
    """Blocks referenced by a request or pinned, over every window group and level."""
    return sum(n for (_, _, state), n in kv.stats().blocks.items() if state == "in_use")


def check_pipeline(core) -> None:
    """The async invariants between two steps: a request has at most one pending token, and only
    from the step in flight; a running one has computed every known token (its pending token is the
    input of its next row); a queued one has none (one preempted with a pending token got it at the
    end of that step), but a choice forked without a block for its KV copy in the step in flight
    (server/engine/choices.py: its first token is on the device, it has computed nothing)."""
    inflight = core.inflight
    for request in core.scheduler.running:
        assert request.num_pending in (0, 1)
        if request.num_pending:
            assert inflight is not None and request in inflight.rows
            assert request.num_computed_tokens == request.num_known_tokens
    for request in core.scheduler.waiting:
        assert request.num_pending == 0 or (request.parent is not None and request.num_pending == 1 and inflight
                                            is not None and request in inflight.rows
                                            and request.num_computed_tokens == 0)
    core.kv.check_accounting()


def run_checked(core, ids: list[str], max_steps: int = 5000) -> tuple[dict[str, Result], int]:
    """`run_to_completion` with `check_pipeline` after every step; also returns how
    many requests were preempted while their token was on the device."""
    results = {rid: Result() for rid in ids}
    preempted_pending = 0
    for _ in range(max_steps):
        pending = [r for r in core.scheduler.running if r.num_pending]
        for output in core.step():
            result = results.setdefault(output.request_id, Result())
            assert result.final is None, f"{output.request_id}: output after its last one"
            result.token_ids += output.new_token_ids
            result.text += output.new_text
            result.final = output if output.finished else None
        check_pipeline(core)
        preempted_pending += sum(r in core.scheduler.waiting for r in pending)
        if all(r.final is not None for r in results.values()) and not core.has_work():
            return results, preempted_pending
    raise AssertionError(f"requests did not finish within {max_steps} steps: {core.scheduler.counts()}")


class PairRun:
    """Steps a context and a generation engine together and gathers each request's outputs."""

    def __init__(self, ctx: EngineCore, gen: EngineCore) -> None:
        self.ctx, self.gen = ctx, gen
        self.outputs: dict[str, list[RequestOutput]] = {}

    def step(self) -> None:
        for core in (self.ctx, self.gen):
            for output in core.step():
                self.outputs.setdefault(output.request_id, []).append(output)
            check_pipeline(core)

    def final(self, rid: str) -> RequestOutput | None:
        outs = self.outputs.get(rid, [])
        return outs[-1] if outs and outs[-1].finished else None

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]

    def wait(self, rids: list[str], what: str) -> None:
        wait_until(lambda: all(self.final(r) for r in rids), 60, what, step=self.step, interval_s=0.001)


def generation_params(answer: RequestOutput, **extra) -> DisaggParams:
    """The generation leg's parameters from a context leg's answer (`extra`: more fields of them)."""
    p = answer.disagg
    assert p is not None, answer
    return DisaggParams("generation_only", p.ctx_request_id, p.ctx_endpoint, p.ctx_epoch, p.first_gen_tokens,
                        p.prompt_token_ids, **extra)


class LoopbackPair(PairRun):
    """A `PairRun` whose engines are joined by a real KV sender and receiver on loopback (their
    connectors set). A context manager: leaving it (or `close`) closes the link."""

    def __init__(self, ctx: EngineCore, gen: EngineCore, fingerprints: tuple[str, str] = ("fp", "fp")) -> None:
        super().__init__(ctx, gen)
        self.sender, self.receiver = kv_link(ctx.kv, gen.kv, fingerprints)
        ctx.connector = ContextConnector(self.sender, ctx.kv)
        gen.connector = GenerationConnector(self.receiver, gen.kv)

    @property
    def cores(self) -> tuple[EngineCore, EngineCore]:
        return self.ctx, self.gen

    def serve(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[str]:
        """Each prompt's context leg, then, once all answered, its generation leg (`params`: for all,
        or one per prompt); the generation legs' ids once they all finished."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        legs = [submit(self.ctx, p, sp, disagg=DisaggParams("context_only"))
                for p, sp in zip(prompts, each, strict=True)]
        self.wait(legs, "the context legs")
        gens = [submit(self.gen, p, sp, disagg=generation_params(self.final(leg)))
                for p, sp, leg in zip(prompts, each, legs, strict=True)]
        self.wait(gens, "the generation legs")
        return gens

    def settle(self) -> None:
        """Every lease and pull ends; nothing stays pinned or in use, and both caches are consistent."""
        wait_until(lambda: self.sender.num_leases == 0 and self.receiver.num_pulls == 0, 30, "leases and pulls to end",
                   step=self.step, interval_s=0.001)
        assert self.sender.pinned_blocks() == {}
        for core in self.cores:
            assert blocks_in_use(core.kv) == 0
            core.kv.check_integrity()

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()

    def __enter__(self) -> LoopbackPair:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def loopback_pair(model: str = "builtin:tiny-llama", *, ctx: dict | None = None, gen: dict | None = None,
                  fingerprints: tuple[str, str] = ("fp", "fp"), **both) -> LoopbackPair:
    """Two engines of `model` (`make_core` keywords: `both` for each, `ctx` / `gen` more for one side)
    in a `LoopbackPair`."""
    return LoopbackPair(make_core(model, **{**both, **(ctx or {})}), make_core(model, **{**both, **(gen or {})}),
                        fingerprints)
