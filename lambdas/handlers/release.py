"""release: the reject path: uncordon, leave the pointer, resume, record FALSE_ALARM."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.close import release_incident
from lambdas.eks_token import kubernetes_client
from lambdas.idempotency import run_once
from lambdas.inputs import DecidedRef, parse_input
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, state}``. Raises ``IncidentNotWaiting``, ``TransientKubernetesError``."""
    settings = get_settings()
    ref = parse_input(DecidedRef, event)

    def release(_: dict[str, Any]) -> dict[str, Any]:
        incident = release_incident(
            Ledger(settings.ledger_table),
            kubernetes_client(settings.eks_cluster),
            ref.incident_id,
            topic_arn=settings.topic_arn,
            decision=ref.decision,
        )
        return {"incident_id": incident.incident_id, "state": incident.state.value}

    result = run_once(release, {"incident_id": ref.incident_id}, settings=settings, context=context)
    metrics.add_metric(name="FalseAlarms", unit=MetricUnit.Count, value=1)
    logger.info("released", extra=result)
    return result
