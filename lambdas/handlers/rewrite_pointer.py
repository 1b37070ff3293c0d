"""rewrite_pointer: point the job at the last pre-suspect checkpoint."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.idempotency import run_once
from lambdas.inputs import IncidentRef, parse_input
from lambdas.ledger import Ledger
from lambdas.pointer import rewrite_for_incident
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, checkpoint_before, checkpoint_after, resumed_from_step}``.

    Raises ``NoSafeCheckpoint``, ``PointerOutsidePrefix``.
    """
    settings = get_settings()
    ref = parse_input(IncidentRef, event)

    def rewrite(_: dict[str, Any]) -> dict[str, Any]:
        incident = rewrite_for_incident(
            Ledger(settings.ledger_table),
            ref.incident_id,
            checkpoint_bucket=settings.checkpoint_bucket,
            checkpoint_prefix=settings.checkpoint_prefix,
        )
        return {
            "incident_id": incident.incident_id,
            "checkpoint_before": incident.checkpoint_before,
            "checkpoint_after": incident.checkpoint_after,
            "resumed_from_step": incident.resumed_from_step,
        }

    result = run_once(rewrite, ref.model_dump(), settings=settings, context=context)
    metrics.add_metric(name="PointersRewritten", unit=MetricUnit.Count, value=1)
    logger.info("resume pointer rewritten", extra=result)
    return result
