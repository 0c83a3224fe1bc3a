"""A tokenizer of Llama 3's size and kind, built offline (no hub download) for scripts/bench_grammar.py.

Byte-level BPE with Llama 3's pre-tokenizer pattern and 128,000 merges-learned tokens plus 256
special tokens (128,256 ids, as Llama 3), trained on the first 60 MB of the Python sources and docs
on this machine (the standard library, then the venv's packages, in path order). About a minute on
two cores; the result is kept under `$PDSERVE_CACHE_DIR/tokenizers/llama3-sized-v1`.

A grammar engine's mask cost grows with the vocabulary and with how many tokens can continue a
lexeme (long identifiers, runs of spaces): this vocabulary has both, like the real one.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from server.models.builtin import cache_root

LEARNED = 128_000
SPECIALS = [f"<|reserved_special_token_{i}|>" for i in range(256)]
SPECIALS[:2] = ["<|begin_of_text|>", "<|end_of_text|>"]
CORPUS_BYTES = 60_000_000
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _corpus() -> Iterator[str]:
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    taken = 0
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".rst", ".md", ".txt") and path.is_file():
                text = path.read_text(errors="replace")
                taken += len(text)
                yield text
                if taken >= CORPUS_BYTES:
                    return


def llama3_sized_tokenizer() -> PreTrainedTokenizerFast:
    folder = cache_root().parent / "tokenizers" / "llama3-sized-v1"
    if not (folder / "tokenizer.json").exists():
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tok = Tokenizer(models.BPE())
        split = pre_tokenizers.Split(Regex(PATTERN), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=LEARNED + len(SPECIALS), special_tokens=SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        print("training the llama3-sized tokenizer (about a minute)...", file=sys.stderr)
        tok.train_from_iterator(_corpus(), trainer)
        wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1])
        folder.mkdir(parents=True, exist_ok=True)
        wrapped.save_pretrained(folder)
    return PreTrainedTokenizerFast.from_pretrained(folder)
