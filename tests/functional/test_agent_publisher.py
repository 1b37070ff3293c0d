"""The alarm publisher: delivered to EventBridge on the stand-in, or spooled within its budget."""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, cast

import boto3
import pytest
from botocore.config import Config

from sdcguard.agent.alarm import job_identity
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.publisher import Publisher
from sdcguard.contract import Alarm
from sdcguard.infra.local.standin import LocalStandIn

if TYPE_CHECKING:
    from mypy_boto3_events import EventBridgeClient

EVENT = Path(__file__).resolve().parents[1] / "events" / "alarm_ring_audit.json"


def sample_alarm(config: GuardConfig | None = None, **changes: object) -> Alarm:
    """The stored sample alarm with a fresh id; with ``config``, sent now by that config's job."""
    detail = json.loads(EVENT.read_text())["detail"]
    if config is not None:
        detail.update(job=job_identity(config).model_dump(), checkpoint_prefix=config.checkpoint_prefix,
                      time=datetime.now(UTC).isoformat())
    return Alarm.model_validate({**detail, "alarm_id": uuid.uuid4().hex, **changes})


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
    alarm = sample_alarm(config)
    assert not Publisher(config, events_client=dead, s3_client=s3).publish(alarm).delivered
    key = f"jobs/gpt/alarms/alarm-{alarm.alarm_id}.json"
    # An alarm only the S3 spool holds (its node's local spool is gone with the node).
    only_s3 = sample_alarm(config)
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


class Accepting:
    """An EventBridge client that accepts every event and remembers it (put_events is all the publisher calls)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def put_events(self, Entries: list[dict[str, str]]) -> dict[str, object]:
        self.sent += [json.loads(e["Detail"])["alarm_id"] for e in Entries]
        return {"FailedEntryCount": 0, "Entries": [{"EventId": f"e-{len(self.sent)}"}]}


def test_a_start_republishes_only_its_own_jobs_recent_alarms_and_says_once_what_it_left(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Given: one spool folder (a shared working directory) holding this job's alarm, two of an unrelated
    # job's, one of this job's name under another checkpoint prefix (another run), and an old one of this job.
    config = GuardConfig(spool_dir=str(tmp_path), job_name="gpt", checkpoint_prefix=str(tmp_path / "ckpt"),
                         spool_max_age_s=3600.0)
    other_job = GuardConfig(spool_dir=str(tmp_path), job_name="bert", checkpoint_prefix=str(tmp_path / "b"))
    mine = sample_alarm(config)
    theirs = [sample_alarm(other_job), sample_alarm(other_job)]
    other_run = sample_alarm(config, checkpoint_prefix=str(tmp_path / "earlier"))
    old = sample_alarm(config, time=datetime.now(UTC) - timedelta(hours=2))
    for alarm in (mine, *theirs, other_run, old):
        (tmp_path / f"alarm-{alarm.alarm_id}.json").write_text(alarm.model_dump_json())
    events = Accepting()

    # When: this job starts.
    publisher = Publisher(config, events_client=cast("EventBridgeClient", events))
    with caplog.at_level(logging.WARNING, logger="sdcguard.agent.publisher"):
        outcomes = publisher.republish_spooled(s3=False)

    # Then: its own recent alarm alone is sent and leaves the spool; the rest stay, said once per kind.
    assert events.sent == [mine.alarm_id]
    assert list(outcomes) == [mine.alarm_id]
    assert not (tmp_path / f"alarm-{mine.alarm_id}.json").exists()
    left = {a.alarm_id for a in (*theirs, other_run, old)}
    assert set(publisher.left_alone) == left
    assert all((tmp_path / f"alarm-{i}.json").exists() for i in left)
    skipped = [r for r in caplog.records if "left alone" in r.getMessage()]
    assert len(skipped) == 1
    assert "3 spooled alarm(s) belong to other jobs" in skipped[0].getMessage()
    assert len([r for r in caplog.records if "older than spool_max_age_s" in r.getMessage()]) == 1
    # The check can fail: with a long enough age the old alarm of this job is republished too.
    again = Publisher(GuardConfig(spool_dir=str(tmp_path), job_name="gpt", checkpoint_prefix=str(tmp_path / "ckpt")),
                      events_client=cast("EventBridgeClient", events)).republish_spooled(s3=False)
    assert list(again) == [old.alarm_id]
