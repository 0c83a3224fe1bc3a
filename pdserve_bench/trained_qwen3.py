"""A second trained model for accuracy measurements: a small Qwen3 (q/k norms, untied lm_head, GQA)
trained for about a minute on the CPU on `builtin:tiny-story`'s text, with its tokenizer.

Random-weight models say nothing about what a rounding costs; a trained one does. `trained_qwen3()`
trains it once and caches it in `$PDSERVE_CACHE_DIR/models/trained-qwen3-v<VERSION>` (as the built-in
tiny models are cached: built in a private folder, renamed into place; a folder that exists is
complete). Deterministic on one kind of CPU: fixed seeds, one torch thread, deterministic algorithms.
The text is the tiny-story training text (pdserve_bench/tiny_story_corpus.py); the held-out modules
(`held_out_documents`) stay unseen, so perplexity on them measures generalisation.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from pdserve_bench import tiny_story_corpus as corpus

VERSION = 1
SEED = 4242
SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False)
STEPS, BATCH, SEQ_LEN, LR, WARMUP = 320, 8, 128, 4e-3, 30


def trained_qwen3(root: Path | None = None) -> Path:
    """The model's folder, trained here the first time (about a minute on one core)."""
    from server.models.builtin import cache_root, resolve_model

    target = (root or cache_root()) / f"trained-qwen3-v{VERSION}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _train_into(tmp, resolve_model("builtin:tiny-story"))
        tmp.chmod(0o755)
        os.rename(tmp, target)  # atomic; fails if another process renamed its copy first
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _train_into(out: Path, story: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _deterministic():
            tokenizer = AutoTokenizer.from_pretrained(story)
            stream = _token_stream(tokenizer)
            torch.manual_seed(SEED)
            config = Qwen3Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPE)
            model = Qwen3ForCausalLM(config)
            start = time.monotonic()
            loss = _train(model, stream)
            model.eval().save_pretrained(out)
            tokenizer.save_pretrained(out)
            record = {"steps": STEPS, "batch": BATCH, "seq_len": SEQ_LEN, "lr": LR, "final_loss": round(loss, 4),
                      "seconds": round(time.monotonic() - start, 1), "torch": torch.__version__,
                      "parameters": sum(p.numel() for p in model.parameters())}
            (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    finally:
        torch.set_num_threads(threads)


class _deterministic:
    def __enter__(self) -> None:
        self.was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc: object) -> None:
        torch.use_deterministic_algorithms(self.was)


def _token_stream(tokenizer) -> torch.Tensor:
    """The tiny-story running text (no chats: a minute goes further on prose), shuffled, EOS-separated."""
    pieces = [corpus.plain_text(d) for d in corpus.documents()]
    random.Random(SEED).shuffle(pieces)
    ids: list[int] = []
    for piece in pieces:
        ids += tokenizer.encode(piece, add_special_tokens=False) + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def _train(model: Qwen3ForCausalLM, stream: torch.Tensor) -> float:
    """AdamW on random windows; the mean loss of the last 20 steps."""
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    losses = []
    for step in range(STEPS):
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH,), generator=gen).tolist()
        batch = torch.stack([stream[s:s + SEQ_LEN] for s in starts])
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        loss = model(input_ids=batch, labels=batch.clone()).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20


def _lr(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
