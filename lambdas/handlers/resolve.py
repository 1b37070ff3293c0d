"""resolve: suspect rank -> pod -> node -> instance, confirmed against the HyperPod cluster."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.inputs import IncidentRef, parse_input
from lambdas.ledger import Ledger
from lambdas.resolve import resolve_incident
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, instance_ids}``. Raises ``SuspectUnresolvable``, ``NotInCluster``."""
    settings = get_settings()
    ref = parse_input(IncidentRef, event)
    incident = resolve_incident(Ledger(settings.ledger_table), ref.incident_id)
    metrics.add_metric(name="SuspectsResolved", unit=MetricUnit.Count, value=len(incident.instance_ids))
    logger.info("resolved", extra={"instance_ids": incident.instance_ids})
    return {"incident_id": incident.incident_id, "instance_ids": incident.instance_ids}
