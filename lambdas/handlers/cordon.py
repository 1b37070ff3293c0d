"""cordon: one suspect instance's node (one iteration of the Map)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from sdcguard.lambdas import clients
from sdcguard.lambdas.clients import named_throttling
from sdcguard.lambdas.cordon import cordon_for_incident
from sdcguard.lambdas.idempotency import run_once
from sdcguard.lambdas.inputs import InstanceRef, parse_input
from sdcguard.lambdas.outputs import Cordoned
from sdcguard.lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
@named_throttling
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns :class:`~sdcguard.lambdas.outputs.Cordoned`. Raises ``NotInCluster``, ``TransientKubernetesError``."""
    result = run_once(cordon, parse_input(InstanceRef, event), Cordoned, context=context)
    if result.changed:
        metrics.add_metric(name="NodesCordoned", unit=MetricUnit.Count, value=1)
    logger.info("node cordoned", extra=result.model_dump())
    return result.model_dump(mode="json")


def cordon(ref: InstanceRef) -> Cordoned:
    """Cordon the resolved node of ``ref.instance_id`` for the incident and record it."""
    change = cordon_for_incident(clients.ledger(), clients.kubernetes(), ref.incident_id, ref.instance_id)
    return Cordoned(incident_id=ref.incident_id, instance_id=ref.instance_id, node=change.node, changed=change.changed)
