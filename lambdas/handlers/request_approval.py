"""request_approval: store the task token, notify the reviewers (``.waitForTaskToken``)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.approval import request_approval
from lambdas.idempotency import run_once
from lambdas.inputs import ApprovalRequest, parse_input
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, state}``; the machine waits for the token's answer. Raises ``IncidentNotWaiting``."""
    settings = get_settings()
    request = parse_input(ApprovalRequest, event)

    def ask(_: dict[str, Any]) -> dict[str, Any]:
        incident = request_approval(
            Ledger(settings.ledger_table),
            request.incident_id,
            request.task_token,
            timeout_seconds=request.timeout_seconds,
            topic_arn=settings.topic_arn,
            decide_machine_arn=settings.decide_state_machine_arn,
        )
        return {"incident_id": incident.incident_id, "state": incident.state.value}

    result = run_once(ask, {"incident_id": request.incident_id, "task_token": request.task_token}, settings=settings, context=context)
    metrics.add_metric(name="ApprovalsRequested", unit=MetricUnit.Count, value=1)
    logger.info("approval requested", extra=result)
    return result
