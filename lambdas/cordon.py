"""Cordon and uncordon a suspect node through the Kubernetes API.

Cordoning sets ``spec.unschedulable``, adds a ``NoSchedule`` taint whose value
names the incident, and annotates the node with the incident and whether the
node was already unschedulable, so that uncordoning restores exactly what was
there before and never frees a node someone else cordoned.

Several incidents may hold one node (two faults on one GPU, alarms of two
windows): the node carries one taint, and ``sdcguard.io/held-by`` lists every
incident that cordoned it (set when a second one comes; one holder is the
one the taint names). Uncordoning for one incident drops it from that
list; the node goes back into service only when no incident listed there is
still open (the caller says which are), as the job's suspension does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client as k8s

from sdcguard.contract import IncidentState
from sdcguard.contract.naming import instance_id_of
from sdcguard.lambdas.errors import IncidentNotWaiting, NotInCluster
from sdcguard.lambdas.kube_errors import kubernetes_errors
from sdcguard.lambdas.ledger import Ledger

S = IncidentState

TAINT_KEY = "sdcguard.io/quarantine"
ANNOTATION_INCIDENT = "sdcguard.io/incident"
ANNOTATION_AT = "sdcguard.io/cordoned-at"
ANNOTATION_WAS_UNSCHEDULABLE = "sdcguard.io/was-unschedulable"
ANNOTATION_HELD_BY = "sdcguard.io/held-by"
"""The incidents holding the node cordoned, comma-separated, in the order they came; only while there are two
or more (one holder is the one our taint names)."""


@dataclass(frozen=True)
class NodeChange:
    """What a cordon or uncordon did to one node."""

    node: str
    changed: bool
    """False when the node already was in the wanted state (a retry, or another incident's cordon)."""
    held_by: tuple[str, ...] = ()
    """The incidents holding the node cordoned afterwards."""


def _taints(node: Any) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in {"key": t.key, "value": t.value, "effect": t.effect}.items() if v is not None}
        for t in (node.spec.taints or [])
    ]


def holders(node: Any) -> list[str]:
    """The incidents holding ``node`` cordoned: :data:`ANNOTATION_HELD_BY`, else (a node cordoned before the
    list was kept) the incident our taint names."""
    listed = (node.metadata.annotations or {}).get(ANNOTATION_HELD_BY)
    if listed:
        return [h for h in listed.split(",") if h]
    return [t.value for t in (node.spec.taints or []) if t.key == TAINT_KEY and t.value]


def cordon_node(api: k8s.ApiClient, node_name: str, incident_id: str) -> NodeChange:
    """Make ``node_name`` unschedulable with sdcguard's taint and annotations naming ``incident_id``.

    Idempotent: a node that already carries our taint is left cordoned as it is, ``incident_id`` added to its
    holders. Raises :class:`KubernetesObjectMissing` and :class:`TransientKubernetesError`.
    """
    core = k8s.CoreV1Api(api)
    with kubernetes_errors(f"node {node_name}"):
        node = core.read_node(node_name)
        taints = _taints(node)
        if any(t["key"] == TAINT_KEY for t in taints):
            held = holders(node)
            if incident_id not in held:
                held.append(incident_id)
                core.patch_node(node_name, {"metadata": {"annotations": {ANNOTATION_HELD_BY: ",".join(held)},
                                                         "resourceVersion": node.metadata.resource_version}})
            return NodeChange(node_name, changed=False, held_by=tuple(held))
        annotations = {
            ANNOTATION_INCIDENT: incident_id,
            ANNOTATION_AT: datetime.now(UTC).isoformat(),
            ANNOTATION_WAS_UNSCHEDULABLE: "true" if node.spec.unschedulable else "false",
        }
        body = {
            # The taints are a whole list written back: with the version read, a taint someone else
            # added meanwhile makes the API server answer 409 (retried) instead of being dropped.
            "metadata": {"annotations": annotations, "resourceVersion": node.metadata.resource_version},
            "spec": {
                "unschedulable": True,
                "taints": [*taints, {"key": TAINT_KEY, "value": incident_id, "effect": "NoSchedule"}],
            },
        }
        core.patch_node(node_name, body)
    return NodeChange(node_name, changed=True, held_by=(incident_id,))


HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
"""HyperPod's health label: anything but ``Schedulable`` means HyperPod itself keeps the node out of use."""


NODE_CONTROLLER_TAINTS = frozenset(
    f"node.kubernetes.io/{name}"
    for name in ("unschedulable", "not-ready", "unreachable", "memory-pressure", "disk-pressure", "pid-pressure", "network-unavailable")
)
"""Taints Kubernetes' node lifecycle controller keeps in step with the node and removes itself.

``unschedulable`` mirrors ``spec.unschedulable``, so our own cordon puts it
there; the others mirror the node's conditions. Counted as someone else's
hold, the first would keep every node we cordoned cordoned after release,
and the others would leave a node cordoned by nobody once a passing
condition clears. ``node.kubernetes.io/out-of-service`` is not among them:
an administrator sets it."""


