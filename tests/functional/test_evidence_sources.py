"""The evidence comes from where the pipeline says, over the time the pipeline recorded: a metric under a
namespace of the tenant's own corroborates nothing, an alarm's own ``time`` cannot move the window away from
the incident's record, and an alarm dated in the future is refused at record, writing nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sdcguard.contract import IncidentState
from sdcguard.lambdas.errors import AlarmFromTheFuture
from sdcguard.lambdas.evidence import AFTER, BEFORE
from sdcguard.lambdas.handlers import evidence, record
from tests.functional.test_handlers_pipeline import CTX, World, alarm_event, drive, world

__all__ = ["world"]  # the fixture, shared with the pipeline's handler tests


def _forge(world: World, instance_id: str, namespace: str, value: float) -> None:
    """What anyone with cloudwatch:PutMetricData can publish: a DCGM counter of that instance's GPU."""
    world.standin.client("cloudwatch").put_metric_data(Namespace=namespace, MetricData=[{
        "MetricName": "DCGM_FI_DEV_XID_ERRORS", "Value": value, "Timestamp": datetime.now(UTC),
        "Dimensions": [{"Name": "InstanceId", "Value": instance_id}, {"Name": "GpuDevice", "Value": "0"}]}])


def test_a_counter_under_another_namespace_corroborates_nothing(world: World) -> None:
    # Given a healthy node whose Xid counter a tenant published as 99 under a namespace of its own
    healthy = world.node(0)
    _forge(world, healthy["instance_id"], "Tenant/GPU", 99.0)
    # When an alarm naming that node reaches the evidence
    incident = world.ledger.get(drive(world, alarm_event(world, 0), through="evidence"))
    # Then the forged series is not read, the verdict stands, and the namespaces read are named
    instances: list[dict[str, Any]] = incident.evidence["instances"]  # type: ignore[assignment]
    (entry,) = instances
    assert incident.evidence["verdict"] == "no hardware signal"
    assert {m["namespace"] for m in entry["metrics"]} == {"ContainerInsights"}
    assert entry["namespaces"] == ["ContainerInsights"]
    assert any("namespace 'ContainerInsights' (DCGM counters)" in r for r in entry["reasons"])
    sources: dict[str, Any] = incident.evidence["sources"]  # type: ignore[assignment]
    assert (sources["dcgm_namespace"], sources["container_insights_namespace"]) == ("ContainerInsights",) * 2


def test_the_window_is_the_records_not_the_alarms(world: World) -> None:
    # Given an incident on the faulty node (its seeded Xid and ECC errors span the last 20 minutes) whose
    # alarm says it was raised 50 minutes before it was recorded
    faulty = world.seeded["faulty_node"]["index"]
    incident_id = drive(world, alarm_event(world, faulty), through="cordon")
    recorded_at = world.ledger.get(incident_id).created_at
    claimed = recorded_at - timedelta(minutes=50)
    world.ledger.update(incident_id, lambda i: i.model_copy(
        update={"alarm": i.alarm.model_copy(update={"time": claimed})}))
    # When the evidence is collected
    evidence.handler({"incident_id": incident_id}, CTX)
    collected = world.ledger.get(incident_id)
    # Then the window reaches the record (and no further back than the clamp), so the errors are read
    instances: list[dict[str, Any]] = collected.evidence["instances"]  # type: ignore[assignment]
    (entry,) = instances
    start, end = datetime.fromisoformat(entry["window_start"]), datetime.fromisoformat(entry["window_end"])
    assert (start, end) == (recorded_at - 2 * BEFORE, recorded_at + AFTER)
    assert collected.state == IncidentState.EVIDENCE_COLLECTED
    assert collected.evidence["verdict"] == "corroborated"


def test_an_alarm_dated_in_the_future_is_refused_at_record_writing_nothing(world: World) -> None:
    before = world.standin.client("dynamodb").scan(TableName=world.ledger.table)["Count"]
    event = alarm_event(world, 0)
    event["detail"]["time"] = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
    with pytest.raises(AlarmFromTheFuture, match=r"after the pipeline's clock .* allowance for clock skew is 300 s"):
        record.handler(event, CTX)
    assert world.standin.client("dynamodb").scan(TableName=world.ledger.table)["Count"] == before
    # A clock a minute ahead is within the allowance.
    event = alarm_event(world, 0)
    event["detail"]["time"] = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    assert record.handler(event, CTX)["duplicate"] is False
