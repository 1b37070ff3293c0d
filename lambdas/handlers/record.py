"""record: validate the alarm event, open the incident or count a duplicate."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.inputs import AlarmEvent, parse_input
from lambdas.ledger import Ledger
from lambdas.record import record_alarm
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="detail.alarm_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, duplicate, mode, timeouts}``. Raises ``MalformedEvent``, ``NotInCluster``."""
    settings = get_settings()
    parsed = parse_input(AlarmEvent, event)

    # No cached answer here: a re-delivered event (same EventBridge id) must
    # come back as a duplicate, or a second execution would act. The ledger's
    # conditional create is what makes this idempotent.
    recorded = record_alarm(Ledger(settings.ledger_table), parsed.detail, settings)
    result: dict[str, Any] = {
        "incident_id": recorded.incident.incident_id,
        "duplicate": recorded.duplicate,
        "mode": recorded.incident.mode,
        "timeouts": settings.timeouts(),
    }
    logger.set_correlation_id(recorded.incident.incident_id)
    metrics.add_metric(name="DuplicateAlarms" if result["duplicate"] else "Incidents", unit=MetricUnit.Count, value=1)
    logger.info("alarm recorded", extra={"duplicate": result["duplicate"], "detector": parsed.detail.detector.value})
    return result
