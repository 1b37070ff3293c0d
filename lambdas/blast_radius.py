"""The blast-radius rule, stated once: which incidents hold nodes, and how many nodes sdcguard may hold and replace.

Pure functions over incidents, so the limits can be tested without AWS. The
guard applies :func:`check_blast_radius` when it admits an incident; replace
applies :func:`check_replacement` again, under the same cluster lock, at the
moment it asks HyperPod; the ledger indexes each incident until
:func:`counts_until` says it stops counting (``lambdas/ledger.py`` only stores
what this module computes).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sdcguard.contract import Incident, IncidentState
from sdcguard.contract.incident import REPLACEMENT_REJECTED

S = IncidentState
FOREVER = 32_503_680_000.0
"""``open_until`` of an incident that counts until something changes it (the year 3000)."""
DAY = timedelta(hours=24)
REPLACEMENT_WINDOW = DAY
"""How long a requested replacement counts toward the daily limit."""
STOPPED_HOLDING = frozenset({S.NEEDS_ATTENTION, S.CONTAINED, S.FAILED})
"""Terminal states that may leave nodes quarantined for a human."""
PENDING = frozenset({S.AWAITING_APPROVAL, S.APPROVED})
"""States in which a replacement may be asked for at any moment: they count toward the daily limit at admission."""


def stopped_holding(incident: Incident) -> bool:
    """Whether ``incident`` ended (NEEDS_ATTENTION, CONTAINED, FAILED) possibly leaving its nodes cordoned.

    It did if the guard had admitted it (CONTAINED always was) and nobody has
    seen its nodes released since (``nodes_released_at``).
    """
    if incident.state not in STOPPED_HOLDING or incident.nodes_released_at is not None:
        return False
    return incident.state == S.CONTAINED or bool(incident.entered(S.GUARDED) or incident.entered(S.CORDONED))


OPEN_HOLDING = frozenset(
    {S.GUARDED, S.SUSPENDED, S.CORDONED, S.EVIDENCE_COLLECTED, S.AWAITING_APPROVAL, S.APPROVED, S.REJECTED, S.REPLACING}
)
"""Open states in which an incident's nodes are (or are about to be) cordoned by us. Before the guard
admits it nothing is held; after REPLACED the node is gone."""


def holds_nodes(incident: Incident) -> bool:
    """Whether ``incident``'s nodes are (or are about to be) under sdcguard quarantine."""
    return stopped_holding(incident) if incident.state.terminal else incident.state in OPEN_HOLDING


def counts_until(incident: Incident) -> float | None:
    """Until when (epoch seconds) ``incident`` counts toward its cluster's blast radius, or None if it does not.

    An open incident counts (it may hold nodes at any moment). One that stopped
    holding nodes (:func:`stopped_holding`) counts until its nodes are seen
    released. One that requested replacements counts toward the daily limit
    for :data:`REPLACEMENT_WINDOW` after the request. A failed incident never
    frees quota by failing.
    """
    until = FOREVER if not incident.state.terminal or stopped_holding(incident) else None
    replacing = incident.entered(S.REPLACING)
    if replacing is not None:
        until = max(until or 0.0, (replacing + REPLACEMENT_WINDOW).timestamp())
    return until


def rejected_nodes(incident: Incident) -> set[str]:
    """The new nodes of ``incident``'s replacements that failed their qualification: cordoned by it."""
    rejected = {r.new_instance_id for r in incident.replacements if r.status == REPLACEMENT_REJECTED}
    return {c.node for c in incident.node_checks if c.purpose == "qualify" and c.instance_id in rejected}


