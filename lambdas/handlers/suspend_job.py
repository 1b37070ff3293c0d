"""suspend_job: ``spec.runPolicy.suspend: true`` on the incident's PyTorchJob."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.idempotency import run_once
from sdcguard.lambdas.inputs import IncidentRef, parse_input
from sdcguard.lambdas.job import suspend_for_incident
from sdcguard.lambdas.outputs import JobChanged
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.JobChanged`. Raises ``TransientKubernetesError``, ``KubernetesObjectMissing``."""
    result = run_once(suspend, parse_input(IncidentRef, event), JobChanged, context=context)
    metrics.add_metric(name="JobsSuspended", unit=MetricUnit.Count, value=1 if result.changed else 0)
    logger.info("job suspended", extra=result.model_dump())
    return result.model_dump(mode="json")


def suspend(ref: IncidentRef) -> JobChanged:
    """Suspend the incident's job (or join the incidents holding it) and record it."""
    change = suspend_for_incident(clients.ledger(), clients.kubernetes(), ref.incident_id)
    return JobChanged(incident_id=ref.incident_id, job=change.job, changed=change.changed, held_by=list(change.held_by))
