"""Following a CloudFormation stack operation: its events as they arrive, until it settles."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError

COMPLETE = frozenset({"CREATE_COMPLETE", "UPDATE_COMPLETE", "DELETE_COMPLETE", "IMPORT_COMPLETE"})


class StackTimeout(RuntimeError):
    """The stack was still changing when the wait ran out."""


@dataclass(frozen=True)
class Settled:
    """Where a stack operation ended."""

    status: str
    """The stack's final status; ``DELETE_COMPLETE`` also when the stack is gone."""
    failures: list[str]
    """``resource: reason`` for every resource that failed during the operation."""

    @property
    def ok(self) -> bool:
        """Whether the operation succeeded."""
        return self.status in COMPLETE


def format_event(event: dict[str, Any]) -> str:
    """One progress line: time, status, logical id, type, and the reason if any."""
    stamp = event["Timestamp"]
    when = stamp.strftime("%H:%M:%S") if isinstance(stamp, datetime) else str(stamp)
    line = (
        f"{when}  {event.get('ResourceStatus', ''):<28} {event.get('LogicalResourceId', ''):<28} "
        f"{event.get('ResourceType', '')}"
    )
    reason = event.get("ResourceStatusReason")
    return f"{line}  {reason}" if reason else line


def follow(
    cfn: Any,
    stack_id: str,
    *,
    since: datetime,
    on_event: Callable[[str], None],
    poll_seconds: float = 2.0,
    timeout_seconds: float = 3600.0,
    skip: frozenset[str] = frozenset(),
) -> Settled:
    """Report the events of ``stack_id`` newer than ``since`` until the stack stops changing.

    ``on_event`` receives one formatted line per event, oldest first, as they
    arrive; events whose ids are in ``skip`` (those of earlier operations, see
    :func:`last_event`) are not reported. Returns the final status and the
    failures seen. Raises :class:`StackTimeout` after ``timeout_seconds``.
    """
    seen: set[str] = set(skip)
    failures: list[str] = []
    deadline = time.monotonic() + timeout_seconds
    while True:
        status = _status(cfn, stack_id)
        for event in _new_events(cfn, stack_id, since, seen):
            on_event(format_event(event))
            if event.get("ResourceStatus", "").endswith("_FAILED"):
                failures.append(f"{event.get('LogicalResourceId')}: {event.get('ResourceStatusReason', '')}")
        if not status.endswith("_IN_PROGRESS"):
            return Settled(status=status, failures=failures)
        if time.monotonic() > deadline:
            raise StackTimeout(f"stack {stack_id} still {status} after {timeout_seconds:.0f} s")
        time.sleep(poll_seconds)


def last_event(cfn: Any, stack_id: str) -> tuple[datetime, frozenset[str]]:
    """The time of the stack's newest event and the ids of the events at that time.

    Following from there reports only what a new operation does. Raises
    ``botocore.exceptions.ClientError`` when the stack does not exist.
    """
    events = cfn.describe_stack_events(StackName=stack_id)["StackEvents"]
    if not events:
        return datetime.fromtimestamp(0, UTC), frozenset()
    newest = max(_aware(e["Timestamp"]) for e in events)
    return newest, frozenset(e["EventId"] for e in events if _aware(e["Timestamp"]) == newest)


def _status(cfn: Any, stack_id: str) -> str:
    try:
        stacks = cfn.describe_stacks(StackName=stack_id)["Stacks"]
    except ClientError as exc:
        if "does not exist" in str(exc):
            return "DELETE_COMPLETE"
        raise
    return str(stacks[0]["StackStatus"]) if stacks else "DELETE_COMPLETE"


def _new_events(cfn: Any, stack_id: str, since: datetime, seen: set[str]) -> list[dict[str, Any]]:
    fresh: list[dict[str, Any]] = []
    try:
        pages = cfn.get_paginator("describe_stack_events").paginate(StackName=stack_id)
        for page in pages:
            for event in page["StackEvents"]:
                stamp = event["Timestamp"]
                if isinstance(stamp, datetime) and _aware(stamp) < since:
                    # Newest first: the rest of the history is older still.
                    return _oldest_first(fresh, since)
                if event["EventId"] not in seen:
                    seen.add(event["EventId"])
                    fresh.append(event)
    except ClientError as exc:
        if "does not exist" not in str(exc):
            raise
    return _oldest_first(fresh, since)


def _oldest_first(events: list[dict[str, Any]], since: datetime) -> list[dict[str, Any]]:
    # The API lists newest first; progress reads oldest first.
    return sorted(events, key=lambda e: _aware(e["Timestamp"]) if isinstance(e["Timestamp"], datetime) else since)


def _aware(stamp: datetime) -> datetime:
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)
