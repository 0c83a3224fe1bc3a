"""`pdserve calibrate-kv MODEL --out scales.json`: per-layer FP8 KV scales measured on sample text.

The model prefills the sample in windows of `seq_len` tokens into a cache in its own dtype, so the
scales are measured on what the cache stores (K after RoPE and any q/k norm). A layer's scale is its
largest |K| (|V|) over the sample / 448: nothing of the sample saturates. The sample: text files
(`--text`), else the prose of Python's language reference. Its size matters: on builtin:tiny-story,
8k tokens set layer 0's k_scale 17% under what held-back text reaches; 64k tokens (the default) come
within 1% (docs/FP8.md).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from kvcache import KvCacheConfig, KVCacheManager
from kvcache.kv_scales import FP8_MAX, write_scales
from server.models.builtin import resolve_model
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner, SeqChunk, resolve_device, resolve_dtype

log = logging.getLogger(__name__)

TOKENS_PER_BLOCK = 32


def sample_text(paths: list[str]) -> str:
    """The text of `paths`, else the prose of Python's language reference topics."""
    if paths:
        return "\n\n".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in paths)
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def calibrate(model_dir: Path, token_ids: list[int], *, seq_len: int, device: torch.device,
              dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """Per-layer (k, v) scales: largest |K|, |V| of `token_ids` prefilled in windows of `seq_len`
    tokens, over FP8_MAX (1.0 for a layer whose K or V were all 0)."""
    spec = load_spec(model_dir)
    seq_len = min(seq_len, spec.max_position_embeddings)
    tokens = -(-seq_len // TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK
    config = KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, max_tokens=tokens, enable_block_reuse=False)
    kv = KVCacheManager(config, spec.cache_layout(tokens, dtype, device))
    runner = ModelRunner(model_dir, kv, dtype=dtype, device=device, max_num_tokens=seq_len, max_batch_size=1,
                         kernels="torch", max_seq_len=tokens)
    k_max = torch.zeros(spec.num_layers, dtype=torch.float32, device=device)
    v_max = torch.zeros_like(k_max)
    for start in range(0, len(token_ids), seq_len):
        window = token_ids[start:start + seq_len]
        if len(window) < 2:
            break
        kv.admit("calibrate", window)
        tables = {w: kv.slot_table("calibrate", w) for w in kv.window_sizes}
        runner.execute([SeqChunk(window, 0, tables, need_logits=True)])
        for layer in range(spec.num_layers):
            # [slots, tpb, kv_heads, head_dim] each; a latent cache's one row a token is both
            k, v = (kv.layer_latent(layer),) * 2 if kv.layout.format.latent else kv.layer_cache(layer)
            held = torch.tensor([s for s in tables[kv.layer_window(layer)] if s >= 0], device=device)
            # the window's blocks: what it wrote, and past its end zeros or an earlier window's K/V
            k_max[layer] = torch.maximum(k_max[layer], k.index_select(0, held).abs().max().float())
            v_max[layer] = torch.maximum(v_max[layer], v.index_select(0, held).abs().max().float())
        kv.release("calibrate")
    return _scales(k_max), _scales(v_max)


def _scales(maxima: torch.Tensor) -> list[float]:
    return [m / FP8_MAX if m > 0 else 1.0 for m in maxima.tolist()]


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = resolve_model(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    ids = AutoTokenizer.from_pretrained(model_dir).encode(sample_text(args.text))[:args.max_tokens]
    if len(ids) < 2:
        raise ValueError("the sample text has fewer than 2 tokens")
    k, v = calibrate(model_dir, ids, seq_len=args.seq_len, device=device, dtype=dtype)
    write_scales(args.out, k, v, model=str(args.model), tokens=len(ids))
    log.info("wrote %s: %d layers from %d tokens; k_scale %.4g..%.4g, v_scale %.4g..%.4g", args.out, len(k),
             len(ids), min(k), max(k), min(v), max(v))
    return 0
