"""The byte-level BPE tokenizer of the built-in tiny models, trained on a fixed in-code corpus.

Deterministic: same corpus, same trainer settings, single-threaded training -> same vocabulary.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
VOCAB_SIZE = 512

# Hermes-style (Qwen 2.5's layout): without tools it renders exactly the plain ChatML it always did;
# with tools, a system turn lists them and asks for <tool_call>{"name", "arguments"}</tool_call>,
# assistant turns show their earlier calls the same way and tool results come as <tool_response>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures are within <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "To call a function, write its name and arguments as a JSON object within <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}\n{% endif %}"
    "{% for call in m['tool_calls'] %}<tool_call>\n{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>\n{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A paged cache keeps keys and values in blocks of tokens.",
    "Prefill runs the prompt; decode writes one token at a time.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2026 appear in text.",
    "She sells sea shells by the sea shore, and the shells she sells are sure.",
    "def main():\n    return [x * 2 for x in range(10)]\n",
    "Servers stream tokens to clients over HTTP with server-sent events.",
    "Once upon a time, a small model learned to write short stories.",
    "Question: what is the capital of France? Answer: Paris.",
)


def _corpus() -> list[str]:
    # [len(_SENTENCES) * 40] lines; the counter varies the digits so numbers get merges too
    return [f"{s} {i}" for i in range(40) for s in _SENTENCES]


def train_tokenizer() -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE tokenizer (about 0.1 s) and wrap it for `save_pretrained`."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # single-threaded merges: reproducible
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END], chat_template=CHAT_TEMPLATE,
    )
