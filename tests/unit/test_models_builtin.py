"""Built-in tiny models: atomic, deterministic materialization; outputs that depend on the context."""

from __future__ import annotations

import threading
from pathlib import Path

import hf_reference
import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from server.models import builtin
from server.models.model_spec import load_spec


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_resolve_builtin_materializes_once_into_versioned_folder(root: Path) -> None:
    path = builtin.resolve_model("builtin:tiny-llama", root=root)
    assert path == root / "tiny-llama-v2"
    assert sorted(p.name for p in path.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert builtin.resolve_model("builtin:tiny-llama", root=root) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no temp folders left


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert builtin.cache_root() == tmp_path / "models"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert builtin.cache_root() == Path.home() / ".cache" / "pdserve" / "models"


def test_concurrent_materialization_yields_one_complete_folder(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(builtin.materialize_builtin("tiny-llama",
                                                                                          root=tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [tmp_path / "tiny-llama-v2"] * 3
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama-v2"]
    load_spec(results[0])  # complete: config, weights and tokenizer all there


def test_build_is_deterministic(root: Path, tmp_path: Path) -> None:
    a = load_file(builtin.resolve_model("builtin:tiny-qwen3-swa", root=root) / "model.safetensors")
    b = load_file(builtin.build_tiny_model(tmp_path / "again", "qwen3", **builtin.BUILTIN_MODELS[
        "tiny-qwen3-swa"].overrides) / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert all(a[k].equal(b[k]) for k in a)


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown builtin model 'nope'"):
        builtin.resolve_model("builtin:nope", root=tmp_path)
    with pytest.raises(ValueError, match="no such directory"):
        builtin.resolve_model(str(tmp_path / "missing"))
    assert builtin.resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="unknown family 'gpt2'"):
        builtin.build_tiny_model(tmp_path / "x", "gpt2")


def test_tokenizer_special_tokens_and_chat_template(root: Path) -> None:
    tok = AutoTokenizer.from_pretrained(builtin.resolve_model("builtin:tiny-llama", root=root))
    assert len(tok) == 512
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [3, 4]
    text = "Hello, world! 42 brown foxes."
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name, prompt_len", [("tiny-llama", 24), ("tiny-qwen3-swa", 100), ("tiny-mixtral", 24),
                                             ("tiny-qwen2-moe", 24), ("tiny-qwen3-moe", 24)])
def test_greedy_output_varies_and_depends_on_first_token(root: Path, name: str, prompt_len: int) -> None:
    model_dir = builtin.resolve_model(f"builtin:{name}", root=root)
    prompt = [5 + (i * 37) % 500 for i in range(prompt_len)]  # longer than the 64-token window for swa
    out = hf_reference.hf_greedy(model_dir, prompt, 32)
    assert len(set(out)) >= 12, out
    changed = hf_reference.hf_greedy(model_dir, [prompt[0] + 1] + prompt[1:], 32)
    assert changed != out


def test_hf_reference_eos_rules(root: Path) -> None:
    """hf_greedy forbids EOS (min_tokens); hf_greedy_ignore_eos lets it through and goes on (ignore_eos)."""
    model_dir = builtin.resolve_model("builtin:tiny-llama", root=root)
    prompt = [245, 251, 150, 218, 121, 233, 7, 214, 442, 341, 369, 137, 126, 330]  # greedy meets EOS at step 21
    free = hf_reference.hf_greedy_ignore_eos(model_dir, prompt, 32)
    forbidden = hf_reference.hf_greedy(model_dir, prompt, 32)
    assert len(free) == len(forbidden) == 32
    assert free.index(2) == 20 and free.count(2) == 1
    assert forbidden[:20] == free[:20] and 2 not in forbidden


PLAIN_CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tiny_chat_template_renders_tools_and_nothing_else_changed() -> None:
    """The random tiny models' template is Hermes-style: tools, earlier calls and tool results render;
    a conversation without them renders as the plain ChatML it always did."""
    from server.api.chat import tool_format
    from server.models.tiny_tokenizer import train_tokenizer

    tok = train_tokenizer()
    talks = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"},
              {"role": "assistant", "content": "c"}, {"role": "user", "content": ""}]]
    for talk in talks:
        for generation_prompt in (True, False):
            assert tok.apply_chat_template(talk, add_generation_prompt=generation_prompt, tokenize=False) == (
                tok.apply_chat_template(talk, add_generation_prompt=generation_prompt, tokenize=False,
                                        chat_template=PLAIN_CHATML))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    talk = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert tok.apply_chat_template(talk, tools=tools, add_generation_prompt=True, tokenize=False) == (
        "<|bos|><|im_start|>system\ns\n\n# Tools\n\nYou may call one or more functions. Their signatures are "
        "within <tools></tools>:\n<tools>\n"
        '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}\n</tools>\n\n'
        "To call a function, write its name and arguments as a JSON object within <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nq<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tool_format(tok.chat_template) == "hermes"
