"""Node replacement through SageMaker HyperPod, and the check the wait loop polls.

``BatchReplaceClusterNodes`` answers per node inside a successful response;
every failure code is handled: ``InstanceIdInUse`` means HyperPod's own
recovery holds the node (we stop and let a human look); a retried request
whose first attempt went through shows up as ``InvalidInstanceStatus`` on a
node already shutting down, or ``InstanceIdNotFound`` once it is gone (both
counted as requested); anything else fails the replacement.

A new node must then qualify (:mod:`sdcguard.lambdas.node_check`); one that fails is
cordoned and its replacement rejected (:func:`reject_unqualified`), and it is
replaced once more while the rounds and the daily limit allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3

from sdcguard.contract import Incident, IncidentState, Replacement
from sdcguard.lambdas.blast_radius import check_replacement
from sdcguard.lambdas.cordon import cordon_node
from sdcguard.lambdas.decide import decided
from sdcguard.lambdas.errors import (
    BlastRadiusExceeded,
    IncidentNotWaiting,
    NodeHeldByHyperPod,
    NotInCluster,
    ReplacementFailed,
)
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lambdas.node_check import REJECTED, checks_of, current_replacements, origin_of
from sdcguard.lambdas.resolve import ClusterNode, list_cluster_nodes

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
    :func:`sdcguard.lambdas.decide.decided`). Under the cluster's lock (the guard's),
    the daily limit is checked again at the moment of asking
    (:func:`sdcguard.lambdas.blast_radius.check_replacement`: approvals that came in
    since the admission count, and an instance another incident already asked
    to replace is refused); ``max_replacements_per_day`` None skips that
    check. A second call for the same instance returns the recorded request and
    asks nothing. A new node of the incident that failed its qualification
    (:func:`reject_unqualified`) is replaced the same way, from REPLACED. Raises :class:`NotInCluster` for an instance the incident
    does not name, :class:`IncidentNotWaiting` if the ledger records no
    approval, :class:`BlastRadiusExceeded` (nothing asked),
    :class:`NodeHeldByHyperPod` and :class:`ReplacementFailed` for refusals,
    :class:`LedgerConflict` when the lock stays taken.
    """
    incident = ledger.update(incident_id, lambda current: decided(current, S.APPROVED))
    once_more = instance_id in rejected_instances(incident)
    if instance_id not in incident.instance_ids and not once_more:
        raise NotInCluster(f"incident {incident_id} does not name instance {instance_id}")
    existing = next((r for r in incident.replacements if r.old_instance_id == instance_id), None)
    if existing is not None:
        return existing
    with ledger.locked(f"guard:{hyperpod_cluster}", owner=f"replace:{incident_id}:{instance_id}") as lease:
        incident = ledger.get(incident_id)
        existing = next((r for r in incident.replacements if r.old_instance_id == instance_id), None)
        if existing is not None:
            return existing
        if incident.state not in (S.APPROVED, S.REPLACING) and not (once_more and incident.state == S.REPLACED):
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
        replacement = _ask_hyperpod(incident, instance_id, hyperpod_cluster, sagemaker or boto3.client("sagemaker"))

        def record(current: Incident) -> Incident:
            if any(r.old_instance_id == instance_id for r in current.replacements):
                return current
            why = " (it failed its qualification)" if once_more else ""
            return current.advance(
                S.REPLACING,
                actor=actor,
                note=f"replacement of {instance_id} requested{why}",
                replacements=[*current.replacements, replacement],
            )

        ledger.update(incident_id, record, lease=lease)
    return replacement


def _ask_hyperpod(incident: Incident, instance_id: str, hyperpod_cluster: str, sagemaker: Any) -> Replacement:
    group = {s.instance_id: s.instance_group for s in incident.suspects}.get(origin_of(incident, instance_id))
    present = sorted(i for i, n in list_cluster_nodes(hyperpod_cluster, sagemaker).items() if n.instance_group == group)
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
    return Replacement(old_instance_id=instance_id, status="Requested", present_before=present)


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


def rejected_instances(incident: Incident) -> set[str]:
    """The new instances of ``incident``'s replacements that failed their qualification (cordoned, to be replaced
    once more or left for a human)."""
    return {r.new_instance_id for r in incident.replacements if r.status == REJECTED and r.new_instance_id}


