"""node_check_status: one poll of the node check wait loop."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.inputs import NodeCheckPoll as PollRequest
from sdcguard.lambdas.inputs import parse_input
from sdcguard.lambdas.node_check import poll_checks
from sdcguard.lambdas.outputs import NodeCheckPoll
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.NodeCheckPoll`.

    ``attempt`` counts this poll; ``exhausted`` is True when the loop's bound
    is reached with checks still running (they are then recorded as
    inconclusive and their Jobs deleted). Raises ``TransientKubernetesError``.
    """
    result = poll(parse_input(PollRequest, event))
    metrics.add_metric(name="NodeCheckPolls", unit=MetricUnit.Count, value=1)
    logger.info("node check status", extra=result.model_dump())
    return result.model_dump(mode="json")


def poll(request: PollRequest) -> NodeCheckPoll:
    """Read the running checks' Jobs once; record and clean up the finished ones."""
    settings = get_settings()
    attempt = request.attempt + 1
    give_up = attempt >= settings.node_check_max_polls
    progress = poll_checks(
        clients.ledger(), clients.kubernetes(), request.incident_id, request.purpose, give_up=give_up,
        accept_injected=settings.node_check_accept_injected_faults,
    )  # fmt: skip
    return NodeCheckPoll(
        incident_id=request.incident_id,
        purpose=request.purpose,
        attempt=attempt,
        done=progress.done and not (give_up and progress.gave_up),
        exhausted=give_up and progress.gave_up,
        summary=progress.summary,
        qualified=progress.qualified,
        failed_instance_ids=progress.failed_instance_ids,
    )
