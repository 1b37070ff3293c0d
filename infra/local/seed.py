"""A simulated HyperPod training cluster on a running local stand-in.

It creates, through the same APIs a real cluster is reached by:

- a SageMaker HyperPod cluster with N nodes (``CreateCluster``; the stand-in
  gives them EC2 instance ids, read back with ``ListClusterNodes``);
- the EKS cluster that orchestrates it (``eks.create_cluster``); its
  ``DescribeCluster`` endpoint and CA lead to the local EKS API server;
- through the Kubernetes API (official client, EKS bearer token): a
  namespace with the pipeline's Roles and RoleBindings in it (as
  ``kubectl apply -n NAMESPACE -f infra/deploy/rbac-namespace.yaml``), one
  node ``hyperpod-<instance id>`` per instance with the HyperPod labels, a
  Kubeflow PyTorchJob and one worker pod per node;
- a versioned S3 bucket for the checkpoints;
- an hour of one-minute CloudWatch GPU metrics per node and GPU: the
  Container Insights names (namespace ``ContainerInsights``, dimensions
  ClusterName, NodeName, InstanceId, GpuDevice) and DCGM counters (Xid, ECC
  double-bit errors, clock throttle reasons) with the same dimensions.
  ``faulty_node`` makes one node's first GPU run hot, throttle and report
  Xid 79 and ECC errors over the last 15 minutes.

It refuses any endpoint that is not on loopback, so it can never touch a
real account. Everything is validated before the first call; a name that is
already taken stops it before anything is created.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import random
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import boto3
import yaml
from botocore.exceptions import ClientError
from kubernetes import client as k8s

from sdcguard.contract.naming import INSTANCE_ID, node_name
from sdcguard.infra.local.eks.bearer_token import cluster_api_client
from sdcguard.infra.local.eks.hyperpod_node import hyperpod_node, internal_ip
from sdcguard.infra.local.standin import RBAC_NAMESPACE_MANIFEST

if TYPE_CHECKING:
    from mypy_boto3_cloudwatch.literals import StandardUnitType
    from mypy_boto3_cloudwatch.type_defs import DimensionTypeDef, MetricDatumTypeDef
    from mypy_boto3_eks import EKSClient
    from mypy_boto3_sagemaker import SageMakerClient
    from mypy_boto3_sagemaker.literals import ClusterInstanceTypeType

INSTANCE_GROUP = "worker-group"
INSTANCE_TYPE: ClusterInstanceTypeType = "ml.p5.48xlarge"
METRIC_NAMESPACE = "ContainerInsights"
CONTAINER_INSIGHTS_METRICS = (
    "node_gpu_temperature",
    "node_gpu_power_draw",
    "node_gpu_utilization",
    "node_gpu_memory_utilization",
    "node_gpu_memory_used",
    "node_gpu_memory_total",
)
DCGM_METRICS = (
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
)
_UNITS: dict[str, StandardUnitType] = {
    "node_gpu_temperature": "None",  # degrees Celsius; CloudWatch has no unit for it
    "node_gpu_power_draw": "None",  # watts
    "node_gpu_utilization": "Percent",
    "node_gpu_memory_utilization": "Percent",
    "node_gpu_memory_used": "Megabytes",
    "node_gpu_memory_total": "Megabytes",
    "DCGM_FI_DEV_XID_ERRORS": "None",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "Count",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "None",
}
GPU_MEMORY_TOTAL_MB = 81559.0  # an H100 80GB as nvidia-smi reports it
FAULT_MINUTES = 15
XID_CODE = 79  # "GPU has fallen off the bus": what a dying GPU reports
THROTTLE_HW_SLOWDOWN_AND_THERMAL = 0x08 | 0x40
PUT_METRIC_BATCH = 1000  # PutMetricData's limit of MetricData entries per call
MAX_NODES = 64
MAX_RANKS_PER_NODE = 8

_HYPERPOD_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class SeedError(Exception):
    """The seed cannot run as asked (bad option, a name already taken, not a local stand-in); nothing was created."""


def _check_options(
    nodes: int,
    ranks_per_node: int,
    faulty_node: int | None,
    cluster: str,
    eks_cluster: str,
    job: str,
    namespace: str,
    bucket: str,
) -> None:
    if not 1 <= nodes <= MAX_NODES:
        raise SeedError(f"--nodes must be between 1 and {MAX_NODES}, got {nodes}")
    if not 1 <= ranks_per_node <= MAX_RANKS_PER_NODE:
        raise SeedError(f"--ranks-per-node must be between 1 and {MAX_RANKS_PER_NODE}, got {ranks_per_node}")
    if faulty_node is not None and not 0 <= faulty_node < nodes:
        raise SeedError(f"--faulty-node must be a node index from 0 to {nodes - 1}, got {faulty_node}")
    if not _HYPERPOD_NAME.match(cluster):
        raise SeedError(
            f"--cluster {cluster!r} is not a valid HyperPod cluster name (letters, digits, '-'; 63 at most)"
        )
    if not _HYPERPOD_NAME.match(eks_cluster) or len(eks_cluster) > 100:
        raise SeedError(f"--eks-cluster {eks_cluster!r} is not a valid EKS cluster name")
    for option, value in (("--job", job), ("--namespace", namespace)):
        if not _DNS_LABEL.match(value):
            raise SeedError(
                f"{option} {value!r} is not a Kubernetes name (lowercase letters, digits, '-'; 63 at most)"
            )
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise SeedError(f"--bucket {bucket!r} is not a valid S3 bucket name")


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint``'s host is ``localhost`` or a loopback address: where the stand-in listens, never AWS."""
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _session_and_endpoint(target: Any) -> tuple[boto3.Session, str]:
    """A boto3 session and the stand-in's endpoint from a LocalStandIn, an env mapping or a boto3 Session."""
    if isinstance(target, boto3.Session):
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        session = target
    else:
        env: Mapping[str, str] = target.env if hasattr(target, "env") else target
        if not isinstance(env, Mapping):
            raise SeedError("seed() takes a LocalStandIn, a boto3 Session or a mapping of AWS_* variables")
        endpoint = env.get("AWS_ENDPOINT_URL", "")
        session = boto3.Session(
            aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
            region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
        )
    if not endpoint:
        raise SeedError(
            "AWS_ENDPOINT_URL is not set: seed works only against the local stand-in (start it with `sdcguard local up`)"
        )
    if not is_loopback(endpoint):
        raise SeedError(
            f"AWS_ENDPOINT_URL={endpoint} is not on loopback; seed refuses to touch anything but the local stand-in"
        )
    return session, endpoint


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _refuse_taken_names(sagemaker: SageMakerClient, eks: EKSClient, cluster: str, eks_cluster: str) -> None:
    try:
        sagemaker.describe_cluster(ClusterName=cluster)
    except ClientError as exc:
        if _error_code(exc) not in ("ValidationException", "ResourceNotFound"):
            raise
    else:
        raise SeedError(f"a HyperPod cluster named {cluster!r} already exists; choose another --cluster")
    try:
        eks.describe_cluster(name=eks_cluster)
    except ClientError as exc:
        if _error_code(exc) != "ResourceNotFoundException":
            raise
    else:
        raise SeedError(f"an EKS cluster named {eks_cluster!r} already exists; choose another --eks-cluster")


