"""Tensor-parallel ranks for tests/unit/test_tp_model.py: `run_ranks` spawns `size` processes that each
run `rank_main` (gloo), and the one-rank reference (`make_runner`, `greedy`) the test compares them with.

A module of its own so that each spawned rank imports only what a rank runs: the test module imports
transformers' models (hf_reference), which a rank does not need (~2 s of imports in every rank).
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable
from pathlib import Path

import torch
from prompts import random_prompt

from kvcache import KvCacheConfig, KVCacheManager
from server.models.model_spec import load_spec
from server.models.parallel import group
from server.models.parallel.context import RankShard
from server.models.runner import ModelRunner, SeqChunk

TPB, MAX_SEQ_LEN, NEW_TOKENS = 16, 256, 6  # every decode step attends past the 64-token window
# the interpreted kernels (their time goes by the tokens a step holds): 4 decode steps, all past the window, and a
# 64-token budget (the warm-up's steps fill it; the prompt's chunks of 37 and 53 fit)
TRITON_NEW_TOKENS, TRITON_MAX_NUM_TOKENS = 4, 64
# and a batch limit of 2: the warm-up runs one step per decode split count of batches 1..limit (16 and 8
# splits for a rank's one kv head; 4 more with a limit of 4), enough for the ranks to run several steps in
# step with their own heads; the test's sequence decodes alone
TRITON_MAX_BATCH_SIZE = 2
PROMPT_LEN, FIRST_CHUNK = 90, 37  # beyond the 64-token window


def tp_prompt(vocab: int) -> list[int]:
    return random_prompt(7, PROMPT_LEN, low=5, high=vocab)


def greedy(runner: ModelRunner, kv: KVCacheManager, ids: list[int],
           new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """Prefill in two chunks, decode `new_tokens` greedily (EOS masked); also the prefill's last logits."""
    kv.admit("r", ids, num_tokens=len(ids) + new_tokens)
    tables = lambda: {w: kv.slot_table("r", w) for w in kv.window_sizes}  # noqa: E731
    runner.execute([SeqChunk(ids[:FIRST_CHUNK], 0, tables(), need_logits=False)])
    kv.release_out_of_window("r", FIRST_CHUNK)
    logits = runner.execute([SeqChunk(ids[FIRST_CHUNK:], FIRST_CHUNK, tables(), need_logits=True)])
    first, out, past = logits[0].tolist(), [], len(ids)
    eos = list(runner.spec.eos_token_ids)
    for _ in range(new_tokens):
        kv.release_out_of_window("r", past)
        logits[:, eos] = float("-inf")
        out.append(int(logits[0].argmax()))
        logits = runner.execute([SeqChunk([out[-1]], past, tables(), need_logits=True)])
        past += 1
    return out, first


def make_runner(model_dir: Path, shard: RankShard | None, kernels: str = "torch", max_num_tokens: int = 128,
                max_batch_size: int = 4) -> tuple[ModelRunner, KVCacheManager]:
    spec = load_spec(model_dir)
    local = spec if shard is None else shard.local_spec(spec)
    kv = KVCacheManager(KvCacheConfig(max_tokens=2048, tokens_per_block=TPB),
                        local.cache_layout(MAX_SEQ_LEN, torch.float32, "cpu"))
    return ModelRunner(model_dir, kv, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=max_num_tokens,
                       max_batch_size=max_batch_size, max_seq_len=MAX_SEQ_LEN, shard=shard, kernels=kernels,
                       cuda_graphs=False), kv


def rank_main(rank: int, size: int, port: int, model_dirs: dict[str, str], out: str, kernels: str,
              new_tokens: int) -> None:
    torch.set_num_threads(1)
    group.join(rank, size, torch.device("cpu"), port=port, timeout_s=120)
    try:
        results = {}
        for name, model_dir in model_dirs.items():
            shard = RankShard.of(load_spec(model_dir), rank, size, expert_parallel=name.endswith((":ep", ":a2a")),
                                 all_to_all=name.endswith(":a2a"))
            triton = kernels == "triton"
            runner, kv = make_runner(Path(model_dir), shard, kernels, TRITON_MAX_NUM_TOKENS if triton else 128,
                                     TRITON_MAX_BATCH_SIZE if triton else 4)
            runner.warm_up()  # the Triton path's warm-up steps: every rank runs the same, collectives pair
            results[name] = greedy(runner, kv, tp_prompt(runner.spec.vocab_size), new_tokens)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        group.leave()


def spawn_ranks(size: int, target: Callable[..., None], *args: object) -> None:
    """`target(rank, size, port, *args)` in `size` spawned processes that meet on the rendezvous store
    at `port` (server/models/parallel/group.py); each must exit with 0."""
    store = group.open_store(size, timeout_s=120)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, size, store.port, *args), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * size


def run_ranks(size: int, model_dirs: dict[str, Path], out: Path, kernels: str = "torch",
              new_tokens: int = NEW_TOKENS) -> list[dict]:
    spawn_ranks(size, rank_main, {k: str(v) for k, v in model_dirs.items()}, str(out), kernels, new_tokens)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(size)]
