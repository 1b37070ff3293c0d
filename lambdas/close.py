"""The ends of an incident: closed, contained, released as a false alarm, stopped for attention, failed.

Every end is recorded in the ledger and announced on the reviewers' topic.
"""

from __future__ import annotations

import json
from datetime import UTC
from typing import Any

from kubernetes import client as k8s

from sdcguard.contract import Failure, Incident, IncidentState
from sdcguard.lambdas import notify
from sdcguard.lambdas.cordon import uncordon_node
from sdcguard.lambdas.decide import decided
from sdcguard.lambdas.errors import IncidentNotWaiting
from sdcguard.lambdas.job import holds_job, resume_job
from sdcguard.lambdas.ledger import Ledger

S = IncidentState
GENERIC_PLACE = "Pipeline"
"""What the state machine's shared NeedsAttention/Failed states send as ``state``."""
STEP_AFTER = {
    S.RECORDED: "Resolve",
    S.RESOLVED: "Guard",
    S.GUARDED: "SuspendJob",
    S.SUSPENDED: "CordonNodes",
    S.CORDONED: "CollectEvidence",
    S.EVIDENCE_COLLECTED: "RequestApproval",
    S.AWAITING_APPROVAL: "RequestApproval",
    S.APPROVED: "ReplaceNodes",
    S.REPLACING: "WaitForReplacement",
    S.REPLACED: "RewritePointer",
    S.POINTER_REWRITTEN: "ResumeJob",
    S.RESUMED: "Close",
    S.REJECTED: "Release",
}
"""The state of the incident machine that runs after the ledger records each state: where a generic stop happened."""
QUALIFICATION_STOPS = frozenset({"ReplacementNotQualified", "QualificationTimedOut", "UnknownQualification"})
"""The errors with which the qualification of a replacement stops an incident (the ledger still says REPLACED)."""


def _place(incident: Incident, error: str) -> str:
    """Where a generic stop happened: the qualification when it stopped the incident (by its own errors, or while
    a check of a new node was still running), else the state that follows the recorded one."""
    if incident.state == S.REPLACED and (
        error in QUALIFICATION_STOPS
        or any(c.purpose == "qualify" and c.state == "running" for c in incident.node_checks)
    ):
        return "QualifyReplacement"
    return STEP_AFTER.get(incident.state, incident.state.value)


def plain_cause(cause: str) -> str:
    """The message of a caught error, without the Lambda JSON and stack trace around it.

    A Lambda failure reaches a ``Catch`` as ``{"errorMessage", "errorType",
    "stackTrace", ...}``; the operator needs the message. Anything else is kept as it is.
    """
    try:
        parsed = json.loads(cause)
    except ValueError:
        return cause
    if isinstance(parsed, dict) and isinstance(parsed.get("errorMessage"), str):
        return str(parsed["errorMessage"])
    return cause


def timings(incident: Incident) -> dict[str, float]:
    """Seconds from the alarm to the cordon, the approval, and the resumed job (those that happened)."""
    start = incident.alarm.time
    if start.tzinfo is None:  # an alarm time without a zone is UTC
        start = start.replace(tzinfo=UTC)
    out: dict[str, float] = {}
    for label, state in (("alarm_to_cordon_s", S.CORDONED), ("alarm_to_approval_s", S.APPROVED), ("alarm_to_resumed_s", S.RESUMED)):
        at = incident.entered(state)
        if at is not None:
            out[label] = round((at - start).total_seconds(), 3)
    return out


def announce(
    ledger: Ledger, incident: Incident, subject: str, body: str, *, topic_arn: str, sns: Any
) -> Incident:
    """Publish the notification of ``incident``'s current state unless it was sent already, then record it sent.

    At least once: the ledger may reach an end before its notification goes
    out (the write succeeded, the publish failed, the handler is retried), so
    what decides is ``notified``, not whether this call made the transition. A
    publish whose record is lost is sent again by the retry.
    """
    mark = incident.state.value
    if mark in incident.notified:
        return incident
    notify.publish(topic_arn, subject, body, incident=incident, client=sns)
    return ledger.update(
        incident.incident_id,
        lambda current: current
        if mark in current.notified
        else current.model_copy(update={"notified": [*current.notified, mark]}),
    )


