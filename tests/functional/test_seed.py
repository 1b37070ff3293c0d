"""``sdcguard local seed`` against the local stand-in: what it creates, seen through boto3 and the kubernetes client."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from botocore.exceptions import ClientError
from kubernetes import client as k8s

from sdcguard.infra.local.eks.bearer_token import cluster_api_client
from sdcguard.infra.local.eks.hyperpod_node import HEALTH_LABEL, INSTANCE_GROUP_LABEL
from sdcguard.infra.local.seed import SeedError, seed
from sdcguard.infra.local.standin import LocalStandIn

NODES = 3
FAULTY = 1


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def seeded(standin: LocalStandIn) -> dict[str, Any]:
    return seed(
        standin, nodes=NODES, ranks_per_node=2, faulty_node=FAULTY, cluster=_name("seed"), job=_name("llm")
    )


@pytest.fixture(scope="module")
def kube(standin: LocalStandIn, seeded: dict[str, Any]) -> k8s.ApiClient:
    # Reached as the handlers reach a cluster: DescribeCluster, then a bearer token.
    return cluster_api_client(seeded["eks_cluster"], standin.client("eks"), standin.client("sts"))


def test_hyperpod_nodes_are_the_seeded_instances(standin: LocalStandIn, seeded: dict[str, Any]) -> None:
    listed = standin.client("sagemaker").list_cluster_nodes(ClusterName=seeded["hyperpod_cluster"])

    ids = [n["InstanceId"] for n in listed["ClusterNodeSummaries"]]
    assert sorted(ids) == sorted(n["instance_id"] for n in seeded["nodes"])
    assert all(n["InstanceStatus"]["Status"] == "Running" for n in listed["ClusterNodeSummaries"])
    assert seeded["world_size"] == NODES * 2
    assert [n["ranks"] for n in seeded["nodes"]] == [[0, 1], [2, 3], [4, 5]]


def test_eks_cluster_points_at_the_local_api_server(standin: LocalStandIn, seeded: dict[str, Any]) -> None:
    cluster = standin.client("eks").describe_cluster(name=seeded["eks_cluster"])["cluster"]

    assert standin.eks is not None
    assert cluster["endpoint"] == standin.eks.url == seeded["eks_endpoint"]
    assert cluster["certificateAuthority"]["data"] == standin.eks.ca_data


def test_kubernetes_nodes_carry_the_hyperpod_labels(kube: k8s.ApiClient, seeded: dict[str, Any]) -> None:
    core = k8s.CoreV1Api(kube)

    for node in seeded["nodes"]:
        live = core.read_node(node["node_name"])
        assert node["node_name"] == f"hyperpod-{node['instance_id']}"
        assert live.metadata.labels[HEALTH_LABEL] == "Schedulable"
        assert live.metadata.labels[INSTANCE_GROUP_LABEL] == seeded["instance_group"]
        assert live.metadata.labels["sagemaker.amazonaws.com/cluster-name"] == seeded["hyperpod_cluster"]
        assert live.status.capacity["nvidia.com/gpu"] == "2"
        assert not live.spec.unschedulable


def test_one_worker_pod_per_node_of_a_running_pytorchjob(kube: k8s.ApiClient, seeded: dict[str, Any]) -> None:
    core, custom = k8s.CoreV1Api(kube), k8s.CustomObjectsApi(kube)

    job = custom.get_namespaced_custom_object(
        "kubeflow.org", "v1", seeded["namespace"], "pytorchjobs", seeded["job"]
    )
    pods = core.list_namespaced_pod(
        seeded["namespace"], label_selector=f"training.kubeflow.org/job-name={seeded['job']}"
    ).items
    faulty_node = seeded["faulty_node"]["node_name"]
    on_faulty = core.list_namespaced_pod(
        seeded["namespace"], field_selector=f"spec.nodeName={faulty_node}"
    ).items

    assert job["spec"]["runPolicy"]["suspend"] is False
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == NODES
    assert {p.metadata.name: p.spec.node_name for p in pods} == {
        n["pod"]: n["node_name"] for n in seeded["nodes"]
    }
    assert all(p.status.phase == "Running" for p in pods)
    assert [p.metadata.name for p in on_faulty] == [f"{seeded['job']}-worker-{FAULTY}"]
    assert pods[0].metadata.owner_references[0].uid == job["metadata"]["uid"]


def test_checkpoint_bucket_is_versioned(standin: LocalStandIn, seeded: dict[str, Any]) -> None:
    versioning = standin.client("s3").get_bucket_versioning(Bucket=seeded["bucket"])

    assert versioning["Status"] == "Enabled"


def _series(
    standin: LocalStandIn, seeded: dict[str, Any], name: str, node: dict[str, Any], stat: str
) -> list[float]:
    end = dt.datetime.fromisoformat(seeded["metrics"]["end"]) + dt.timedelta(minutes=1)
    answer = standin.client("cloudwatch").get_metric_data(
        MetricDataQueries=[
            {
                "Id": "m",
                "MetricStat": {
                    "Metric": {
                        "Namespace": "ContainerInsights",
                        "MetricName": name,
                        "Dimensions": [
                            {"Name": "ClusterName", "Value": seeded["eks_cluster"]},
                            {"Name": "NodeName", "Value": node["node_name"]},
                            {"Name": "InstanceId", "Value": node["instance_id"]},
                            {"Name": "GpuDevice", "Value": "nvidia0"},
                        ],
                    },
                    "Period": 60,
                    "Stat": stat,
                },
            }
        ],
        StartTime=end - dt.timedelta(hours=1, minutes=5),
        EndTime=end,
    )
    return list(answer["MetricDataResults"][0]["Values"])


def test_an_hour_of_minute_metrics_per_gpu(standin: LocalStandIn, seeded: dict[str, Any]) -> None:
    healthy = seeded["nodes"][0]

    utilization = _series(standin, seeded, "node_gpu_utilization", healthy, "Average")

    assert len(utilization) == 60
    assert seeded["metrics"]["datapoints"] == NODES * 2 * 60 * 9


def test_the_faulty_node_looks_faulty_and_the_others_do_not(
    standin: LocalStandIn, seeded: dict[str, Any]
) -> None:
    faulty = seeded["nodes"][FAULTY]
    healthy = seeded["nodes"][0]

    assert seeded["faulty_node"]["instance_id"] == faulty["instance_id"]
    assert max(_series(standin, seeded, "node_gpu_temperature", faulty, "Maximum")) > 85
    assert max(_series(standin, seeded, "node_gpu_temperature", healthy, "Maximum")) < 70
    assert max(_series(standin, seeded, "DCGM_FI_DEV_XID_ERRORS", faulty, "Maximum")) == 79
    assert max(_series(standin, seeded, "DCGM_FI_DEV_XID_ERRORS", healthy, "Maximum")) == 0
    assert max(_series(standin, seeded, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", faulty, "Maximum")) > 0


def test_a_hyperpod_replacement_swaps_the_kubernetes_node(
    standin: LocalStandIn, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    sagemaker, core = standin.client("sagemaker"), k8s.CoreV1Api(kube)
    old = seeded["nodes"][2]

    answer = sagemaker.batch_replace_cluster_nodes(
        ClusterName=seeded["hyperpod_cluster"], NodeIds=[old["instance_id"]]
    )
    assert answer.get("Failed", []) == []
    deadline = time.monotonic() + 30
    new_ids: set[str] = set()
    while time.monotonic() < deadline:
        listed = sagemaker.list_cluster_nodes(ClusterName=seeded["hyperpod_cluster"])["ClusterNodeSummaries"]
        new_ids = {n["InstanceId"] for n in listed} - {n["instance_id"] for n in seeded["nodes"]}
        if new_ids and all(n["InstanceStatus"]["Status"] == "Running" for n in listed):
            break
        time.sleep(0.1)
    assert len(new_ids) == 1
    new_node = f"hyperpod-{new_ids.pop()}"

    with pytest.raises(k8s.ApiException) as caught:
        core.read_node(old["node_name"])
    assert caught.value.status == 404
    assert core.read_node(new_node).metadata.labels[HEALTH_LABEL] == "Schedulable"
    assert core.read_namespaced_pod(old["pod"], seeded["namespace"]).spec.node_name == new_node


def test_bad_options_are_refused_before_anything_is_created(standin: LocalStandIn) -> None:
    cluster = _name("bad")

    with pytest.raises(SeedError, match="--faulty-node"):
        seed(standin, nodes=3, faulty_node=3, cluster=cluster)
    with pytest.raises(SeedError, match="--job"):
        seed(standin, job="Not_A_K8s_Name", cluster=cluster)

    with pytest.raises(ClientError):
        standin.client("sagemaker").describe_cluster(ClusterName=cluster)


def test_a_taken_cluster_name_is_refused_and_nothing_changes(
    standin: LocalStandIn, seeded: dict[str, Any]
) -> None:
    before = standin.client("eks").list_clusters()["clusters"]

    with pytest.raises(SeedError, match="already exists"):
        seed(standin, cluster=seeded["hyperpod_cluster"], eks_cluster=_name("other"))

    assert standin.client("eks").list_clusters()["clusters"] == before


def test_a_taken_job_name_is_refused_and_no_cluster_is_left(
    standin: LocalStandIn, seeded: dict[str, Any]
) -> None:
    cluster = _name("dup")

    with pytest.raises(SeedError, match="PyTorchJob"):
        seed(standin, cluster=cluster, job=seeded["job"], namespace=seeded["namespace"])

    assert f"{cluster}-eks" not in standin.client("eks").list_clusters()["clusters"]
    with pytest.raises(ClientError):
        standin.client("sagemaker").describe_cluster(ClusterName=cluster)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "AWS_ENDPOINT_URL is not set"),
        ({"AWS_ENDPOINT_URL": "https://sagemaker.us-east-1.amazonaws.com"}, "not on loopback"),
    ],
)
def test_seed_never_targets_anything_but_a_local_stand_in(env: dict[str, str], message: str) -> None:
    with pytest.raises(SeedError, match=message):
        seed({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", **env}, cluster=_name("x"))


def test_the_seed_command_prints_one_json_object(standin: LocalStandIn) -> None:
    cluster = _name("cli")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdcguard",
            "local",
            "seed",
            "--nodes",
            "2",
            "--cluster",
            cluster,
            "--faulty-node",
            "0",
        ],
        env={**env, **standin.env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    for key in ("hyperpod_cluster", "eks_cluster", "namespace", "job", "bucket", "region"):
        assert printed[key]
    assert printed["hyperpod_cluster"] == cluster
    assert [sorted(n) for n in printed["nodes"]] == [
        ["index", "instance_id", "node_name", "pod", "ranks"]
    ] * 2
    listed = standin.client("sagemaker").list_cluster_nodes(ClusterName=cluster)["ClusterNodeSummaries"]
    assert sorted(n["InstanceId"] for n in listed) == sorted(n["instance_id"] for n in printed["nodes"])


def test_the_seed_command_reports_a_bad_option_as_an_error(standin: LocalStandIn) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sdcguard", "local", "seed", "--nodes", "0"],
        env={**os.environ, **standin.env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert done.returncode == 1
    assert "sdcguard: error: --nodes must be between 1 and 64" in done.stderr


def test_the_pipelines_own_eks_client_cordons_a_seeded_node(
    standin: LocalStandIn, seeded: dict[str, Any]
) -> None:
    from sdcguard.lambdas.cordon import TAINT_KEY, cordon_node, uncordon_node
    from sdcguard.lambdas.eks_token import kubernetes_client

    api = kubernetes_client(seeded["eks_cluster"], eks=standin.client("eks"), sts=standin.client("sts"))
    node = seeded["nodes"][0]["node_name"]

    cordon_node(api, node, "inc-seed-1")
    cordoned = k8s.CoreV1Api(api).read_node(node)
    uncordon_node(api, node, "inc-seed-1")
    released = k8s.CoreV1Api(api).read_node(node)

    assert cordoned.spec.unschedulable is True
    assert [(t.key, t.value, t.effect) for t in cordoned.spec.taints] == [
        (TAINT_KEY, "inc-seed-1", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", None, "NoSchedule"),  # Kubernetes mirrors the cordon as a taint
    ]
    assert released.spec.unschedulable is False
    assert not released.spec.taints
