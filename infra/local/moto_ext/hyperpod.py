"""Gap: moto's SageMaker HyperPod has node ids like ``gpu-0`` and no node actions.

Here a cluster's nodes get real-looking EC2 instance ids (``i-`` and 17 hex
digits) and a private DNS name, and three actions exist:

- ``BatchReplaceClusterNodes``: each node goes ShuttingDown, then its id
  disappears and a new instance (new id) appears Pending, then Running. Per
  node ``Failed`` entries: ``InstanceIdNotFound`` for ids the cluster does not
  have, ``InstanceIdInUse`` for nodes already being replaced or rebooted,
  ``InvalidInstanceStatus`` for nodes under a deep health check.
- ``BatchRebootClusterNodes``: Pending, then Running, same id.
- ``StartClusterHealthCheck``: the chosen nodes go DeepHealthCheckInProgress,
  then Running.

Each phase lasts ``timings`` seconds (zero in tests), or until ``advance()``
when its timing is ``None``; timers move the nodes on, so a poller sees what
it would see on AWS. When a replacement reaches
Running, ``hooks.on_node_replaced(cluster, old_id, new_id)`` runs (the stand-in
uses it to swap the Kubernetes node).

Hooks: ``SageMakerModelBackend.create_cluster``, ``ClusterNode.describe``,
and three new actions on ``SageMakerResponse`` and the backend. ``install``
also installs :mod:`sdcguard.infra.local.moto_ext.hyperpod_faults`, the HyperPod calls'
chaos knob (transient throttling and 5xx at a rate).
"""

from __future__ import annotations

import copy
import functools
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moto.core.responses import ActionResult
from moto.core.utils import utcnow
from moto.sagemaker.exceptions import ResourceNotFound, ValidationError
from moto.sagemaker.models import Cluster, ClusterNode, SageMakerModelBackend
from moto.sagemaker.responses import SageMakerResponse

from sdcguard.infra.local.moto_ext import hyperpod_faults

logger = logging.getLogger(__name__)

_original_create_cluster = SageMakerModelBackend.create_cluster
_original_describe_node = ClusterNode.describe


@dataclass
class Timings:
    """Seconds each simulated phase lasts (AWS takes minutes; tests want zero).

    ``None`` holds the phase until ``advance()`` is called, so a test or a
    drill can look at each phase for as long as it likes.
    """

    shutdown_seconds: float | None = 2.0
    pending_seconds: float | None = 5.0
    reboot_seconds: float | None = 3.0
    health_check_seconds: float | None = 5.0


@dataclass
class Hooks:
    """Callbacks into the rest of the stand-in."""

    on_node_replaced: Callable[[str, str, str], None] | None = None


timings = Timings()
hooks = Hooks()
# One lock for every cluster's node table: the timers and the request threads share it.
_lock = threading.RLock()
_busy: dict[tuple[str, str], str] = {}  # (cluster, instance id) -> what is in progress


def new_instance_id() -> str:
    """A fresh EC2-style instance id: ``i-`` and 17 lowercase hex digits."""
    return "i-" + secrets.token_hex(9)[:17]


def _private_ip(instance_id: str) -> str:
    octets = bytes.fromhex(instance_id[2:8])
    return "10." + ".".join(str(b) for b in octets)


def describe_node(self: ClusterNode) -> dict[str, Any]:
    """``ClusterNode.describe`` plus the private address HyperPod reports."""
    details = _original_describe_node(self)
    ip = _private_ip(self.instance_id)
    details["PrivatePrimaryIp"] = ip
    details["PrivateDnsHostname"] = "ip-" + ip.replace(".", "-") + ".ec2.internal"
    return details


def create_cluster(self: SageMakerModelBackend, *args: Any, **kwargs: Any) -> str:
    """``create_cluster`` whose nodes carry instance ids."""
    arn = _original_create_cluster(self, *args, **kwargs)
    cluster_name = kwargs.get("cluster_name") or args[0]
    cluster = self.clusters[cluster_name]
    with _lock:
        renamed: dict[str, ClusterNode] = {}
        for node in cluster.nodes.values():
            node.instance_id = new_instance_id()
            renamed[node.instance_id] = node
        cluster.nodes = renamed
    return str(arn)


