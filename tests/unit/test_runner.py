"""The runner against transformers, token for token (float32, CPU), for every supported family.

Each family is a deterministic tiny model; the reference is transformers on the same directory.
The KV cache is the real `kvcache.KVCacheManager`: requests are admitted, their slot tables read
back, and blocks that leave a sliding window are released (-1 in the table) as the engine does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import hf_reference
import pytest
import torch
from kv_factories import make_manager
from prompts import random_prompt

from kvcache import KvCacheConfig, KVCacheManager
from server.models.builtin import build_tiny_model, materialize_builtin
from server.models.catalog import TINY_MLA
from server.models.model_spec import load_spec
from server.models.runner import ModelRunner, PendingTokens, SeqChunk, resolve_device, resolve_dtype

TPB = 16
MAX_SEQ_LEN = 512
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "mistral-sliding": ("mistral", {"sliding_window": 24}),
    "qwen2-bias-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 24,
                                     "max_window_layers": 2}),
    "qwen3-qknorm": ("qwen3", {}),
    "llama-tied-bias": ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "tiny-qwen3-swa": None,  # the built-in model: window 64, sliding and full layers
    # latent attention with rotate_half rope (`rope_interleave: false`), q through its low-rank projection
    "deepseek-v3-halves-rope": ("deepseek_v3", {**TINY_MLA, "q_lora_rank": 48, "rope_interleave": False,
                                                "n_group": 2, "topk_group": 1}),
    "tiny-glm4-moe": None,  # RoPE on half of each head, q/k norms and biases, DeepSeek-V3's gate
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runner")
    dirs = {}
    for name, recipe in FAMILIES.items():
        if recipe is None:
            dirs[name] = materialize_builtin(name, root=root)
        else:
            dirs[name] = build_tiny_model(root / name, recipe[0], **recipe[1])
    return dirs


def make_runner(model_dir: Path, *, max_tokens: int = 4096, max_num_tokens: int = 512,
                max_batch_size: int = 8) -> tuple[ModelRunner, KVCacheManager]:
    layout = load_spec(model_dir).cache_layout(MAX_SEQ_LEN, torch.float32, "cpu")
    kv = KVCacheManager(KvCacheConfig(max_tokens=max_tokens, tokens_per_block=TPB), layout)
    runner = ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"),
                         max_num_tokens=max_num_tokens, max_batch_size=max_batch_size)
    return runner, kv


def prompt(length: int, seed: int) -> list[int]:
    return random_prompt(seed, length, low=5, high=512)  # ids 5..511 of the models' 512


def greedy(logits: torch.Tensor, eos_ids: tuple[int, ...]) -> list[int]:
    """argmax with EOS masked, as HF's min_new_tokens does."""
    masked = logits.clone()
    masked[:, list(eos_ids)] = float("-inf")
    return masked.argmax(-1).tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_match_hf(model_dirs: dict[str, Path], family: str) -> None:
    model_dir = model_dirs[family]
    runner, kv = make_runner(model_dir)
    ids = prompt(150, seed=1)  # longer than every sliding window here (24, 64)
    ref = hf_reference.hf_logits(model_dir, ids)  # [150, vocab]
    kv.admit("r", ids)
    past, diffs = 0, []
    for size in (1, 1, 37, 50, 61):  # single tokens (decode path), then chunks across blocks
        chunk = SeqChunk(ids[past:past + size], past, _tables(kv, "r"), need_logits=True)
        logits = runner.execute([chunk])
        past += size
        assert logits.shape == (1, 512) and logits.dtype == torch.float32
        diffs.append((logits[0] - ref[past - 1]).abs().max().item())
        kv.release_out_of_window("r", past)
    assert max(diffs) < 1e-4, diffs


def _tables(kv: KVCacheManager, rid: str) -> dict[int, list[int]]:
    return {w: kv.slot_table(rid, w) for w in kv.window_sizes}


@dataclass
class _Seq:
    rid: str
    prompt: list[int]
    start_step: int
    out: list[int] = field(default_factory=list)
    computed: int = 0

    def tokens(self) -> list[int]:
        return self.prompt + self.out


