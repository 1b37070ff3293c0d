"""replace: BatchReplaceClusterNodes for one approved instance (one iteration of the Map)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.idempotency import run_once
from sdcguard.lambdas.inputs import InstanceRef, parse_input
from sdcguard.lambdas.outputs import ReplacementRequested
from sdcguard.lambdas.replace import request_replacement
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.ReplacementRequested`. Raises ``IncidentNotWaiting`` (no approval in the ledger), ``BlastRadiusExceeded``, ``NodeHeldByHyperPod``, ``ReplacementFailed``."""
    result = run_once(replace, parse_input(InstanceRef, event), ReplacementRequested, context=context)
    metrics.add_metric(name="ReplacementsRequested", unit=MetricUnit.Count, value=1)
    logger.info("replacement requested", extra=result.model_dump())
    return result.model_dump(mode="json")


def replace(ref: InstanceRef) -> ReplacementRequested:
    """Ask HyperPod to replace the approved instance, once."""
    replacement = request_replacement(
        clients.ledger(),
        ref.incident_id,
        ref.instance_id,
        hyperpod_cluster=get_settings().hyperpod_cluster,
        max_replacements_per_day=get_settings().max_replacements_per_day,
        sagemaker=clients.aws("sagemaker"),
    )
    return ReplacementRequested(incident_id=ref.incident_id, instance_id=ref.instance_id, status=replacement.status)
