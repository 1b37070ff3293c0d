"""evidence: CloudWatch GPU metrics, DCGM counters and alarm history of the suspect instances."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.evidence import CORROBORATED, evidence_for_incident
from lambdas.inputs import IncidentRef, parse_input
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, verdict, note, instances}`` (the summary the reviewers see)."""
    settings = get_settings()
    ref = parse_input(IncidentRef, event)
    incident = evidence_for_incident(Ledger(settings.ledger_table), ref.incident_id, dcgm_counters=settings.dcgm_metric_names)
    verdict = incident.evidence.get("verdict")
    metrics.add_metric(name="Corroborated" if verdict == CORROBORATED else "NoHardwareSignal", unit=MetricUnit.Count, value=1)
    logger.info("evidence collected", extra={"verdict": verdict})
    return {"incident_id": incident.incident_id, **incident.evidence}
