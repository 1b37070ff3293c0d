"""The ends of an incident: closed, contained, released as a false alarm, stopped for attention, failed.

Every end is recorded in the ledger and announced on the reviewers' topic.
"""

from __future__ import annotations

from datetime import UTC
from typing import Any

from kubernetes import client as k8s

from contract import Decision, Failure, Incident, IncidentState
from lambdas import notify
from lambdas.cordon import uncordon_node
from lambdas.decide import record_decision
from lambdas.errors import IncidentNotWaiting
from lambdas.job import holds_job, resume_job
from lambdas.ledger import Ledger

S = IncidentState
GENERIC_PLACE = "Pipeline"
"""What the state machine's shared NeedsAttention/Failed states send as ``state``."""


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


def close_incident(
    ledger: Ledger, incident_id: str, *, topic_arn: str, sns: Any = None, actor: str = "close"
) -> tuple[Incident, dict[str, float]]:
    """End the incident: RESUMED -> CLOSED, or in cordon-only mode EVIDENCE_COLLECTED -> CONTAINED.

    Notifies once. Returns the incident and its timings. Raises
    :class:`IncidentNotWaiting` for an incident in any other state.
    """
    incident = ledger.get(incident_id)
    if incident.state in (S.CLOSED, S.CONTAINED):
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
    notify.publish(topic_arn, f"sdcguard: incident {incident_id} {closed.state.value}", notify.describe(closed), incident=closed, client=sns)
    return closed, spent


def release_incident(
    ledger: Ledger,
    api: k8s.ApiClient,
    incident_id: str,
    *,
    topic_arn: str,
    decision: Decision | None = None,
    sns: Any = None,
    actor: str = "release",
) -> Incident:
    """The reject path: uncordon the nodes, leave the pointer, resume the job, record FALSE_ALARM.

    Idempotent. Raises :class:`IncidentNotWaiting` unless the incident was rejected.
    """
    if decision is not None:
        ledger.update(incident_id, lambda current: record_decision(current, decision))
    incident = ledger.get(incident_id)
    if incident.state == S.FALSE_ALARM:
        return incident
    if incident.state != S.REJECTED:
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; only a rejected incident is released")
    for suspect in incident.suspects:
        uncordon_node(api, suspect.node, incident_id)
    job = incident.alarm.job
    resume_job(api, job.namespace, job.job_name, incident_id, still_open=lambda other: holds_job(ledger, other))
    reviewer = incident.decision.reviewer if incident.decision else "unknown"
    released = ledger.update(
        incident_id,
        lambda current: current
        if current.state != S.REJECTED
        else current.advance(S.FALSE_ALARM, actor=actor, note=f"rejected by {reviewer}: nodes released, job resumed"),
    )
    notify.publish(topic_arn, f"sdcguard: incident {incident_id} FALSE_ALARM", notify.describe(released), incident=released, client=sns)
    return released


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
        where = failure if failure.state != GENERIC_PLACE else failure.model_copy(update={"state": f"after {current.state.value}"})
        recorded[:] = [where]
        return current.advance(target, actor=actor, note=f"{where.state}: {where.error}", failure=where)

    stopped = ledger.update(incident_id, change)
    if stopped.state == target and recorded and stopped.failure == recorded[0]:
        notify.publish(
            topic_arn,
            f"sdcguard: incident {incident_id} {target.value} ({failure.error})",
            notify.describe(stopped)
            + "\nThe node stays cordoned and the job suspended until someone acts."
            * (target == S.NEEDS_ATTENTION and stopped.entered(S.CORDONED) is not None),
            incident=stopped,
            client=sns,
        )
    return stopped


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