def _cluster(backend: SageMakerModelBackend, name_or_arn: str) -> Cluster:
    name = name_or_arn.split("/")[-1] if name_or_arn.startswith("arn:") else name_or_arn
    cluster = backend.clusters.get(name)
    if cluster is None:
        raise ResourceNotFound(message=f"Cluster {name} not found.")
    return cluster


_held: list[Callable[[], None]] = []


def _later(seconds: float | None, step: Callable[[], None]) -> None:
    if seconds is None:
        with _lock:
            _held.append(step)
        return
    timer = threading.Timer(max(0.0, seconds), step)
    timer.daemon = True
    timer.start()


def advance() -> int:
    """End every phase held by a ``None`` timing (one phase per call); returns how many ended."""
    with _lock:
        steps = list(_held)
        _held.clear()
    for step in steps:
        step()
    return len(steps)


def _check(cluster: Cluster, node_ids: list[str]) -> tuple[list[str], list[dict[str, str]]]:
    ok: list[str] = []
    failed: list[dict[str, str]] = []
    for node_id in node_ids:
        node = cluster.nodes.get(node_id)
        if node is None:
            failed.append(
                {
                    "NodeId": node_id,
                    "ErrorCode": "InstanceIdNotFound",
                    "Message": f"Instance {node_id} not found in cluster {cluster.cluster_name}.",
                }
            )
        elif (cluster.cluster_name, node_id) in _busy or node_id in ok:
            what = _busy.get((cluster.cluster_name, node_id), "an action")
            failed.append(
                {
                    "NodeId": node_id,
                    "ErrorCode": "InstanceIdInUse",
                    "Message": f"Instance {node_id} is already in use by {what}.",
                }
            )
        elif node.status != "Running":
            failed.append(
                {
                    "NodeId": node_id,
                    "ErrorCode": "InvalidInstanceStatus",
                    "Message": f"Instance {node_id} is {node.status}.",
                }
            )
        else:
            ok.append(node_id)
    return ok, failed


def _validate_ids(node_ids: list[str] | None) -> list[str]:
    if not node_ids:
        raise ValidationError(message="NodeIds: provide between 1 and 25 node ids.")
    if len(node_ids) > 25:
        raise ValidationError(message=f"NodeIds: {len(node_ids)} ids given, at most 25 allowed.")
    return list(node_ids)


def batch_replace_cluster_nodes(self: SageMakerModelBackend, cluster_name: str, node_ids: list[str]) -> dict[str, Any]:
    """Start replacing each node; the response lists per-node successes and failures."""
    node_ids = _validate_ids(node_ids)
    with _lock:
        cluster = _cluster(self, cluster_name)
        ok, failed = _check(cluster, node_ids)
        for node_id in ok:
            _busy[(cluster.cluster_name, node_id)] = "a replacement"
            cluster.nodes[node_id].status = "ShuttingDown"
            _later(timings.shutdown_seconds, functools.partial(_replace_instance, cluster, node_id))
    return {"Successful": ok, "Failed": failed}


def _replace_instance(cluster: Cluster, old_id: str) -> None:
    with _lock:
        old = cluster.nodes.pop(old_id, None)
        _busy.pop((cluster.cluster_name, old_id), None)
        if old is None:
            return
        new = copy.copy(old)
        new.instance_id = new_instance_id()
        new.status = "Pending"
        new.launch_time = utcnow()
        cluster.nodes[new.instance_id] = new
        _busy[(cluster.cluster_name, new.instance_id)] = "a replacement"
    _later(timings.pending_seconds, functools.partial(_replacement_running, cluster, old_id, new.instance_id))