def held_by_others(node: Any) -> bool:
    """Whether someone other than sdcguard keeps ``node`` out of scheduling now: another NoSchedule or
    NoExecute taint (not one the node lifecycle controller derives), or HyperPod's health label saying it
    is not schedulable."""
    others = [
        t
        for t in (node.spec.taints or [])
        if t.key != TAINT_KEY and t.key not in NODE_CONTROLLER_TAINTS and t.effect in ("NoSchedule", "NoExecute")
    ]
    health = (node.metadata.labels or {}).get(HEALTH_LABEL)
    return bool(others) or (health is not None and health != "Schedulable")


def uncordon_node(
    api: k8s.ApiClient, node_name: str, incident_id: str, *, still_open: Callable[[str], bool] = lambda _: True
) -> NodeChange:
    """Undo :func:`cordon_node` for ``incident_id``: drop it from the node's holders and, when no other holder
    is ``still_open`` (default: every one listed is), remove our taint and annotations and restore
    ``unschedulable`` to what it was before. While another holder remains, the node stays cordoned under
    our taint, now naming that holder.

    ``unschedulable`` stays set when it was set before us, or when someone else
    holds the node now (:func:`held_by_others`). A ``kubectl cordon`` during
    the incident changes nothing on the node and cannot be told apart from
    ours: to keep a node out past a release, add a taint of your own.
    A node not cordoned by this incident is left untouched; a node that no
    longer exists (replaced) counts as done. Raises :class:`TransientKubernetesError`.
    """
    core = k8s.CoreV1Api(api)
    with kubernetes_errors(f"node {node_name}"):
        try:
            node = core.read_node(node_name)
        except k8s.exceptions.ApiException as exc:
            if exc.status == 404:
                return NodeChange(node_name, changed=False)
            raise
        taints = _taints(node)
        held = holders(node)
        if incident_id not in held or not any(t["key"] == TAINT_KEY for t in taints):
            return NodeChange(node_name, changed=False, held_by=tuple(held))
        others = [h for h in held if h != incident_id and still_open(h)]
        if others:
            body = {
                # One holder left: the taint names it, as a node one incident cordoned carries it.
                "metadata": {"annotations": {ANNOTATION_HELD_BY: ",".join(others) if len(others) > 1 else None,
                                             ANNOTATION_INCIDENT: others[0]},
                             "resourceVersion": node.metadata.resource_version},
                "spec": {"taints": [({**t, "value": others[0]} if t["key"] == TAINT_KEY else t) for t in taints]},
            }
            core.patch_node(node_name, body)
            return NodeChange(node_name, changed=False, held_by=tuple(others))
        annotations = node.metadata.annotations or {}
        # Unschedulable before us, or held by someone else since (their taint, HyperPod's health label):
        # theirs stays; only what sdcguard added goes.
        keep = annotations.get(ANNOTATION_WAS_UNSCHEDULABLE) == "true" or held_by_others(node)
        body = {
            "metadata": {
                "annotations": {ANNOTATION_INCIDENT: None, ANNOTATION_AT: None, ANNOTATION_WAS_UNSCHEDULABLE: None,
                                ANNOTATION_HELD_BY: None},
                "resourceVersion": node.metadata.resource_version,
            },
            "spec": {
                "unschedulable": keep,
                # The taint of whichever listed holder it named (each of them has ended).
                "taints": [t for t in taints if not (t["key"] == TAINT_KEY and t.get("value") in (*held, incident_id))],
            },
        }
        core.patch_node(node_name, body)
    return NodeChange(node_name, changed=True)


def cordon_for_incident(
    ledger: Ledger, api: k8s.ApiClient, incident_id: str, instance_id: str, *, actor: str = "cordon"
) -> NodeChange:
    """Cordon the node of ``instance_id`` for the incident and record it (SUSPENDED -> CORDONED).

    Raises :class:`NotInCluster` (the incident does not name the instance) and
    :class:`IncidentNotWaiting` (the incident is not at the containment
    stage), changing nothing.
    """
    incident = ledger.get(incident_id)
    suspect = next((s for s in incident.suspects if s.instance_id == instance_id), None)
    if suspect is None:
        raise NotInCluster(f"incident {incident_id} does not name instance {instance_id}")
    named = instance_id_of(suspect.node)
    if named is not None and named != instance_id:  # a HyperPod node name carries its instance: they must agree
        raise NotInCluster(f"incident {incident_id}: node {suspect.node} is not the node of instance {instance_id}")
    if incident.state not in (S.SUSPENDED, S.CORDONED):
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; cordoning follows the job's suspension")
    change = cordon_node(api, suspect.node, incident_id)
    note = f"cordoned {suspect.node}" + ("" if change.changed else " (already cordoned)")
    ledger.update(
        incident_id,
        lambda current: current if current.state != S.SUSPENDED else current.advance(S.CORDONED, actor=actor, note=note),
    )
    return change
