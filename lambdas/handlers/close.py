"""close: the final state (CLOSED, or CONTAINED in cordon-only mode), timings and metrics."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.close import close_incident
from lambdas.idempotency import run_once
from lambdas.inputs import IncidentRef, parse_input
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, state, timings}``. Raises ``IncidentNotWaiting``."""
    settings = get_settings()
    ref = parse_input(IncidentRef, event)

    def close(_: dict[str, Any]) -> dict[str, Any]:
        incident, spent = close_incident(Ledger(settings.ledger_table), ref.incident_id, topic_arn=settings.topic_arn)
        return {"incident_id": incident.incident_id, "state": incident.state.value, "timings": spent}

    result = run_once(close, ref.model_dump(), settings=settings, context=context)
    for name, seconds in result["timings"].items():
        metrics.add_metric(name=name, unit=MetricUnit.Seconds, value=seconds)
    metrics.add_metric(name=f"Incidents{result['state'].title()}", unit=MetricUnit.Count, value=1)
    logger.info("incident ended", extra=result)
    return result
