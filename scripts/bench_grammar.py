"""Measure the two grammar engines, xgrammar and llguidance, on pdserve's tokenizers (docs/API.md,
"Structured output", has the figures and the choice they led to).

Per tokenizer (builtin:tiny-llama's, builtin:tiny-story's, and a Llama-3-sized one built offline:
scripts/llama3_sized_tokenizer.py) and engine:
- setup: the engine's tokenizer object (and compiler) from the Hugging Face tokenizer;
- compile: each schema of scripts/grammar_bench_cases.py SCHEMAS, cold (a new compiler, nothing
  cached) and cached (the compiled grammar kept, a new matcher from it), and the first mask after;
- mask: per token, filling one bitmask row and accepting the token, along the schema's valid
  instance and along random walks (each step a token drawn uniformly from those the mask allows:
  what a random-weight model does), with whitespace strict;
- loops: random walks of the "bounded" schema (every string, array, number bounded) that end by EOS
  within 2,000 tokens,
  whitespace strict and the engine's default (flexible) whitespace;
- features: OpenAI strict-mode schema features (FEATURES): compiles, accepts the valid instance,
  refuses the invalid one.
Plus import time, dependencies and license of each package.

    HF_HUB_OFFLINE=1 PYTHONPATH=$PWD:$PWD/scripts python scripts/bench_grammar.py \
        [--tokenizers tiny-llama,tiny-story,llama3-sized] [--walks 10]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import random
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
from grammar_bench_cases import FEATURES, SCHEMAS
from llama3_sized_tokenizer import llama3_sized_tokenizer
from transformers import AutoTokenizer

from server.models.builtin import resolve_model
from server.models.model_spec import load_spec

WALK_CAP = 2000


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        self.cache: dict[tuple[str, bool], object] = {}  # llguidance keeps none: a compiled matcher is the unit

    def compile(self, schema: str, strict: bool = True, fresh: bool = True):
        if not fresh and (schema, strict) in self.cache:
            return self.cache[schema, strict]
        options = {"whitespace_flexible": not strict}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        self.cache[schema, strict] = matcher
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, mask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accepting(self, matcher) -> bool:
        return matcher.is_accepting()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: list[int]) -> None:
        import xgrammar
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2)

    def compile(self, schema: str, strict: bool = True, fresh: bool = True):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2) if fresh else self.compiler
        return compiler.compile_json_schema(schema, any_whitespace=not strict,
                                            separators=(",", ":") if strict else None)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, mask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accepting(self, matcher) -> bool:
        return matcher.is_completed()


def allowed(mask: torch.Tensor, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab])


def walk(engine, compiled, tokens: list[int] | None, vocab: int, eos: set[int], rng: random.Random,
         fills: list[float], accepts: list[float]) -> tuple[bool, int]:
    """Follow `tokens`, or draw uniformly among the allowed tokens; (ended by EOS or complete, length)."""
    matcher, mask = engine.matcher(compiled), torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    for step in range(len(tokens) if tokens is not None else WALK_CAP):
        t0 = time.perf_counter()
        engine.fill(matcher, mask)
        fills.append(time.perf_counter() - t0)
        token = tokens[step] if tokens is not None else int(rng.choice(allowed(mask, vocab)))
        if token in eos:
            return True, step
        t0 = time.perf_counter()
        if not engine.accept(matcher, token):
            raise AssertionError(f"{engine.name} refused token {token} of a valid path")
        accepts.append(time.perf_counter() - t0)
    return tokens is not None and engine.accepting(matcher), len(tokens or ()) or WALK_CAP


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def median_timed(fn, repeats: int = 5):
    """The last result and the median time of `repeats` calls (the machine is shared: medians)."""
    times = []
    for _ in range(repeats):
        result, seconds = timed(fn)
        times.append(seconds)
    return result, statistics.median(times)


def us(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {"mean": round(1e6 * statistics.fmean(values), 1), "p50": round(1e6 * values[len(values) // 2], 1),
            "p99": round(1e6 * values[int(len(values) * 0.99)], 1), "max": round(1e6 * values[-1], 1)}


def bench_schemas(engine, tok, vocab: int, eos: set[int], walks: int) -> dict:
    out, fills, accepts = {}, [], []
    rng = random.Random(0)
    for name, (schema, instance) in SCHEMAS.items():
        text = json.dumps(schema)
        compiled, cold = median_timed(lambda: engine.compile(text))  # noqa: B023 (called at once)
        engine.compile(text, fresh=False)
        _, cached = median_timed(lambda: engine.matcher(engine.compile(text, fresh=False)))  # noqa: B023
        first_mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
        _, first = timed(lambda: engine.fill(engine.matcher(compiled), first_mask))  # noqa: B023
        path = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        done, _ = walk(engine, compiled, path, vocab, eos, rng, fills, accepts)
        ends = [walk(engine, compiled, None, vocab, eos, rng, fills, accepts)[0] for _ in range(walks)]
        out[name] = {"compile_cold_ms": round(1e3 * cold, 2), "compile_cached_ms": round(1e3 * cached, 3),
                     "first_mask_ms": round(1e3 * first, 2), "instance_complete": done,
                     "walks_ended": f"{sum(ends)}/{walks}"}
    return {"schemas": out, "fill_us": us(fills), "accept_us": us(accepts)}


def bench_loops(engine, vocab: int, eos: set[int], walks: int) -> dict:
    schema, _ = SCHEMAS["bounded"]
    out = {}
    for strict in (True, False):
        compiled = engine.compile(json.dumps(schema), strict=strict)
        rng, lengths = random.Random(1), []
        for _ in range(walks):
            ended, length = walk(engine, compiled, None, vocab, eos, rng, [], [])
            lengths.append(length if ended else None)
        done = [n for n in lengths if n is not None]
        out["strict" if strict else "flexible"] = {
            "ended": f"{len(done)}/{walks}", "max_len": max(done) if done else None}
    return out


def bench_features(engine, tok) -> dict[str, str]:
    out = {}
    for name, (schema, good, bad) in FEATURES.items():
        try:
            compiled = engine.compile(json.dumps(schema))
        except Exception as error:  # noqa: BLE001 (the engine's own error types)
            out[name] = f"no: {str(error).splitlines()[0][:80]}"
            continue
        out[name] = ("yes" if _accepts(engine, compiled, tok, good) and not _accepts(engine, compiled, tok, bad)
                     else "not enforced" if _accepts(engine, compiled, tok, bad) else "refuses valid")
    return out


def _accepts(engine, compiled, tok, instance) -> bool:
    matcher = engine.matcher(compiled)
    for token in tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False):
        if not engine.accept(matcher, token):
            return False
    return engine.accepting(matcher)


def tokenizers(names: list[str]) -> dict:
    out = {}
    for name in names:
        if name == "llama3-sized":
            tok = llama3_sized_tokenizer()
            out[name] = (tok, len(tok), [tok.eos_token_id])
        else:
            folder = resolve_model(f"builtin:{name}")
            spec = load_spec(folder)
            out[name] = (AutoTokenizer.from_pretrained(folder), spec.vocab_size, list(spec.eos_token_ids))
    return out


def package_facts(name: str, module: str) -> dict:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    seconds = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    meta = md.metadata(name)
    return {"version": meta["Version"], "license": meta.get("License-Expression") or meta.get("License"),
            "requires": [r for r in md.requires(name) or [] if "extra ==" not in r], "import_s": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizers", default="tiny-llama,tiny-story,llama3-sized")
    parser.add_argument("--walks", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {"packages": {"xgrammar": package_facts("xgrammar", "xgrammar"),
                           "llguidance": package_facts("llguidance", "llguidance")}}
    for tname, (tok, vocab, eos) in tokenizers(args.tokenizers.split(",")).items():
        for cls in (XGrammar, LLGuidance):
            engine, setup = timed(lambda: cls(tok, vocab, eos))  # noqa: B023
            result = {"vocab": vocab, "setup_ms": round(1e3 * setup, 1),
                      **bench_schemas(engine, tok, vocab, set(eos), args.walks),
                      "loops": bench_loops(engine, vocab, set(eos), args.walks),
                      "features": bench_features(engine, tok)}
            report[f"{tname}/{cls.name}"] = result
            print(json.dumps({f"{tname}/{cls.name}": result}), flush=True)
    print("SUMMARY " + json.dumps(report))


if __name__ == "__main__":
    main()
