"""Publishing an alarm: EventBridge PutEvents with retries inside a time budget, else a spool.

One rank publishes (the guard picks the lowest-ranked non-suspect). If
EventBridge cannot be reached within the budget, the alarm is written to a
local spool file and, when checkpoints live in S3, next to them under
``<prefix>/alarms/``, so an operator (or a later start) still finds it.
Publishing never blocks longer than its budget: the network part runs on a
daemon thread that is abandoned when the budget is spent.

The next start of the job republishes what was spooled before it trains
(:meth:`Publisher.republish_spooled`, called when the guard is built): each
spooled alarm that EventBridge now accepts is removed from the spool; one it
still refuses stays there for the start after. The alarm's id is stable, so a
republished alarm the pipeline already saw is recognised there as the same.

A spool belongs to one job: only alarms of this job (its cluster, namespace
and name, and its checkpoint prefix) are republished; another job's, left in
a shared working directory or prefix, are left alone, and so are this job's
alarms older than ``spool_max_age_s`` (acting on them now could cordon a node
repaired since). Each kind is reported once per start, not per alarm.

``SDCGuard(publisher=...)`` takes a publisher, :data:`DEFAULT_PUBLISHER` (the
default: a :class:`Publisher` built from the guard's config), or None, which
the guard turns into a :class:`NoPublisher`: the alarm is logged and its
policy applies, but nothing is sent, spooled or republished.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from pydantic import ValidationError

from sdcguard.agent.alarm import job_identity
from sdcguard.contract import DETAIL_TYPE, EVENT_SOURCE, Alarm

if TYPE_CHECKING:
    from mypy_boto3_events import EventBridgeClient
    from mypy_boto3_s3 import S3Client

    from sdcguard.agent.config import GuardConfig

log = logging.getLogger(__name__)


class PublisherDefault(enum.Enum):
    """The guard's default publisher, as opposed to None (no publishing at all)."""

    FROM_CONFIG = "a Publisher built from the guard's config"


