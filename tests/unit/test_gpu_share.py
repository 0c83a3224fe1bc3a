"""server/deploy/gpu_share.py: which servers of a deployment share a GPU, and their SM percentages."""

from pathlib import Path

import pytest
import yaml

from server.config.schema import load_deployment
from server.deploy.gpu_share import (
    SM_PERCENT,
    GpuSharePlan,
    SharedGpus,
    plan_gpu_share,
    visible_list,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


pytestmark = pytest.mark.usefixtures("no_env_overrides")


def pair(**sections) -> dict:
    """One context and one generation server; `sections` adds keys to `context` / `generation`."""
    data = {"model": "builtin:tiny-llama",
            "context_servers": {"urls": ["127.0.0.1:8001"]},
            "generation_servers": {"urls": ["127.0.0.1:8002"]}}
    for name, extra in sections.items():
        data[f"{name}_servers"].update(extra)
    return data


def plan_of(tmp_path: Path, data: dict, launcher_devices: str | None = None) -> GpuSharePlan:
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    return plan_gpu_share(load_deployment(path).named(), launcher_devices)


def test_no_server_is_capped_by_default():
    assert SM_PERCENT == 100


def test_the_shipped_pair_shares_gpu_0():
    plan = plan_gpu_share(load_deployment(CONFIGS / "disagg.yaml").named(), None)
    assert plan == GpuSharePlan((SharedGpus(("0",), {"context-0": 100, "generation-0": 100}, False, True),))
    assert plan.percent_of("context-0") == 100 and plan.percent_of("router") is None
    assert plan.describe() == "context-0 (100%) and generation-0 (100%) on GPU 0"


def test_two_by_two_on_one_gpu_is_one_group():
    plan = plan_gpu_share(load_deployment(CONFIGS / "disagg_2x2.yaml").named(), None)
    assert plan.groups == (SharedGpus(("0",), {"context-0": 100, "context-1": 100, "generation-0": 100,
                                               "generation-1": 100}, False, True),)
    assert plan.describe() == ("context-0 (100%), context-1 (100%), generation-0 (100%) and generation-1 (100%) "
                               "on GPU 0")


def test_a_number_is_that_servers_percentage(tmp_path):
    plan = plan_of(tmp_path, pair(context={"gpu_share": 100}, generation={"gpu_share": "auto"}))
    assert plan.groups == (SharedGpus(("0",), {"context-0": 100, "generation-0": 100}, False, True),)
    inherited = plan_of(tmp_path, {**pair(), "gpu_share": 100})
    assert inherited.groups[0].percent == {"context-0": 100, "generation-0": 100}


@pytest.mark.parametrize("data", [
    pair(context={"gpu_share": "off"}),
    pair(generation={"gpu_share": "off"}, context={"gpu_share": 100}),  # off on a GPU keeps it plain
    {**pair(), "gpu_share": "off"},
    {**pair(), "device": "cpu"},
    pair(context={"device": "cpu"}),
    pair(context={"env": {"CUDA_VISIBLE_DEVICES": "0"}}, generation={"env": {"CUDA_VISIBLE_DEVICES": "1"}}),
    pair(context={"env": {"CUDA_VISIBLE_DEVICES": ""}}),  # sees no GPU
], ids=["context-off", "generation-off-beats-a-number", "top-level-off", "cpu", "context-on-cpu", "two-gpus",
        "hidden-gpus"])
def test_no_mps_where_no_gpu_is_shared_or_a_server_says_off(tmp_path, data):
    assert plan_of(tmp_path, data) == GpuSharePlan()


def test_auto_needs_a_context_and_a_generation_server(tmp_path):
    aggregated = {"model": "builtin:tiny-llama", "generation_servers": {"urls": ["127.0.0.1:8001", "127.0.0.1:8002"]}}
    assert plan_of(tmp_path, aggregated) == GpuSharePlan()
    asked = plan_of(tmp_path, {**aggregated, "gpu_share": 100})
    assert asked.groups == (SharedGpus(("0",), {"aggregated-0": 100, "aggregated-1": 100}, False),)
    one_side = pair(context={"env": {"CUDA_VISIBLE_DEVICES": "1"}})
    one_side["context_servers"]["urls"] = ["127.0.0.1:8001", "127.0.0.1:8003"]
    assert plan_of(tmp_path, one_side) == GpuSharePlan()  # two context servers on GPU 1, the generation on 0


def test_gpus_are_the_ones_each_server_sees(tmp_path):
    data = pair(context={"env": {"CUDA_VISIBLE_DEVICES": "2"}})
    assert plan_of(tmp_path, data, launcher_devices="2,3").groups == (
        SharedGpus(("2",), {"context-0": 100, "generation-0": 100}, False, True),)
    assert plan_of(tmp_path, data, launcher_devices="3,2") == GpuSharePlan()  # the generation server: GPU 3
    uuid = "GPU-4f1c7d2e"
    assert plan_of(tmp_path, pair(), launcher_devices=f" {uuid} ,1").groups[0].gpus == (uuid,)


def test_tensor_parallel_servers_join_every_gpu_they_use(tmp_path):
    data = pair(context={"tensor_parallel_size": 2, "env": {"CUDA_VISIBLE_DEVICES": "0,1"}},
                generation={"env": {"CUDA_VISIBLE_DEVICES": "1"}})
    assert plan_of(tmp_path, data).groups == (
        SharedGpus(("0", "1"), {"context-0": 100, "generation-0": 100}, False, True),)
    # a generation server on GPU 1 and one on GPU 0 are joined through the context server on both
    data = pair(context={"tensor_parallel_size": 2})
    data["generation_servers"] = {"urls": ["127.0.0.1:8002", "127.0.0.1:8003"], "env": {"CUDA_VISIBLE_DEVICES": "1"}}
    data["context_servers"]["urls"] = ["127.0.0.1:8001"]
    assert plan_of(tmp_path, data).groups == (
        SharedGpus(("0", "1"), {"context-0": 100, "generation-0": 100, "generation-1": 100}, False, True),)


def test_separate_gpus_are_separate_groups(tmp_path):
    data = pair()
    data["context_servers"].update(urls=["127.0.0.1:8001", "127.0.0.1:8003"], env={"CUDA_VISIBLE_DEVICES": "0"})
    data["generation_servers"].update(urls=["127.0.0.1:8002", "127.0.0.1:8004"], gpu_share=100)
    data["generation_servers"]["env"] = {"CUDA_VISIBLE_DEVICES": "1"}
    data["context_servers"]["gpu_share"] = 100
    plan = plan_of(tmp_path, data)
    assert plan.groups == (SharedGpus(("0",), {"context-0": 100, "context-1": 100}, False),
                           SharedGpus(("1",), {"generation-0": 100, "generation-1": 100}, False))
    assert plan.describe() == ("context-0 (100%) and context-1 (100%) on GPU 0; "
                               "generation-0 (100%) and generation-1 (100%) on GPU 1")


def test_device_cuda_is_remembered(tmp_path):
    assert plan_of(tmp_path, pair(context={"device": "cuda"})).groups[0].cuda_required is True


@pytest.mark.parametrize("value, gpus", [
    ("0", ("0",)), ("1,0", ("1", "0")), (" 2 , 3 ", ("2", "3")), ("0,-1,2", ("0",)), ("", ()), ("-1", ()),
    ("0,,1", ("0",)), ("GPU-4f1c,MIG-9a", ("GPU-4f1c", "MIG-9a")),
])
def test_visible_devices_read_as_cuda_reads_them(value, gpus):
    assert visible_list(value) == gpus