def quarantined_nodes(incidents: Iterable[Incident], *, exclude: str, released: Collection[str] = ()) -> set[str]:
    """Nodes held by sdcguard quarantine, from incidents other than ``exclude``.

    A stopped incident's node counts until it is seen ``released`` (no
    sdcguard taint any more, or gone); an open incident's counts from its
    admission until the node is replaced. A replacement node that failed its
    qualification was cordoned too: it counts while its incident is open, and
    after it stopped until its nodes are seen released.
    """
    held: set[str] = set()
    for incident in incidents:
        if incident.incident_id == exclude:
            continue
        if stopped_holding(incident):
            held.update(s.node for s in incident.suspects if s.node not in released)
            held.update(rejected_nodes(incident) - set(released))
        elif holds_nodes(incident):
            held.update(s.node for s in incident.suspects)
        if not incident.state.terminal:
            held.update(rejected_nodes(incident))
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


def pending_replacements(incidents: Iterable[Incident], *, exclude: str) -> int:
    """Replacements other incidents may ask for at any moment: those waiting for a reviewer, or approved."""
    return sum(len(i.instance_ids) for i in incidents if i.incident_id != exclude and i.state in PENDING)


@dataclass(frozen=True)
class Verdict:
    """Whether an incident may go ahead, with the numbers behind the answer."""

    allowed: bool
    quarantined: int
    """Nodes held by other incidents of the cluster."""
    replacements_last_day: int
    """Replacements requested by other incidents in the last 24 hours."""
    reason: str
    pending: int = 0
    """Replacements other incidents await approval for (counted at admission only)."""


def check_blast_radius(
    incident: Incident,
    others: Iterable[Incident],
    *,
    max_quarantined_nodes: int,
    max_replacements_per_day: int,
    now: datetime,
) -> Verdict:
    """Whether ``incident``'s nodes may be quarantined (and later replaced) within the limits: the admission rule.

    Nodes the incident shares with one already held are not counted twice.
    The daily limit counts the replacements requested in the last 24 h and
    those other incidents await approval for: a reviewer is only asked when the
    replacement could still be made.
    """
    others = list(others)
    held = quarantined_nodes(others, exclude=incident.incident_id)
    mine = {s.node for s in incident.suspects}
    after = len(held | mine)
    replaced = replacements_since(others, now - DAY, exclude=incident.incident_id)
    pending = pending_replacements(others, exclude=incident.incident_id)
    new_replacements = len(incident.instance_ids)
    if after > max_quarantined_nodes:
        return Verdict(
            False,
            len(held),
            replaced,
            f"quarantining {len(mine - held)} more node(s) would hold {after} nodes of the cluster; "
            f"the limit is {max_quarantined_nodes}",
            pending,
        )
    if replaced + pending + new_replacements > max_replacements_per_day:
        return Verdict(
            False,
            len(held),
            replaced,
            f"{replaced} replacement(s) in the last 24 h and {pending} awaiting approval plus {new_replacements} "
            f"would exceed the limit of {max_replacements_per_day} per day",
            pending,
        )
    return Verdict(
        True, len(held), replaced, f"{after} of {max_quarantined_nodes} nodes held; {replaced} replaced in 24 h, "
        f"{pending} awaiting approval", pending,
    )  # fmt: skip


def check_replacement(incident: Incident, instance_id: str, others: Iterable[Incident], *, max_replacements_per_day: int, now: datetime) -> str | None:
    """Why replacing ``instance_id`` for ``incident`` now would break a limit, or None: the rule at the moment of acting.

    Counts the replacements other incidents requested in the last 24 h (their
    approvals may have come in since this incident was admitted), and refuses
    an instance another incident already asked HyperPod to replace (one node,
    one replacement: a second request would be taken for our own retry).
    """
    others = [o for o in others if o.incident_id != incident.incident_id]
    for other in others:
        if any(r.old_instance_id == instance_id for r in other.replacements):
            return f"instance {instance_id} is already being replaced by incident {other.incident_id}"
    replaced = replacements_since(others, now - DAY, exclude=incident.incident_id)
    mine = sum(1 for r in incident.replacements)  # already requested by this incident
    if replaced + mine + 1 > max_replacements_per_day:
        return (
            f"{replaced} replacement(s) in the last 24 h by other incidents and {mine} by this one, plus {instance_id}, "
            f"would exceed the limit of {max_replacements_per_day} per day"
        )
    return None
