"""The incident ledger: one DynamoDB item per incident, written with conditional updates.

Table layout (the template creates it): partition key ``incident_id`` (S) only;
TTL attribute ``expires_at``. Item kinds:

- the incident: ``incident_id``, ``kind="incident"``, ``version`` (N),
  ``state``, ``hyperpod_cluster``, ``created_at``, ``body`` (the
  :class:`contract.Incident` as JSON), ``duplicates`` (N, an atomic counter of
  the alarms that collapsed into it, merged into ``duplicate_alarms`` on read);
- its approval task token: ``incident_id="token#<id>"``, ``kind="token"``,
  ``token``, ``expires_at`` (epoch seconds, also the TTL);
- a lock per HyperPod cluster: ``incident_id="lock#<cluster>"``,
  ``kind="lock"``, ``owner``, ``expires_at`` (a lease), held by the guard so
  that two incidents are never admitted against the same count of
  quarantined nodes.

An incident's id is derived from its idempotency key (cluster, job, suspect
nodes, suspect window), so duplicate alarms (many ranks, re-deliveries,
several detectors on one fault) all try to create the same item; the first
wins and the others only count themselves into ``duplicate_alarms``.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import boto3
from botocore.exceptions import ClientError

from contract import Alarm, Incident, IncidentState, Transition
from lambdas.errors import IncidentNotFound, LedgerConflict

UNLOCALISED = "unlocalised"
_TOKEN = "token#"
_LOCK = "lock#"
_MAX_ATTEMPTS = 12


def idempotency_key(alarm: Alarm) -> str:
    """The key that makes alarms about one fault one incident.

    (HyperPod cluster, namespace/job, the suspect nodes sorted, the suspect
    window's start). The window starts after the last trusted step, which
    every detector on the same fault agrees on (see
    :meth:`contract.Alarm.trusted_through_step`); an unlocalised alarm names
    no nodes and collapses with other unlocalised alarms of the same window.
    """
    nodes = ",".join(alarm.suspect_nodes) or UNLOCALISED
    job = alarm.job
    return f"{job.hyperpod_cluster}|{job.namespace}/{job.job_name}|{nodes}|after-{alarm.trusted_through_step()}"


def incident_id_for(key: str) -> str:
    """The incident id for an idempotency key: stable, short, and safe in a CLI argument."""
    return "sdc-" + hashlib.sha256(key.encode()).hexdigest()[:20]


class Ledger:
    """The DynamoDB incident ledger. ``client`` defaults to a boto3 DynamoDB client."""

    def __init__(self, table: str, client: Any = None) -> None:
        self.table = table
        self.client = client or boto3.client("dynamodb")

    # -- incidents ------------------------------------------------------------

    def open(self, alarm: Alarm, *, mode: str, actor: str = "record") -> tuple[Incident, bool]:
        """Open the incident for ``alarm``, or count the alarm into the existing one.

        Returns ``(incident, created)``; ``created`` is False for a duplicate.
        Raises :class:`LedgerConflict` if the item keeps changing under us.
        """
        key = idempotency_key(alarm)
        incident = Incident(
            incident_id=incident_id_for(key),
            idempotency_key=key,
            alarm=alarm,
            mode=mode,
            transitions=[Transition(state=IncidentState.RECORDED, actor=actor, note="alarm recorded")],
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
        # An atomic counter, not a rewrite of the body: a storm of duplicates
        # must not contend with each other or with the handlers' writes.
        try:
            item = self.client.update_item(
                TableName=self.table,
                Key={"incident_id": {"S": incident.incident_id}},
                UpdateExpression="ADD duplicates :one",
                ConditionExpression="attribute_exists(incident_id)",
                ExpressionAttributeValues={":one": {"N": "1"}},
                ReturnValues="ALL_NEW",
            )["Attributes"]
        except ClientError as exc:
            if _code(exc) == "ConditionalCheckFailedException":
                raise LedgerConflict(f"incident {incident.incident_id} vanished while counting a duplicate") from None
            raise
        return self._incident(item), False

    def get(self, incident_id: str) -> Incident:
        """The incident. Raises :class:`IncidentNotFound`."""
        return self.get_versioned(incident_id)[0]

    def get_versioned(self, incident_id: str) -> tuple[Incident, int]:
        """The incident and its item version. Raises :class:`IncidentNotFound`."""
        item = self.client.get_item(
            TableName=self.table, Key={"incident_id": {"S": incident_id}}, ConsistentRead=True
        ).get("Item")
        if not item or item.get("kind", {}).get("S") != "incident":
            raise IncidentNotFound(f"no incident {incident_id!r} in the ledger {self.table}")
        return self._incident(item), int(item["version"]["N"])

    def save(self, incident: Incident, expected_version: int) -> int:
        """Write ``incident`` if the item is still at ``expected_version``; returns the new version.

        Raises :class:`LedgerConflict` when someone else wrote it first.
        """
        item = self._item(incident, expected_version + 1)
        del item["incident_id"]
        try:
            # SET, not a whole-item put: the duplicates counter is someone else's.
            self.client.update_item(
                TableName=self.table,
                Key={"incident_id": {"S": incident.incident_id}},
                UpdateExpression="SET " + ", ".join(f"#{k} = :{k}" for k in item),
                ConditionExpression="version = :expected",
                ExpressionAttributeNames={f"#{k}": k for k in item},
                ExpressionAttributeValues={**{f":{k}": v for k, v in item.items()}, ":expected": {"N": str(expected_version)}},
            )
        except ClientError as exc:
            if _code(exc) == "ConditionalCheckFailedException":
                raise LedgerConflict(f"incident {incident.incident_id} changed since version {expected_version}") from None
            raise
        return expected_version + 1

    @contextlib.contextmanager
    def locked(self, name: str, owner: str, *, lease_seconds: float = 30.0, wait_seconds: float = 20.0) -> Iterator[None]:
        """Hold the lock item ``lock#<name>`` while the block runs.

        Decisions that read many incidents (the blast radius) run under the
        cluster's lock, so two of them never act on the same picture. A lease
        that its holder never released (a crashed Lambda) expires after
        ``lease_seconds``. Raises :class:`LedgerConflict` when the lock stays
        taken for ``wait_seconds``.
        """
        key = {"incident_id": {"S": _LOCK + name}}
        deadline = time.monotonic() + wait_seconds
        delay = 0.02
        while True:
            now = time.time()
            try:
                self.client.put_item(
                    TableName=self.table,
                    Item={
                        **key,
                        "kind": {"S": "lock"},
                        "owner": {"S": owner},
                        "expires_at": {"N": str(now + lease_seconds)},
                    },
                    ConditionExpression="attribute_not_exists(incident_id) OR expires_at < :now",
                    ExpressionAttributeValues={":now": {"N": str(now)}},
                )
                break
            except ClientError as exc:
                if _code(exc) != "ConditionalCheckFailedException":
                    raise
            if time.monotonic() > deadline:
                raise LedgerConflict(f"lock {name} stayed taken for {wait_seconds:g} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        try:
            yield
        finally:
            try:
                self.client.delete_item(
                    TableName=self.table,
                    Key=key,
                    ConditionExpression="#o = :me",
                    ExpressionAttributeNames={"#o": "owner"},
                    ExpressionAttributeValues={":me": {"S": owner}},
                )
            except ClientError as exc:
                if _code(exc) != "ConditionalCheckFailedException":  # our lease expired and was taken over
                    raise

    def update(self, incident_id: str, change: Callable[[Incident], Incident]) -> Incident:
        """Read, apply ``change``, write conditionally; re-read and re-apply on a conflict.

        ``change`` returning the incident unchanged (the same object) writes
        nothing: a retried handler does no second thing. Exceptions from
        ``change`` propagate and nothing is written. Raises
        :class:`IncidentNotFound` and :class:`LedgerConflict` (still losing
        after several attempts).
        """
        for attempt in range(_MAX_ATTEMPTS):
            current, version = self.get_versioned(incident_id)
            changed = change(current)
            if changed is current:
                return current
            try:
                self.save(changed, version)
                return changed
            except LedgerConflict:
                time.sleep(min(0.05 * 2**attempt, 1.0))
        raise LedgerConflict(f"incident {incident_id}: gave up after {_MAX_ATTEMPTS} conflicting writes")

    def list(self, *, hyperpod_cluster: str | None = None) -> list[Incident]:
        """Every incident (optionally of one cluster), newest first."""
        kwargs: dict[str, Any] = {
            "TableName": self.table,
            "FilterExpression": "kind = :k",
            "ExpressionAttributeValues": {":k": {"S": "incident"}},
        }
        if hyperpod_cluster:
            kwargs["FilterExpression"] += " AND hyperpod_cluster = :c"
            kwargs["ExpressionAttributeValues"][":c"] = {"S": hyperpod_cluster}
        out: list[Incident] = []
        for page in self.client.get_paginator("scan").paginate(**kwargs):
            out.extend(self._incident(item) for item in page.get("Items", []))
        return sorted(out, key=lambda i: i.created_at, reverse=True)

    # -- approval task tokens ---------------------------------------------------

    def put_token(self, incident_id: str, token: str, *, expires_at: float) -> None:
        """Store the approval task token of ``incident_id`` until ``expires_at`` (epoch seconds)."""
        self.client.put_item(
            TableName=self.table,
            Item={
                "incident_id": {"S": _TOKEN + incident_id},
                "kind": {"S": "token"},
                "token": {"S": token},
                "expires_at": {"N": str(int(expires_at))},
            },
        )

    def get_token(self, incident_id: str) -> tuple[str, float] | None:
        """The stored token and its expiry, or None (never stored, or already answered)."""
        item = self.client.get_item(
            TableName=self.table, Key={"incident_id": {"S": _TOKEN + incident_id}}, ConsistentRead=True
        ).get("Item")
        if not item:
            return None
        return item["token"]["S"], float(item["expires_at"]["N"])

    def delete_token(self, incident_id: str) -> None:
        """Forget the token (it was answered)."""
        self.client.delete_item(TableName=self.table, Key={"incident_id": {"S": _TOKEN + incident_id}})

    @staticmethod
    def _incident(item: dict[str, Any]) -> Incident:
        incident = Incident.model_validate_json(item["body"]["S"])
        counted = int(item.get("duplicates", {}).get("N", "0"))
        if counted > incident.duplicate_alarms:
            incident = incident.model_copy(update={"duplicate_alarms": counted})
        return incident

    @staticmethod
    def _item(incident: Incident, version: int) -> dict[str, Any]:
        return {
            "incident_id": {"S": incident.incident_id},
            "kind": {"S": "incident"},
            "version": {"N": str(version)},
            "state": {"S": incident.state.value},
            "hyperpod_cluster": {"S": incident.alarm.job.hyperpod_cluster},
            "created_at": {"S": incident.created_at.isoformat()},
            "body": {"S": incident.model_dump_json()},
        }


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