def _schedule(seqs: list[_Seq], step: int, sizes: list[int]) -> list[tuple[_Seq, SeqChunk]]:
    """Every live sequence gets a chunk: the next prefill piece (size cycling) or one decode token.
    Prefill chunks are listed before decode tokens so the runner must restore chunk order."""
    plan = []
    for s in seqs:
        if step < s.start_step or len(s.out) == 16:
            continue
        todo = len(s.prompt) - s.computed
        n = min(todo, sizes[(step + len(s.prompt)) % len(sizes)]) if todo > 0 else 1
        plan.append((s, n))
    plan.sort(key=lambda sn: sn[1] == 1)
    return [(s, SeqChunk(s.tokens()[s.computed:s.computed + n], s.computed, {},
                         need_logits=s.computed + n >= len(s.prompt))) for s, n in plan]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_mixed_batches_match_hf_generate(model_dirs: dict[str, Path], family: str) -> None:
    model_dir = model_dirs[family]
    runner, kv = make_runner(model_dir, max_num_tokens=128)
    seqs = [_Seq("a", prompt(9, 2), 0), _Seq("b", prompt(150, 3), 0), _Seq("c", prompt(70, 4), 3)]
    eos = runner.spec.eos_token_ids
    mixed_steps = 0
    for step in range(80):
        plan = _schedule(seqs, step, sizes=[7, 29, 16, 50])
        if not plan:
            break
        for s, chunk in plan:
            if s.computed == 0:
                kv.admit(s.rid, s.prompt, num_tokens=len(s.prompt) + 16)
            chunk.slot_tables = _tables(kv, s.rid)
        mixed_steps += len({len(c.token_ids) == 1 for _, c in plan}) == 2
        logits = runner.execute([c for _, c in plan])
        sampled = iter(greedy(logits, eos))
        for s, chunk in plan:
            s.computed += len(chunk.token_ids)
            if chunk.need_logits:
                s.out.append(next(sampled))
            kv.release_out_of_window(s.rid, s.computed)
    assert mixed_steps >= 3
    for s in seqs:
        assert s.out == hf_reference.hf_greedy(model_dir, s.prompt, 16), s.rid


def _prefilled(model_dir: Path, length: int) -> tuple[ModelRunner, KVCacheManager, list[int]]:
    runner, kv = make_runner(model_dir)
    ids = prompt(length, seed=5)
    kv.admit("r", ids, num_tokens=length + 1)
    runner.execute([SeqChunk(ids, 0, _tables(kv, "r"), need_logits=True)])
    return runner, kv, ids


def test_corrupt_block_changes_output_and_out_of_window_block_does_not(model_dirs: dict[str, Path]) -> None:
    """Negative control: the output reads the cache. Corrupting a full-attention block moves the
    logits; corrupting a sliding-window block that is out of the window (still in the table) cannot."""
    runner, kv, ids = _prefilled(model_dirs["tiny-qwen3-swa"], 150)
    tables = _tables(kv, "r")
    decode = SeqChunk([7], 150, tables, need_logits=True)
    clean = runner.execute([decode])
    assert torch.equal(runner.execute([decode]), clean)  # rewriting the same token is idempotent
    sliding_pool, full_pool = kv.pool(64), kv.pool(MAX_SEQ_LEN)
    sliding_pool[tables[64][0]].normal_()  # block 0 (tokens 0..15) is out of the window of position 150
    assert torch.equal(runner.execute([decode]), clean)
    full_pool[tables[MAX_SEQ_LEN][0]].normal_()
    corrupted = runner.execute([decode])
    assert (corrupted - clean).abs().max().item() > 0.1


def test_step_validation_errors(model_dirs: dict[str, Path]) -> None:
    runner, kv = make_runner(model_dirs["tiny-qwen3-swa"], max_num_tokens=64, max_batch_size=2)
    kv.admit("r", prompt(100, 6))
    tables = _tables(kv, "r")
    with pytest.raises(ValueError, match="exceeds max_batch_size=2 / max_num_tokens=64"):
        runner.execute([SeqChunk(prompt(65, 7), 0, tables, True)])
    with pytest.raises(ValueError, match="exceeds max_batch_size=2"):
        runner.execute([SeqChunk([5], 0, tables, True)] * 3)
    with pytest.raises(ValueError, match="empty"):
        runner.execute([])
    with pytest.raises(ValueError, match="a chunk without tokens"):
        runner.execute([SeqChunk([], 0, tables, True)])
    released = {**tables, 64: [-1] + tables[64][1:]}  # block 0 released, but position 40 still sees it
    with pytest.raises(ValueError, match=r"slot table of window 64 lacks blocks 0\.\.2"):
        runner.execute([SeqChunk([5], 40, released, True)])
    short = {**tables, MAX_SEQ_LEN: tables[MAX_SEQ_LEN][:1]}
    with pytest.raises(ValueError, match=f"slot table of window {MAX_SEQ_LEN} lacks blocks 0..1"):
        runner.execute([SeqChunk(prompt(20, 8), 0, short, True)])


