"""replace: BatchReplaceClusterNodes for one approved instance (one iteration of the Map)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.idempotency import run_once
from lambdas.inputs import InstanceRef, parse_input
from lambdas.ledger import Ledger
from lambdas.replace import request_replacement
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, instance_id, status}``. Raises ``NodeHeldByHyperPod``, ``ReplacementFailed``."""
    settings = get_settings()
    ref = parse_input(InstanceRef, event)

    def replace(_: dict[str, Any]) -> dict[str, Any]:
        replacement = request_replacement(
            Ledger(settings.ledger_table),
            ref.incident_id,
            ref.instance_id,
            hyperpod_cluster=settings.hyperpod_cluster,
            decision=ref.decision,
        )
        return {"incident_id": ref.incident_id, "instance_id": ref.instance_id, "status": replacement.status}

    result = run_once(
        replace, {"incident_id": ref.incident_id, "instance_id": ref.instance_id}, settings=settings, context=context
    )
    metrics.add_metric(name="ReplacementsRequested", unit=MetricUnit.Count, value=1)
    logger.info("replacement requested", extra=result)
    return result
