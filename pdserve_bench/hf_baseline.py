"""Baseline: transformers `generate` on the same model directory, one request at a time.

Greedy, float32 on CPU, `min_new_tokens == max_new_tokens` so every request makes exactly the
workload's output length (random weights emit EOS at random). A streamer records the time of each
generated token, so TTFT and TPOT mean the same as for the server (there is no HTTP in between).

    pdserve-bench hf --num-prompts 8 --input-len 256 --output-len 64 --repeat 5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from pdserve_bench import options
from pdserve_bench.stats import RequestResult, Summary, median_summary, summarize
from pdserve_bench.tables import figures_table
from pdserve_bench.workloads import Workload, random_workload, usable_token_ids

HELP = "baseline: transformers generate on the same model, one request at a time"


class _TokenClock(BaseStreamer):
    """Timestamps of generated tokens; `generate` first puts the prompt, then one tensor per step."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None


def load_model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def generate_one(model: PreTrainedModel, prompt: list[int], max_tokens: int) -> RequestResult:
    ids = torch.tensor([prompt], dtype=torch.long)  # [1, prompt_len]
    clock = _TokenClock()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, do_sample=False, streamer=clock)
    end = time.perf_counter()
    produced = out.shape[1] - ids.shape[1]
    result = RequestResult(start=start, end=end, first_token=clock.times[0] if clock.times else None,
                           output_tokens=produced, prompt_tokens=len(prompt), chunk_times=clock.times)
    if produced != max_tokens:
        result.error = f"generate made {produced} tokens, wanted {max_tokens}"
    return result


def run_hf_baseline(model: PreTrainedModel, workload: Workload) -> list[RequestResult]:
    """Every prompt of `workload`, sequentially."""
    return [generate_one(model, prompt, workload.max_tokens) for prompt in workload.prompts]


def warm_up(model: PreTrainedModel, vocab: list[int]) -> None:
    warm = random_workload(vocab, num_prompts=1, input_len=32, output_len=4, seed=-1)
    run_hf_baseline(model, warm)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=8)
    options.add_lengths(parser)
    parser.add_argument("--seed", type=int, default=0)
    options.add_common(parser, repeat=5)


def run(args: argparse.Namespace) -> int:
    from server.models.builtin import resolve_model

    out = options.writer(args)
    model_dir = resolve_model(args.model)
    model = load_model(model_dir)
    vocab = usable_token_ids(AutoTokenizer.from_pretrained(model_dir))
    warm_up(model, vocab)
    runs: list[Summary] = []
    for r in range(args.repeat):
        workload = random_workload(vocab, num_prompts=args.num_prompts, input_len=args.input_len,
                                   output_len=args.output_len, seed=args.seed + r)
        runs.append(summarize(run_hf_baseline(model, workload)))
    figures = median_summary(runs)
    print(figures_table([("hf-generate", figures)]))
    config = {"target": "hf", "deployment": "hf", "source": "transformers generate", "workload": "random",
              "figure": "random c=1", "concurrency": 1, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "seed": args.seed, "repeat": args.repeat, "model": args.model}
    out.write("hf", config, figures, runs)
    return 0
