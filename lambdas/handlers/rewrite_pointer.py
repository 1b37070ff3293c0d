"""rewrite_pointer: point the job at the last pre-suspect checkpoint."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.idempotency import run_once
from sdcguard.lambdas.inputs import IncidentRef, parse_input
from sdcguard.lambdas.outputs import PointerRewritten
from sdcguard.lambdas.pointer import rewrite_for_incident
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.PointerRewritten`. Raises ``NoSafeCheckpoint``, ``PointerOutsidePrefix``."""
    result = run_once(rewrite, parse_input(IncidentRef, event), PointerRewritten, context=context)
    metrics.add_metric(name="PointersRewritten", unit=MetricUnit.Count, value=1)
    logger.info("resume pointer rewritten", extra=result.model_dump())
    return result.model_dump(mode="json")


def rewrite(ref: IncidentRef) -> PointerRewritten:
    """Move the pointer back to the newest verified checkpoint before the suspect window; record before/after."""
    settings = get_settings()
    incident = rewrite_for_incident(
        clients.ledger(),
        ref.incident_id,
        checkpoint_bucket=settings.checkpoint_bucket,
        checkpoint_prefix=settings.checkpoint_prefix,
        s3=clients.aws("s3"),
    )
    return PointerRewritten(
        incident_id=incident.incident_id,
        checkpoint_before=incident.checkpoint_before,
        checkpoint_after=incident.checkpoint_after,
        resumed_from_step=incident.resumed_from_step,
    )
