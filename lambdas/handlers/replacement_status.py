"""replacement_status: one poll of the wait loop."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.inputs import StatusPoll, parse_input
from lambdas.ledger import Ledger
from lambdas.replace import replacement_status
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, attempt, done, failed, exhausted, pending}``.

    ``attempt`` counts this poll; ``exhausted`` is True when the bound of the
    loop is reached without the replacement running.
    """
    settings = get_settings()
    poll = parse_input(StatusPoll, event)
    progress = replacement_status(Ledger(settings.ledger_table), poll.incident_id, hyperpod_cluster=settings.hyperpod_cluster)
    attempt = poll.attempt + 1
    result = {
        "incident_id": poll.incident_id,
        "attempt": attempt,
        "done": progress.done,
        "failed": progress.failed,
        "exhausted": not progress.done and attempt >= settings.replacement_max_polls,
        "pending": progress.pending,
    }
    metrics.add_metric(name="ReplacementPolls", unit=MetricUnit.Count, value=1)
    logger.info("replacement status", extra=result)
    return result
