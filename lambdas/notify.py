"""Notifications to the reviewers' SNS topic."""

from __future__ import annotations

from typing import Any

import boto3

from contract import Incident

SUBJECT_LIMIT = 100


def publish(topic_arn: str, subject: str, message: str, *, incident: Incident | None = None, client: Any = None) -> str:
    """Publish ``message`` to the topic; returns the SNS message id.

    The subject is cut to SNS's 100 characters; the incident id and state
    travel as message attributes so subscribers can filter.
    """
    client = client or boto3.client("sns")
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


def describe(incident: Incident) -> str:
    """A plain-text description of the incident for a human."""
    alarm = incident.alarm
    lines = [
        f"Incident {incident.incident_id}: {incident.state.value}",
        f"Job: {alarm.job.namespace}/{alarm.job.job_name} on HyperPod {alarm.job.hyperpod_cluster} (EKS {alarm.job.eks_cluster})",
        f"Detector: {alarm.detector.value} at step {alarm.step} ({'localised' if alarm.localized else 'not localised'})",
        f"Trusted through step: {alarm.trusted_through_step()}",
        f"Duplicate alarms: {incident.duplicate_alarms}",
    ]
    for suspect in incident.suspects:
        lines.append(f"Suspect: rank {suspect.global_rank} pod {suspect.pod} node {suspect.node} instance {suspect.instance_id}")
    if not incident.suspects:
        for raw in alarm.suspects:
            lines.append(f"Suspect (unresolved): rank {raw.global_rank} pod {raw.pod} node {raw.node}")
    if alarm.message:
        lines.append(f"Agent says: {alarm.message}")
    if incident.failure is not None:
        lines.append(f"Stopped in {incident.failure.state}: {incident.failure.error}: {incident.failure.cause}")
    return "\n".join(lines)
