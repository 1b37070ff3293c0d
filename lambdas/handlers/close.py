"""close: the final state (CLOSED, or CONTAINED in cordon-only mode), timings and metrics."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.close import close_incident
from sdcguard.lambdas.idempotency import run_once
from sdcguard.lambdas.inputs import IncidentRef, parse_input
from sdcguard.lambdas.outputs import Closed
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Closed`. Raises ``IncidentNotWaiting``."""
    result = run_once(close, parse_input(IncidentRef, event), Closed, context=context)
    for name, seconds in result.timings.items():
        metrics.add_metric(name=name, unit=MetricUnit.Seconds, value=seconds)
    metrics.add_metric(name=f"Incidents{result.state.title()}", unit=MetricUnit.Count, value=1)
    logger.info("incident ended", extra=result.model_dump())
    return result.model_dump(mode="json")


def close(ref: IncidentRef) -> Closed:
    """End the incident and notify once."""
    incident, spent = close_incident(clients.ledger(), ref.incident_id, topic_arn=get_settings().topic_arn, sns=clients.aws("sns"))
    return Closed(incident_id=incident.incident_id, state=incident.state.value, timings=spent)
