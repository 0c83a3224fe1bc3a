"""What the OpenAI API's features cost under load, on one aggregated server of the 8B-shaped model:
c=C closed-loop output tok/s with a JSON schema (structured output), with `logprobs: 5`, with
penalties, each against the plain requests of the same run; and b1 TPOT with a grammar against
without. Goals: json_schema >= 0.9x, logprobs >= 0.95x, penalties >= 0.95x, b1 grammar <= 1.1x.

The constrained requests' schema holds one long string (`minLength` far beyond max_tokens), so every
request generates exactly max_tokens tokens under the grammar, as the plain ones do (the client
counts tokens from the usage chunk). Runs alternate plain and feature, twice each, on one warm
server, and the medians are compared.

    python scripts/bench_gpu_api.py --workdir /tmp/bench-gpu --out $OUT
    python scripts/bench_gpu_api.py --model builtin:tiny-llama --max-seq-len 2048 ... tiny sizes   # a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path

from bench_gpu_load import deployment_file, engine_phase, parse_args, start
from bench_gpu_load_session import Session

from pdserve_bench.launch import ServerUnderTest
from pdserve_bench.load_client import LoadPlan
from pdserve_bench.load_job import Traffic
from pdserve_bench.measure import model_vocab, warm_up
from pdserve_bench.record import RecordWriter, RunContext

LONG_STRING = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100_000}},
               "required": ["text"], "additionalProperties": False}
FEATURES = {  # name: (extra body fields, goal, at least)
    "json_schema": ({"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "long", "schema": LONG_STRING, "strict": True}}},
                    0.9),
    "logprobs": ({"logprobs": 5}, 0.95),
    "penalties": ({"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1}, 0.95),
}


def plan(args: argparse.Namespace, s: Session, concurrency: int, body: dict, count: int | None = None) -> LoadPlan:
    traffic = Traffic("main", args.input_len, args.output_len, concurrency=concurrency, count=count, seed=s.seed(),
                      body=body)
    return LoadPlan((traffic,), None if count else args.peak_duration, 0.0 if count else args.ramp_s)


def features(s: Session, args: argparse.Namespace, target) -> None:
    for name, (body, goal) in FEATURES.items():
        if name not in args.features:
            continue
        with s.phase(name):
            plain, feature = [], []
            for _ in range(2):  # alternated: the machine's drift falls on both alike
                plain += s.runs(target, "plain", f"c{args.peak_concurrency} vs {name}",
                                [plan(args, s, args.peak_concurrency, {})])
                feature += s.runs(target, name, f"c{args.peak_concurrency}",
                                  [plan(args, s, args.peak_concurrency, body)])
            med = lambda runs, k: sorted(r[k] for r in runs)[len(runs) // 2]
            s.goal(f"api_{name}_tok_s", f"c={args.peak_concurrency} steady output tok/s, {name} / plain",
                   med(feature, "steady_output_tok_s"), med(plain, "steady_output_tok_s"), goal, True)


def b1_grammar(s: Session, args: argparse.Namespace, target) -> None:
    body = FEATURES["json_schema"][0]
    with s.phase("b1"):
        plain = s.runs(target, "plain", "b1", [plan(args, s, 1, {}, count=args.b1_requests)])[0]
        grammar = s.runs(target, "json_schema", "b1", [plan(args, s, 1, body, count=args.b1_requests)])[0]
        s.goal("api_b1_grammar_tpot", "b1 TPOT p50, json_schema / plain", grammar["tpot_p50_ms"],
               plain["tpot_p50_ms"], 1.1, False)


def main() -> int:
    args = parse_args([a for a in sys.argv[1:] if not a.startswith("--features=")])
    args.features = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--features=")),
                         list(FEATURES))
    args.skip |= {"a"}  # the engine phase only builds the model here
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    s = Session(args, RecordWriter(args.out, RunContext.capture(["scripts/bench_gpu_api.py", *sys.argv[1:]])), {})
    with s.phase("build"):
        model = engine_phase(s, args)
        s.vocab = model_vocab(model)
    if not s.vocab:
        s.finish(args.out)
        return 1
    with ExitStack() as stack:
        target = start(s, stack, ServerUnderTest(deployment_file(args, model, "agg")), "agg")
        warm_up(target.url, target.model, s.vocab)
        features(s, args, target)
        b1_grammar(s, args, target)
    s.finish(args.out)
    print(json.dumps({"out": str(Path(args.out))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
