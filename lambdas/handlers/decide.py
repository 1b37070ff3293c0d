"""decide: behind the decision machine: check the incident waits, answer its token, record the decision."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.decide import decide
from lambdas.inputs import DecideInput, parse_input
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, state, decision, reviewer}``.

    Raises ``UnknownDecision``, ``IncidentNotWaiting``, ``ApprovalExpired``,
    ``IncidentNotFound``; none of them changes anything.
    """
    settings = get_settings()
    request = parse_input(DecideInput, event)
    incident = decide(
        Ledger(settings.ledger_table),
        request.incident_id,
        request.decision,
        reviewer=request.reviewer,
        reason=request.reason,
    )
    metrics.add_metric(name="Approved" if request.decision == "approve" else "Rejected", unit=MetricUnit.Count, value=1)
    logger.info("decided", extra={"decision": request.decision, "reviewer": request.reviewer})
    return {
        "incident_id": incident.incident_id,
        "state": incident.state.value,
        "decision": request.decision,
        "reviewer": request.reviewer,
    }
