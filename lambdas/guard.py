"""The guard: admit an incident within the blast-radius limits, under the cluster's lock.

The rule itself lives in :mod:`sdcguard.lambdas.blast_radius` (stated once; replace
applies it again when it acts); this module reads the ledger and the cluster
for it and records the admission.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from kubernetes import client as k8s

from sdcguard.contract import Incident, IncidentState
from sdcguard.lambdas.blast_radius import (
    Verdict,
    check_blast_radius,
    quarantined_nodes,
    rejected_nodes,
    stopped_holding,
)
from sdcguard.lambdas.cordon import TAINT_KEY
from sdcguard.lambdas.errors import BlastRadiusExceeded
from sdcguard.lambdas.kube_errors import kubernetes_errors
from sdcguard.lambdas.ledger import Ledger

if TYPE_CHECKING:
    from sdcguard.lambdas.ledger import Lease

S = IncidentState
__all__ = ["Verdict", "check_blast_radius", "guard_incident", "quarantined_nodes", "released_nodes", "stopped_holding"]


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
    :class:`LedgerConflict` (including :class:`~sdcguard.lambdas.errors.LockLost`) and
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


def _cordoned_by(incident: Incident) -> set[str]:
    """The nodes ``incident`` cordoned: its suspects', and its replacements' that failed their qualification."""
    return {s.node for s in incident.suspects} | rejected_nodes(incident)


def _count_releases(
    ledger: Ledger, incidents: list[Incident], kubernetes: Callable[[], k8s.ApiClient] | None, *, exclude: str
) -> list[Incident]:
    """``incidents`` with the stopped ones whose nodes were all released marked (in the ledger too)."""
    stopped = [i for i in incidents if i.incident_id != exclude and stopped_holding(i)]
    if not stopped or kubernetes is None:
        return incidents
    # A replacement node that failed its qualification was cordoned by the incident too: it must be released
    # as well before the incident stops holding.
    released = released_nodes(kubernetes(), (n for i in stopped for n in _cordoned_by(i)))
    out = []
    now = datetime.now(UTC)
    for incident in incidents:
        if incident in stopped and _cordoned_by(incident) <= released:
            incident = ledger.update(
                incident.incident_id,
                lambda current: current
                if current.nodes_released_at is not None
                else current.model_copy(update={"nodes_released_at": now, "updated_at": now}),
            )
        out.append(incident)
    return out
