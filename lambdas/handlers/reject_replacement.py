"""reject_replacement: a new node failed its qualification: cordon it and decide whether to replace it again."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.inputs import IncidentRef, parse_input
from sdcguard.lambdas.outputs import ReplacementRejected
from sdcguard.lambdas.replace import reject_unqualified
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.ReplacementRejected`. Raises ``IncidentNotWaiting`` (the replacement does
    not run yet), ``KubernetesObjectMissing``, ``TransientKubernetesError``."""
    # Idempotent through the ledger, not powertools' idempotency: a second replacement round calls it again
    # with an equal payload and must act on that round's nodes.
    result = reject(parse_input(IncidentRef, event))
    metrics.add_metric(name="ReplacementsRejected", unit=MetricUnit.Count, value=len(result.instance_ids))
    logger.info("replacement rejected", extra=result.model_dump())
    return result.model_dump(mode="json")


def reject(ref: IncidentRef) -> ReplacementRejected:
    """Cordon the new nodes that failed qualification; replace them once more if the limits allow."""
    settings = get_settings()
    rejection = reject_unqualified(
        clients.ledger(),
        clients.kubernetes(),
        ref.incident_id,
        hyperpod_cluster=settings.hyperpod_cluster,
        max_rounds=settings.max_replacement_rounds,
        max_replacements_per_day=settings.max_replacements_per_day,
    )
    return ReplacementRejected(
        incident_id=ref.incident_id,
        replace_again=rejection.replace_again,
        instance_ids=rejection.instance_ids,
        reason=rejection.reason,
    )
