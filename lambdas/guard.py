"""Blast-radius arithmetic: how many nodes sdcguard may hold and replace at once.

Pure functions over the ledger's incidents, so the limits can be tested
without AWS.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from contract import Incident, IncidentState
from lambdas.errors import BlastRadiusExceeded
from lambdas.ledger import Ledger

S = IncidentState
# States in which an incident's nodes are (or are about to be) cordoned by us.
# NEEDS_ATTENTION and CONTAINED leave the node cordoned for a human; after
# REPLACED the node is gone and no longer counts.
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


def quarantined_nodes(incidents: Iterable[Incident], *, exclude: str) -> set[str]:
    """Nodes held by sdcguard quarantine, from incidents other than ``exclude``."""
    held: set[str] = set()
    for incident in incidents:
        if incident.incident_id == exclude or incident.state not in HOLDING:
            continue
        if incident.state == S.NEEDS_ATTENTION and not incident.entered(S.CORDONED) and not incident.entered(S.GUARDED):
            continue  # stopped before it touched anything
        held.update(s.node for s in incident.suspects)
    return held


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
    actor: str = "guard",
) -> Incident:
    """Apply the blast-radius limits and the mode (RESOLVED -> GUARDED, or DRY_RUN).

    In dry-run mode the incident ends as DRY_RUN after the limits were
    evaluated and recorded; nothing is touched. Idempotent. Concurrent
    guards of one cluster are serialised by the ledger's cluster lock, so two
    incidents are never admitted against the same count. Raises
    :class:`BlastRadiusExceeded`, recording nothing, and :class:`LedgerConflict`.
    """
    cluster = ledger.get(incident_id).alarm.job.hyperpod_cluster
    # Under the cluster's lock: concurrent incidents are admitted one by one.
    with ledger.locked(f"guard:{cluster}", owner=incident_id):
        incident = ledger.get(incident_id)
        if incident.state != S.RESOLVED:
            return incident
        verdict = check_blast_radius(
            incident,
            ledger.list(hyperpod_cluster=cluster),
            max_quarantined_nodes=max_quarantined_nodes,
            max_replacements_per_day=max_replacements_per_day,
            now=datetime.now(UTC),
        )
        if not verdict.allowed:
            raise BlastRadiusExceeded(f"incident {incident_id}: {verdict.reason}")
        target = S.DRY_RUN if mode == "dry_run" else S.GUARDED
        note = verdict.reason + ("; dry run: nothing will be touched" if target == S.DRY_RUN else f"; mode {mode}")
        return ledger.update(
            incident_id,
            lambda current: current if current.state != S.RESOLVED else current.advance(target, actor=actor, note=note),
        )
