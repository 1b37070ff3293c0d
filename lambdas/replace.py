"""Node replacement through SageMaker HyperPod, and the check the wait loop polls.

``BatchReplaceClusterNodes`` answers per node inside a successful response;
every failure code is handled: ``InstanceIdInUse`` means HyperPod's own
recovery holds the node (we stop and let a human look); a retried request
whose first attempt went through shows up as ``InvalidInstanceStatus`` on a
node already shutting down, or ``InstanceIdNotFound`` once it is gone (both
counted as requested); anything else fails the replacement.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3

from contract import Incident, IncidentState, Replacement
from lambdas.blast_radius import check_replacement
from lambdas.decide import decided
from lambdas.errors import (
    BlastRadiusExceeded,
    IncidentNotWaiting,
    NodeHeldByHyperPod,
    NotInCluster,
    ReplacementFailed,
)
from lambdas.ledger import Ledger
from lambdas.resolve import ClusterNode, list_cluster_nodes

S = IncidentState
GOING_AWAY = frozenset({"ShuttingDown", "Terminating", "Terminated", "Deleting", "Replacing"})
LAUNCH_SLACK = timedelta(seconds=5)


def request_replacement(
    ledger: Ledger,
    incident_id: str,
    instance_id: str,
    *,
    hyperpod_cluster: str,
    max_replacements_per_day: int | None = None,
    sagemaker: Any = None,
    actor: str = "replace",
) -> Replacement:
    """Ask HyperPod to replace ``instance_id`` of the approved incident, once.

    Acts only on an approval the decide function wrote to the ledger (see
    :func:`lambdas.decide.decided`). Under the cluster's lock (the guard's),
    the daily limit is checked again at the moment of asking
    (:func:`lambdas.blast_radius.check_replacement`: approvals that came in
    since the admission count, and an instance another incident already asked
    to replace is refused); ``max_replacements_per_day`` None skips that
    check. A second call for the same instance returns the recorded request and
    asks nothing. Raises :class:`NotInCluster` for an instance the incident
    does not name, :class:`IncidentNotWaiting` if the ledger records no
    approval, :class:`BlastRadiusExceeded` (nothing asked),
    :class:`NodeHeldByHyperPod` and :class:`ReplacementFailed` for refusals,
    :class:`LedgerConflict` when the lock stays taken.
    """
    incident = ledger.update(incident_id, lambda current: decided(current, S.APPROVED))
    if instance_id not in incident.instance_ids:
        raise NotInCluster(f"incident {incident_id} does not name instance {instance_id}")
    existing = next((r for r in incident.replacements if r.old_instance_id == instance_id), None)
    if existing is not None:
        return existing
    with ledger.locked(f"guard:{hyperpod_cluster}", owner=f"replace:{incident_id}:{instance_id}") as lease:
        incident = ledger.get(incident_id)
        existing = next((r for r in incident.replacements if r.old_instance_id == instance_id), None)
        if existing is not None:
            return existing
        if incident.state not in (S.APPROVED, S.REPLACING):
            raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; only an approved incident is replaced")
        if max_replacements_per_day is not None:
            why = check_replacement(
                incident,
                instance_id,
                ledger.counting(hyperpod_cluster, lease=lease),
                max_replacements_per_day=max_replacements_per_day,
                now=datetime.now(UTC),
            )
            if why is not None:
                raise BlastRadiusExceeded(f"incident {incident_id}: {why}; nothing was replaced")
        replacement = _ask_hyperpod(instance_id, hyperpod_cluster, sagemaker or boto3.client("sagemaker"))

        def record(current: Incident) -> Incident:
            if any(r.old_instance_id == instance_id for r in current.replacements):
                return current
            return current.advance(
                S.REPLACING,
                actor=actor,
                note=f"replacement of {instance_id} requested",
                replacements=[*current.replacements, replacement],
            )

        ledger.update(incident_id, record, lease=lease)
    return replacement


def _ask_hyperpod(instance_id: str, hyperpod_cluster: str, sagemaker: Any) -> Replacement:
    response = sagemaker.batch_replace_cluster_nodes(ClusterName=hyperpod_cluster, NodeIds=[instance_id])
    for failed in response.get("Failed", []):
        if failed.get("NodeId") != instance_id:
            continue
        code, message = failed.get("ErrorCode", ""), failed.get("Message", "")
        if code == "InstanceIdInUse":
            raise NodeHeldByHyperPod(f"{instance_id}: HyperPod's own recovery holds the node ({message})")
        if code in ("InvalidInstanceStatus", "InstanceIdNotFound") and _going_away(
            instance_id, hyperpod_cluster, sagemaker
        ):
            # Resolve confirmed the instance was in the cluster, and no other incident asked to
            # replace it (checked under the lock): shutting down or gone means an earlier attempt's
            # request went through.
            break
        raise ReplacementFailed(f"{instance_id}: {code or 'unknown error'}: {message}")
    return Replacement(old_instance_id=instance_id, status="Requested")


def _going_away(instance_id: str, cluster: str, sagemaker: Any) -> bool:
    node = list_cluster_nodes(cluster, sagemaker).get(instance_id)
    return node is None or node.status in GOING_AWAY


@dataclass(frozen=True)
class ReplacementProgress:
    """Where the replacements of an incident stand."""

    done: bool
    failed: bool
    pending: list[str]
    """Old instance ids still without a running successor."""


def find_successors(incident: Incident, nodes: dict[str, ClusterNode]) -> dict[str, ClusterNode | None]:
    """For each replaced instance of ``incident``, the new node that took its place, or None yet.

    A successor is a node of the same instance group, launched after the
    replacement was requested, not claimed by another replacement of the
    incident, and not one of the incident's suspects.
    """
    requested = incident.entered(S.REPLACING)
    since = (requested - LAUNCH_SLACK).timestamp() if requested else 0.0
    groups = {s.instance_id: s.instance_group for s in incident.suspects}
    claimed = {r.new_instance_id for r in incident.replacements if r.new_instance_id}
    suspects = set(incident.instance_ids)
    out: dict[str, ClusterNode | None] = {}
    for replacement in incident.replacements:
        if replacement.new_instance_id:
            out[replacement.old_instance_id] = nodes.get(replacement.new_instance_id)
            continue
        candidates = sorted(
            (
                n
                for n in nodes.values()
                if n.instance_id not in suspects
                and n.instance_id not in claimed
                and n.instance_group == groups.get(replacement.old_instance_id, n.instance_group)
                and n.launch_time >= since
            ),
            key=lambda n: (n.launch_time, n.instance_id),
        )
        out[replacement.old_instance_id] = candidates[0] if candidates else None
        if candidates:
            claimed.add(candidates[0].instance_id)
    return out


def replacement_status(
    ledger: Ledger, incident_id: str, *, hyperpod_cluster: str, sagemaker: Any = None, actor: str = "replacement_status"
) -> ReplacementProgress:
    """Check HyperPod for the incident's replacements; record the new instances once all run.

    ``failed`` is True when a successor or a suspect reports ``Failure``.
    """
    incident = ledger.get(incident_id)
    if incident.state != S.REPLACING:
        # Already recorded as replaced (a retried poll), or stopped meanwhile.
        done = incident.entered(S.REPLACED) is not None
        return ReplacementProgress(done=done, failed=not done and incident.state.terminal, pending=[])
    nodes = list_cluster_nodes(hyperpod_cluster, sagemaker)
    successors = find_successors(incident, nodes)
    failed = any(n is not None and n.status == "Failure" for n in successors.values()) or any(
        nodes[i].status == "Failure" for i in incident.instance_ids if i in nodes
    )
    pending = sorted(old for old, new in successors.items() if new is None or new.status != "Running")
    if failed or pending:
        return ReplacementProgress(done=False, failed=failed, pending=pending)

    def record(current: Incident) -> Incident:
        if current.state != S.REPLACING:
            return current
        updated = [
            Replacement(old_instance_id=r.old_instance_id, new_instance_id=successors[r.old_instance_id].instance_id, status="Running")  # type: ignore[union-attr]
            for r in current.replacements
        ]
        note = ", ".join(f"{r.old_instance_id} -> {r.new_instance_id}" for r in updated)
        return current.advance(S.REPLACED, actor=actor, note=note, replacements=updated)

    ledger.update(incident_id, record)
    return ReplacementProgress(done=True, failed=False, pending=[])
