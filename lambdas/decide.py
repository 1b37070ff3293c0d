"""The reviewer's decision: record it, then answer the incident machine's task token.

Behind the ``decide`` state machine, which a reviewer starts from the Step
Functions console or through ``sdcguard approve``/``reject``: one path, one
validation, one audit trail.

The ledger is the only place a decision lives. ``decide`` writes it there
before it answers the token; every later handler (replace, release, close)
acts on the decision it reads from the ledger and ignores whatever its input
says, so invoking one of them directly with an "approve" decides nothing.
"""

from __future__ import annotations

import json
from typing import Any

import boto3
from botocore.exceptions import ClientError

from sdcguard.contract import Decision, Incident, IncidentState
from sdcguard.lambdas.errors import ApprovalExpired, IncidentNotWaiting, UnknownDecision, UnverifiedDecision
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lambdas.task_tokens import TaskTokens

S = IncidentState
DECISIONS = {"approve": S.APPROVED, "reject": S.REJECTED}


def verify_execution(
    sfn: Any, execution_arn: str, *, decide_machine_arn: str, incident_id: str, decision: str
) -> None:
    """Raises :class:`UnverifiedDecision` unless ``execution_arn`` is a running execution of the decide machine
    that was started for this incident and this decision.

    The decide function takes ``execution_arn`` from its input; a caller who
    invokes the function directly could name any execution. Step Functions
    itself says which machine an execution belongs to, whether it still runs,
    and what it was started with, so only a decision somebody started the
    decide machine for (which IAM on StartExecution authorises, and CloudTrail
    records with the caller) gets through.
    """
    if not decide_machine_arn:
        raise UnverifiedDecision(
            "this deployment names no decide machine (DECIDE_STATE_MACHINE_ARN); no decision can be verified"
        )
    try:
        described = sfn.describe_execution(executionArn=execution_arn)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("ExecutionDoesNotExist", "InvalidArn", "AccessDeniedException"):
            raise UnverifiedDecision(f"execution {execution_arn!r} cannot be confirmed ({code}); nothing changed") from None
        raise
    if described.get("stateMachineArn") != decide_machine_arn:
        raise UnverifiedDecision(f"execution {execution_arn!r} is not an execution of the decide machine; nothing changed")
    if described.get("status") != "RUNNING":
        raise UnverifiedDecision(f"execution {execution_arn!r} is {described.get('status')}, not running; nothing changed")
    try:
        started = json.loads(described.get("input") or "{}")
    except ValueError:
        started = {}
    if not isinstance(started, dict) or (started.get("incident_id"), started.get("decision")) != (incident_id, decision):
        raise UnverifiedDecision(
            f"execution {execution_arn!r} was not started to {decision} incident {incident_id}; nothing changed"
        )


def decide(
    ledger: Ledger,
    tokens: TaskTokens,
    incident_id: str,
    decision: str,
    *,
    reviewer: str,
    reason: str,
    execution_arn: str,
    decide_machine_arn: str,
    sfn: Any = None,
) -> Incident:
    """Record ``decision`` for the waiting incident, then deliver it, with reviewer, reason and ``execution_arn``
    (the decide execution, whose StartExecution event in CloudTrail names the caller), answering the task token
    that ``tokens`` holds for it.

    The decision is written first (still AWAITING_APPROVAL, its ``decision``
    set) and the token answered after, so the next handler always finds it in
    the ledger; once delivered, the incident moves to APPROVED or REJECTED. If
    the token can no longer be answered, the decision is withdrawn again.
    Raises :class:`UnknownDecision`, :class:`UnverifiedDecision` (see
    :func:`verify_execution`), :class:`IncidentNotWaiting` (any state but
    AWAITING_APPROVAL, no token, or a decision already taken) and
    :class:`ApprovalExpired` (the token timed out); in all of these nothing changes.
    A retry of the same decide execution (:func:`same_decision`) that finds
    its own decision written but the token still stored delivers it again; if
    the token was already taken, the earlier attempt delivered it and the
    decision is adopted.
    """
    if decision not in DECISIONS:
        raise UnknownDecision(f"decision must be 'approve' or 'reject', not {decision!r}")
    sfn = sfn or boto3.client("stepfunctions")
    verify_execution(sfn, execution_arn, decide_machine_arn=decide_machine_arn, incident_id=incident_id, decision=decision)
    record = Decision(decision=decision, reviewer=reviewer, reason=reason, execution_arn=execution_arn)
    incident = ledger.get(incident_id)
    stored = tokens.get(incident_id)
    if incident.state == S.NEEDS_ATTENTION and incident.failure and "Timeout" in incident.failure.error:
        raise ApprovalExpired(
            f"incident {incident_id}: the approval request timed out ({incident.failure.error}); "
            "the incident stopped safely for attention"
        )
    retry = incident.state == S.AWAITING_APPROVAL and stored is not None and same_decision(incident.decision, record)
    if retry:
        # This execution's own decision, written by an attempt that stopped before it was delivered (a crash, a
        # timeout of the function): deliver that one, as it was recorded, instead of reporting it as another's.
        assert incident.decision is not None
        record = incident.decision
    elif incident.state != S.AWAITING_APPROVAL or stored is None or incident.decision is not None:
        raise IncidentNotWaiting(
            f"incident {incident_id} is {incident.state.value}, not waiting for approval"
            + (f" (decided by {incident.decision.reviewer})" if incident.decision else "")
        )
    assert stored is not None
    token, _expires = stored
    ledger.update(incident_id, lambda current: note_decision(current, record))
    try:
        sfn.send_task_success(taskToken=token, output=json.dumps(record.model_dump(mode="json")))
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if retry and code in ("TaskDoesNotExist", "InvalidToken"):
            # The earlier attempt's answer was taken (the incident machine went on): the decision stands.
            tokens.delete(incident_id)
            return ledger.update(incident_id, adopt_decision)
        ledger.update(incident_id, lambda current: withdraw_decision(current, record))
        if code in ("TaskTimedOut", "TaskDoesNotExist", "InvalidToken"):
            raise ApprovalExpired(
                f"incident {incident_id}: the approval request is no longer open ({code}); "
                "the incident stops safely for attention"
            ) from None
        raise
    tokens.delete(incident_id)
    return ledger.update(incident_id, adopt_decision)


