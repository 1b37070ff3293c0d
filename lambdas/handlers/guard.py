"""guard: blast-radius limits and the mode (normal, dry_run, cordon_only)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from contract import IncidentState
from lambdas.guard import guard_incident
from lambdas.inputs import IncidentRef, parse_input
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, action: "proceed" | "dry_run", mode}``. Raises ``BlastRadiusExceeded``."""
    settings = get_settings()
    ref = parse_input(IncidentRef, event)
    incident = guard_incident(
        Ledger(settings.ledger_table),
        ref.incident_id,
        mode=settings.mode,
        max_quarantined_nodes=settings.max_quarantined_nodes,
        max_replacements_per_day=settings.max_replacements_per_day,
    )
    action = "dry_run" if incident.state == IncidentState.DRY_RUN else "proceed"
    metrics.add_metric(name="DryRuns" if action == "dry_run" else "IncidentsAdmitted", unit=MetricUnit.Count, value=1)
    logger.info("guarded", extra={"action": action, "mode": settings.mode})
    return {"incident_id": incident.incident_id, "action": action, "mode": settings.mode}
