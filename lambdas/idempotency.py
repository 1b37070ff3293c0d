"""Idempotency of the mutating handlers, on powertools' DynamoDB persistence layer.

The persistence layer is built per call from the settings (not at import), so
a handler module imports without AWS configuration and tests can point it at
the stand-in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aws_lambda_powertools.utilities.idempotency import (
    DynamoDBPersistenceLayer,
    IdempotencyConfig,
    idempotent_function,
)

from lambdas.settings import Settings

EXPIRES_AFTER_SECONDS = 24 * 3600


def run_once(
    operation: Callable[[dict[str, Any]], dict[str, Any]],
    payload: dict[str, Any],
    *,
    settings: Settings,
    context: Any = None,
    key: str | None = None,
    client: Any = None,
) -> dict[str, Any]:
    """``operation(payload)``, or the result it returned for an equal payload before.

    ``key`` is a JMESPath into the payload naming what makes two calls the same
    (default: the whole payload). A failed call records nothing, so it can be retried.
    """
    persistence = DynamoDBPersistenceLayer(table_name=settings.idempotency_table, boto3_client=client)
    config = IdempotencyConfig(event_key_jmespath=key or "", expires_after_seconds=EXPIRES_AFTER_SECONDS)
    if context is not None:
        config.register_lambda_context(context)

    def once(payload: dict[str, Any]) -> dict[str, Any]:
        return operation(payload)

    # powertools keys its records by the function's qualified name: each
    # operation keeps its own, so equal payloads of different handlers differ.
    once.__qualname__ = once.__name__ = operation.__qualname__
    once.__module__ = operation.__module__
    wrapped = idempotent_function(data_keyword_argument="payload", persistence_store=persistence, config=config)(once)
    return wrapped(payload=payload)