def test_kv_layout_must_fit_the_model(model_dirs: dict[str, Path]) -> None:
    def kv(windows: tuple[int, ...], kv_heads: int) -> KVCacheManager:
        return make_manager("cpu", tpb=TPB, primary_blocks=8, windows=windows, max_seq_len=MAX_SEQ_LEN,
                            heads=kv_heads, dim=32)

    full_windows = kv((MAX_SEQ_LEN,) * 4, 2)  # swa model needs window 64 on layers 0 and 2
    with pytest.raises(ValueError, match="KV cache layer 0 .* window 512\\) does not fit"):
        ModelRunner(model_dirs["tiny-qwen3-swa"], full_windows, dtype=torch.float32,
                    device=torch.device("cpu"), max_num_tokens=8, max_batch_size=1)
    wrong_heads = kv((MAX_SEQ_LEN,) * 4, 4)
    with pytest.raises(ValueError, match="kv_heads 2, head_dim 32"):
        ModelRunner(model_dirs["llama"], wrong_heads, dtype=torch.float32, device=torch.device("cpu"),
                    max_num_tokens=8, max_batch_size=1)


def test_logits_only_for_chunks_that_want_them(model_dirs: dict[str, Path]) -> None:
    runner, kv = make_runner(model_dirs["llama"])
    ids = prompt(40, 9)
    kv.admit("r", ids)
    assert runner.execute([SeqChunk(ids[:20], 0, _tables(kv, "r"), need_logits=False)]).shape == (0, 512)
    last = runner.execute([SeqChunk(ids[20:], 20, _tables(kv, "r"), need_logits=True)])
    ref = hf_reference.hf_logits(model_dirs["llama"], ids)[-1]
    assert (last[0] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "tiny-qwen3-swa"])
def test_pending_tokens_are_read_on_the_device(model_dirs: dict[str, Path], family: str) -> None:
    """Async scheduling: decode rows whose token is still on the device (rows of the step before's
    sampled ids) give the logits of the same step with those tokens on the host, beside a prefill
    chunk and a decode row with a host token."""
    runner, kv = make_runner(model_dirs[family])
    prompts = {rid: prompt(n, seed) for rid, n, seed in (("a", 30, 1), ("b", 75, 2), ("c", 9, 3), ("d", 20, 4))}
    for rid in "abc":
        kv.admit(rid, prompts[rid], num_tokens=len(prompts[rid]) + 1)
        runner.execute([SeqChunk(prompts[rid], 0, _tables(kv, rid), need_logits=True)])
    kv.admit("d", prompts["d"])
    host = {"a": 17, "b": 250, "c": 3}

    def step(tokens: dict[str, int]) -> list[SeqChunk]:
        decode = [SeqChunk([tokens[rid]], len(prompts[rid]), _tables(kv, rid), True) for rid in "abc"]
        return [decode[0], SeqChunk(prompts["d"], 0, _tables(kv, "d"), True), decode[1], decode[2]]

    expected = runner.execute(step(host))  # the second run writes the same K/V at the same places
    source = torch.tensor([99, host["c"], 5, host["a"]])  # [M] int64 on the runner's device
    logits = runner.execute(step({"a": 0, "b": host["b"], "c": 0}), PendingTokens(source, {0: 3, 3: 1}))
    assert torch.equal(logits, expected)