def same_decision(recorded: Decision | None, asked: Decision) -> bool:
    """Whether ``recorded`` is ``asked`` written by an earlier attempt of the same decide execution (its time
    aside)."""
    return (recorded is not None and asked.execution_arn is not None
            and (recorded.decision, recorded.reviewer, recorded.reason, recorded.execution_arn)
            == (asked.decision, asked.reviewer, asked.reason, asked.execution_arn))


def note_decision(incident: Incident, decision: Decision) -> Incident:
    """``incident`` (AWAITING_APPROVAL) with ``decision`` written, before it is delivered.

    Raises :class:`IncidentNotWaiting` if the incident stopped waiting or
    another decision was written first (two reviewers at once: one wins).
    """
    if incident.decision == decision:
        return incident
    if incident.state != S.AWAITING_APPROVAL or incident.decision is not None:
        raise IncidentNotWaiting(
            f"incident {incident.incident_id} is {incident.state.value}, not waiting for approval"
            + (f" (decided by {incident.decision.reviewer})" if incident.decision else "")
        )
    return incident.advance(S.AWAITING_APPROVAL, actor=decision.reviewer[:256], decision=decision)


def withdraw_decision(incident: Incident, decision: Decision) -> Incident:
    """``incident`` without ``decision`` again (its delivery failed), if it is still the one written and undelivered."""
    if incident.state != S.AWAITING_APPROVAL or incident.decision != decision:
        return incident
    return incident.advance(S.AWAITING_APPROVAL, actor=decision.reviewer[:256], decision=None)


def adopt_decision(incident: Incident) -> Incident:
    """``incident`` moved to APPROVED or REJECTED by the decision ``decide`` wrote in the ledger; unchanged otherwise.

    ``decide`` does this itself once the token is answered; the next handler of
    the incident machine repeats it, should that last write have been lost.
    The decision comes from the ledger, never from a handler's input.
    """
    decision = incident.decision
    if decision is None or incident.state != S.AWAITING_APPROVAL:
        return incident
    return incident.advance(
        DECISIONS[decision.decision],
        actor=decision.reviewer[:256],
        note=(decision.reason + (f" (decide execution {decision.execution_arn})" if decision.execution_arn else ""))[:1024],
    )


def decided(incident: Incident, want: IncidentState) -> Incident:
    """``incident`` after :func:`adopt_decision`, if that leaves it in ``want`` (or beyond it on that path).

    Raises :class:`IncidentNotWaiting` when the ledger holds no such decision:
    a handler invoked directly, with whatever decision in its input, acts on nothing.
    """
    adopted = adopt_decision(incident)
    recorded = adopted.decision
    if recorded is None or DECISIONS[recorded.decision] != want or adopted.entered(want) is None:
        raise IncidentNotWaiting(
            f"incident {incident.incident_id} is {incident.state.value}; no {want.value.lower()} decision of the "
            "decide machine is recorded (a decision in a handler's input is ignored)"
        )
    return adopted
