"""What a HyperPod node replacement does to the cluster: one node goes, a new one comes, pods follow.

The HyperPod stand-in (``sdcguard.infra.local.moto_ext.hyperpod``) calls this, through
``EksApiServer.replace_node``, when a replacement reaches Running.
"""

from __future__ import annotations

import logging
from typing import Any

from sdcguard.infra.local.eks.errors import ApiError
from sdcguard.infra.local.eks.hyperpod_node import (
    CLUSTER_NAME_LABEL,
    INSTANCE_GROUP_LABEL,
    INSTANCE_TYPE_LABEL,
    hyperpod_node,
    internal_ip,
    node_name,
)
from sdcguard.infra.local.eks.objects import ObjectStore
from sdcguard.infra.local.eks.resources import NODES, PODS
from sdcguard.infra.local.eks.selectors import parse_field_selector

log = logging.getLogger(__name__)


def replace_node(store: ObjectStore, old_instance_id: str, new_instance_id: str) -> dict[str, Any]:
    """Apply a HyperPod node replacement to ``store`` and return the new node.

    Node ``hyperpod-<old>`` disappears; ``hyperpod-<new>`` appears Ready
    and schedulable (no taints, health label Schedulable) with the old
    node's instance group, type, zone and cluster labels; pods bound to
    the old node are bound to the new one. Tolerates an old node that
    the cluster never had. Raises ValueError for ids that are not
    ``i-`` + 17 hex, ApiError 409 if the new node already exists.
    """
    old_name, new_name = node_name(old_instance_id), node_name(new_instance_id)
    with store.transaction():
        if store.exists(NODES, None, new_name):
            raise ApiError(409, f'nodes "{new_name}" already exists', reason="AlreadyExists")
        old: dict[str, Any] = {}
        if store.exists(NODES, None, old_name):
            old = store.delete(NODES, None, old_name)
        labels = old.get("metadata", {}).get("labels", {})
        capacity = old.get("status", {}).get("capacity", {})
        node = hyperpod_node(
            new_instance_id,
            instance_group=labels.get(INSTANCE_GROUP_LABEL, "worker-group"),
            instance_type=labels.get(INSTANCE_TYPE_LABEL, "ml.p5.48xlarge"),
            hyperpod_cluster=labels.get(CLUSTER_NAME_LABEL, ""),
            gpus=int(capacity.get("nvidia.com/gpu", 8)),
            zone=labels.get("topology.kubernetes.io/zone", "us-east-1a"),
        )
        created = store.create(NODES, None, node)
        bound, _ = store.list(PODS, None, parse_field_selector(f"spec.nodeName={old_name}"))
        for pod in bound:

            def rebind(obj: dict[str, Any]) -> dict[str, Any]:
                obj["spec"]["nodeName"] = new_name
                if (obj.get("status") or {}).get("hostIP"):  # the kubelet of the new node reports its own address
                    obj["status"]["hostIP"] = internal_ip(new_instance_id)
                return obj

            store.update(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], rebind)
    log.info("replaced node %s by %s (%d pods moved)", old_name, new_name, len(bound))
    return created
