"""The incident ledger: one DynamoDB item per incident, written with conditional updates.

Table layout (the template creates it): partition key ``incident_id`` (S);
TTL attribute ``expires_at``; two sparse global secondary indexes, keys only:
:data:`OPEN_INDEX_DEFINITION` (partition ``open_cluster``, sort ``open_until``),
holding only the incidents that still count toward a cluster's blast radius,
so the guard reads those and never the closed ones; and
:data:`SUSPECT_INDEX_DEFINITION` (partition ``suspect_instance``, sort
``suspect_of``), holding one entry per incident and instance it names, so the
evidence step reads an instance's history and not the whole ledger. Item kinds:

- the incident: ``incident_id``, ``kind="incident"``, ``version`` (N),
  ``state``, ``hyperpod_cluster``, ``created_at``, ``body`` (the
  :class:`sdcguard.contract.Incident` as JSON), ``duplicates`` (N, an atomic counter of
  the alarms that collapsed into it, merged into ``duplicate_alarms`` on read),
  ``opened_by`` (the execution that opened it), ``fault_persistence``, and,
  while it counts toward the blast radius (:func:`counts_until`),
  ``open_cluster`` and ``open_until`` (epoch seconds);
- for each instance an incident names as a suspect, its index entry:
  ``incident_id="suspect#<instance id>#<id>"``, ``kind="suspect"``,
  ``suspect_instance`` (the instance id), ``suspect_of`` (the incident id);
  written before the incident records its suspects (:meth:`Ledger.index_suspects`);
- a lock per HyperPod cluster: ``incident_id="lock#<cluster>"``,
  ``kind="lock"``, ``owner``, ``expires_at`` (a lease), held by the guard so
  that two incidents are never admitted against the same count of
  quarantined nodes; ``recent`` maps the incidents admitted in the last
  :data:`RECENT_SECONDS` to when, so a guard also sees an admission that the
  (eventually consistent) index does not show yet.

An incident's id is derived from its idempotency key (cluster, job, suspect
nodes, suspect window), so duplicate alarms (many ranks, re-deliveries,
several detectors on one fault) all try to create the same item; the first
wins and the others only count themselves into ``duplicate_alarms``.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC
from typing import TYPE_CHECKING, Any

import boto3
from botocore.exceptions import ClientError

from sdcguard.contract import Alarm, Earlier, Incident, IncidentState, Transition
from sdcguard.lambdas.blast_radius import FOREVER, STOPPED_HOLDING, counts_until
from sdcguard.lambdas.errors import IncidentNotFound, LedgerConflict, LockLost

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient
    from mypy_boto3_dynamodb.type_defs import UpdateTypeDef

UNLOCALISED = "unlocalised"
INCIDENT_ATTRIBUTES = (
    "incident_id", "kind", "version", "state", "hyperpod_cluster", "created_at", "fault_persistence", "body",
    "duplicates", "opened_by",
)
"""The attributes an incident is read with (a projection): the reviewers' policy may read these and no
others (the template's ReviewerPolicy). Approval task tokens are not in the ledger at all (:mod:`sdcguard.lambdas.task_tokens`)."""
_PROJECTION = {
    "ProjectionExpression": ", ".join(f"#a{n}" for n in range(len(INCIDENT_ATTRIBUTES))),
    "ExpressionAttributeNames": {f"#a{n}": a for n, a in enumerate(INCIDENT_ATTRIBUTES)},
}
_SUSPECT = "suspect#"
_LOCK = "lock#"
_MAX_ATTEMPTS = 12
MAX_REPEATS = 50
"""How many incidents one fault (one idempotency key) may open, each a repeat of the one before."""
__all__ = ["FOREVER", "STOPPED_HOLDING", "Ledger", "counts_until", "idempotency_key", "incident_id_for"]

OPEN_INDEX = "open-by-cluster"
OPEN_INDEX_ATTRIBUTES = [
    {"AttributeName": "open_cluster", "AttributeType": "S"},
    {"AttributeName": "open_until", "AttributeType": "N"},
]
OPEN_INDEX_DEFINITION: dict[str, Any] = {
    "IndexName": OPEN_INDEX,
    "KeySchema": [
        {"AttributeName": "open_cluster", "KeyType": "HASH"},
        {"AttributeName": "open_until", "KeyType": "RANGE"},
    ],
    "Projection": {"ProjectionType": "KEYS_ONLY"},
}
"""The ledger's index of the incidents that count toward a cluster's blast radius (the template's
``GlobalSecondaryIndexes`` entry; its attributes are :data:`OPEN_INDEX_ATTRIBUTES`)."""
SUSPECT_INDEX = "incidents-by-instance"
SUSPECT_INDEX_ATTRIBUTES = [
    {"AttributeName": "suspect_instance", "AttributeType": "S"},
    {"AttributeName": "suspect_of", "AttributeType": "S"},
]
SUSPECT_INDEX_DEFINITION: dict[str, Any] = {
    "IndexName": SUSPECT_INDEX,
    "KeySchema": [
        {"AttributeName": "suspect_instance", "KeyType": "HASH"},
        {"AttributeName": "suspect_of", "KeyType": "RANGE"},
    ],
    "Projection": {"ProjectionType": "KEYS_ONLY"},
}
"""The ledger's index of incidents by the instances they named as suspects (the template's second
``GlobalSecondaryIndexes`` entry; its attributes are :data:`SUSPECT_INDEX_ATTRIBUTES`)."""
RECENT_SECONDS = 60.0


@dataclass(frozen=True)
class Lease:
    """A held cluster lock: who holds it, until when, and the admissions it remembers."""

    name: str
    owner: str
    expires_at: float
    recent: dict[str, float]
    """Incident id -> epoch seconds of its admission, for the last :data:`RECENT_SECONDS`."""

    @property
    def key(self) -> dict[str, Any]:
        return {"incident_id": {"S": _LOCK + self.name}}


def idempotency_key(alarm: Alarm) -> str:
    """The key that makes alarms about one fault in one run of the job one incident.

    (HyperPod cluster, namespace/job, the agent's run id, the suspect nodes
    sorted, the suspect window's start). The window starts after the last
    trusted step, which every detector on the same fault agrees on (see
    :meth:`sdcguard.contract.Alarm.trusted_through_step`); the run id (from the alarm id,
    :attr:`sdcguard.contract.Alarm.run_id`) is one per start of the job, so the same
    fault after a restart, or in a new job of the same name, is a new incident.
    An alarm without a run id (older agents) keys as before, without it. An
    unlocalised alarm names no nodes and collapses with other unlocalised
    alarms of the same window.
    """
    nodes = ",".join(alarm.suspect_nodes) or UNLOCALISED
    job = alarm.job
    run = f"|run-{alarm.run_id}" if alarm.run_id else ""
    return f"{job.hyperpod_cluster}|{job.namespace}/{job.job_name}{run}|{nodes}|after-{alarm.trusted_through_step()}"


def incident_id_for(key: str, generation: int = 0) -> str:
    """The incident id for an idempotency key: stable, short, and safe in a CLI argument.

    ``generation`` counts the repeats of the key (:meth:`Ledger.open`): the
    first incident of a key is generation 0.
    """
    material = key if generation == 0 else f"{key}#repeat-{generation}"
    return "sdc-" + hashlib.sha256(material.encode()).hexdigest()[:20]


def failed_before_acting(incident: Incident) -> bool:
    """Whether ``incident`` failed while still only RECORDED: nothing was resolved, admitted or touched for it."""
    return incident.state == IncidentState.FAILED and all(
        t.state in (IncidentState.RECORDED, IncidentState.FAILED) for t in incident.transitions
    )


def is_repeat(existing: Incident, alarm: Alarm) -> bool:
    """Whether ``alarm`` is the fault of ``existing`` coming back, not one more report of it.

    It is when ``existing`` has ended and the alarm was raised after it ended:
    alarms raised before the end (other ranks, re-deliveries, late detectors)
    are the same report and count into it. An incident that failed before
    acting (:func:`failed_before_acting`, e.g. its ``record`` wrote, then
    failed) did nothing about the fault: any later delivery of an alarm of it
    is a repeat, whenever raised, so the fault is still contained.
    """
    if not existing.state.terminal:
        return False
    if failed_before_acting(existing):
        return True
    raised = alarm.time if alarm.time.tzinfo is not None else alarm.time.replace(tzinfo=UTC)
    return raised > existing.transitions[-1].at if existing.transitions else True


def earlier(existing: Incident) -> Earlier:
    """What a repeat says about the incident it repeats."""
    ended = existing.transitions[-1].at if existing.transitions else existing.updated_at
    reviewer = existing.decision.reviewer if existing.decision else None
    return Earlier(incident_id=existing.incident_id, state=existing.state, ended_at=ended, decided_by=reviewer)


class Ledger:
    """The DynamoDB incident ledger. ``client`` defaults to a boto3 DynamoDB client."""

    def __init__(self, table: str, client: DynamoDBClient | None = None) -> None:
        self.table = table
        self.client = client or boto3.client("dynamodb")

    # -- incidents ------------------------------------------------------------

    def open(
        self, alarm: Alarm, *, mode: str, actor: str = "record", opened_by: str | None = None
    ) -> tuple[Incident, bool]:
        """Open the incident for ``alarm``, or count the alarm into the existing one.

        An incident that has ended absorbs only the alarms raised before it
        ended, and none once it failed before acting (:func:`is_repeat`): the
        same fault alarming after that opens a new incident, one generation
        on (:func:`incident_id_for`), whose ``repeat_of`` says how the earlier
        one ended, so it is never counted silently into a closed incident.
        Returns ``(incident, created)``; ``created`` is False for a duplicate.
        ``opened_by`` names the execution recording it: when the incident
        already exists because that same execution opened it (a retried
        ``record``, or a request botocore resent after a lost reply), it comes
        back as created and nothing is counted. Raises :class:`LedgerConflict`
        if the item keeps changing under us.
        """
        key = idempotency_key(alarm)
        repeats: Earlier | None = None
        generation, conflicts = 0, 0
        while generation < MAX_REPEATS:
            incident = Incident(
                incident_id=incident_id_for(key, generation),
                idempotency_key=key,
                alarm=alarm,
                mode=mode,
                opened_by=opened_by,
                repeat_of=repeats,
                transitions=[
                    Transition(
                        state=IncidentState.RECORDED,
                        actor=actor,
                        note="alarm recorded" + (f"; {repeats.describe()}" if repeats else ""),
                    )
                ],
            )
            try:
                self.client.put_item(
                    TableName=self.table,
                    Item=self._item(incident, 1),
                    ConditionExpression="attribute_not_exists(incident_id)",
                )
                return incident, True
            except ClientError as exc:
                if _code(exc) != "ConditionalCheckFailedException":
                    raise
            existing = self.get(incident.incident_id)  # IncidentNotFound if it vanished
            if opened_by is not None and existing.opened_by == opened_by:
                return existing, True  # our own earlier write: go on as its opener
            if is_repeat(existing, alarm):
                repeats = earlier(existing)
                generation += 1
                continue
            counted = self._count_duplicate(existing, opened_by)
            if counted is not None:
                return counted, False
            conflicts += 1  # it changed state meanwhile: read it again
            if conflicts >= _MAX_ATTEMPTS:
                raise LedgerConflict(f"incident {incident.incident_id} kept changing while counting a duplicate")
        raise LedgerConflict(f"alarm {alarm.alarm_id}: {MAX_REPEATS} incidents of one fault already; refusing another")

    def opened_by(self, alarm: Alarm, execution: str) -> Incident | None:
        """The incident of ``alarm`` that ``execution`` opened, if it opened one (its ``record`` wrote, then failed)."""
        key = idempotency_key(alarm)
        for generation in range(MAX_REPEATS):
            try:
                incident = self.get(incident_id_for(key, generation))
            except IncidentNotFound:
                return None
            if incident.opened_by == execution:
                return incident
        return None

    def _count_duplicate(self, existing: Incident, opened_by: str | None) -> Incident | None:
        """Count one more alarm into ``existing``, if it is still in the state it was read in; else None."""
        # An atomic counter, not a rewrite of the body: a storm of duplicates
        # must not contend with each other or with the handlers' writes. The
        # state must be the one read: an incident that ended meanwhile may make
        # this alarm a repeat instead.
        condition = "attribute_exists(incident_id) AND #state = :state"
        values: dict[str, Any] = {":one": {"N": "1"}, ":state": {"S": existing.state.value}}
        if opened_by is not None:
            condition += " AND (attribute_not_exists(opened_by) OR opened_by <> :me)"
            values[":me"] = {"S": opened_by}
        try:
            item = self.client.update_item(
                TableName=self.table,
                Key={"incident_id": {"S": existing.incident_id}},
                UpdateExpression="ADD duplicates :one",
                ConditionExpression=condition,
                ExpressionAttributeNames={"#state": "state"},
                ExpressionAttributeValues=values,
                ReturnValues="ALL_NEW",
            )["Attributes"]
        except ClientError as exc:
            if _code(exc) != "ConditionalCheckFailedException":
                raise
            return None
        return self._incident(item)

    def get(self, incident_id: str) -> Incident:
        """The incident. Raises :class:`IncidentNotFound`."""
        return self.get_versioned(incident_id)[0]

    def get_versioned(self, incident_id: str) -> tuple[Incident, int]:
        """The incident and its item version. Raises :class:`IncidentNotFound`."""
        item = self.client.get_item(
            TableName=self.table, Key={"incident_id": {"S": incident_id}}, ConsistentRead=True, **_PROJECTION  # type: ignore[arg-type]
        ).get("Item")
        if not item or item.get("kind", {}).get("S") != "incident":
            raise IncidentNotFound(f"no incident {incident_id!r} in the ledger {self.table}")
        return self._incident(item), int(item["version"]["N"])

    def save(self, incident: Incident, expected_version: int, *, lease: Lease | None = None) -> int:
        """Write ``incident`` if the item is still at ``expected_version``; returns the new version.

        With ``lease``, the write is one transaction with a check that the lease
        is still held (and it records the admission on the lock): a guard whose
        lease expired meanwhile writes nothing. Raises :class:`LedgerConflict`
        when someone else wrote it first and :class:`LockLost` when the lease is gone.
        """
        item = self._item(incident, expected_version + 1)
        del item["incident_id"]
        gone = [k for k in _INDEX_KEYS if k not in item]
        # SET, not a whole-item put: the duplicates counter is someone else's.
        update: UpdateTypeDef = {
            "TableName": self.table,
            "Key": {"incident_id": {"S": incident.incident_id}},
            "UpdateExpression": "SET " + ", ".join(f"#{k} = :{k}" for k in item)
            + (" REMOVE " + ", ".join(f"#{k}" for k in gone) if gone else ""),
            "ConditionExpression": "version = :expected",
            "ExpressionAttributeNames": {f"#{k}": k for k in [*item, *gone]},
            "ExpressionAttributeValues": {**{f":{k}": v for k, v in item.items()}, ":expected": {"N": str(expected_version)}},
        }
        if lease is None:
            try:
                self.client.update_item(**update)
            except ClientError as exc:
                if _code(exc) == "ConditionalCheckFailedException":
                    raise LedgerConflict(f"incident {incident.incident_id} changed since version {expected_version}") from None
                raise
            return expected_version + 1
        now = time.time()
        stale = [i for i, at in lease.recent.items() if at < now - RECENT_SECONDS and i != incident.incident_id]
        names = {"#o": "owner", "#me": incident.incident_id, **{f"#r{n}": i for n, i in enumerate(stale)}}
        lock: UpdateTypeDef = {
            "TableName": self.table,
            "Key": lease.key,
            "UpdateExpression": "SET recent.#me = :now" + "".join(f" REMOVE recent.#r{n}" if n == 0 else f", recent.#r{n}" for n in range(len(stale))),
            "ConditionExpression": "#o = :owner AND expires_at > :now",
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": {":owner": {"S": lease.owner}, ":now": {"N": str(now)}},
        }
        try:
            self.client.transact_write_items(TransactItems=[{"Update": lock}, {"Update": update}])
        except ClientError as exc:
            if _code(exc) != "TransactionCanceledException":
                raise
            reasons = [r.get("Code", "") for r in exc.response.get("CancellationReasons", [])]
            if reasons[:1] == ["ConditionalCheckFailed"]:
                raise LockLost(f"lock {lease.name}: the lease of {lease.owner} expired before its write") from None
            if reasons[1:2] == ["ConditionalCheckFailed"]:
                raise LedgerConflict(f"incident {incident.incident_id} changed since version {expected_version}") from None
            raise LedgerConflict(f"incident {incident.incident_id}: transaction cancelled ({', '.join(reasons)})") from None
        return expected_version + 1

    @contextlib.contextmanager
    def locked(self, name: str, owner: str, *, lease_seconds: float = 30.0, wait_seconds: float = 20.0) -> Iterator[Lease]:
        """Hold the lock item ``lock#<name>`` while the block runs; yields the :class:`Lease`.

        Decisions that read many incidents (the blast radius) run under the
        cluster's lock, so two of them never act on the same picture; their
        write passes the lease to :meth:`update`, which re-checks it in the same
        transaction. A lease that its holder never released (a crashed Lambda)
        expires after ``lease_seconds``. Raises :class:`LedgerConflict` when the
        lock stays taken for ``wait_seconds``.
        """
        key = {"incident_id": {"S": _LOCK + name}}
        deadline = time.monotonic() + wait_seconds
        delay = 0.02
        while True:
            now = time.time()
            try:
                item = self.client.update_item(
                    TableName=self.table,
                    Key=key,
                    UpdateExpression="SET kind = :lock, #o = :me, expires_at = :until, recent = if_not_exists(recent, :none)",
                    ConditionExpression="attribute_not_exists(#o) OR expires_at < :now",
                    ExpressionAttributeNames={"#o": "owner"},
                    ExpressionAttributeValues={
                        ":lock": {"S": "lock"},
                        ":me": {"S": owner},
                        ":until": {"N": str(now + lease_seconds)},
                        ":now": {"N": str(now)},
                        ":none": {"M": {}},
                    },
                    ReturnValues="ALL_NEW",
                )["Attributes"]
                break
            except ClientError as exc:
                if _code(exc) != "ConditionalCheckFailedException":
                    raise
            if time.monotonic() > deadline:
                raise LedgerConflict(f"lock {name} stayed taken for {wait_seconds:g} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        recent = {k: float(v["N"]) for k, v in item.get("recent", {}).get("M", {}).items()}
        try:
            yield Lease(name=name, owner=owner, expires_at=now + lease_seconds, recent=recent)
        finally:
            try:
                # The item stays (its ``recent`` admissions are the next guard's); only the lease goes.
                self.client.update_item(
                    TableName=self.table,
                    Key=key,
                    UpdateExpression="REMOVE #o, expires_at",
                    ConditionExpression="#o = :me",
                    ExpressionAttributeNames={"#o": "owner"},
                    ExpressionAttributeValues={":me": {"S": owner}},
                )
            except ClientError as exc:
                if _code(exc) != "ConditionalCheckFailedException":  # our lease expired and was taken over
                    raise

    def update(
        self, incident_id: str, change: Callable[[Incident], Incident], *, lease: Lease | None = None
    ) -> Incident:
        """Read, apply ``change``, write conditionally; re-read and re-apply on a conflict.

        ``change`` returning the incident unchanged (the same object) writes
        nothing: a retried handler does no second thing. Exceptions from
        ``change`` propagate and nothing is written. With ``lease`` the write
        also checks the lease (see :meth:`save`). Raises
        :class:`IncidentNotFound`, :class:`LockLost` (not retried: the
        decision must be made again) and :class:`LedgerConflict` (still losing
        after several attempts).
        """
        for attempt in range(_MAX_ATTEMPTS):
            current, version = self.get_versioned(incident_id)
            changed = change(current)
            if changed is current:
                return current
            try:
                self.save(changed, version, lease=lease)
                return changed
            except LockLost:
                raise
            except LedgerConflict:
                time.sleep(min(0.05 * 2**attempt, 1.0))
        raise LedgerConflict(f"incident {incident_id}: gave up after {_MAX_ATTEMPTS} conflicting writes")

    def list(self, *, hyperpod_cluster: str | None = None) -> list[Incident]:
        """Every incident (optionally of one cluster), newest first."""
        kwargs: dict[str, Any] = {
            "TableName": self.table,
            "FilterExpression": "#a1 = :k",
            "ExpressionAttributeValues": {":k": {"S": "incident"}},
            "Select": "SPECIFIC_ATTRIBUTES",
            **_PROJECTION,
        }
        if hyperpod_cluster:
            kwargs["FilterExpression"] += " AND #a4 = :c"
            kwargs["ExpressionAttributeValues"][":c"] = {"S": hyperpod_cluster}
        out: list[Incident] = []
        for page in self.client.get_paginator("scan").paginate(**kwargs):
            out.extend(self._incident(item) for item in page.get("Items", []))
        return sorted(out, key=lambda i: i.created_at, reverse=True)

    def counting(self, hyperpod_cluster: str, *, lease: Lease | None = None) -> builtins.list[Incident]:
        """The incidents that count toward ``hyperpod_cluster``'s blast radius now, read consistently.

        One query of :data:`OPEN_INDEX` (closed incidents are not in it), plus
        the admissions the lease remembers (the index may not show them yet);
        each incident is then read from the table itself, so its state is the
        current one. Incidents whose :func:`counts_until` has passed are left out.
        """
        now = time.time()
        ids: set[str] = set()
        pages = self.client.get_paginator("query").paginate(
            TableName=self.table,
            IndexName=OPEN_INDEX,
            KeyConditionExpression="open_cluster = :c AND open_until > :now",
            ExpressionAttributeValues={":c": {"S": hyperpod_cluster}, ":now": {"N": str(now)}},
        )
        for page in pages:
            ids.update(item["incident_id"]["S"] for item in page.get("Items", []))
        if lease is not None:
            ids.update(i for i, at in lease.recent.items() if at >= now - RECENT_SECONDS)
        out: builtins.list[Incident] = []
        for incident_id in sorted(ids):
            try:
                incident = self.get(incident_id)
            except IncidentNotFound:
                continue
            until = counts_until(incident)
            if until is not None and until > now and incident.alarm.job.hyperpod_cluster == hyperpod_cluster:
                out.append(incident)
        return out

    # -- incidents by suspect instance ---------------------------------------------

    def index_suspects(self, incident_id: str, instance_ids: Iterable[str]) -> None:
        """Enter ``incident_id`` in :data:`SUSPECT_INDEX` under each of ``instance_ids`` (repeating it changes nothing).

        Called before the incident records the suspects, so that no incident
        naming an instance is ever missing from the index; an entry whose
        incident did not come to name the instance (the write that would have
        recorded it failed) is passed over by :meth:`naming`.
        """
        for instance_id in sorted(set(instance_ids)):
            self.client.put_item(
                TableName=self.table,
                Item={
                    "incident_id": {"S": f"{_SUSPECT}{instance_id}#{incident_id}"},
                    "kind": {"S": "suspect"},
                    "suspect_instance": {"S": instance_id},
                    "suspect_of": {"S": incident_id},
                },
            )

    def naming(self, instance_id: str) -> builtins.list[Incident]:
        """The incidents that name ``instance_id`` as a suspect, oldest first.

        One query of :data:`SUSPECT_INDEX` (its entries only, never the other
        incidents), then each incident read from the table itself; an entry
        whose incident does not name the instance, or no longer exists, is left out.
        """
        ids: set[str] = set()
        pages = self.client.get_paginator("query").paginate(
            TableName=self.table,
            IndexName=SUSPECT_INDEX,
            KeyConditionExpression="suspect_instance = :i",
            ExpressionAttributeValues={":i": {"S": instance_id}},
        )
        for page in pages:
            ids.update(item["suspect_of"]["S"] for item in page.get("Items", []))
        out: builtins.list[Incident] = []
        for incident_id in sorted(ids):
            try:
                incident = self.get(incident_id)
            except IncidentNotFound:
                continue
            if instance_id in incident.instance_ids:
                out.append(incident)
        return sorted(out, key=lambda i: i.created_at)

    @staticmethod
    def _incident(item: dict[str, Any]) -> Incident:
        incident = Incident.model_validate_json(item["body"]["S"])
        counted = int(item.get("duplicates", {}).get("N", "0"))
        if counted > incident.duplicate_alarms:
            incident = incident.model_copy(update={"duplicate_alarms": counted})
        return incident

    @staticmethod
    def _item(incident: Incident, version: int) -> dict[str, Any]:
        item: dict[str, Any] = {
            "incident_id": {"S": incident.incident_id},
            "kind": {"S": "incident"},
            "version": {"N": str(version)},
            "state": {"S": incident.state.value},
            "hyperpod_cluster": {"S": incident.alarm.job.hyperpod_cluster},
            "created_at": {"S": incident.created_at.isoformat()},
            "fault_persistence": {"S": incident.alarm.fault_persistence},
            "body": {"S": incident.model_dump_json()},
        }
        if incident.opened_by is not None:
            item["opened_by"] = {"S": incident.opened_by}
        until = counts_until(incident)
        if until is not None:
            item["open_cluster"] = {"S": incident.alarm.job.hyperpod_cluster}
            item["open_until"] = {"N": f"{until:.3f}"}
        return item


_INDEX_KEYS = ("open_cluster", "open_until")


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
