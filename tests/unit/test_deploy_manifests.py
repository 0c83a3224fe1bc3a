"""docs/DEPLOY.md's Ray deployments: the two-node YAML and the KubeRay manifests parse, and say what
makes them work (the router pinned to the head, GPUs per server, the job running `--ray auto` on
the cluster it selects, the deployment file mounted where the job reads it, the token from a Secret)."""

import re
from pathlib import Path

import yaml

from server.config.schema import deployment_from_dict
from server.deploy.ray.placement import provisional, wants

DOC = Path(__file__).resolve().parents[2] / "docs" / "DEPLOY.md"


def ray_section() -> str:
    text = DOC.read_text()
    return text[text.index("## Many machines on Ray"):text.index("## Tensor parallelism")]


def yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", ray_section(), re.S)


def manifests() -> dict[str, dict]:
    docs = [d for block in yaml_blocks() for d in yaml.safe_load_all(block) if d and "kind" in d]
    return {d["kind"]: d for d in docs}


def check_deployment(data: dict) -> None:
    cfg = deployment_from_dict(provisional(data), "DEPLOY.md", DOC.parent)
    by_name = {w.name: w for w in wants(cfg)}
    assert by_name["router"].options.resources == {"head": 1}
    assert cfg.host == "0.0.0.0" and cfg.port == 8000
    for name, want in by_name.items():
        if name != "router":
            assert want.options.num_gpus == 1, name


def test_the_two_node_deployment_loads_and_pins_each_server():
    data = yaml.safe_load(yaml_blocks()[0])
    check_deployment(data)
    assert data["context_servers"]["ray_actor_options"]["resources"] == {"node_a": 1}
    assert data["generation_servers"]["ray_actor_options"]["resources"] == {"node_b": 1}
    assert "urls" not in data["context_servers"] and "urls" not in data["generation_servers"]
    section = ray_section()
    assert "--resources='{\"head\": 1}'" in section and "--resources='{\"node_a\": 1}'" in section
    assert "pdserve launch deployment.yaml --ray auto" in section


def test_kuberay_cluster_job_and_service_fit_together():
    m = manifests()
    assert set(m) == {"ConfigMap", "RayCluster", "RayJob", "Service"}
    cluster, job, config = m["RayCluster"], m["RayJob"], m["ConfigMap"]
    assert cluster["apiVersion"] == job["apiVersion"] == "ray.io/v1"
    name = cluster["metadata"]["name"]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": name}
    assert m["Service"]["spec"]["selector"] == {"ray.io/cluster": name, "ray.io/node-type": "head"}

    head = cluster["spec"]["headGroupSpec"]
    assert yaml.safe_load(yaml.safe_load(head["rayStartParams"]["resources"])) == {"head": 1}
    (head_pod,) = head["template"]["spec"]["containers"]
    assert 8000 in [p["containerPort"] for p in head_pod["ports"]]
    token = next(e for e in head_pod["env"] if e["name"] == "PDSERVE_AUTH_TOKEN")
    assert "secretKeyRef" in token["valueFrom"]

    (workers,) = cluster["spec"]["workerGroupSpecs"]
    (worker,) = workers["template"]["spec"]["containers"]
    gpus_per_pod = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert workers["replicas"] == workers["minReplicas"] >= 2

    entry = job["spec"]["entrypoint"].split()
    assert entry[:2] == ["pdserve", "launch"] and entry[entry.index("--ray") + 1] == "auto"
    mount = next(v["mountPath"] for v in head_pod["volumeMounts"] if v["name"] == "deployment")
    assert entry[2] == f"{mount}/deployment.yaml"
    for spec in (head["template"]["spec"], workers["template"]["spec"]):
        volume = next(v for v in spec["volumes"] if v["name"] == "deployment")
        assert volume["configMap"]["name"] == config["metadata"]["name"]

    data = yaml.safe_load(config["data"]["deployment.yaml"])
    check_deployment(data)
    for pod in (head_pod, worker):  # the model directory is a path on every node (the router's tokenizer too)
        assert any(data["model"].startswith(v["mountPath"] + "/") for v in pod["volumeMounts"]), pod["name"]
    tp = data["context_servers"]["tensor_parallel_size"]
    assert tp <= gpus_per_pod  # STRICT_PACK: a context server's ranks fit on one worker pod
    servers = tp * data["context_servers"]["num_instances"] + data["generation_servers"]["num_instances"]
    assert servers <= gpus_per_pod * workers["replicas"]
