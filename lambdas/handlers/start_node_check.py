"""start_node_check: create the replay Jobs of the suspect's reproduction or the replacements' qualification."""

from __future__ import annotations

import os
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.inputs import NodeCheckStart, parse_input
from sdcguard.lambdas.node_check import start_checks
from sdcguard.lambdas.outputs import NodeChecksStarted
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.NodeChecksStarted`. Raises ``IncidentNotWaiting`` (not at the check's
    stage), ``TransientKubernetesError``; a missing capsule or a refused Job is recorded as skipped, not raised."""
    # Idempotent through the ledger, not powertools' idempotency: a second replacement round calls it again
    # with an equal payload and must act on that round's nodes.
    result = start(parse_input(NodeCheckStart, event))
    metrics.add_metric(name="NodeChecksStarted", unit=MetricUnit.Count, value=result.started)
    logger.info("node checks started", extra=result.model_dump())
    return result.model_dump(mode="json")


def start(request: NodeCheckStart) -> NodeChecksStarted:
    """One replay Job per node to check, running the pipeline's image (NODE_CHECK_IMAGE), recorded in the ledger."""
    settings = get_settings()
    started = start_checks(
        clients.ledger(),
        clients.kubernetes(),
        request.incident_id,
        request.purpose,
        repeats=settings.node_check_repeats,
        deadline_seconds=settings.node_check_deadline_seconds,
        s3=clients.aws("s3"),
        image=settings.node_check_image,
        region=os.environ.get("AWS_REGION", ""),
        factories=tuple(f for f in settings.node_check_factories.split(",") if f),
    )
    return NodeChecksStarted(
        incident_id=request.incident_id, purpose=request.purpose, started=started.started, skipped=started.skipped
    )