def _replacement_running(cluster: Cluster, old_id: str, new_id: str) -> None:
    with _lock:
        node = cluster.nodes.get(new_id)
        _busy.pop((cluster.cluster_name, new_id), None)
        if node is None:
            return
        node.status = "Running"
    callback = hooks.on_node_replaced
    if callback is not None:
        try:
            callback(cluster.cluster_name, old_id, new_id)
        except Exception:
            logger.exception("on_node_replaced(%s, %s, %s) failed", cluster.cluster_name, old_id, new_id)


def batch_reboot_cluster_nodes(self: SageMakerModelBackend, cluster_name: str, node_ids: list[str]) -> dict[str, Any]:
    """Start rebooting each node (Pending, then Running under the same id)."""
    node_ids = _validate_ids(node_ids)
    with _lock:
        cluster = _cluster(self, cluster_name)
        ok, failed = _check(cluster, node_ids)
        for node_id in ok:
            _busy[(cluster.cluster_name, node_id)] = "a reboot"
            cluster.nodes[node_id].status = "Pending"
            _later(timings.reboot_seconds, functools.partial(_back_to_running, cluster, node_id))
    return {"Successful": ok, "Failed": failed}


def _back_to_running(cluster: Cluster, node_id: str) -> None:
    with _lock:
        _busy.pop((cluster.cluster_name, node_id), None)
        node = cluster.nodes.get(node_id)
        if node is not None:
            node.status = "Running"


def start_cluster_health_check(
    self: SageMakerModelBackend, cluster_name: str, configurations: list[dict[str, Any]]
) -> str:
    """Put the chosen nodes of each instance group under a deep health check.

    Raises ``ValidationError`` for an unknown instance group or an instance
    outside it; nothing changes then.
    """
    with _lock:
        cluster = _cluster(self, cluster_name)
        chosen: list[ClusterNode] = []
        for config in configurations or []:
            group = config["InstanceGroupName"]
            in_group = [n for n in cluster.nodes.values() if n.instance_group_name == group]
            if not in_group:
                raise ValidationError(message=f"Instance group {group} not found in cluster {cluster.cluster_name}.")
            wanted = config.get("InstanceIds")
            if wanted:
                ids = {n.instance_id for n in in_group}
                missing = [i for i in wanted if i not in ids]
                if missing:
                    raise ValidationError(message=f"Instances {missing} are not in instance group {group}.")
                in_group = [n for n in in_group if n.instance_id in wanted]
            chosen.extend(n for n in in_group if n.status == "Running")
        for node in chosen:
            # Not "in use": a replacement of this node fails on its status (InvalidInstanceStatus).
            node.status = "DeepHealthCheckInProgress"
            _later(timings.health_check_seconds, functools.partial(_back_to_running, cluster, node.instance_id))
        return str(cluster.arn)


def _respond_replace(self: SageMakerResponse) -> ActionResult:
    return ActionResult(
        batch_replace_cluster_nodes(self.sagemaker_backend, self._get_param("ClusterName"), self._get_param("NodeIds"))
    )


def _respond_reboot(self: SageMakerResponse) -> ActionResult:
    return ActionResult(
        batch_reboot_cluster_nodes(self.sagemaker_backend, self._get_param("ClusterName"), self._get_param("NodeIds"))
    )


def _respond_health_check(self: SageMakerResponse) -> ActionResult:
    arn = start_cluster_health_check(
        self.sagemaker_backend, self._get_param("ClusterName"), self._get_param("DeepHealthCheckConfigurations")
    )
    return ActionResult({"ClusterArn": arn})


def install() -> None:
    """Give HyperPod clusters instance ids and the replace/reboot/health-check actions."""
    SageMakerModelBackend.create_cluster = create_cluster  # type: ignore[method-assign]
    ClusterNode.describe = describe_node  # type: ignore[method-assign]
    SageMakerResponse.batch_replace_cluster_nodes = _respond_replace  # type: ignore[attr-defined]
    SageMakerResponse.batch_reboot_cluster_nodes = _respond_reboot  # type: ignore[attr-defined]
    SageMakerResponse.start_cluster_health_check = _respond_health_check  # type: ignore[attr-defined]
    hyperpod_faults.install()