def test_resolve_dtype_and_device() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype(torch.bfloat16, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="'int8' is not a floating point torch dtype"):
        resolve_dtype("int8", cpu)
    assert resolve_device("cpu") == cpu
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("family", ["llama", "mistral-sliding", "tiny-qwen3-swa"])
def test_a_verify_chunk_as_decode_rows_matches_the_chunk(model_dirs: dict[str, Path], family: str) -> None:
    """What the decode graphs replay for speculative verification (`as_decode_rows`): a chunk's tokens
    as one-token rows over the same blocks give the chunk's logits, beside a plain decode row."""
    from server.models.runner import as_decode_rows, first_rows

    runner, kv = make_runner(model_dirs[family])
    a, b = prompt(90, seed=3), prompt(40, seed=4)  # past the sliding windows (24, 64)
    for rid, ids in (("a", a), ("b", b)):
        kv.admit(rid, ids + [7] * 8)
        runner.execute([SeqChunk(ids, 0, _tables(kv, rid), need_logits=True)])
    chunks = [SeqChunk([11], 40, _tables(kv, "b"), True), SeqChunk([5, 9, 13, 17, 21], 90, _tables(kv, "a"), True, 5)]
    whole = runner.execute(chunks)
    rows = as_decode_rows(chunks)
    assert [(r.token_ids, r.num_past) for r in rows] == [([11], 40), ([5], 90), ([9], 91), ([13], 92), ([17], 93),
                                                        ([21], 94)]
    assert first_rows(chunks) == [0, 1]
    by_rows = runner.forward(runner.prepare(rows))
    assert by_rows.shape == whole.shape == (6, 512)
    assert (by_rows - whole).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "tiny-qwen3-swa"])
def test_a_mixed_step_as_decode_rows_gives_the_eager_logits(model_dirs: dict[str, Path], family: str) -> None:
    """What a graph replays for a mixed prefill + decode step (`replay_plan`): a decode row, a whole
    prompt and the first chunk of another (no logits) as one-token rows give the eager step's logits
    at the rows the plan names, and the K/V they write lets the next chunk continue exactly."""
    from server.models.runner import replay_plan

    runner, kv = make_runner(model_dirs[family], max_batch_size=64)  # the rows run eagerly here: 51 of them
    a, b, c = prompt(70, seed=5), prompt(30, seed=6), prompt(50, seed=7)
    kv.admit("a", a + [7] * 4)
    runner.execute([SeqChunk(a, 0, _tables(kv, "a"), need_logits=True)])
    for rid, ids in (("b", b), ("c", c)):
        kv.admit(rid, ids)
    step = [SeqChunk([11], 70, _tables(kv, "a"), True), SeqChunk(b, 0, _tables(kv, "b"), True),
            SeqChunk(c[:20], 0, _tables(kv, "c"), False)]
    eager = runner.execute(step)
    rows, logit_rows = replay_plan(step, lambda n, m: n <= 64 and m <= 8)
    assert len(rows) == 51 and logit_rows == [0, 30]
    by_rows = runner.forward(runner.prepare(rows))[logit_rows]
    assert eager.shape == by_rows.shape == (2, 512) and (by_rows - eager).abs().max().item() < 1e-4
    rest = runner.execute([SeqChunk(c[20:], 20, _tables(kv, "c"), True)])  # over the rows' K/V of c[:20]
    fresh, kv2 = make_runner(model_dirs[family])
    kv2.admit("c", c)
    assert (fresh.execute([SeqChunk(c, 0, _tables(kv2, "c"), True)]) - rest).abs().max().item() < 1e-4


def test_replay_plan_keeps_long_prefills_and_misfits_eager() -> None:
    from server.models.runner import PREFILL_ROW_READS, replay_plan

    tables = {64: [0]}
    decode = [SeqChunk([1], 5, tables, True) for _ in range(3)]
    assert replay_plan(decode, lambda n, m: True)[1] is None  # decode only: every row's logits, in order
    assert replay_plan(decode, lambda n, m: n <= 2) is None  # no bucket holds 3 rows
    long = SeqChunk([1] * 1024, PREFILL_ROW_READS // 1024, tables, True)  # reads past the budget
    assert replay_plan([*decode, long], lambda n, m: True) is None
    short = SeqChunk([1] * 16, 0, tables, True)
    assert replay_plan([*decode, short], lambda n, m: True)[1] == [0, 1, 2, 18]
    assert replay_plan([*decode, short], lambda n, m: m <= 3) is None  # its logits do not fit
