"""record: validate the alarm event, open the incident or count a duplicate."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.inputs import AlarmEvent, RecordRequest, parse_input
from sdcguard.lambdas.outputs import Recorded, Timeouts
from sdcguard.lambdas.record import record_alarm
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="event.detail.alarm_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Recorded`. Raises ``MalformedEvent``, ``NotInCluster``.

    The incident machine hands ``{event, execution_id}``; the bare EventBridge
    event is accepted too (a direct invocation, with no execution to recognise).
    """
    request = parse_input(RecordRequest, event) if "execution_id" in event else None
    alarm_event = request.event if request is not None else parse_input(AlarmEvent, event)
    result = record(alarm_event, opened_by=request.execution_id if request is not None else None)
    logger.set_correlation_id(result.incident_id)
    metrics.add_metric(name="DuplicateAlarms" if result.duplicate else "Incidents", unit=MetricUnit.Count, value=1)
    logger.info("alarm recorded", extra={"duplicate": result.duplicate, "detector": alarm_event.detail.detector.value})
    return result.model_dump(mode="json")


def record(alarm_event: AlarmEvent, *, opened_by: str | None) -> Recorded:
    """Open the incident or count a duplicate into it.

    No cached answer here: a re-delivered event (same EventBridge id) in
    another execution must come back as a duplicate, or a second execution
    would act. The ledger's conditional create is what makes this idempotent,
    and ``opened_by`` what lets the same execution's retry go on.
    """
    settings = get_settings()
    recorded = record_alarm(clients.ledger(), alarm_event.detail, settings, opened_by=opened_by)
    return Recorded(
        incident_id=recorded.incident.incident_id,
        duplicate=recorded.duplicate,
        mode=recorded.incident.mode,
        timeouts=Timeouts(**settings.timeouts()),
        topic_arn=settings.topic_arn,
    )
