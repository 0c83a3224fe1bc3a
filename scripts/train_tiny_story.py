"""Train `builtin:tiny-story`, the default model: a 2.4 M parameter Llama that writes English-like text.

    .venv/bin/python scripts/train_tiny_story.py            # writes server/models/data/tiny-story/

The text ships with Python (pdserve_bench/tiny_story_corpus.py: the language reference topics, standard
library docstrings, the Zen of Python), as running text and as chat turns rendered with the model's
own chat template, so `/v1/chat/completions` answers look like answers. Nothing is downloaded.

Deterministic on one kind of CPU: fixed seeds, one torch thread (`--threads`), deterministic torch
algorithms, single-threaded tokenizer training (another instruction set may round differently).
The output folder is an ordinary Hugging Face model directory (config.json, generation_config.json,
model.safetensors, tokenizer files, chat template) plus training.json, which records the command,
the wall time, the final loss and a digest of the corpus.

Recorded run of the shipped model (docs/BENCHMARKS.md, "Training builtin:tiny-story"): the command
above with its defaults, 1,200 steps, 2,361,024 parameters, 295,445 corpus tokens; 1,325 s wall time
on the 2-core dev box under other load (Python 3.11.7, torch 2.13.0+cpu); final training loss 0.429
(mean of the last 100 steps).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pdserve_bench import tiny_story_corpus as corpus

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "server" / "models" / "data" / "tiny-story"
SEED = 20260
VOCAB_SIZE = 4096
PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_SHAPE = dict(
    hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
)


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE over `texts` (any byte stays encodable), wrapped with the chat template."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # single-threaded merges: reproducible
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[PAD, BOS, EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START, IM_END], chat_template=CHAT_TEMPLATE)


def training_texts(docs: list[corpus.Document], tokenizer: PreTrainedTokenizerFast | None = None) -> list[str]:
    """Every piece of training text, in a seeded shuffled order: running text and rendered chats."""
    pieces = [corpus.plain_text(d) for d in docs]
    for doc in docs:
        for conversation in corpus.chat_conversations(doc):
            pieces.append(render_chat(conversation, tokenizer))
    random.Random(SEED).shuffle(pieces)
    return pieces


def render_chat(conversation: list[dict[str, str]], tokenizer: PreTrainedTokenizerFast | None) -> str:
    if tokenizer is None:  # before the tokenizer exists: the same text without the BOS marker
        return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in conversation)
    return tokenizer.apply_chat_template(conversation, tokenize=False)


def token_stream(pieces: list[str], tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """All pieces as one stream of token ids, each piece followed by EOS. [num_tokens] int64"""
    ids: list[int] = []
    for piece in pieces:
        ids.extend(tokenizer.encode(piece, add_special_tokens=False))
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         attn_implementation="sdpa", **MODEL_SHAPE)
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def sample(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, max_new_tokens: int = 60) -> str:
    """Greedy text after a plain prompt and after a chat question, to watch training."""
    model.eval()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is a generator?"}], tokenize=False,
                                         add_generation_prompt=True)
    texts = []
    for prompt in ("The", chat):
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
        texts.append(repr(tokenizer.decode(out[0, ids.shape[1]:])))
    model.train()
    return "\n".join(texts)


def train(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, stream: torch.Tensor,
          args: argparse.Namespace) -> list[float]:
    """AdamW on random windows of the stream; returns the loss of every step."""
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    losses: list[float] = []
    start = time.monotonic()
    for step in range(args.steps):
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch,), generator=gen)
        batch = torch.stack([stream[s:s + args.seq_len + 1] for s in starts.tolist()])  # [batch, seq_len + 1]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        # labels equal inputs: transformers shifts them by one inside the loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == args.steps - 1:
            recent = sum(losses[-100:]) / len(losses[-100:])
            print(f"step {step:5d}  loss {recent:.3f}  {time.monotonic() - start:6.0f} s", flush=True)
        if args.sample_every and (step + 1) % args.sample_every == 0:
            print(sample(model, tokenizer), flush=True)
    model.eval()
    return losses


def check_out_dir(out: Path) -> None:
    """Refuse to replace a folder that is not an earlier output of this script."""
    if out.exists() and any(out.iterdir()) and not (out / "training.json").is_file():
        raise SystemExit(f"{out} is not empty and has no training.json: not replacing it")


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, record: dict) -> None:
    """Write the model folder next to `out`, then swap it in (an old `out` goes only once it is done)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    _write(model, tokenizer, tmp, record)
    check_out_dir(out)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


def _write(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, record: dict) -> None:
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    portable_tokenizer_config(out / "tokenizer_config.json")
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def portable_tokenizer_config(path: Path) -> None:
    """Name the class every transformers release knows and keep the chat template in the config too
    (transformers 5 writes `TokenizersBackend` and chat_template.jinja; older readers want these)."""
    config = json.loads(path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed for reproducibility)")
    parser.add_argument("--sample-every", type=int, default=250, help="print greedy samples every N steps (0: never)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_out_dir(args.out)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # NaN-filling every empty(): 10x slower
    started = time.monotonic()
    docs = corpus.documents()
    tokenizer = train_tokenizer(training_texts(docs))
    pieces = training_texts(docs, tokenizer)
    stream = token_stream(pieces, tokenizer)
    model = build_model(tokenizer)
    params = sum(p.numel() for p in model.parameters())
    print(f"{len(docs)} documents, {len(pieces)} pieces, {len(stream)} tokens; {params} parameters", flush=True)
    losses = train(model, tokenizer, stream, args)
    seconds = time.monotonic() - started
    final = sum(losses[-100:]) / len(losses[-100:])
    record = {
        "command": " ".join(["python scripts/train_tiny_story.py", *(argv if argv is not None else sys.argv[1:])]),
        "wall_time_s": round(seconds, 1), "final_loss_last_100_steps": round(final, 4),
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "threads": args.threads,
        "parameters": params, "corpus_tokens": len(stream), "corpus_documents": len(docs),
        "corpus_sha256": hashlib.sha256("\x00".join(pieces).encode()).hexdigest(),
        "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    save(model, tokenizer, args.out, record)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
