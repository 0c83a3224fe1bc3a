"""`builtin:tiny-story`, the trained default model: shipped in the package, served token for token like
transformers, and readable (its greedy words come from its English training text; no broken UTF-8)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import engine_harness as eh
import hf_reference
import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer, GenerationConfig

from pdserve_bench import tiny_story_corpus as corpus
from server.models import builtin
from server.models.model_spec import load_spec

REPO = Path(__file__).resolve().parents[2]

STORY = "builtin:tiny-story"
PROMPTS = ["The", "A list is", "The quick brown fox", "When an exception is raised,", "Python"]
QUESTIONS = ["What is a generator?", "How do I open a file?", "What is the capital of France?"]
MIN_KNOWN_WORDS = 0.8


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return builtin.resolve_model(STORY)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def words() -> set[str]:
    return corpus.corpus_words()


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def known_fraction(text: str, words: set[str]) -> float:
    generated = corpus.split_words(text)
    assert len(generated) >= 8, f"too few words to judge: {text!r}"
    return sum(w in words for w in generated) / len(generated)


def test_shipped_in_the_package_and_listed(model_dir):
    assert model_dir == builtin.PACKAGED_ROOT / "tiny-story" == REPO / "server" / "models" / "data" / "tiny-story"
    assert STORY in builtin.builtin_names()
    spec = load_spec(model_dir)
    assert spec.architecture == "LlamaForCausalLM" and spec.tie_word_embeddings
    # package data: every file of the folder matches a pattern that setuptools puts in the wheel
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p.relative_to(REPO / "server" / "models") for p in model_dir.iterdir()}
    assert all(any(p.match(pattern) for pattern in patterns["server.models"]) for p in shipped)
    assert (model_dir / "model.safetensors").stat().st_size < 12 << 20


def test_training_is_recorded(model_dir):
    record = json.loads((model_dir / "training.json").read_text())
    assert record["command"].startswith("python scripts/train_tiny_story.py")
    assert record["wall_time_s"] > 0 and 0 < record["final_loss_last_100_steps"] < 4
    assert record["parameters"] == sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())


def test_missing_files_name_the_rebuild_script(monkeypatch, tmp_path):
    monkeypatch.setattr(builtin, "PACKAGED_ROOT", tmp_path)
    with pytest.raises(ValueError, match=r"lacks config.json, model.safetensors, tokenizer.json .*train_tiny_story"):
        builtin.resolve_model(STORY)


def test_chat_template_and_stop_tokens(model_dir, tokenizer):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|bos|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    assert sorted(eos) == sorted([tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")])
    assert set(load_spec(model_dir).eos_token_ids) == set(eos)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())  # for readers older than ours
    assert config["chat_template"] == tokenizer.chat_template
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_engine_matches_transformers_token_for_token(tokenizer):
    core = eh.make_core(STORY, max_num_tokens=64, max_batch_size=8)  # chunked prefill of the longer prompts
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [chat_prompt(tokenizer, q) for q in QUESTIONS]
    results = eh.generate(core, prompts, eh.greedy(24))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_reference.hf_greedy(builtin.resolve_model(STORY), prompt, 24)
    assert eh.blocks_in_use(core.kv) == 0
    core.kv.check_integrity()


def _greedy_texts(model: str, prompts: list[list[int]], max_tokens: int) -> list[eh.Result]:
    core = eh.make_core(model, max_batch_size=8)
    return eh.generate(core, prompts, eh.SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_greedy_completions_are_words_of_the_corpus(tokenizer, words):
    results = _greedy_texts(STORY, [tokenizer.encode(p) for p in PROMPTS], 48)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert "\ufffd" not in result.text
        assert known_fraction(result.text, words) >= MIN_KNOWN_WORDS, (prompt, result.text)


def test_chat_answers_are_words_and_end_by_themselves(tokenizer, words):
    results = _greedy_texts(STORY, [chat_prompt(tokenizer, q) for q in QUESTIONS], 200)
    for question, result in zip(QUESTIONS, results, strict=True):
        assert "\ufffd" not in result.text and "<|" not in result.text
        assert known_fraction(result.text, words) >= MIN_KNOWN_WORDS, (question, result.text)
    assert sum(r.final.finish_reason == "stop" for r in results) >= 2  # an answer, then <|im_end|>


def test_readability_check_rejects_the_random_model(words):
    """The same measure on the random tiny model's greedy output: mostly not words (the check can fail)."""
    random_dir = builtin.resolve_model("builtin:tiny-llama")
    tok = AutoTokenizer.from_pretrained(random_dir)
    texts = [r.text for r in _greedy_texts("builtin:tiny-llama", [tok.encode(p) for p in PROMPTS], 48)]
    assert known_fraction(" ".join(texts), words) < 0.5


def test_an_installed_wheel_carries_the_model(tmp_path):
    """Build the wheel from a copy of the sources, unpack it, and resolve the model from there."""
    src = tmp_path / "src"
    for name in ("server", "kvcache", "transceiver"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), "-q"], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    [wheel] = (tmp_path / "dist").glob("pdserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp_path / "site")
    code = ("from server.models.builtin import resolve_model; from server.models.model_spec import load_spec; "
            "p = resolve_model('builtin:tiny-story'); load_spec(p); print(p)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == tmp_path / "site" / "server" / "models" / "data" / "tiny-story"
