"""The alarm publisher: delivered to EventBridge on the stand-in, or spooled within its budget."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, cast

import boto3
from botocore.config import Config

from agent.config import GuardConfig
from agent.publisher import Publisher
from contract import Alarm
from infra.local.standin import LocalStandIn

if TYPE_CHECKING:
    from mypy_boto3_events import EventBridgeClient

EVENT = Path(__file__).resolve().parents[1] / "events" / "alarm_ring_audit.json"


def sample_alarm() -> Alarm:
    detail = json.loads(EVENT.read_text())["detail"]
    return Alarm.model_validate({**detail, "alarm_id": uuid.uuid4().hex})


def test_delivers_to_the_bus(standin: LocalStandIn) -> None:
    suffix = uuid.uuid4().hex[:8]
    events, sqs = standin.client("events"), standin.client("sqs")
    events.create_event_bus(Name=f"bus-{suffix}")
    events.put_rule(Name=f"r-{suffix}", EventBusName=f"bus-{suffix}",
                    EventPattern=json.dumps({"source": ["sdcguard.agent"]}))
    queue = sqs.create_queue(QueueName=f"q-{suffix}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_targets(Rule=f"r-{suffix}", EventBusName=f"bus-{suffix}", Targets=[{"Id": "q", "Arn": arn}])
    alarm = sample_alarm()

    outcome = Publisher(GuardConfig(event_bus=f"bus-{suffix}"), events_client=events).publish(alarm)

    assert outcome.delivered
    assert outcome.event_id
    assert outcome.attempts == 1
    assert not outcome.spooled
    [message] = sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=2)["Messages"]
    event = json.loads(message["Body"])
    assert event["detail-type"] == "SDC Alarm"
    assert Alarm.model_validate(event["detail"]) == alarm


def test_unreachable_eventbridge_spools_locally_and_to_s3_within_budget(tmp_path: Path,
                                                                         standin: LocalStandIn) -> None:
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    s3 = standin.client("s3")
    s3.create_bucket(Bucket=bucket)
    # Nothing listens on port 9 of loopback: every attempt is refused.
    dead = boto3.client("events", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
                        aws_access_key_id="x", aws_secret_access_key="x",
                        config=Config(retries={"max_attempts": 1}, connect_timeout=0.5))
    config = GuardConfig(publish_budget_s=2.0, publish_retries=3, spool_dir=str(tmp_path / "spool"),
                         checkpoint_prefix=f"s3://{bucket}/jobs/gpt")
    alarm = sample_alarm()

    started = time.monotonic()
    outcome = Publisher(config, events_client=dead, s3_client=s3).publish(alarm)
    elapsed = time.monotonic() - started

    assert not outcome.delivered
    assert outcome.attempts == 3
    assert outcome.error
    assert elapsed < 2.5
    local = tmp_path / "spool" / f"alarm-{alarm.alarm_id}.json"
    assert Alarm.model_validate_json(local.read_text()) == alarm
    key = f"jobs/gpt/alarms/alarm-{alarm.alarm_id}.json"
    assert outcome.spooled == [str(local), f"s3://{bucket}/{key}"]
    assert Alarm.model_validate_json(s3.get_object(Bucket=bucket, Key=key)["Body"].read()) == alarm


def test_a_hanging_endpoint_never_blocks_past_the_budget(tmp_path: Path) -> None:
    class Hanging:
        def put_events(self, **_: object) -> dict[str, object]:
            time.sleep(30)
            return {}

    config = GuardConfig(publish_budget_s=1.0, spool_dir=str(tmp_path))
    started = time.monotonic()
    # put_events is all the publisher calls on its EventBridge client.
    outcome = Publisher(config, events_client=cast("EventBridgeClient", Hanging())).publish(sample_alarm())
    assert time.monotonic() - started < 1.5
    assert not outcome.delivered
    assert len(outcome.spooled) == 1
    assert "within" in (outcome.error or "")


def test_the_next_start_republishes_what_was_spooled_locally_and_in_s3(tmp_path: Path, standin: LocalStandIn) -> None:
    # Given: an alarm spooled (locally and under the checkpoint prefix) while EventBridge was unreachable.
    suffix = uuid.uuid4().hex[:8]
    events, sqs, s3 = standin.client("events"), standin.client("sqs"), standin.client("s3")
    bucket = f"ckpt-{suffix}"
    s3.create_bucket(Bucket=bucket)
    events.create_event_bus(Name=f"bus-{suffix}")
    events.put_rule(Name=f"r-{suffix}", EventBusName=f"bus-{suffix}",
                    EventPattern=json.dumps({"source": ["sdcguard.agent"]}))
    queue = sqs.create_queue(QueueName=f"q-{suffix}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_targets(Rule=f"r-{suffix}", EventBusName=f"bus-{suffix}", Targets=[{"Id": "q", "Arn": arn}])
    dead = boto3.client("events", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
                        aws_access_key_id="x", aws_secret_access_key="x",
                        config=Config(retries={"max_attempts": 1}, connect_timeout=0.5))
    config = GuardConfig(event_bus=f"bus-{suffix}", publish_budget_s=2.0, spool_dir=str(tmp_path / "spool"),
                         checkpoint_prefix=f"s3://{bucket}/jobs/gpt")
    alarm = sample_alarm()
    assert not Publisher(config, events_client=dead, s3_client=s3).publish(alarm).delivered
    key = f"jobs/gpt/alarms/alarm-{alarm.alarm_id}.json"
    # An alarm only the S3 spool holds (its node's local spool is gone with the node).
    only_s3 = sample_alarm()
    s3.put_object(Bucket=bucket, Key=f"jobs/gpt/alarms/alarm-{only_s3.alarm_id}.json",
                  Body=only_s3.model_dump_json().encode())

    # When: the next start republishes, EventBridge reachable again.
    outcomes = Publisher(config, events_client=events, s3_client=s3).republish_spooled()

    # Then: both arrive once each and leave both spools.
    assert set(outcomes) == {alarm.alarm_id, only_s3.alarm_id}
    assert all(o.delivered for o in outcomes.values())
    bodies = []
    for _ in range(5):
        bodies += [json.loads(m["Body"]) for m in
                   sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages", [])]
        if len(bodies) >= 2:
            break
    assert sorted(Alarm.model_validate(b["detail"]).alarm_id for b in bodies) == sorted(outcomes)
    assert not (tmp_path / "spool" / f"alarm-{alarm.alarm_id}.json").exists()
    assert s3.list_objects_v2(Bucket=bucket, Prefix="jobs/gpt/alarms/").get("KeyCount", 0) == 0
    assert key not in [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
