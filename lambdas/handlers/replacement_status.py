"""replacement_status: one poll of the wait loop."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.inputs import StatusPoll, parse_input
from sdcguard.lambdas.outputs import ReplacementPoll
from sdcguard.lambdas.replace import replacement_status
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.ReplacementPoll`.

    ``attempt`` counts this poll; ``exhausted`` is True when the bound of the
    loop is reached without the replacement running.
    """
    result = poll(parse_input(StatusPoll, event))
    metrics.add_metric(name="ReplacementPolls", unit=MetricUnit.Count, value=1)
    logger.info("replacement status", extra=result.model_dump())
    return result.model_dump(mode="json")


def poll(request: StatusPoll) -> ReplacementPoll:
    """Ask HyperPod once; record the new instances when they all run."""
    settings = get_settings()
    progress = replacement_status(
        clients.ledger(), request.incident_id, hyperpod_cluster=settings.hyperpod_cluster, sagemaker=clients.aws("sagemaker")
    )
    attempt = request.attempt + 1
    return ReplacementPoll(
        incident_id=request.incident_id,
        attempt=attempt,
        done=progress.done,
        failed=progress.failed,
        exhausted=not progress.done and attempt >= settings.replacement_max_polls,
        pending=progress.pending,
    )