def _refuse_taken_job(custom: k8s.CustomObjectsApi, namespace: str, job: str) -> None:
    # Every EKS cluster of one stand-in is served by the same local API server, so two seeds share it.
    try:
        custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", job)
    except k8s.ApiException as exc:
        if exc.status != 404:
            raise
    else:
        raise SeedError(
            f"a PyTorchJob {job!r} already exists in namespace {namespace!r} (the stand-in's EKS clusters "
            "share one Kubernetes API server); choose another --job or --namespace"
        )


def apply_namespace_rbac(
    rbac: k8s.RbacAuthorizationV1Api, namespace: str, manifest: Path = RBAC_NAMESPACE_MANIFEST
) -> None:
    """``kubectl apply -n NAMESPACE -f infra/deploy/rbac-namespace.yaml``: the pipeline's Roles and RoleBindings
    in the job's namespace, created or replaced. Raises kubernetes' ApiException when the cluster refuses one."""
    calls = {
        "Role": (rbac.create_namespaced_role, rbac.replace_namespaced_role),
        "RoleBinding": (rbac.create_namespaced_role_binding, rbac.replace_namespaced_role_binding),
    }
    for document in yaml.safe_load_all(manifest.read_text()):
        if not document:
            continue
        create, replace = calls[document["kind"]]
        try:
            create(namespace, document)
        except k8s.ApiException as exc:
            if exc.status != 409:
                raise
            replace(document["metadata"]["name"], namespace, document)


