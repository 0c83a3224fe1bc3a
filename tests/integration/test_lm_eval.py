"""lm-evaluation-harness scores pdserve through its `local-completions` model as it scores the same
model directory through its own `hf` model (transformers in this process), against one aggregated
server and against a disaggregated deployment (router, context server, generation server).

Two small tasks from tests/data/lm_eval/ (JSONL files read by `datasets`' json builder, offline):
a multiple-choice task (loglikelihood requests: token-id prompts with echo, logprobs 1 and
max_tokens 1) and a generate_until task (greedy, until "\\n", 16 tokens). lm-eval runs in this
process through its Python API; nothing reaches the network (the offline switches below are set
before `datasets`, `huggingface_hub` and `transformers` are first imported by lm_eval).

Greedy generation is compared with `hf` too: its generate_until decodes greedily (temperature 0,
no do_sample), stops on the stop strings and on the model's EOS ids, drops special tokens and cuts
the text at the first stop string, which is what the server's stop handling returns.
"""

from __future__ import annotations

import os

os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})

import contextlib  # noqa: E402
import functools  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import deploy_harness as dh  # noqa: E402
import huggingface_hub.constants  # noqa: E402
import lm_eval  # noqa: E402
import pytest  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from server.models.builtin import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"  # the YAMLs name their data files relative to ROOT
MC, GEN = "pdserve_python_docs_mc", "pdserve_python_docs_gen"
MODEL = "builtin:tiny-story"
OVERRIDES = {"model": MODEL, "dtype": "float32"}
LOGLIKELIHOOD_TOL = 1e-3


@functools.cache
def _task_manager() -> TaskManager:
    """Our two tasks only: lm-eval's own thousands of task files are not indexed (~15 s each time)."""
    return TaskManager(include_path=str(TASK_DIR), include_defaults=False)


def _evaluate(model: str, model_args: dict) -> dict:
    """lm-eval's results and logged samples for both tasks, run from the repository root."""
    with contextlib.chdir(ROOT):
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[MC, GEN],
                                      task_manager=_task_manager(), log_samples=True, bootstrap_iters=0)
    assert out is not None
    return {"results": out["results"],
            "samples": {task: sorted(rows, key=lambda s: s["doc_id"]) for task, rows in out["samples"].items()}}


def _served(url: str, model_dir: Path) -> dict:
    args = {"base_url": f"{url}/v1/completions", "tokenizer": str(model_dir), "tokenizer_backend": "huggingface",
            "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}
    return _evaluate("local-completions", args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    assert datasets.config.HF_DATASETS_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE
    model_dir = resolve_model(MODEL)
    out = {"hf": _evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"})}
    with dh.launched("aggregated.yaml", tmp_path_factory.mktemp("agg"), OVERRIDES) as agg:
        out["aggregated"] = _served(agg.url, model_dir)
    with dh.launched("disagg.yaml", tmp_path_factory.mktemp("disagg"), OVERRIDES) as disagg:
        out["disaggregated"] = _served(disagg.url, model_dir)
        out["disaggregated"]["legs"] = {
            "split": disagg.metric(disagg.url, "pdserve_router_disaggregated_requests_total"),
            "local": disagg.metric(disagg.url, "pdserve_router_local_requests_total")}
    return out


def test_disaggregated_run_split_every_request(runs):
    """Each lm-eval request (one per choice, one per generation) ran a context and a generation leg."""
    samples = runs["disaggregated"]["samples"]
    requests = sum(len(s["doc"]["choices"]) for s in samples[MC]) + len(samples[GEN])
    assert requests == 48 + 10
    assert runs["disaggregated"]["legs"] == {"split": requests, "local": 0}


def _scores(run: dict) -> dict:
    return {"acc": run["results"][MC]["acc,none"], "acc_norm": run["results"][MC]["acc_norm,none"],
            "exact_match": run["results"][GEN]["exact_match,strip"]}


def test_scores_equal_hf(runs):
    want = _scores(runs["hf"])
    assert want["acc"] > 0.5  # the trained model knows its documentation: the scores measure something
    assert _scores(runs["aggregated"]) == want
    assert _scores(runs["disaggregated"]) == want


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_loglikelihoods_equal_hf(runs, mode):
    """Every choice's loglikelihood within LOGLIKELIHOOD_TOL of hf's, and the same is_greedy."""
    want, got = runs["hf"]["samples"][MC], runs[mode]["samples"][MC]
    assert [s["doc_id"] for s in got] == [s["doc_id"] for s in want] == list(range(15))
    for w, g in zip(want, got, strict=True):
        assert g["arguments"] == w["arguments"]
        assert len(g["resps"]) == len(w["resps"]) == len(w["doc"]["choices"])
        for (w_ll, w_greedy), (g_ll, g_greedy) in zip(w["filtered_resps"], g["filtered_resps"], strict=True):
            assert abs(g_ll - w_ll) <= LOGLIKELIHOOD_TOL, (w["doc"], w["filtered_resps"], g["filtered_resps"])
            assert g_greedy == w_greedy, (w["doc"], w["filtered_resps"], g["filtered_resps"])
        assert [r[0] for r in g["resps"]] == g["filtered_resps"]
        assert (g["acc"], g["acc_norm"]) == (w["acc"], w["acc_norm"])


def test_generations_identical(runs):
    """The raw completions (resps) and the stripped ones are the same text in all three runs."""
    texts = {mode: [(s["resps"], s["filtered_resps"]) for s in run["samples"][GEN]] for mode, run in runs.items()}
    assert len(texts["hf"]) == 10
    assert texts["disaggregated"] == texts["aggregated"]
    assert texts["aggregated"] == texts["hf"]
    assert [s["exact_match"] for s in runs["aggregated"]["samples"][GEN]] == \
        [s["exact_match"] for s in runs["hf"]["samples"][GEN]]