def find_successors(incident: Incident, nodes: dict[str, ClusterNode]) -> dict[str, ClusterNode | None]:
    """For each replaced instance of ``incident``, the new node that took its place, or None yet.

    A successor is a node of the same instance group (as the suspect it
    ultimately replaces), launched after the latest replacement request, not
    listed in the group when its replacement was asked for, not claimed by
    another replacement of the incident, and not one of the incident's
    suspects. A replacement whose new node was rejected has none:
    that node is being replaced in its turn.
    """
    requested = max((t.at for t in incident.transitions if t.state == S.REPLACING), default=None)
    since = (requested - LAUNCH_SLACK).timestamp() if requested else 0.0
    groups = {s.instance_id: s.instance_group for s in incident.suspects}
    claimed = {r.new_instance_id for r in incident.replacements if r.new_instance_id}
    suspects = set(incident.instance_ids)
    out: dict[str, ClusterNode | None] = {}
    for replacement in incident.replacements:
        if replacement.status == REJECTED:
            continue
        if replacement.new_instance_id:
            out[replacement.old_instance_id] = nodes.get(replacement.new_instance_id)
            continue
        candidates = sorted(
            (
                n
                for n in nodes.values()
                if n.instance_id not in suspects
                and n.instance_id not in claimed
                and n.instance_id not in replacement.present_before
                and n.instance_group == groups.get(origin_of(incident, replacement.old_instance_id), n.instance_group)
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
            r
            if r.status == REJECTED
            else Replacement(old_instance_id=r.old_instance_id, new_instance_id=successors[r.old_instance_id].instance_id, status="Running")  # type: ignore[union-attr]
            for r in current.replacements
        ]
        note = ", ".join(f"{r.old_instance_id} -> {r.new_instance_id}" for r in updated if r.status != REJECTED)
        return current.advance(S.REPLACED, actor=actor, note=note, replacements=updated)

    ledger.update(incident_id, record)
    return ReplacementProgress(done=True, failed=False, pending=[])


@dataclass(frozen=True)
class Rejection:
    """What :func:`reject_unqualified` did and decided."""

    replace_again: bool
    instance_ids: list[str]
    """The new instances that failed their qualification: cordoned, their replacements marked rejected."""
    reason: str


def reject_unqualified(
    ledger: Ledger,
    api: Any,
    incident_id: str,
    *,
    hyperpod_cluster: str,
    max_rounds: int,
    max_replacements_per_day: int,
    actor: str = "reject_replacement",
) -> Rejection:
    """Cordon each new node that failed its qualification (any mismatch, or no answer), mark its replacement
    rejected, and decide whether it may be replaced once more.

    Once more only while fewer than ``max_rounds`` replacement rounds were made
    and the daily limit allows one more replacement per rejected node (the rule
    of :func:`sdcguard.lambdas.blast_radius.check_replacement`, which replace applies
    again at the moment of asking). Either way the job is never resumed onto a
    rejected node: it stays cordoned. Idempotent through the ledger (a retry
    answers the same; the next round's call sees only that round's nodes). Raises
    :class:`IncidentNotWaiting` unless the incident's replacements run
    (REPLACED), :class:`KubernetesObjectMissing` and
    :class:`TransientKubernetesError` from the cordon.
    """
    incident = ledger.get(incident_id)
    if incident.state != S.REPLACED:
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; a replacement is rejected once it runs")
    # This round's new nodes: those standing, and those rejected but not yet asked to be replaced (a retried
    # call answers as the first did; a later round's call no longer sees them).
    replaced_again = {r.old_instance_id for r in incident.replacements}
    this_round = {r.new_instance_id for r in current_replacements(incident)} | (rejected_instances(incident) - replaced_again)
    failed = [c for c in checks_of(incident, "qualify") if c.instance_id in this_round and c.state in ("failed", "inconclusive")]
    rejected = sorted({c.instance_id for c in failed if c.instance_id})
    if not rejected:
        return Rejection(False, [], "no new node failed its qualification")
    for check in failed:
        cordon_node(api, check.node, incident_id)

    def record(current: Incident) -> Incident:
        if not any(r.new_instance_id in rejected and r.status != REJECTED for r in current.replacements):
            return current
        marked = [
            r.model_copy(update={"status": REJECTED}) if r.new_instance_id in rejected else r for r in current.replacements
        ]
        return current.advance(current.state, actor=actor, replacements=marked)

    incident = ledger.update(incident_id, record)
    what = "; ".join(c.summary for c in failed)
    rounds = sum(1 for t in incident.transitions if t.state == S.REPLACING)
    if rounds >= max_rounds:
        return Rejection(
            False, rejected, f"{what}; cordoned. {rounds} replacement round(s) made, the limit is {max_rounds}: "
            "stopping for attention, the job stays suspended",
        )  # fmt: skip
    others = ledger.counting(hyperpod_cluster)
    now = datetime.now(UTC)
    planned = incident
    for instance_id in rejected:
        why = check_replacement(planned, instance_id, others, max_replacements_per_day=max_replacements_per_day, now=now)
        if why is not None:
            return Rejection(False, rejected, f"{what}; cordoned. Replacing once more would break a limit: {why}")
        planned = planned.model_copy(update={"replacements": [*planned.replacements, Replacement(old_instance_id=instance_id)]})
    return Rejection(True, rejected, f"{what}; cordoned, replacing once more (round {rounds + 1} of {max_rounds})")