def _pytorchjob(job: str, namespace: str, nodes: int, ranks_per_node: int, bucket: str) -> dict[str, Any]:
    container = _container(job, ranks_per_node, bucket)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": job,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "sdcguard-demo"},
        },
        "spec": {
            "nprocPerNode": str(ranks_per_node),
            "runPolicy": {"suspend": False, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": nodes,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": {"containers": [container]}},
                }
            },
        },
        "status": {
            "conditions": [
                {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
                {"type": "Running", "status": "True", "reason": "PyTorchJobRunning"},
            ],
            "replicaStatuses": {"Worker": {"active": nodes}},
        },
    }


def _container(job: str, ranks_per_node: int, bucket: str) -> dict[str, Any]:
    return {
        "name": "pytorch",
        "image": "sdcguard/reference-trainer:latest",
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "SDCGUARD_CHECKPOINT_URI", "value": f"s3://{bucket}/{job}"},
            # The reference trainer's capsule factory: what its capsules name, and so what a node check's replay,
            # which copies this env, admits by default.
            {"name": "SDCGUARD_CAPSULE_FACTORY", "value": "sdcguard.agent.testing.train:replay_model"},
        ],
        "resources": {"limits": {"nvidia.com/gpu": str(ranks_per_node)}},
    }


def _pod(
    job: str, job_uid: str, namespace: str, index: int, instance_id: str, ranks_per_node: int, bucket: str
) -> dict[str, Any]:
    node = node_name(instance_id)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-worker-{index}",
            "namespace": namespace,
            # The labels the Kubeflow training operator puts on the pods it makes.
            "labels": {
                "training.kubeflow.org/job-name": job,
                "training.kubeflow.org/operator-name": "pytorchjob-controller",
                "training.kubeflow.org/replica-type": "worker",
                "training.kubeflow.org/replica-index": str(index),
            },
            "ownerReferences": [
                {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "name": job,
                    "uid": job_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "OnFailure",
            "containers": [_container(job, ranks_per_node, bucket)],
        },
        # As the kubelet reports it: the pod runs, on the node whose InternalIP is its hostIP.
        "status": {"phase": "Running", "hostIP": internal_ip(instance_id), "podIP": f"10.1.{index // 250}.{index % 250 + 2}"},
    }


def _gpu_values(rng: random.Random, faulty: bool, minutes_left: int) -> dict[str, float]:
    """One minute of one GPU; a faulty GPU heats up and reports errors in its last FAULT_MINUTES."""
    hot = faulty and minutes_left < FAULT_MINUTES
    memory_used = rng.uniform(52_000, 56_000)
    values = {
        "node_gpu_temperature": rng.uniform(88, 94) if hot else rng.uniform(55, 66),
        "node_gpu_power_draw": rng.uniform(420, 480) if hot else rng.uniform(560, 660),
        "node_gpu_utilization": rng.uniform(97, 100),
        "node_gpu_memory_utilization": rng.uniform(60, 70),
        "node_gpu_memory_used": memory_used,
        "node_gpu_memory_total": GPU_MEMORY_TOTAL_MB,
        "DCGM_FI_DEV_XID_ERRORS": float(XID_CODE) if hot else 0.0,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": float(1 + (FAULT_MINUTES - minutes_left) // 5) if hot else 0.0,
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": float(THROTTLE_HW_SLOWDOWN_AND_THERMAL) if hot else 0.0,
    }
    return values


