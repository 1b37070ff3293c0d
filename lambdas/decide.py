"""The reviewer's decision: record it and answer the incident machine's task token.

Behind the ``decide`` state machine, which a reviewer starts from the Step
Functions console or through ``sdcguard approve``/``reject``: one path, one
validation, one audit trail.
"""

from __future__ import annotations

import json
from typing import Any

import boto3
from botocore.exceptions import ClientError

from contract import Decision, Incident, IncidentState
from lambdas.errors import ApprovalExpired, IncidentNotWaiting, UnknownDecision
from lambdas.ledger import Ledger

S = IncidentState
DECISIONS = {"approve": S.APPROVED, "reject": S.REJECTED}


def decide(
    ledger: Ledger,
    incident_id: str,
    decision: str,
    *,
    reviewer: str,
    reason: str,
    execution_arn: str | None = None,
    sfn: Any = None,
) -> Incident:
    """Deliver ``decision`` to the waiting incident and record it with reviewer, reason and ``execution_arn``
    (the decide execution, whose StartExecution event in CloudTrail names the caller).

    The token is answered first and the ledger written after: a decision that
    never reached the machine is never recorded. Raises
    :class:`UnknownDecision`, :class:`IncidentNotWaiting` (any state but
    AWAITING_APPROVAL, or no token) and :class:`ApprovalExpired` (the token
    timed out); in all three cases nothing changes.
    """
    if decision not in DECISIONS:
        raise UnknownDecision(f"decision must be 'approve' or 'reject', not {decision!r}")
    record = Decision(decision=decision, reviewer=reviewer, reason=reason, execution_arn=execution_arn)
    incident = ledger.get(incident_id)
    stored = ledger.get_token(incident_id)
    if incident.state == S.NEEDS_ATTENTION and incident.failure and "Timeout" in incident.failure.error:
        raise ApprovalExpired(
            f"incident {incident_id}: the approval request timed out ({incident.failure.error}); "
            "the incident stopped safely for attention"
        )
    if incident.state != S.AWAITING_APPROVAL or stored is None:
        raise IncidentNotWaiting(
            f"incident {incident_id} is {incident.state.value}, not waiting for approval"
            + (f" (decided by {incident.decision.reviewer})" if incident.decision else "")
        )
    token, _expires = stored
    sfn = sfn or boto3.client("stepfunctions")
    try:
        sfn.send_task_success(taskToken=token, output=json.dumps(record.model_dump(mode="json")))
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("TaskTimedOut", "TaskDoesNotExist", "InvalidToken"):
            raise ApprovalExpired(
                f"incident {incident_id}: the approval request is no longer open ({code}); "
                "the incident stops safely for attention"
            ) from None
        raise
    ledger.delete_token(incident_id)
    return ledger.update(incident_id, lambda current: record_decision(current, record))


def record_decision(incident: Incident, decision: Decision) -> Incident:
    """``incident`` with ``decision`` recorded (APPROVED or REJECTED); unchanged if already recorded.

    Used by ``decide`` and, should its write have been lost, by the next
    handler of the incident machine, which receives the same decision.
    """
    if incident.decision is not None or incident.state != S.AWAITING_APPROVAL:
        return incident
    return incident.advance(
        DECISIONS[decision.decision],
        actor=decision.reviewer[:256],
        note=(decision.reason + (f" (decide execution {decision.execution_arn})" if decision.execution_arn else ""))[:1024],
        decision=decision,
    )
