"""Server-side printing: ``Table`` answers for ``kubectl get``.

kubectl asks for ``application/json;as=Table;v=v1;g=meta.k8s.io`` and prints
the columns the server chooses (``-o wide`` adds those of priority 1). The
columns and cell values follow the API server's own printers for nodes, pods,
namespaces, events, Jobs and RBAC objects, and the Kubeflow CRD's ``additionalPrinterColumns``
for PyTorchJobs, so the output reads as it does against EKS.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from sdcguard.infra.local.eks.resources import (
    CLUSTER_ROLE_BINDINGS,
    CLUSTER_ROLES,
    EVENTS,
    JOBS,
    NAMESPACES,
    NODES,
    PODS,
    PYTORCHJOBS,
    ROLE_BINDINGS,
    ROLES,
    Resource,
)

TABLE_VERSIONS = ("v1", "v1beta1")
_ROLE_PREFIX = "node-role.kubernetes.io/"

Column = tuple[str, str, int, str]  # name, type, priority, description


def table_version(accept: str | None) -> str | None:
    """The ``meta.k8s.io`` Table version the ``Accept`` header asks for first, or None when it wants plain objects."""
    for media_range in (accept or "").split(","):
        params = dict(
            part.strip().partition("=")[::2] for part in media_range.split(";")[1:] if "=" in part
        )
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io" and params.get("v") in TABLE_VERSIONS:
            return params["v"]
    return None


def human_duration(seconds: float) -> str:
    """An age as kubectl prints it (``45s``, ``3m20s``, ``5h``, ``12d``), like apimachinery's HumanDuration."""
    if seconds < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    s = int(seconds)
    if s < 60 * 2:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        rest = s % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 60 * 3:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rest = hours % 24
        return f"{hours // 24}d{rest}h" if rest else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def _age(obj: dict[str, Any], now: dt.datetime) -> str:
    stamp = (obj.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return "<unknown>"
    created = dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    return human_duration((now - created).total_seconds())


def _node_cells(node: dict[str, Any], now: dt.datetime) -> list[Any]:
    spec, status = node.get("spec") or {}, node.get("status") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    state = "Unknown" if ready is None else ("Ready" if ready.get("status") == "True" else "NotReady")
    if spec.get("unschedulable"):
        state += ",SchedulingDisabled"
    roles = sorted(key[len(_ROLE_PREFIX) :] for key in labels if key.startswith(_ROLE_PREFIX))
    if labels.get("kubernetes.io/role"):
        roles.append(labels["kubernetes.io/role"])
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    info = status.get("nodeInfo") or {}
    return [
        node["metadata"]["name"],
        state,
        ",".join(roles) or "<none>",
        _age(node, now),
        info.get("kubeletVersion", ""),
        addresses.get("InternalIP") or "<none>",
        addresses.get("ExternalIP") or "<none>",
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


def _pod_cells(pod: dict[str, Any], now: dt.datetime) -> list[Any]:
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    containers = spec.get("containers") or []
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for s in statuses if s.get("ready"))
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    reason = status.get("reason") or status.get("phase") or "Unknown"
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        reason = "Terminating"
    gates = spec.get("readinessGates") or []
    return [
        pod["metadata"]["name"],
        f"{ready}/{len(containers)}",
        reason,
        str(restarts),
        _age(pod, now),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
        status.get("nominatedNodeName") or "<none>",
        f"{len(gates)}/{len(gates)}" if gates else "<none>",
    ]


def _namespace_cells(namespace: dict[str, Any], now: dt.datetime) -> list[Any]:
    phase = (namespace.get("status") or {}).get("phase") or "Active"
    return [namespace["metadata"]["name"], phase, _age(namespace, now)]


def _event_cells(event: dict[str, Any], now: dt.datetime) -> list[Any]:
    involved = event.get("involvedObject") or {}
    kind, name = involved.get("kind", ""), involved.get("name", "")
    return [
        event.get("lastTimestamp") or "<unknown>",
        event.get("type", ""),
        event.get("reason", ""),
        f"{kind.lower()}/{name}" if kind else name,
        event.get("message", ""),
    ]


def _pytorchjob_cells(job: dict[str, Any], now: dt.datetime) -> list[Any]:
    # The CRD's State column is the jsonPath .status.conditions[-1:].type.
    conditions = (job.get("status") or {}).get("conditions") or []
    return [job["metadata"]["name"], conditions[-1].get("type", "") if conditions else "", _age(job, now)]


def _stamp(value: str | None) -> dt.datetime | None:
    return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC) if value else None


