"""Publishing an alarm: EventBridge PutEvents with retries inside a time budget, else a spool.

One rank publishes (the guard picks the lowest-ranked non-suspect). If
EventBridge cannot be reached within the budget, the alarm is written to a
local spool file and, when checkpoints live in S3, next to them under
``<prefix>/alarms/``, so an operator (or a later start) still finds it.
Publishing never blocks longer than its budget: the network part runs on a
daemon thread that is abandoned when the budget is spent.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract import DETAIL_TYPE, EVENT_SOURCE, Alarm

if TYPE_CHECKING:
    from agent.config import GuardConfig

log = logging.getLogger(__name__)


@dataclass
class PublishOutcome:
    """What became of one alarm."""

    delivered: bool = False
    """EventBridge accepted it."""
    event_id: str | None = None
    attempts: int = 0
    spooled: list[str] = field(default_factory=list)
    """Where it was spooled (local path, s3:// URI) when not delivered."""
    error: str | None = None


class Publisher:
    """Sends alarms to an EventBridge bus; clients may be passed in (tests, the local stand-in)."""

    def __init__(self, config: GuardConfig, *, events_client: Any = None, s3_client: Any = None) -> None:
        self.config = config
        self._events = events_client
        self._s3 = s3_client

    def _client(self, service: str, timeout: float) -> Any:
        import boto3
        from botocore.config import Config

        # Our own retry loop spends the budget; botocore's would not know it.
        cfg = Config(connect_timeout=max(timeout, 0.1), read_timeout=max(timeout, 0.1),
                     retries={"max_attempts": 1, "mode": "standard"})
        return boto3.client(service, config=cfg)

    def publish(self, alarm: Alarm) -> PublishOutcome:
        """Deliver ``alarm``, or spool it; returns within ``publish_budget_s`` (plus a local file write)."""
        budget = self.config.publish_budget_s
        deadline = time.monotonic() + budget
        outcome = PublishOutcome()
        done = threading.Event()

        def attempt() -> None:
            try:
                self._deliver(alarm, outcome, deadline)
            except Exception as exc:  # any failure ends in the spool, never in the training loop
                outcome.error = f"{type(exc).__name__}: {exc}"
            finally:
                done.set()

        # Reserve a fifth of the budget for the S3 spool.
        worker = threading.Thread(target=attempt, name="sdcguard-publish", daemon=True)
        worker.start()
        done.wait(timeout=budget * 0.8)
        if outcome.delivered:
            log.warning("alarm %s published to EventBridge bus %s (event %s)", alarm.alarm_id,
                        self.config.event_bus, outcome.event_id)
            return outcome
        if outcome.error is None:
            outcome.error = f"no answer from EventBridge within {budget * 0.8:.1f} s"
        log.error("alarm %s not delivered (%s); spooling it", alarm.alarm_id, outcome.error)
        self._spool(alarm, outcome, deadline)
        return outcome

    def _deliver(self, alarm: Alarm, outcome: PublishOutcome, deadline: float) -> None:
        body = alarm.model_dump_json()
        delay = 0.2
        for attempt in range(1, self.config.publish_retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            outcome.attempts = attempt
            try:
                client = self._events or self._client("events", remaining)
                response = client.put_events(Entries=[{
                    "Source": EVENT_SOURCE,
                    "DetailType": DETAIL_TYPE,
                    "Detail": body,
                    "EventBusName": self.config.event_bus,
                }])
                entry = response["Entries"][0]
                if not response.get("FailedEntryCount") and entry.get("EventId"):
                    outcome.delivered = True
                    outcome.event_id = entry["EventId"]
                    outcome.error = None
                    return
                outcome.error = f"{entry.get('ErrorCode')}: {entry.get('ErrorMessage')}"
            except Exception as exc:  # connection refused, throttled, timed out: retry within budget
                outcome.error = f"{type(exc).__name__}: {exc}"
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay *= 2

    def _spool(self, alarm: Alarm, outcome: PublishOutcome, deadline: float) -> None:
        body = alarm.model_dump_json(indent=2)
        name = f"alarm-{alarm.alarm_id}.json"
        try:
            folder = Path(self.config.spool_dir)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(body)
            outcome.spooled.append(str(folder / name))
        except OSError as exc:
            log.error("could not spool alarm %s locally: %s", alarm.alarm_id, exc)
        prefix = self.config.checkpoint_prefix
        if not prefix.startswith("s3://"):
            return
        bucket, _, key_prefix = prefix[len("s3://"):].partition("/")
        key = f"{key_prefix.strip('/')}/alarms/{name}".lstrip("/")
        done = threading.Event()

        def upload() -> None:
            try:
                client = self._s3 or self._client("s3", max(deadline - time.monotonic(), 0.1))
                client.put_object(Bucket=bucket, Key=key, Body=body.encode(), ContentType="application/json")
                outcome.spooled.append(f"s3://{bucket}/{key}")
            except Exception as exc:  # the local spool already holds it
                log.error("could not spool alarm %s to s3://%s/%s: %s", alarm.alarm_id, bucket, key, exc)
            finally:
                done.set()

        threading.Thread(target=upload, name="sdcguard-spool", daemon=True).start()
        done.wait(timeout=max(deadline - time.monotonic(), 0.0))
