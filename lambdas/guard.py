"""Blast-radius arithmetic: how many nodes sdcguard may hold and replace at once.

Pure functions over the ledger's incidents, so the limits can be tested
without AWS.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from kubernetes import client as k8s

from contract import Incident, IncidentState
from lambdas.cordon import TAINT_KEY
from lambdas.errors import BlastRadiusExceeded
from lambdas.kube_errors import kubernetes_errors
from lambdas.ledger import STOPPED_HOLDING, Ledger

if TYPE_CHECKING:
    from lambdas.ledger import Lease

S = IncidentState
# States in which an incident's nodes are (or are about to be) cordoned by us.
# NEEDS_ATTENTION, CONTAINED and FAILED may leave the node cordoned for a
# human (they count until the node is seen released); after REPLACED the node
# is gone and no longer counts.
HOLDING = frozenset(
    {
        S.GUARDED,
        S.SUSPENDED,
        S.CORDONED,
        S.EVIDENCE_COLLECTED,
        S.AWAITING_APPROVAL,
        S.APPROVED,
        S.REJECTED,
        S.REPLACING,
        S.CONTAINED,
        S.NEEDS_ATTENTION,
        S.FAILED,
    }
)
DAY = timedelta(hours=24)


@dataclass(frozen=True)
class Verdict:
    """Whether a new incident may go ahead, with the numbers behind the answer."""

    allowed: bool
    quarantined: int
    """Nodes held by other incidents of the cluster."""
    replacements_last_day: int
    """Replacements requested by other incidents in the last 24 hours."""
    reason: str


def stopped_holding(incident: Incident) -> bool:
    """Whether ``incident`` ended (NEEDS_ATTENTION, CONTAINED, FAILED) possibly leaving its nodes cordoned."""
    if incident.state not in STOPPED_HOLDING or incident.nodes_released_at is not None:
        return False
    # CONTAINED always passed the cordon; the others only count if the guard had admitted them.
    return incident.state == S.CONTAINED or bool(incident.entered(S.CORDONED) or incident.entered(S.GUARDED))


def quarantined_nodes(incidents: Iterable[Incident], *, exclude: str, released: Collection[str] = ()) -> set[str]:
    """Nodes held by sdcguard quarantine, from incidents other than ``exclude``.

    A stopped incident's node counts until it is seen ``released`` (no
    sdcguard taint any more, or gone); an open incident's always counts.
    """
    held: set[str] = set()
    for incident in incidents:
        if incident.incident_id == exclude or incident.state not in HOLDING:
            continue
        if incident.state in STOPPED_HOLDING:
            if stopped_holding(incident):
                held.update(s.node for s in incident.suspects if s.node not in released)
            continue
        held.update(s.node for s in incident.suspects)
    return held


def released_nodes(api: k8s.ApiClient, nodes: Iterable[str]) -> set[str]:
    """Those of ``nodes`` no longer under sdcguard quarantine: gone, or without sdcguard's taint.

    Raises :class:`TransientKubernetesError`; an unreadable node is never taken as released.
    """
    core = k8s.CoreV1Api(api)
    out: set[str] = set()
    for name in sorted(set(nodes)):
        with kubernetes_errors(f"node {name}"):
            try:
                node = core.read_node(name)
            except k8s.exceptions.ApiException as exc:
                if exc.status == 404:
                    out.add(name)
                    continue
                raise
        if not any(t.key == TAINT_KEY for t in (node.spec.taints or [])):
            out.add(name)
    return out


def replacements_since(incidents: Iterable[Incident], since: datetime, *, exclude: str) -> int:
    """Replacements requested since ``since`` by incidents other than ``exclude``."""
    count = 0
    for incident in incidents:
        if incident.incident_id == exclude:
            continue
        started = incident.entered(S.REPLACING)
        if started is not None and started >= since:
            count += len(incident.replacements) or len(incident.instance_ids)
    return count


def check_blast_radius(
    incident: Incident,
    others: Iterable[Incident],
    *,
    max_quarantined_nodes: int,
    max_replacements_per_day: int,
    now: datetime,
) -> Verdict:
    """Whether ``incident``'s nodes may be quarantined (and later replaced) within the limits.

    Nodes the incident shares with one already held are not counted twice.
    """
    others = list(others)
    held = quarantined_nodes(others, exclude=incident.incident_id)
    mine = {s.node for s in incident.suspects}
    after = len(held | mine)
    replaced = replacements_since(others, now - DAY, exclude=incident.incident_id)
    new_replacements = len(incident.instance_ids)
    if after > max_quarantined_nodes:
        return Verdict(
            False,
            len(held),
            replaced,
            f"quarantining {len(mine - held)} more node(s) would hold {after} nodes of the cluster; "
            f"the limit is {max_quarantined_nodes}",
        )
    if replaced + new_replacements > max_replacements_per_day:
        return Verdict(
            False,
            len(held),
            replaced,
            f"{replaced} replacement(s) in the last 24 h plus {new_replacements} would exceed "
            f"the limit of {max_replacements_per_day} per day",
        )
    return Verdict(True, len(held), replaced, f"{after} of {max_quarantined_nodes} nodes held; {replaced} replaced in 24 h")


def guard_incident(
    ledger: Ledger,
    incident_id: str,
    *,
    mode: str,
    max_quarantined_nodes: int,
    max_replacements_per_day: int,
    kubernetes: Callable[[], k8s.ApiClient] | None = None,
    actor: str = "guard",
) -> Incident:
    """Apply the blast-radius limits and the mode (RESOLVED -> GUARDED, or DRY_RUN).

    In dry-run mode the incident ends as DRY_RUN after the limits were
    evaluated and recorded; nothing is touched. Idempotent. Concurrent guards
    of one cluster are serialised by the ledger's cluster lock, and the write
    re-checks the lock's lease in the same transaction, so two incidents are
    never admitted against the same count. The count reads only the
    incidents that still count (the ledger's open index), never the whole
    ledger. Nodes of stopped incidents are checked on the cluster through
    ``kubernetes`` (a factory, called only when needed; without it they all
    count); a stopped incident whose nodes are all released is marked so and
    stops counting. Raises :class:`BlastRadiusExceeded`, recording nothing,
    :class:`LedgerConflict` (including :class:`~lambdas.errors.LockLost`) and
    :class:`TransientKubernetesError`.
    """
    cluster = ledger.get(incident_id).alarm.job.hyperpod_cluster
    # Under the cluster's lock: concurrent incidents are admitted one by one.
    with ledger.locked(f"guard:{cluster}", owner=incident_id) as lease:
        incident = ledger.get(incident_id)
        if incident.state != S.RESOLVED:
            return incident
        others = _count_releases(ledger, ledger.counting(cluster, lease=lease), kubernetes, exclude=incident_id)
        verdict = check_blast_radius(
            incident,
            others,
            max_quarantined_nodes=max_quarantined_nodes,
            max_replacements_per_day=max_replacements_per_day,
            now=datetime.now(UTC),
        )
        if not verdict.allowed:
            raise BlastRadiusExceeded(f"incident {incident_id}: {verdict.reason}")
        target = S.DRY_RUN if mode == "dry_run" else S.GUARDED
        note = verdict.reason + ("; dry run: nothing will be touched" if target == S.DRY_RUN else f"; mode {mode}")
        return _admit(ledger, incident_id, target, note, actor=actor, lease=lease)


def _admit(ledger: Ledger, incident_id: str, target: IncidentState, note: str, *, actor: str, lease: Lease) -> Incident:
    return ledger.update(
        incident_id,
        lambda current: current if current.state != S.RESOLVED else current.advance(target, actor=actor, note=note),
        lease=lease,
    )


def _count_releases(
    ledger: Ledger, incidents: list[Incident], kubernetes: Callable[[], k8s.ApiClient] | None, *, exclude: str
) -> list[Incident]:
    """``incidents`` with the stopped ones whose nodes were all released marked (in the ledger too)."""
    stopped = [i for i in incidents if i.incident_id != exclude and stopped_holding(i)]
    if not stopped or kubernetes is None:
        return incidents
    released = released_nodes(kubernetes(), (s.node for i in stopped for s in i.suspects))
    out = []
    now = datetime.now(UTC)
    for incident in incidents:
        if incident in stopped and all(s.node in released for s in incident.suspects):
            incident = ledger.update(
                incident.incident_id,
                lambda current: current
                if current.nodes_released_at is not None
                else current.model_copy(update={"nodes_released_at": now, "updated_at": now}),
            )
        out.append(incident)
    return out
