"""decide: behind the decision machine: check the incident waits, answer its token, record the decision."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.decide import decide
from sdcguard.lambdas.inputs import DecideInput, parse_input
from sdcguard.lambdas.outputs import Decided
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.task_tokens import TaskTokens
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Decided`.

    Raises ``UnknownDecision``, ``UnverifiedDecision``, ``IncidentNotWaiting``,
    ``ApprovalExpired``, ``IncidentNotFound``; none of them changes anything.
    """
    result = deliver(parse_input(DecideInput, event))
    metrics.add_metric(name="Approved" if result.decision == "approve" else "Rejected", unit=MetricUnit.Count, value=1)
    logger.info("decided", extra={"decision": result.decision, "reviewer": result.reviewer, "execution": result.execution_arn})
    return result.model_dump(mode="json")


def deliver(request: DecideInput) -> Decided:
    """Answer the incident's task token and record the decision with who and which execution."""
    settings = get_settings()
    incident = decide(
        clients.ledger(),
        TaskTokens(settings.token_table, clients.aws("dynamodb")),
        request.incident_id,
        request.decision,
        reviewer=request.reviewer,
        reason=request.reason,
        execution_arn=request.execution_arn,
        decide_machine_arn=settings.decide_state_machine_arn,
        sfn=clients.aws("stepfunctions"),
    )
    return Decided(
        incident_id=incident.incident_id,
        state=incident.state.value,
        decision=request.decision,
        reviewer=request.reviewer,
        execution_arn=request.execution_arn,
    )
