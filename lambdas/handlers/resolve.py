"""resolve: suspect rank -> pod -> node -> instance, each link confirmed by the cluster."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.inputs import IncidentRef, parse_input
from sdcguard.lambdas.outputs import Resolved
from sdcguard.lambdas.resolve import resolve_incident
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Resolved`.

    Raises ``SuspectMismatch``, ``SuspectNotOperatorPod``, ``SuspectUnresolvable``, ``NotInCluster`` (nothing touched),
    ``TransientKubernetesError``.
    """
    result = resolve(parse_input(IncidentRef, event))
    metrics.add_metric(name="SuspectsResolved", unit=MetricUnit.Count, value=len(result.instance_ids))
    logger.info("resolved", extra={"instance_ids": result.instance_ids})
    return result.model_dump(mode="json")


def resolve(ref: IncidentRef) -> Resolved:
    """Resolve and record the incident's suspects (reads only: retried as it is)."""
    incident = resolve_incident(
        clients.ledger(), ref.incident_id, get_settings(), kubernetes=clients.kubernetes(), sagemaker=clients.aws("sagemaker")
    )
    return Resolved(incident_id=incident.incident_id, instance_ids=incident.instance_ids)
