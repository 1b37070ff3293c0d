"""resume_job: un-suspend the PyTorchJob that this incident suspended."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.eks_token import kubernetes_client
from lambdas.idempotency import run_once
from lambdas.inputs import IncidentRef, parse_input
from lambdas.job import resume_for_incident
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, job, changed}``. Raises ``TransientKubernetesError``, ``IncidentNotWaiting``."""
    settings = get_settings()
    ref = parse_input(IncidentRef, event)

    def resume(_: dict[str, Any]) -> dict[str, Any]:
        change = resume_for_incident(Ledger(settings.ledger_table), kubernetes_client(settings.eks_cluster), ref.incident_id)
        return {"incident_id": ref.incident_id, "job": change.job, "changed": change.changed}

    result = run_once(resume, ref.model_dump(), settings=settings, context=context)
    metrics.add_metric(name="JobsResumed", unit=MetricUnit.Count, value=1 if result["changed"] else 0)
    logger.info("job resumed", extra=result)
    return result
