"""cordon: one suspect instance's node (one iteration of the Map)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from lambdas.cordon import cordon_for_incident
from lambdas.eks_token import kubernetes_client
from lambdas.idempotency import run_once
from lambdas.inputs import InstanceRef, parse_input
from lambdas.ledger import Ledger
from lambdas.settings import get_settings
from lambdas.telemetry import logger, metrics, tracer


@logger.inject_lambda_context(correlation_id_path="incident_id")
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Returns ``{incident_id, instance_id, node, changed}``. Raises ``NotInCluster``, ``TransientKubernetesError``."""
    settings = get_settings()
    ref = parse_input(InstanceRef, event)

    def cordon(_: dict[str, Any]) -> dict[str, Any]:
        change = cordon_for_incident(
            Ledger(settings.ledger_table), kubernetes_client(settings.eks_cluster), ref.incident_id, ref.instance_id
        )
        return {"incident_id": ref.incident_id, "instance_id": ref.instance_id, "node": change.node, "changed": change.changed}

    result = run_once(cordon, ref.model_dump(mode="json"), settings=settings, context=context)
    if result["changed"]:
        metrics.add_metric(name="NodesCordoned", unit=MetricUnit.Count, value=1)
    logger.info("node cordoned", extra=result)
    return result
