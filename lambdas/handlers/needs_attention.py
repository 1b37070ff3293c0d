"""needs_attention: a safe stop (approval timed out, limits reached, nothing resolvable)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from contract import Failure
from lambdas.close import stop_for_attention
from lambdas.errors import MalformedEvent
from lambdas.inputs import FailureReport, parse_input
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, state}``: NEEDS_ATTENTION recorded and the reviewers told."""
    settings = get_settings()
    report = parse_input(FailureReport, event)
    if report.incident_id is None:
        raise MalformedEvent("needs_attention: incident_id is required")
    failure = Failure(state=report.state, error=report.error.error or "Stopped", cause=report.error.cause[:4096])
    incident = stop_for_attention(Ledger(settings.ledger_table), report.incident_id, failure, topic_arn=settings.topic_arn)
    metrics.add_metric(name="NeedsAttention", unit=MetricUnit.Count, value=1)
    logger.warning("incident needs attention", extra={"error": failure.error, "cause": failure.cause})
    return {"incident_id": incident.incident_id, "state": incident.state.value}
