"""guard: blast-radius limits and the mode (normal, dry_run, cordon_only)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.contract import IncidentState
from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.guard import guard_incident
from sdcguard.lambdas.inputs import IncidentRef, parse_input
from sdcguard.lambdas.outputs import Guarded
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Guarded`. Raises ``BlastRadiusExceeded``, ``LedgerConflict``."""
    result = guard(parse_input(IncidentRef, event))
    metrics.add_metric(name="DryRuns" if result.action == "dry_run" else "IncidentsAdmitted", unit=MetricUnit.Count, value=1)
    logger.info("guarded", extra={"action": result.action, "mode": result.mode})
    return result.model_dump(mode="json")


def guard(ref: IncidentRef) -> Guarded:
    """Admit the incident within the limits, under the cluster's lock (idempotent through the ledger)."""
    settings = get_settings()
    incident = guard_incident(
        clients.ledger(),
        ref.incident_id,
        mode=settings.mode,
        max_quarantined_nodes=settings.max_quarantined_nodes,
        max_replacements_per_day=settings.max_replacements_per_day,
        kubernetes=clients.kubernetes,
    )
    action = "dry_run" if incident.state == IncidentState.DRY_RUN else "proceed"
    return Guarded(incident_id=incident.incident_id, action=action, mode=settings.mode)
