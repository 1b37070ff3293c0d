"""release: the reject path: uncordon, leave the pointer, resume, record FALSE_ALARM."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.close import release_incident
from sdcguard.lambdas.idempotency import run_once
from sdcguard.lambdas.inputs import DecidedRef, parse_input
from sdcguard.lambdas.outputs import Ended
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Ended`. Raises ``IncidentNotWaiting``, ``TransientKubernetesError``."""
    result = run_once(release, parse_input(DecidedRef, event), Ended, context=context)
    metrics.add_metric(name="FalseAlarms", unit=MetricUnit.Count, value=1)
    logger.info("released", extra=result.model_dump())
    return result.model_dump(mode="json")


def release(ref: DecidedRef) -> Ended:
    """Uncordon, resume (unless another incident holds the job), record FALSE_ALARM, notify."""
    incident = release_incident(
        clients.ledger(),
        clients.kubernetes(),
        ref.incident_id,
        topic_arn=get_settings().topic_arn,
        sns=clients.aws("sns"),
    )
    return Ended(incident_id=incident.incident_id, state=incident.state.value)
