"""fail: record where and why a step failed, and notify (also for alarms refused before an incident)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from pydantic import ValidationError

from sdcguard.contract import Alarm, Failure
from sdcguard.lambdas import clients, notify
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.close import record_failure
from sdcguard.lambdas.inputs import FailureReport, parse_input
from sdcguard.lambdas.outputs import Ended
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Ended` (``incident_id`` None when the alarm was refused before an incident).

    If this handler fails, the state machine publishes to the topic itself.
    """
    report = parse_input(FailureReport, event)
    metrics.add_metric(name="Failures", unit=MetricUnit.Count, value=1)
    logger.error("step failed", extra={"state": report.state, "error": report.error.error, "cause": report.error.cause})
    return fail(report).model_dump(mode="json")


def fail(report: FailureReport) -> Ended:
    """Record FAILED with where and why (once) and notify; a refused alarm is only announced."""
    settings = get_settings()
    failure = Failure(state=report.state, error=report.error.error or "Unknown", cause=report.error.cause[:4096])
    opened = _opened_before_failing(report) if report.incident_id is None else None
    if report.incident_id is None and opened is not None:
        report = report.model_copy(update={"incident_id": opened})
    if report.incident_id is None:
        notify.publish(
            settings.topic_arn,
            f"sdcguard: alarm refused in {failure.state} ({failure.error})",
            "An alarm was refused before any incident was opened; nothing was touched.\n"
            f"{notify.quote(failure.error)}: {notify.quote(failure.cause)}",
            client=clients.aws("sns"),
        )
        return Ended(incident_id=None, state="REFUSED")
    incident = record_failure(clients.ledger(), report.incident_id, failure, topic_arn=settings.topic_arn, sns=clients.aws("sns"))
    return Ended(incident_id=incident.incident_id, state=incident.state.value)


def _opened_before_failing(report: FailureReport) -> str | None:
    """The incident the failed ``record`` of this execution had opened, if it had (found by the alarm's key)."""
    if report.execution_id is None or report.event is None:
        return None
    try:
        alarm = Alarm.model_validate((report.event or {}).get("detail"))
    except ValidationError:
        return None  # an alarm that does not validate opened nothing
    incident = clients.ledger().opened_by(alarm, report.execution_id)
    return incident.incident_id if incident is not None else None
