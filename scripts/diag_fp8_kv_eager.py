"""Diagnostic (GPU): where an FP8 KV cache's eager Triton steps part from its graph-replayed ones.
Prints, per teacher-forced step, the largest |eager - graphed| logit for an FP8 and a bf16 cache.
python3 scripts/diag_fp8_kv_eager.py  (on a CUDA machine; uses tests/gpu/test_fp8_kv_cuda.py's setup)"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "gpu"), str(Path(__file__).resolve().parents[1])]
import test_fp8_kv_cuda as t  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from kvcache import KvCacheConfig  # noqa: E402
from kvcache.kv_scales import write_scales  # noqa: E402
from pdserve_bench import tiny_story_corpus as corpus  # noqa: E402
from server.models.builtin import resolve_model  # noqa: E402
from server.models.calibrate_kv import calibrate  # noqa: E402


def story() -> tuple[Path, str, list[list[int]]]:
    """As the test's fixture: the model, scales calibrated on 64k tokens, ROWS sequences."""
    model_dir = resolve_model(t.STORY)
    ids = AutoTokenizer.from_pretrained(model_dir).encode("\n\n".join(corpus.plain_text(d) for d in corpus.documents()))
    k, v = calibrate(model_dir, ids[:65536], seq_len=2048, device=t.DEVICE, dtype=torch.bfloat16)
    write_scales(Path("/tmp/diag_scales.json"), k, v)
    span = t.PROMPT + t.STEPS
    return model_dir, "/tmp/diag_scales.json", [ids[70_000 + i * 3 * span:70_000 + i * 3 * span + span]
                                                for i in range(t.ROWS)]


def main() -> None:
    model_dir, scales, seqs = story()
    for name, extra in (("bf16", {}), ("fp8", {"dtype": "fp8", "scales": scales})):
        cfg = KvCacheConfig(tokens_per_block=32, max_tokens=t.ROWS * 1024, **extra)
        graphed = t._teacher_forced(t._runner(model_dir, cfg, graphs=True), seqs)
        eager = t._teacher_forced(t._runner(model_dir, cfg, graphs=False), seqs)
        diff = (graphed - eager).abs().amax(dim=(1, 2))
        print(name, "max |eager - graphed| per step:", [round(x, 3) for x in diff.tolist()], flush=True)
        print(name, "argmax agreement", (graphed.argmax(-1) == eager.argmax(-1)).float().mean().item(), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
