"""What a HyperPod EKS worker node looks like to the Kubernetes API.

HyperPod names each node ``hyperpod-<EC2 instance id>`` (:mod:`sdcguard.contract.naming`) and labels it with
its health status and instance group; the seed and a simulated replacement
both build nodes from here, so every node in the stand-in has the same shape.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from sdcguard.contract.naming import node_name

HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
INSTANCE_GROUP_LABEL = "sagemaker.amazonaws.com/instance-group-name"
CLUSTER_NAME_LABEL = "sagemaker.amazonaws.com/cluster-name"
COMPUTE_TYPE_LABEL = "sagemaker.amazonaws.com/compute-type"
DEEP_HEALTH_LABEL = "sagemaker.amazonaws.com/deep-health-check-status"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


def internal_ip(instance_id: str) -> str:
    """The node's ``InternalIP`` (its VPC address): fixed by the instance id, so a replacement gets another.

    The kubelet reports it among the node's ``status.addresses`` and as the
    ``status.hostIP`` of every pod it runs, which is what resolve compares.
    """
    digest = hashlib.sha256(instance_id.encode()).digest()
    return f"10.0.{digest[0]}.{digest[1] % 250 + 2}"


def hyperpod_node(
    instance_id: str,
    *,
    instance_group: str = "worker-group",
    instance_type: str = "ml.p5.48xlarge",
    hyperpod_cluster: str = "",
    gpus: int = 8,
    zone: str = "us-east-1a",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Ready, schedulable node manifest for ``instance_id`` with the HyperPod labels (extra ``labels`` win)."""
    name = node_name(instance_id)
    all_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        INSTANCE_TYPE_LABEL: instance_type,
        "topology.kubernetes.io/zone": zone,
        COMPUTE_TYPE_LABEL: "hyperpod",
        INSTANCE_GROUP_LABEL: instance_group,
        HEALTH_LABEL: "Schedulable",
        DEEP_HEALTH_LABEL: "Passed",
    }
    if hyperpod_cluster:
        all_labels[CLUSTER_NAME_LABEL] = hyperpod_cluster
    all_labels.update(labels or {})
    resources = {"cpu": "192", "memory": "2097152Mi", "nvidia.com/gpu": str(gpus), "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels, "annotations": {}},
        "spec": {"providerID": f"aws:///{zone}/{instance_id}"},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                }
            ],
            "addresses": [{"type": "InternalIP", "address": internal_ip(instance_id)}, {"type": "Hostname", "address": name}],
            # The kubernetes client refuses a NodeSystemInfo without every one of these.
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": str(uuid.uuid5(uuid.NAMESPACE_OID, instance_id)),
                "containerRuntimeVersion": "containerd://1.7.22",
                "kernelVersion": "5.10.226-214.880.amzn2.x86_64",
                "kubeProxyVersion": "v1.31.0-eks",
                "kubeletVersion": "v1.31.0-eks",
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, instance_id).hex,
                "operatingSystem": "linux",
                "osImage": "Amazon Linux 2",
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, instance_id)),
            },
        },
    }