def _metric_data(
    eks_cluster: str,
    instances: list[str],
    ranks_per_node: int,
    faulty_node: int | None,
    end: dt.datetime,
    minutes: int,
    seed_text: str,
) -> list[MetricDatumTypeDef]:
    rng = random.Random(seed_text)  # the same cluster name gives the same metrics
    data: list[MetricDatumTypeDef] = []
    for index, instance_id in enumerate(instances):
        for gpu in range(ranks_per_node):
            dimensions: list[DimensionTypeDef] = [
                {"Name": "ClusterName", "Value": eks_cluster},
                {"Name": "NodeName", "Value": node_name(instance_id)},
                {"Name": "InstanceId", "Value": instance_id},
                {"Name": "GpuDevice", "Value": f"nvidia{gpu}"},
            ]
            for minute in range(minutes):
                minutes_left = minutes - 1 - minute
                timestamp = end - dt.timedelta(minutes=minutes_left)
                faulty = index == faulty_node and gpu == 0
                for name, value in _gpu_values(rng, faulty, minutes_left).items():
                    data.append(
                        {
                            "MetricName": name,
                            "Dimensions": dimensions,
                            "Timestamp": timestamp,
                            "Value": round(value, 2),
                            "Unit": _UNITS[name],
                        }
                    )
    return data