def _job_cells(job: dict[str, Any], now: dt.datetime) -> list[Any]:
    # As the API server's Job printer (1.31): the last true Complete/Failed condition, else Running.
    spec, status = job.get("spec") or {}, job.get("status") or {}
    state = "Running"
    for condition in status.get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in ("Complete", "Failed"):
            state = condition["type"]
    started, finished = _stamp(status.get("startTime")), _stamp(status.get("completionTime"))
    duration = human_duration(((finished or now) - started).total_seconds()) if started else ""
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    selector = ",".join(f"{k}={v}" for k, v in ((spec.get("selector") or {}).get("matchLabels") or {}).items())
    return [
        job["metadata"]["name"],
        state,
        f"{status.get('succeeded', 0)}/{spec.get('completions', 1)}",
        duration,
        _age(job, now),
        ",".join(c.get("name", "") for c in containers),
        ",".join(c.get("image", "") for c in containers),
        selector or "<none>",
    ]


def _cluster_role_cells(role: dict[str, Any], now: dt.datetime) -> list[Any]:
    return [role["metadata"]["name"], role["metadata"].get("creationTimestamp", "")]


def _binding_cells(binding: dict[str, Any], now: dt.datetime) -> list[Any]:
    ref = binding.get("roleRef") or {}
    subjects = binding.get("subjects") or []

    def names(kind: str) -> str:
        return ", ".join(s.get("name", "") for s in subjects if s.get("kind") == kind)

    return [
        binding["metadata"]["name"],
        f"{ref.get('kind', '')}/{ref.get('name', '')}",
        _age(binding, now),
        names("User"),
        names("Group"),
        names("ServiceAccount"),
    ]


def _default_cells(obj: dict[str, Any], now: dt.datetime) -> list[Any]:
    return [obj["metadata"]["name"], _age(obj, now)]


