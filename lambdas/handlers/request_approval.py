"""request_approval: store the task token, notify the reviewers (``.waitForTaskToken``)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.approval import request_approval
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.idempotency import run_once
from sdcguard.lambdas.inputs import ApprovalRequest, parse_input
from sdcguard.lambdas.outputs import Ended
from sdcguard.lambdas.pointer import plan_rollback
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.task_tokens import TaskTokens
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Ended`; the machine waits for the token's answer.

    Raises ``IncidentNotWaiting``, and ``NoSafeCheckpoint`` or ``PointerOutsidePrefix`` (nothing asked,
    nothing replaced: the machine stops for attention).
    """
    result = run_once(ask, parse_input(ApprovalRequest, event), Ended, context=context)
    metrics.add_metric(name="ApprovalsRequested", unit=MetricUnit.Count, value=1)
    logger.info("approval requested", extra=result.model_dump())
    return result.model_dump(mode="json")


def ask(request: ApprovalRequest) -> Ended:
    """Store the token, move to AWAITING_APPROVAL and notify the reviewers once."""
    settings = get_settings()
    incident = request_approval(
        clients.ledger(),
        TaskTokens(settings.token_table, clients.aws("dynamodb")),
        request.incident_id,
        request.task_token,
        timeout_seconds=request.timeout_seconds,
        topic_arn=settings.topic_arn,
        decide_machine_arn=settings.decide_state_machine_arn,
        plan=lambda incident: plan_rollback(
            incident,
            checkpoint_bucket=settings.checkpoint_bucket,
            checkpoint_prefix=settings.checkpoint_prefix,
            s3=clients.aws("s3"),
        ),
        sns=clients.aws("sns"),
    )
    return Ended(incident_id=incident.incident_id, state=incident.state.value)
