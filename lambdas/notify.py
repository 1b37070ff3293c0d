"""Notifications to the reviewers' SNS topic."""

from __future__ import annotations

import json
import re
from typing import Any

import boto3

from sdcguard.contract import Incident

SUBJECT_LIMIT = 100
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")
PERSISTENCE = {
    "persistent": "persistent: the suspect replayed its computation and got it wrong again",
    "transient": "transient: the suspect replayed its computation and now agrees with the majority",
    "unknown": "unknown: no replay applies to this detector",
}


def quote(value: object) -> str:
    """``value`` as a JSON string literal: newlines, control and non-ASCII characters escaped.

    Every string an alarm or a reviewer supplied goes through this before it is
    put in a notification, so a crafted message or name cannot start a line of
    its own (a forged "Suspect:" or approve command) in the reviewers' e-mail.
    """
    return json.dumps(str(value), ensure_ascii=True)


def publish(topic_arn: str, subject: str, message: str, *, incident: Incident | None = None, client: Any = None) -> str:
    """Publish ``message`` to the topic; returns the SNS message id.

    The subject is cut to SNS's 100 characters; the incident id and state
    travel as message attributes so subscribers can filter.
    """
    client = client or boto3.client("sns")
    subject = _UNPRINTABLE.sub(" ", subject)  # SNS refuses a subject with a line break or non-ASCII
    attributes: dict[str, Any] = {}
    if incident is not None:
        attributes = {
            "incident_id": {"DataType": "String", "StringValue": incident.incident_id},
            "state": {"DataType": "String", "StringValue": incident.state.value},
        }
    response = client.publish(
        TopicArn=topic_arn,
        Subject=subject[:SUBJECT_LIMIT],
        Message=message,
        MessageAttributes=attributes,
    )
    return str(response["MessageId"])


NODE_CHECK_TITLES = {
    "reproduce": "Reproduction on the suspect",
    "qualify": "Qualification of the replacement",
}


def node_check_lines(incident: Incident) -> list[str]:
    """One line per node check (the capsule replayed on a suspect or a new node), by purpose, and one naming the
    image it ran when it ran one."""
    lines = []
    for purpose, title in NODE_CHECK_TITLES.items():
        for check in (c for c in incident.node_checks if c.purpose == purpose):
            lines.append(f"{title}: {quote(check.node)}: {quote(check.summary)}")
            if check.image:  # which software gave the answer (the stack's NodeCheckImage, by digest)
                lines.append(f"{title}: {quote(check.node)}: ran image {quote(check.image)}")
    return lines


def describe(incident: Incident) -> str:
    """A plain-text description of the incident for a human."""
    alarm = incident.alarm
    job = alarm.job
    lines = [
        f"Incident {incident.incident_id}: {incident.state.value}",
        f"Job: {quote(job.namespace)}/{quote(job.job_name)} on HyperPod {quote(job.hyperpod_cluster)} "
        f"(EKS {quote(job.eks_cluster)})",
        f"Detector: {alarm.detector.value} at step {alarm.step} ({'localised' if alarm.localized else 'not localised'})",
        f"Fault persistence: {PERSISTENCE[alarm.fault_persistence]}",
        f"Trusted through step: {alarm.trusted_through_step()}",
        f"Duplicate alarms: {incident.duplicate_alarms}",
    ]
    if incident.repeat_of is not None:
        lines.insert(1, f"The same fault again: {incident.repeat_of.describe()}")
    for suspect in incident.suspects:
        lines.append(
            f"Suspect: rank {suspect.global_rank} pod {quote(suspect.pod)} node {quote(suspect.node)} "
            f"instance {suspect.instance_id}"
        )
    if not incident.suspects:
        for raw in alarm.suspects:
            lines.append(f"Suspect (unresolved): rank {raw.global_rank} pod {quote(raw.pod)} node {quote(raw.node)}")
    if alarm.message:
        lines.append(f"Agent says: {quote(alarm.message)}")
    for line in node_check_lines(incident):
        lines.append(line)
    if incident.decision is not None:
        d = incident.decision
        lines.append(f"Decision: {d.decision} by {quote(d.reviewer)}: {quote(d.reason)}")
    if incident.failure is not None:
        f = incident.failure
        lines.append(f"Stopped in {quote(f.state)}: {quote(f.error)}: {quote(f.cause)}")
    return "\n".join(lines)