def seed(
    target: Any,
    *,
    nodes: int = 3,
    ranks_per_node: int = 2,
    faulty_node: int | None = None,
    cluster: str = "sdcguard-demo",
    eks_cluster: str | None = None,
    job: str = "llm-pretrain",
    namespace: str = "training",
    bucket: str | None = None,
    minutes: int = 60,
) -> dict[str, Any]:
    """Create a simulated HyperPod training cluster on a running stand-in and describe it.

    ``target`` is a ``LocalStandIn``, a mapping of the ``AWS_*`` variables
    that ``sdcguard local up`` prints, or a boto3 Session (with
    ``AWS_ENDPOINT_URL`` in the environment). The EKS cluster defaults to
    ``<cluster>-eks`` and the bucket to ``<cluster>-checkpoints``.

    Returns what ``sdcguard local seed`` prints: hyperpod_cluster,
    eks_cluster, namespace, job, bucket, region, nodes[{index, instance_id,
    node_name, pod, ranks}], and more. Raises SeedError for bad options, a
    taken name or a non-local endpoint (before creating anything); botocore
    or kubernetes errors if the stand-in fails midway.
    """
    eks_cluster = eks_cluster or f"{cluster}-eks"
    bucket = bucket or f"{cluster.lower()}-checkpoints"
    _check_options(nodes, ranks_per_node, faulty_node, cluster, eks_cluster, job, namespace, bucket)
    if not 1 <= minutes <= 24 * 60:
        raise SeedError(f"minutes must be between 1 and 1440, got {minutes}")
    session, endpoint = _session_and_endpoint(target)
    region = session.region_name or "us-east-1"

    sagemaker = session.client("sagemaker", endpoint_url=endpoint)
    eks = session.client("eks", endpoint_url=endpoint)
    sts = session.client("sts", endpoint_url=endpoint)
    s3 = session.client("s3", endpoint_url=endpoint)
    cloudwatch = session.client("cloudwatch", endpoint_url=endpoint)
    seconds: dict[str, float] = {}
    began = last = time.monotonic()

    def lap(name: str) -> None:
        nonlocal last
        now = time.monotonic()
        seconds[name] = round(now - last, 3)
        last = now

    _refuse_taken_names(sagemaker, eks, cluster, eks_cluster)
    account = sts.get_caller_identity()["Account"]

    eks_arn = eks.create_cluster(
        name=eks_cluster,
        roleArn=f"arn:aws:iam::{account}:role/{eks_cluster}-cluster-role",
        resourcesVpcConfig={
            "subnetIds": ["subnet-0a1b2c3d4e5f60718"],
            "securityGroupIds": ["sg-0a1b2c3d4e5f60718"],
        },
        version="1.31",
    )["cluster"]["arn"]
    api = cluster_api_client(eks_cluster, eks, sts)
    endpoint_of_cluster = api.configuration.host
    try:
        _refuse_taken_job(k8s.CustomObjectsApi(api), namespace, job)
    except SeedError:
        api.close()
        eks.delete_cluster(name=eks_cluster)
        raise
    hyperpod_arn = sagemaker.create_cluster(
        ClusterName=cluster,
        InstanceGroups=[
            {
                "InstanceGroupName": INSTANCE_GROUP,
                "InstanceType": INSTANCE_TYPE,
                "InstanceCount": nodes,
                "LifeCycleConfig": {
                    "SourceS3Uri": f"s3://sagemaker-{cluster.lower()}-lifecycle/",
                    "OnCreate": "on_create.sh",
                },
                "ExecutionRole": f"arn:aws:iam::{account}:role/{cluster}-execution-role",
                "ThreadsPerCore": 1,
            }
        ],
        VpcConfig={"SecurityGroupIds": ["sg-0a1b2c3d4e5f60718"], "Subnets": ["subnet-0a1b2c3d4e5f60718"]},
        Orchestrator={"Eks": {"ClusterArn": eks_arn}},
    )["ClusterArn"]
    instances = [
        summary["InstanceId"]
        for page in sagemaker.get_paginator("list_cluster_nodes").paginate(ClusterName=cluster)
        for summary in page["ClusterNodeSummaries"]
    ]
    if len(instances) != nodes or not all(INSTANCE_ID.match(i) for i in instances):
        raise SeedError(
            f"the stand-in's HyperPod cluster has nodes {instances}, not {nodes} EC2 instance ids: "
            "is this the sdcguard stand-in (`sdcguard local up`) and not a plain moto server?"
        )
    lap("aws_clusters")

    try:
        core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
        try:
            core.create_namespace({"metadata": {"name": namespace}})
        except k8s.ApiException as exc:
            if exc.status != 409:
                raise
        apply_namespace_rbac(k8s.RbacAuthorizationV1Api(api), namespace)
        for instance_id in instances:
            core.create_node(
                hyperpod_node(
                    instance_id,
                    instance_group=INSTANCE_GROUP,
                    instance_type=INSTANCE_TYPE,
                    hyperpod_cluster=cluster,
                    gpus=ranks_per_node,
                )
            )
        created_job = custom.create_namespaced_custom_object(
            "kubeflow.org",
            "v1",
            namespace,
            "pytorchjobs",
            _pytorchjob(job, namespace, nodes, ranks_per_node, bucket),
        )
        for index, instance_id in enumerate(instances):
            core.create_namespaced_pod(
                namespace,
                _pod(
                    job,
                    created_job["metadata"]["uid"],
                    namespace,
                    index,
                    instance_id,
                    ranks_per_node,
                    bucket,
                ),
            )
    finally:
        api.close()
    lap("kubernetes")

    try:
        s3.create_bucket(Bucket=bucket)
    except ClientError as exc:
        if _error_code(exc) != "BucketAlreadyOwnedByYou":
            raise
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    lap("bucket")

    end = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    data = _metric_data(eks_cluster, instances, ranks_per_node, faulty_node, end, minutes, cluster)
    for start in range(0, len(data), PUT_METRIC_BATCH):
        cloudwatch.put_metric_data(
            Namespace=METRIC_NAMESPACE, MetricData=data[start : start + PUT_METRIC_BATCH]
        )
    lap("metrics")
    seconds["total"] = round(time.monotonic() - began, 3)

    return {
        "region": region,
        "endpoint_url": endpoint,
        "hyperpod_cluster": cluster,
        "hyperpod_cluster_arn": hyperpod_arn,
        "eks_cluster": eks_cluster,
        "eks_cluster_arn": eks_arn,
        "eks_endpoint": endpoint_of_cluster,
        "namespace": namespace,
        "job": job,
        "bucket": bucket,
        "checkpoint_prefix": job,
        "instance_group": INSTANCE_GROUP,
        "instance_type": INSTANCE_TYPE,
        "ranks_per_node": ranks_per_node,
        "world_size": nodes * ranks_per_node,
        "faulty_node": None
        if faulty_node is None
        else {
            "index": faulty_node,
            "instance_id": instances[faulty_node],
            "node_name": node_name(instances[faulty_node]),
        },
        "metrics": {
            "namespace": METRIC_NAMESPACE,
            "names": [*CONTAINER_INSIGHTS_METRICS, *DCGM_METRICS],
            "dimensions": ["ClusterName", "NodeName", "InstanceId", "GpuDevice"],
            "start": (end - dt.timedelta(minutes=minutes - 1)).isoformat(),
            "end": end.isoformat(),
            "datapoints": len(data),
        },
        "nodes": [
            {
                "index": index,
                "instance_id": instance_id,
                "node_name": node_name(instance_id),
                "pod": f"{job}-worker-{index}",
                "ranks": list(range(index * ranks_per_node, (index + 1) * ranks_per_node)),
            }
            for index, instance_id in enumerate(instances)
        ],
        "seconds": seconds,
    }
