"""evidence: CloudWatch GPU metrics, DCGM counters and alarm history of the suspect instances."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.evidence import CORROBORATED, MetricSources, evidence_for_incident
from sdcguard.lambdas.inputs import IncidentRef, parse_input
from sdcguard.lambdas.outputs import Evidence
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Evidence` (the summary the reviewers see)."""
    result = evidence(parse_input(IncidentRef, event))
    metrics.add_metric(name="Corroborated" if result.verdict == CORROBORATED else "NoHardwareSignal", unit=MetricUnit.Count, value=1)
    logger.info("evidence collected", extra={"verdict": result.verdict})
    return result.model_dump(mode="json")


def evidence(ref: IncidentRef) -> Evidence:
    """Collect and record the evidence (reads only, then one conditional write: retried as it is)."""
    settings = get_settings()
    sources = MetricSources(dcgm_namespace=settings.dcgm_namespace,
                            container_insights_namespace=settings.container_insights_namespace)
    incident = evidence_for_incident(
        clients.ledger(), ref.incident_id, dcgm_counters=settings.dcgm_metric_names, sources=sources,
        cloudwatch=clients.aws("cloudwatch"),
    )
    return Evidence.model_validate({"incident_id": incident.incident_id, **incident.evidence})
