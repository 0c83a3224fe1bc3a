"""What an FP8 KV cache costs `builtin:tiny-story` in accuracy, on the CPU: perplexity of held-back text
against the float32 cache, and greedy agreement over 64 tokens (pdserve_bench/kv_accuracy.py).

    .venv/bin/python scripts/fp8_kv_accuracy.py [--model builtin:tiny-story] [--max-tokens N]

Two FP8 caches: scales 1.0 (no scales given, none in the checkpoint) and scales calibrated with
`pdserve calibrate-kv` on the model's training text (held-back text is never calibrated on).
docs/FP8.md, "FP8 KV cache", records a run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from kvcache import KvCacheConfig  # noqa: E402
from kvcache.kv_scales import write_scales  # noqa: E402
from pdserve_bench import kv_accuracy  # noqa: E402
from pdserve_bench import tiny_story_corpus as corpus  # noqa: E402
from server.models.builtin import resolve_model  # noqa: E402
from server.models.calibrate_kv import calibrate  # noqa: E402

BOUND = 0.005  # the FP8 cache's perplexity within 0.5% of the float32 cache's


def calibrated_scales(model_dir: Path, tokenizer, out: Path, tokens: int = 65536) -> None:
    """Scales measured on the training text (the corpus' documents in order)."""
    text = "\n\n".join(corpus.plain_text(d) for d in corpus.documents())
    ids = tokenizer.encode(text)[:tokens]
    import torch

    k, v = calibrate(model_dir, ids, seq_len=2048, device=torch.device("cpu"), dtype=torch.float32)
    write_scales(out, k, v, model=str(model_dir), tokens=len(ids))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-story")
    parser.add_argument("--max-tokens", type=int, default=1 << 30, help="held-back tokens scored at most")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        scales = Path(tmp) / "scales.json"
        calibrated_scales(model_dir, tokenizer, scales)
        print(f"model {args.model}; held-back text: the prose of {len(kv_accuracy.HELD_BACK_MODULES)} standard "
              "library modules outside the training corpus")
        print("greedy: share of the 64 tokens after each of 8 prompts equal to the float32 cache's, and the "
              "mean tokens before the first that differs; prompts of held-back text, then of training text")
        print(f"{'KV cache':<24} {'tokens':>7} {'ppl fp32':>9} {'ppl FP8':>9} {'delta':>8} "
              f"{'greedy held-back':>20} {'greedy training':>20}  seconds")
        for name, config in (("fp8, scales 1.0", KvCacheConfig(dtype="fp8")),
                             ("fp8, calibrated scales", KvCacheConfig(dtype="fp8", scales=str(scales)))):
            start = time.perf_counter()
            r = kv_accuracy.measure(model_dir, tokenizer, config, max_tokens=args.max_tokens)
            greedy = [f"{100 * a.same_positions:5.1f}%, {a.common_prefix:4.1f} of {a.steps}"
                      for a in (r.agreement, r.agreement_seen)]
            print(f"{name:<24} {r.tokens:>7} {r.reference:>9.2f} {r.fp8:>9.2f} {100 * r.relative:>+7.3f}% "
                  f"{greedy[0]:>20} {greedy[1]:>20}  {time.perf_counter() - start:6.1f}")
            ok &= abs(r.relative) <= BOUND
    print(f"within {100 * BOUND:.1f}% of the float32 cache's perplexity: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
