"""What FP8 weights cost in accuracy, on the CPU: one JSON line per model (pdserve_bench/fp8_accuracy.py
says what each figure is), then a table.

    .venv/bin/python scripts/fp8_accuracy.py [--prompts 8]

Models: `builtin:tiny-story` and the small Qwen3 that the tests train (pdserve_bench/trained_qwen3.py;
trained here first, about a minute, if the pdserve cache lacks it). docs/FP8.md records a run.
"""

from __future__ import annotations

import argparse
import json

from pdserve_bench.fp8_accuracy import GREEDY_TOKENS, PROMPTS, measure
from pdserve_bench.trained_qwen3 import trained_qwen3
from server.models.builtin import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts for the greedy agreement")
    args = parser.parse_args()
    rows = [measure(resolve_model("builtin:tiny-story"), "tiny-story", args.prompts),
            measure(trained_qwen3(), "trained-qwen3", args.prompts)]
    for row in rows:
        print(json.dumps(row), flush=True)
    print(f"\n| model | variant | perplexity (held out) | vs float32 | seen text vs float32 | top-1 agreement | "
          f"greedy {GREEDY_TOKENS}: identical | tokens before first difference |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | float32 | {row['perplexity']['float32']:.2f} | | | | | |")
        for v in ("fp8", "fp8_w8a8"):
            greedy = row[f"greedy_{GREEDY_TOKENS}"][v]
            print(f"| {row['model']} | {v} | {row['perplexity'][v]:.2f} | {row['perplexity_vs_float32'][v]:+.3%} | "
                  f"{row['seen_perplexity_vs_float32'][v]:+.3%} | {row['top1_agreement'][v]:.3f} | "
                  f"{greedy['identical']:.2f} | {greedy['mean_tokens_before_first_difference']:.1f} |")


if __name__ == "__main__":
    main()
