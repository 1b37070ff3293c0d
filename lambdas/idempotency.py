"""Idempotency of the mutating handlers, on powertools' DynamoDB persistence layer.

The logic function is made idempotent on its real, typed payload: an equal
payload (the state machine retrying a task, or botocore resending a lost
invocation) gets the stored result back and the function does not run again.
The persistence layer is built once per cold start and table, not at import,
so a handler module imports without AWS configuration and tests can point it
at the stand-in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from aws_lambda_powertools.utilities.idempotency import (
    DynamoDBPersistenceLayer,
    IdempotencyConfig,
    idempotent_function,
)
from pydantic import BaseModel

from sdcguard.lambdas.clients import aws
from sdcguard.lambdas.settings import get_settings

EXPIRES_AFTER_SECONDS = 24 * 3600
M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)


@functools.cache
def _persistence(table: str) -> DynamoDBPersistenceLayer:
    return DynamoDBPersistenceLayer(table_name=table, boto3_client=aws("dynamodb"))


def run_once(operation: Callable[[M], R], payload: M, result: type[R], *, context: Any = None) -> R:
    """``operation(payload)``, or the result it returned for an equal ``payload`` before.

    Every field of ``payload`` makes the call what it is. A failed call
    records nothing, so it can be retried. ``result`` is the model the stored
    answer is read back into.
    """
    config = IdempotencyConfig(expires_after_seconds=EXPIRES_AFTER_SECONDS)
    if context is not None:
        config.register_lambda_context(context)
    kind = type(payload)

    def once(payload: dict[str, Any]) -> dict[str, Any]:
        return operation(kind.model_validate(payload)).model_dump(mode="json")

    # powertools keys its records by the function's qualified name: each
    # operation keeps its own, so equal payloads of different handlers differ.
    once.__qualname__ = once.__name__ = operation.__qualname__
    once.__module__ = operation.__module__
    persistence = _persistence(get_settings().idempotency_table)
    wrapped = idempotent_function(data_keyword_argument="payload", persistence_store=persistence, config=config)(once)
    return result.model_validate(wrapped(payload=payload.model_dump(mode="json")))