_NAME: Column = ("Name", "string", 0, "Name must be unique within a namespace.")
_AGE: Column = ("Age", "string", 0, "CreationTimestamp is a timestamp representing the server time when this object was created.")
Printer = tuple[tuple[Column, ...], Callable[[dict[str, Any], dt.datetime], list[Any]]]
# By (group, plural): Resource holds a dict and is not hashable.
_PRINTERS: dict[tuple[str, str], Printer] = {
    (NODES.group, NODES.plural): (
        (
            _NAME,
            ("Status", "string", 0, "The status of the node"),
            ("Roles", "string", 0, "The roles of the node"),
            _AGE,
            ("Version", "string", 0, "Kubelet Version reported by the node."),
            ("Internal-IP", "string", 1, "List of internal IPs for the node."),
            ("External-IP", "string", 1, "List of external IPs for the node."),
            ("OS-Image", "string", 1, "OS Image reported by the node from /etc/os-release."),
            ("Kernel-Version", "string", 1, "Kernel Version reported by the node from 'uname -r'."),
            ("Container-Runtime", "string", 1, "Container Runtime Version reported by the node."),
        ),
        _node_cells,
    ),
    (PODS.group, PODS.plural): (
        (
            _NAME,
            ("Ready", "string", 0, "The aggregate readiness state of this pod for accepting traffic."),
            ("Status", "string", 0, "The aggregate status of the containers in this pod."),
            ("Restarts", "string", 0, "The number of times the containers in this pod have been restarted."),
            _AGE,
            ("IP", "string", 1, "IP address allocated to the pod."),
            ("Node", "string", 1, "Name of the node this pod is assigned to."),
            ("Nominated Node", "string", 1, "Name of the node this pod is nominated to run on."),
            ("Readiness Gates", "string", 1, "The readiness gates of this pod."),
        ),
        _pod_cells,
    ),
    (NAMESPACES.group, NAMESPACES.plural): (
        (_NAME, ("Status", "string", 0, "The status of the namespace"), _AGE),
        _namespace_cells,
    ),
    (EVENTS.group, EVENTS.plural): (
        (
            ("Last Seen", "string", 0, "The last time the event was seen."),
            ("Type", "string", 0, "Type of this event."),
            ("Reason", "string", 0, "Why the action was taken."),
            ("Object", "string", 0, "The object this event is about."),
            ("Message", "string", 0, "A human-readable description of the status of this operation."),
        ),
        _event_cells,
    ),
    (JOBS.group, JOBS.plural): (
        (
            _NAME,
            ("Status", "string", 0, "Status of the job."),
            ("Completions", "string", 0, "The completion status of the job."),
            ("Duration", "string", 0, "Time required to complete the job."),
            _AGE,
            ("Containers", "string", 1, "Names of each container in the template."),
            ("Images", "string", 1, "Images referenced by each container in the template."),
            ("Selector", "string", 1, "Selector used for matching pods."),
        ),
        _job_cells,
    ),
    (CLUSTER_ROLES.group, CLUSTER_ROLES.plural): (
        (_NAME, ("Created At", "date", 0, "")),
        _cluster_role_cells,
    ),
    (CLUSTER_ROLE_BINDINGS.group, CLUSTER_ROLE_BINDINGS.plural): (
        (
            _NAME,
            ("Role", "string", 0, ""),
            _AGE,
            ("Users", "string", 1, ""),
            ("Groups", "string", 1, ""),
            ("ServiceAccounts", "string", 1, ""),
        ),
        _binding_cells,
    ),
    (ROLES.group, ROLES.plural): (
        (_NAME, ("Created At", "date", 0, "")),
        _cluster_role_cells,
    ),
    (ROLE_BINDINGS.group, ROLE_BINDINGS.plural): (
        (
            _NAME,
            ("Role", "string", 0, ""),
            _AGE,
            ("Users", "string", 1, ""),
            ("Groups", "string", 1, ""),
            ("ServiceAccounts", "string", 1, ""),
        ),
        _binding_cells,
    ),
    (PYTORCHJOBS.group, PYTORCHJOBS.plural): (
        (_NAME, ("State", "string", 0, ""), ("Age", "date", 0, "")),
        _pytorchjob_cells,
    ),
}


def _row_object(obj: dict[str, Any], include_object: str) -> dict[str, Any] | None:
    if include_object == "None":
        return None
    if include_object == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata", {})}


def to_table(
    resource: Resource,
    objects: list[dict[str, Any]],
    list_metadata: dict[str, Any],
    *,
    version: str = "v1",
    include_object: str = "Metadata",
    now: dt.datetime | None = None,
) -> dict[str, Any]:
    """A ``Table`` of ``objects`` with the resource's columns.

    ``include_object`` is the request's ``includeObject`` (``None``,
    ``Metadata``, the default, or ``Object``); raises ValueError for anything
    else.
    """
    if include_object not in ("None", "Metadata", "Object"):
        raise ValueError(f"includeObject must be None, Metadata or Object, got {include_object!r}")
    now = now or dt.datetime.now(dt.UTC)
    # Any other kind prints as a custom resource without printer columns does.
    columns, cells = _PRINTERS.get((resource.group, resource.plural), ((_NAME, _AGE), _default_cells))
    rows = []
    for obj in objects:
        row: dict[str, Any] = {"cells": cells(obj, now)}
        embedded = _row_object(obj, include_object)
        if embedded is not None:
            row["object"] = embedded
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": f"meta.k8s.io/{version}",
        "metadata": list_metadata,
        "columnDefinitions": [
            {"name": name, "type": kind, "format": "name" if name == "Name" else "", "description": text, "priority": priority}
            for name, kind, priority, text in columns
        ],
        "rows": rows,
    }
