"""resume_job: release the incident's hold on its PyTorchJob; un-suspend it when no other incident holds it."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.idempotency import run_once
from sdcguard.lambdas.inputs import IncidentRef, parse_input
from sdcguard.lambdas.job import resume_for_incident
from sdcguard.lambdas.outputs import JobChanged
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.JobChanged`. Raises ``TransientKubernetesError``, ``IncidentNotWaiting``."""
    result = run_once(resume, parse_input(IncidentRef, event), JobChanged, context=context)
    metrics.add_metric(name="JobsResumed", unit=MetricUnit.Count, value=1 if result.changed else 0)
    logger.info("job resumed" if result.changed else "job stays suspended", extra=result.model_dump())
    return result.model_dump(mode="json")


def resume(ref: IncidentRef) -> JobChanged:
    """Resume the incident's job unless another open incident still holds it; record it."""
    change = resume_for_incident(clients.ledger(), clients.kubernetes(), ref.incident_id)
    return JobChanged(incident_id=ref.incident_id, job=change.job, changed=change.changed, held_by=list(change.held_by))