DEFAULT_PUBLISHER = PublisherDefault.FROM_CONFIG
"""``SDCGuard``'s default ``publisher``: EventBridge from the config and the environment, else the spool."""


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

    def __init__(
        self, config: GuardConfig, *, events_client: EventBridgeClient | None = None, s3_client: S3Client | None = None
    ) -> None:
        self.config = config
        self._events = events_client
        self._s3 = s3_client
        self.left_alone: dict[str, str] = {}
        """Spooled alarms the last :meth:`republish_spooled` did not republish, by id: why (another job's,
        too old)."""

    @overload
    def _client(self, service: Literal["events"], timeout: float) -> EventBridgeClient: ...
    @overload
    def _client(self, service: Literal["s3"], timeout: float) -> S3Client: ...
    def _client(self, service: Literal["events", "s3"], timeout: float) -> Any:
        import boto3
        from botocore.config import Config

        # Our own retry loop spends the budget; botocore's would not know it.
        cfg = Config(connect_timeout=max(timeout, 0.1), read_timeout=max(timeout, 0.1),
                     retries={"max_attempts": 1, "mode": "standard"})
        return boto3.client(service, config=cfg)

    def publish(self, alarm: Alarm) -> PublishOutcome:
        """Deliver ``alarm``, or spool it; returns within ``publish_budget_s`` (plus a local file write)."""
        deadline = time.monotonic() + self.config.publish_budget_s
        outcome = self.deliver(alarm, deadline=deadline)
        if not outcome.delivered:
            log.error("alarm %s not delivered (%s); spooling it", alarm.alarm_id, outcome.error)
            self._spool(alarm, outcome, deadline)
        return outcome

    def deliver(self, alarm: Alarm, *, deadline: float | None = None) -> PublishOutcome:
        """Try EventBridge alone (no spool) within four fifths of the budget; the outcome says how it went."""
        budget = self.config.publish_budget_s
        deadline = time.monotonic() + budget if deadline is None else deadline
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
        return outcome

    def republish_spooled(self, *, local: bool = True, s3: bool = True) -> dict[str, PublishOutcome]:
        """Deliver the alarms an earlier start spooled (``spool_dir`` and ``<prefix>/alarms/`` in S3).

        Returns the outcome by alarm id. A delivered alarm is removed from
        both spools; one that is not stays (and is logged). Only this job's
        alarms no older than ``spool_max_age_s`` are republished; the others
        stay in the spool, are listed in :attr:`left_alone` and logged once
        per kind. Never raises for an unreadable spool or an unreachable
        service: it logs and goes on.
        """
        found: dict[str, tuple[Alarm, list[str]]] = {}
        if local:
            folder = Path(self.config.spool_dir)
            for path in sorted(folder.glob("alarm-*.json")) if folder.is_dir() else []:
                try:
                    alarm = Alarm.model_validate_json(path.read_text())
                except (OSError, ValidationError) as exc:
                    log.error("spooled alarm %s is unreadable, left alone: %s", path, exc)
                    continue
                found.setdefault(alarm.alarm_id, (alarm, []))[1].append(str(path))
        location = self._s3_spool()
        if s3 and location is not None:
            bucket, key_prefix = location
            try:
                client = self._s3 or self._client("s3", self.config.publish_budget_s)
                listed = client.list_objects_v2(Bucket=bucket, Prefix=key_prefix).get("Contents", [])
                for item in listed:
                    body = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
                    alarm = Alarm.model_validate_json(body)
                    found.setdefault(alarm.alarm_id, (alarm, []))[1].append(f"s3://{bucket}/{item['Key']}")
            except Exception as exc:  # an outage here must not stop the job from starting
                log.error("could not read the S3 alarm spool s3://%s/%s: %s", bucket, key_prefix, exc)
        found = self._this_jobs(found)
        outcomes: dict[str, PublishOutcome] = {}
        for alarm_id, (alarm, places) in found.items():
            outcome = self.deliver(alarm)
            outcomes[alarm_id] = outcome
            if not outcome.delivered:
                log.error("spooled alarm %s still not delivered (%s); it stays in %s", alarm_id, outcome.error, places)
                continue
            log.warning("spooled alarm %s republished (event %s)", alarm_id, outcome.event_id)
            for place in places:
                self._unspool(place)
        return outcomes

    def _this_jobs(self, found: dict[str, tuple[Alarm, list[str]]]) -> dict[str, tuple[Alarm, list[str]]]:
        """The spooled alarms to republish: this job's, recent enough; the rest go to ``left_alone``, logged once."""
        job, prefix = job_identity(self.config), self.config.checkpoint_prefix
        oldest = datetime.now(UTC) - timedelta(seconds=self.config.spool_max_age_s)
        self.left_alone = {}
        others: dict[str, str] = {}
        stale: list[str] = []
        kept: dict[str, tuple[Alarm, list[str]]] = {}
        for alarm_id, (alarm, places) in found.items():
            sent = alarm.time if alarm.time.tzinfo is not None else alarm.time.replace(tzinfo=UTC)
            if alarm.job != job or alarm.checkpoint_prefix != prefix:
                others[alarm_id] = (f"{alarm.job.hyperpod_cluster}/{alarm.job.namespace}/{alarm.job.job_name} "
                                    f"({alarm.checkpoint_prefix})")
                self.left_alone[alarm_id] = f"another job's: {others[alarm_id]}"
            elif sent < oldest:
                stale.append(alarm_id)
                self.left_alone[alarm_id] = f"sent {sent.isoformat()}, older than spool_max_age_s"
            else:
                kept[alarm_id] = (alarm, places)
        if others:
            log.warning("%d spooled alarm(s) belong to other jobs than %s/%s/%s (%s) and are left alone in the "
                        "spool: %s", len(others), job.hyperpod_cluster, job.namespace, job.job_name, prefix,
                        sorted(set(others.values())))
        if stale:
            log.warning("%d spooled alarm(s) of this job are older than spool_max_age_s (%.0f s) and are not "
                        "republished: %s", len(stale), self.config.spool_max_age_s, stale)
        return kept

    def _s3_spool(self) -> tuple[str, str] | None:
        prefix = self.config.checkpoint_prefix
        if not prefix.startswith("s3://"):
            return None
        bucket, _, key_prefix = prefix[len("s3://"):].partition("/")
        return bucket, f"{key_prefix.strip('/')}/alarms/".lstrip("/")

    def _unspool(self, place: str) -> None:
        try:
            if place.startswith("s3://"):
                bucket, _, key = place[len("s3://"):].partition("/")
                (self._s3 or self._client("s3", self.config.publish_budget_s)).delete_object(Bucket=bucket, Key=key)
            else:
                Path(place).unlink(missing_ok=True)
        except Exception as exc:  # delivered already; a stale copy is only republished again
            log.error("could not remove the spooled copy %s: %s", place, exc)

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
        location = self._s3_spool()
        if location is None:
            return
        bucket, key_prefix = location
        key = f"{key_prefix}{name}"
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


class NoPublisher(Publisher):
    """What ``SDCGuard(publisher=None)`` publishes with: nothing. No bus is called, no spool is written or read."""

    def publish(self, alarm: Alarm) -> PublishOutcome:
        """Log ``alarm`` as not published; the outcome is not delivered and spooled nowhere."""
        log.warning("alarm %s not published: the guard was built with publisher=None", alarm.alarm_id)
        return PublishOutcome(error="not published (publisher=None)")

    def deliver(self, alarm: Alarm, *, deadline: float | None = None) -> PublishOutcome:
        """Nothing is sent: not delivered."""
        return PublishOutcome(error="not published (publisher=None)")

    def republish_spooled(self, *, local: bool = True, s3: bool = True) -> dict[str, PublishOutcome]:
        """No spool is read: an earlier run's alarms are not this guard's to send."""
        return {}
