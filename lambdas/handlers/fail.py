"""fail: record where and why a step failed, and notify (also for alarms refused before an incident)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from contract import Failure
from lambdas import notify
from lambdas.close import record_failure
from lambdas.inputs import FailureReport, parse_input
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, state}`` (``incident_id`` None when the alarm was refused before an incident)."""
    settings = get_settings()
    report = parse_input(FailureReport, event)
    failure = Failure(state=report.state, error=report.error.error or "Unknown", cause=report.error.cause[:4096])
    metrics.add_metric(name="Failures", unit=MetricUnit.Count, value=1)
    logger.error("step failed", extra={"state": failure.state, "error": failure.error, "cause": failure.cause})
    if report.incident_id is None:
        notify.publish(
            settings.topic_arn,
            f"sdcguard: alarm refused in {failure.state} ({failure.error})",
            f"An alarm was refused before any incident was opened; nothing was touched.\n{failure.error}: {failure.cause}",
        )
        return {"incident_id": None, "state": "REFUSED"}
    incident = record_failure(Ledger(settings.ledger_table), report.incident_id, failure, topic_arn=settings.topic_arn)
    return {"incident_id": incident.incident_id, "state": incident.state.value}
