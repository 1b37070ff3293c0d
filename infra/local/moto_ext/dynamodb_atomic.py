"""Gap: moto's DynamoDB is not atomic under concurrent requests, and DynamoDB is.

The stand-in's server runs requests side by side. moto's
``TransactWriteItems`` copies each table it touches when it begins and, when a
condition fails, puts the copy back: every write another request made in
between is undone with it (an incident's duplicate count lost an alarm; a
third incident was admitted past a limit of two). Its condition checks and
writes can interleave too. DynamoDB makes each request atomic and isolates
transactions. Hook: every public method of ``DynamoDBBackend`` runs under one
lock (re-entrant: they call each other), so requests apply one at a time.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from moto.dynamodb.models import DynamoDBBackend

LOCK = threading.RLock()
"""Held while the backend serves one request: take it to hold every DynamoDB request of this process back."""


def _serialised(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with LOCK:
            return method(*args, **kwargs)

    run.__sdcguard_serialised__ = True  # type: ignore[attr-defined]
    return run


def install() -> None:
    """Serialise the DynamoDB backend's public methods (idempotent)."""
    for name, value in list(vars(DynamoDBBackend).items()):
        # Plain functions only (a staticmethod wrapped as one would take the instance as its first argument).
        if name.startswith("_") or not inspect.isfunction(value) or getattr(value, "__sdcguard_serialised__", False):
            continue
        setattr(DynamoDBBackend, name, _serialised(value))
