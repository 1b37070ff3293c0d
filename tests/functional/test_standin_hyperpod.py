"""SageMaker HyperPod and EKS on the stand-in (moto_ext.hyperpod, moto_ext.eks_endpoint)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from sdcguard.infra.local.eks.bearer_token import cluster_api_client
from sdcguard.infra.local.eks.hyperpod_node import hyperpod_node
from sdcguard.infra.local.moto_ext import hyperpod
from sdcguard.infra.local.standin import LocalStandIn

INSTANCE_ID = re.compile(r"^i-[0-9a-f]{17}$")


def create_cluster(standin: LocalStandIn, nodes: int = 3) -> tuple[str, list[str]]:
    name = f"hp-{uuid.uuid4().hex[:8]}"
    sagemaker = standin.client("sagemaker")
    sagemaker.create_cluster(
        ClusterName=name,
        InstanceGroups=[
            {
                "InstanceGroupName": "worker-group",
                "InstanceType": "ml.p5.48xlarge",
                "InstanceCount": nodes,
                "LifeCycleConfig": {"SourceS3Uri": "s3://sagemaker-lifecycle/scripts/", "OnCreate": "on_create.sh"},
                "ExecutionRole": "arn:aws:iam::123456789012:role/hyperpod",
                "ThreadsPerCore": 1,
            }
        ],
        VpcConfig={"SecurityGroupIds": ["sg-0123456789abcdef0"], "Subnets": ["subnet-0123456789abcdef0"]},
    )
    summaries = sagemaker.list_cluster_nodes(ClusterName=name)["ClusterNodeSummaries"]
    return name, [s["InstanceId"] for s in summaries]


def statuses(standin: LocalStandIn, cluster: str) -> dict[str, str]:
    summaries = _sagemaker(standin).list_cluster_nodes(ClusterName=cluster)["ClusterNodeSummaries"]
    return {s["InstanceId"]: s["InstanceStatus"]["Status"] for s in summaries}


_clients: dict[int, Any] = {}


def _sagemaker(standin: LocalStandIn) -> Any:
    # Creating a boto3 client takes a while on a busy machine; polls reuse one.
    return _clients.setdefault(id(standin), standin.client("sagemaker"))


def wait_until(check: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def held_phases() -> Iterator[None]:
    """Every HyperPod phase waits for ``hyperpod.advance()``; restored (and drained) afterwards."""
    saved = hyperpod.Timings(**vars(hyperpod.timings))
    for name in vars(saved):
        setattr(hyperpod.timings, name, None)
    yield
    for name, value in vars(saved).items():
        setattr(hyperpod.timings, name, value)
    while hyperpod.advance():
        pass


def test_nodes_have_instance_ids_and_addresses(standin: LocalStandIn) -> None:
    cluster, ids = create_cluster(standin)

    assert len(ids) == 3
    assert all(INSTANCE_ID.match(i) for i in ids)
    details = standin.client("sagemaker").describe_cluster_node(ClusterName=cluster, NodeId=ids[0])["NodeDetails"]
    assert details["InstanceId"] == ids[0]
    assert details["InstanceStatus"]["Status"] == "Running"
    assert details["PrivateDnsHostname"].endswith(".ec2.internal")


@pytest.mark.usefixtures("held_phases")
def test_replacement_moves_through_its_phases_under_a_new_id(standin: LocalStandIn) -> None:
    cluster, ids = create_cluster(standin)
    old = ids[0]
    sagemaker = standin.client("sagemaker")

    response = sagemaker.batch_replace_cluster_nodes(ClusterName=cluster, NodeIds=[old])

    assert response["Successful"] == [old]
    assert response.get("Failed", []) == []
    assert statuses(standin, cluster)[old] == "ShuttingDown"
    hyperpod.advance()
    now = statuses(standin, cluster)
    assert old not in now
    [new] = set(now) - set(ids)
    assert INSTANCE_ID.match(new)
    assert now[new] == "Pending"
    hyperpod.advance()
    assert statuses(standin, cluster) == {ids[1]: "Running", ids[2]: "Running", new: "Running"}
    with pytest.raises(ClientError):
        sagemaker.describe_cluster_node(ClusterName=cluster, NodeId=old)


@pytest.mark.usefixtures("held_phases")
def test_failed_entries_name_unknown_ids_and_ids_in_use(standin: LocalStandIn) -> None:
    cluster, ids = create_cluster(standin)
    sagemaker = standin.client("sagemaker")
    sagemaker.batch_replace_cluster_nodes(ClusterName=cluster, NodeIds=[ids[0]])
    unknown = "i-0000000000000000f"

    response = sagemaker.batch_replace_cluster_nodes(ClusterName=cluster, NodeIds=[ids[0], unknown, ids[1]])

    assert response["Successful"] == [ids[1]]
    failures = {f["NodeId"]: f["ErrorCode"] for f in response["Failed"]}
    assert failures == {ids[0]: "InstanceIdInUse", unknown: "InstanceIdNotFound"}
    with pytest.raises(ClientError) as info:
        sagemaker.batch_replace_cluster_nodes(ClusterName="no-such-cluster", NodeIds=[ids[2]])
    assert info.value.response["Error"]["Code"] == "ResourceNotFound"


@pytest.mark.usefixtures("held_phases")
def test_reboot_keeps_the_id(standin: LocalStandIn) -> None:
    cluster, ids = create_cluster(standin)
    sagemaker = standin.client("sagemaker")

    response = sagemaker.batch_reboot_cluster_nodes(ClusterName=cluster, NodeIds=[ids[1]])

    assert response["Successful"] == [ids[1]]
    assert statuses(standin, cluster)[ids[1]] == "Pending"
    hyperpod.advance()
    assert statuses(standin, cluster) == dict.fromkeys(ids, "Running")


@pytest.mark.usefixtures("held_phases")
def test_health_check_runs_then_returns_to_running(standin: LocalStandIn) -> None:
    cluster, ids = create_cluster(standin)
    sagemaker = standin.client("sagemaker")

    sagemaker.start_cluster_health_check(
        ClusterName=cluster,
        DeepHealthCheckConfigurations=[
            {"InstanceGroupName": "worker-group", "InstanceIds": [ids[2]], "DeepHealthChecks": ["InstanceStress"]}
        ],
    )

    assert statuses(standin, cluster) == {ids[0]: "Running", ids[1]: "Running", ids[2]: "DeepHealthCheckInProgress"}
    replaced = sagemaker.batch_replace_cluster_nodes(ClusterName=cluster, NodeIds=[ids[2]])
    assert replaced["Failed"][0]["ErrorCode"] == "InvalidInstanceStatus"
    hyperpod.advance()
    assert statuses(standin, cluster)[ids[2]] == "Running"
    with pytest.raises(ClientError) as info:
        sagemaker.start_cluster_health_check(
            ClusterName=cluster,
            DeepHealthCheckConfigurations=[{"InstanceGroupName": "nope", "DeepHealthChecks": ["InstanceStress"]}],
        )
    assert info.value.response["Error"]["Code"] == "ValidationException"


def test_phases_end_on_their_own_with_timings(standin: LocalStandIn) -> None:
    # The session's stand-in has 0-second phases: a replacement completes by itself.
    cluster, ids = create_cluster(standin, nodes=1)

    standin.client("sagemaker").batch_replace_cluster_nodes(ClusterName=cluster, NodeIds=ids)

    wait_until(lambda: (now := statuses(standin, cluster)).keys() != set(ids) and set(now.values()) == {"Running"})


def eks_cluster(standin: LocalStandIn) -> str:
    name = f"eks-{uuid.uuid4().hex[:8]}"
    standin.client("eks").create_cluster(
        name=name,
        roleArn="arn:aws:iam::123456789012:role/eks",
        resourcesVpcConfig={"subnetIds": ["subnet-0123456789abcdef0"]},
    )
    return name


def test_describe_cluster_points_at_the_local_eks_api_server(standin: LocalStandIn) -> None:
    assert standin.eks is not None
    name = eks_cluster(standin)

    cluster = standin.client("eks").describe_cluster(name=name)["cluster"]

    assert cluster["endpoint"] == standin.eks.url
    assert cluster["certificateAuthority"]["data"] == standin.eks.ca_data


def test_replacement_swaps_the_kubernetes_node(standin: LocalStandIn) -> None:
    hyperpod_cluster, ids = create_cluster(standin, nodes=2)
    api = cluster_api_client(eks_cluster(standin), standin.client("eks"), standin.client("sts"))
    core = k8s.CoreV1Api(api)
    for instance_id in ids:
        core.create_node(hyperpod_node(instance_id, hyperpod_cluster=hyperpod_cluster))

    standin.client("sagemaker").batch_replace_cluster_nodes(ClusterName=hyperpod_cluster, NodeIds=[ids[0]])

    def new_node_ready() -> bool:
        now = statuses(standin, hyperpod_cluster)
        new = [i for i, s in now.items() if i not in ids and s == "Running"]
        if not new:
            return False
        try:
            node: Any = core.read_node(f"hyperpod-{new[0]}")
        except ApiException:
            return False
        return not node.spec.unschedulable

    wait_until(new_node_ready)
    with pytest.raises(ApiException) as info:
        core.read_node(f"hyperpod-{ids[0]}")
    assert info.value.status == 404
    core.read_node(f"hyperpod-{ids[1]}")