def close_incident(
    ledger: Ledger, incident_id: str, *, topic_arn: str, sns: Any = None, actor: str = "close"
) -> tuple[Incident, dict[str, float]]:
    """End the incident: RESUMED -> CLOSED, or in cordon-only mode EVIDENCE_COLLECTED -> CONTAINED.

    Notifies once. Returns the incident and its timings. Raises
    :class:`IncidentNotWaiting` for an incident in any other state.
    """
    incident = ledger.get(incident_id)
    if incident.state in (S.CLOSED, S.CONTAINED):
        incident = announce(
            ledger, incident, f"sdcguard: incident {incident_id} {incident.state.value}", notify.describe(incident),
            topic_arn=topic_arn, sns=sns,
        )  # fmt: skip
        return incident, timings(incident)
    if incident.state == S.RESUMED:
        target, note = S.CLOSED, "replaced, rolled back to a clean checkpoint, resumed"
    elif incident.state == S.EVIDENCE_COLLECTED and incident.mode == "cordon_only":
        target, note = S.CONTAINED, "cordon-only mode: node stays cordoned, job stays suspended"
    else:
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; it cannot be closed")
    spent = timings(incident)
    note += "; " + ", ".join(f"{k}={v:g}" for k, v in spent.items())
    closed = ledger.update(
        incident_id, lambda current: current if current.state.terminal else current.advance(target, actor=actor, note=note)
    )
    spent = timings(closed)
    closed = announce(
        ledger, closed, f"sdcguard: incident {incident_id} {closed.state.value}", notify.describe(closed),
        topic_arn=topic_arn, sns=sns,
    )  # fmt: skip
    return closed, spent


def release_incident(
    ledger: Ledger,
    api: k8s.ApiClient,
    incident_id: str,
    *,
    topic_arn: str,
    sns: Any = None,
    actor: str = "release",
) -> Incident:
    """The reject path: uncordon the nodes, leave the pointer, resume the job, record FALSE_ALARM.

    Acts only on a rejection the decide function wrote to the ledger. Idempotent.
    Raises :class:`IncidentNotWaiting` unless the ledger records the incident as rejected.
    """
    incident = ledger.update(incident_id, lambda current: decided(current, S.REJECTED))
    if incident.state == S.FALSE_ALARM:
        return announce(
            ledger, incident, f"sdcguard: incident {incident_id} FALSE_ALARM", notify.describe(incident),
            topic_arn=topic_arn, sns=sns,
        )  # fmt: skip
    if incident.state != S.REJECTED:
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; only a rejected incident is released")
    for suspect in incident.suspects:
        uncordon_node(api, suspect.node, incident_id, still_open=lambda other: holds_job(ledger, other))
    job = incident.alarm.job
    resume_job(api, job.namespace, job.job_name, incident_id, still_open=lambda other: holds_job(ledger, other))
    reviewer = incident.decision.reviewer if incident.decision else "unknown"
    released = ledger.update(
        incident_id,
        lambda current: current
        if current.state != S.REJECTED
        else current.advance(S.FALSE_ALARM, actor=actor, note=f"rejected by {reviewer}: nodes released, job resumed"),
    )
    return announce(
        ledger, released, f"sdcguard: incident {incident_id} FALSE_ALARM", notify.describe(released),
        topic_arn=topic_arn, sns=sns,
    )  # fmt: skip


def _stop(
    ledger: Ledger,
    incident_id: str,
    target: IncidentState,
    failure: Failure,
    *,
    topic_arn: str,
    sns: Any,
    actor: str,
) -> Incident:
    recorded: list[Failure] = []

    def change(current: Incident) -> Incident:
        if current.state.terminal:
            return current
        # The state machine reports a generic place; the ledger knows how far the incident got.
        place = _place(current, failure.error) if failure.state == GENERIC_PLACE else failure.state
        where = failure.model_copy(update={"state": place, "cause": plain_cause(failure.cause)[:4096]})
        recorded[:] = [where]
        return current.advance(target, actor=actor, note=f"{where.state}: {where.error}", failure=where)

    stopped = ledger.update(incident_id, change)
    if stopped.state != target or stopped.failure is None:
        return stopped  # it had ended otherwise: that end announced itself
    held = stopped.entered(S.CORDONED) is not None
    return announce(
        ledger,
        stopped,
        f"sdcguard: incident {incident_id} {target.value} ({stopped.failure.error})",
        notify.describe(stopped)
        + ("\nThe node stays cordoned and the job suspended until someone acts: "
           f"sdcguard incidents release {incident_id} --reason \"...\" once it has been looked at." if held else ""),
        topic_arn=topic_arn,
        sns=sns,
    )  # fmt: skip


def stop_for_attention(
    ledger: Ledger, incident_id: str, failure: Failure, *, topic_arn: str, sns: Any = None, actor: str = "needs_attention"
) -> Incident:
    """A safe stop (approval timed out, limits reached, nothing to resolve): NEEDS_ATTENTION, notify.

    What was contained stays contained. An incident already ended is left as it is.
    """
    return _stop(ledger, incident_id, S.NEEDS_ATTENTION, failure, topic_arn=topic_arn, sns=sns, actor=actor)


def record_failure(
    ledger: Ledger, incident_id: str, failure: Failure, *, topic_arn: str, sns: Any = None, actor: str = "fail"
) -> Incident:
    """A step failed: FAILED with where and why, and notify. An incident already ended is left as it is."""
    return _stop(ledger, incident_id, S.FAILED, failure, topic_arn=topic_arn, sns=sns, actor=actor)
