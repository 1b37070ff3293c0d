"""needs_attention: a safe stop (approval timed out, limits reached, a suspect that does not match the cluster)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.contract import Failure
from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.close import stop_for_attention
from sdcguard.lambdas.errors import MalformedEvent
from sdcguard.lambdas.inputs import FailureReport, parse_input
from sdcguard.lambdas.outputs import Ended
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Ended`: NEEDS_ATTENTION recorded and the reviewers told.

    If this handler fails, the state machine publishes to the topic itself.
    """
    result = stop(parse_input(FailureReport, event))
    metrics.add_metric(name="NeedsAttention", unit=MetricUnit.Count, value=1)
    logger.warning("incident needs attention", extra=result.model_dump())
    return result.model_dump(mode="json")


def stop(report: FailureReport) -> Ended:
    """Record NEEDS_ATTENTION with where and why (once) and notify."""
    if report.incident_id is None:
        raise MalformedEvent("needs_attention: incident_id is required")
    failure = Failure(state=report.state, error=report.error.error or "Stopped", cause=report.error.cause[:4096])
    incident = stop_for_attention(
        clients.ledger(), report.incident_id, failure, topic_arn=get_settings().topic_arn, sns=clients.aws("sns")
    )
    return Ended(incident_id=incident.incident_id, state=incident.state.value)
