"""The approval request: store the task token, tell the reviewers how to answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sdcguard.contract import Incident, IncidentState, RollbackPlan
from sdcguard.lambdas import notify
from sdcguard.lambdas.errors import IncidentNotWaiting
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lambdas.task_tokens import TaskTokens

S = IncidentState
REPRODUCTION_NOTE = (
    "the step's capsule was replayed on the cordoned suspect (see above). N/N is a persistent fault: replace. "
    "Some of N is intermittent: replace. 0/N means the fault did not recur there (transient, or not this "
    "node's): the detector's evidence still stands. Inconclusive or not run says nothing either way."
)


def approval_message(incident: Incident, *, decide_machine_arn: str = "") -> str:
    """The reviewers' notification: the incident, the evidence, and the exact commands to answer."""
    evidence = incident.evidence
    lines = [notify.describe(incident), ""]
    if incident.repeat_of is not None:
        lines.append(f"This fault came back: {incident.repeat_of.describe()}.")
    if incident.rollback is not None:
        lines.append(f"Approving rolls the job back: {incident.rollback.describe()}.")
    lines.append(f"Evidence verdict: {evidence.get('verdict', 'none collected')}")
    instances = evidence.get("instances")
    for entry in instances if isinstance(instances, list) else []:
        if isinstance(entry, dict):
            reasons = "; ".join(str(r) for r in entry.get("reasons", []))
            lines.append(f"  {entry.get('instance_id')}: {entry.get('verdict')}: {notify.quote(reasons)}")
    if evidence.get("note"):
        lines.append(f"Note: {notify.quote(evidence['note'])}")
    if any(c.purpose == "reproduce" for c in incident.node_checks):
        lines.append(f"Reproduction: {REPRODUCTION_NOTE}")
    lines += [
        "",
        "The node is cordoned and the job suspended. To replace the node and resume from the last clean checkpoint:",
        f'  sdcguard approve {incident.incident_id} --reason "..."',
        "To release the node and resume without replacing it (a false alarm):",
        f'  sdcguard reject {incident.incident_id} --reason "..."',
    ]
    if decide_machine_arn:
        lines.append(
            f"Or start the state machine {decide_machine_arn} in the Step Functions console with input "
            f'{{"incident_id": "{incident.incident_id}", "decision": "approve" | "reject", "reason": "...", "reviewer": "..."}}'
        )
    return "\n".join(lines)


def request_approval(
    ledger: Ledger,
    tokens: TaskTokens,
    incident_id: str,
    task_token: str,
    *,
    timeout_seconds: int,
    topic_arn: str,
    decide_machine_arn: str = "",
    plan: Callable[[Incident], RollbackPlan] | None = None,
    sns: Any = None,
    actor: str = "request_approval",
) -> Incident:
    """Store ``task_token`` in ``tokens``, move the incident to AWAITING_APPROVAL and notify the reviewers once.

    ``plan`` computes the rollback approving means (see
    :func:`sdcguard.lambdas.pointer.plan_rollback`) before anything is stored: the
    reviewers see it, and its errors (``NoSafeCheckpoint``,
    ``PointerOutsidePrefix``) stop the incident before it asks, with nothing
    replaced. A retry with the same token neither notifies again nor writes
    again. Raises :class:`IncidentNotWaiting` if the incident is past the point of asking.
    """
    stored = tokens.get(incident_id)
    incident = ledger.get(incident_id)
    if incident.state == S.AWAITING_APPROVAL and stored is not None and stored[0] == task_token:
        return incident
    if incident.state not in (S.EVIDENCE_COLLECTED, S.AWAITING_APPROVAL):
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; approval cannot be requested")
    rollback = plan(incident) if plan is not None else None
    tokens.put(incident_id, task_token, expires_at=time.time() + timeout_seconds)
    note = "reviewers notified" + (f"; approving: {rollback.describe()}" if rollback else "")
    incident = ledger.update(
        incident_id,
        lambda current: current.advance(
            S.AWAITING_APPROVAL, actor=actor, note=note, approval_requested_at=datetime.now(UTC), rollback=rollback
        ),
    )
    notify.publish(
        topic_arn,
        f"sdcguard: approve or reject node replacement for {incident_id}",
        approval_message(incident, decide_machine_arn=decide_machine_arn),
        incident=incident,
        client=sns,
    )
    return incident
