"""Watches (``?watch=true``): what ``kubectl get -w`` streams.

The store keeps no change log, so a watch polls it: each poll lists the
objects the watch covers and compares their ``resourceVersion`` with the
previous poll, yielding ``ADDED``, ``MODIFIED`` and ``DELETED`` events as the
API server streams them (one JSON object per line). A change and its revert
between two polls are not seen; nothing in the stand-in needs that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

POLL_SECONDS = 0.2

Snapshot = dict[tuple[str, str], dict[str, Any]]  # (namespace, name) -> object


def snapshot(objects: list[dict[str, Any]]) -> Snapshot:
    """The objects of one poll, by namespace and name."""
    return {
        ((o.get("metadata") or {}).get("namespace", ""), o["metadata"]["name"]): o for o in objects
    }


def changes(before: Snapshot, after: Snapshot) -> list[tuple[str, dict[str, Any]]]:
    """The watch events that turn ``before`` into ``after``, in name order (deletions carry the last state seen)."""
    events: list[tuple[str, dict[str, Any]]] = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old is None and new is not None:
            events.append(("ADDED", new))
        elif new is None and old is not None:
            events.append(("DELETED", old))
        elif (
            old is not None
            and new is not None
            and old["metadata"].get("resourceVersion") != new["metadata"].get("resourceVersion")
        ):
            events.append(("MODIFIED", new))
    return events


def since(objects: Snapshot, resource_version: str | None) -> list[tuple[str, dict[str, Any]]]:
    """The objects changed after ``resource_version`` (a list's), as MODIFIED events: what a watch started late owes."""
    if not resource_version or not resource_version.isdigit():
        return []
    return [
        ("MODIFIED", obj)
        for _key, obj in sorted(objects.items())
        if int(obj["metadata"].get("resourceVersion") or 0) > int(resource_version)
    ]


def events(
    poll: Callable[[], list[dict[str, Any]]],
    stop: threading.Event,
    *,
    resource_version: str | None = None,
    timeout_seconds: float | None = None,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Events until ``stop`` is set or ``timeout_seconds`` pass; ``poll`` lists the watched objects."""
    current = snapshot(poll())
    yield from since(current, resource_version)
    waited = 0.0
    while not stop.wait(POLL_SECONDS):
        waited += POLL_SECONDS
        if timeout_seconds is not None and waited >= timeout_seconds:
            return
        latest = snapshot(poll())
        yield from changes(current, latest)
        current = latest
