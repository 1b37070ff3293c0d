"""Approval task tokens, in a table of their own that only two roles may touch.

A live task token answers the incident machine's approval wait: whoever holds
one, and may call ``states:SendTaskSuccess``, approves as anyone. Every
pipeline role reads the incident ledger, so the tokens are not kept there.
They live in the template's ``TokenTable``: one item per incident waiting for
approval, ``incident_id``, ``token``, ``expires_at`` (epoch seconds, also the
table's TTL). IAM grants that table to request_approval's role (``GetItem``,
``PutItem``) and to the decide role (``GetItem``, ``DeleteItem``) and to no one
else, so no deny statement or condition key has to hold for a token to stay
private, and a grant later added on the ledger (a ``Scan``) cannot reveal one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import boto3

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient


class TaskTokens:
    """The token table ``table`` (partition key ``incident_id``). ``client`` defaults to a boto3 DynamoDB client.

    Raises ``ValueError`` when ``table`` is empty (a deployment that names no token table cannot ask for approval).
    """

    def __init__(self, table: str, client: DynamoDBClient | None = None) -> None:
        if not table:
            raise ValueError(
                "no task token table is configured (TOKEN_TABLE); approvals cannot be asked or answered"
            )
        self.table = table
        self.client = client or boto3.client("dynamodb")

    def put(self, incident_id: str, token: str, *, expires_at: float) -> None:
        """Store the approval task token of ``incident_id`` until ``expires_at`` (epoch seconds)."""
        self.client.put_item(
            TableName=self.table,
            Item={
                "incident_id": {"S": incident_id},
                "token": {"S": token},
                "expires_at": {"N": str(int(expires_at))},
            },
        )

    def get(self, incident_id: str) -> tuple[str, float] | None:
        """The stored token and its expiry, or None (never stored, or already answered)."""
        item = self.client.get_item(
            TableName=self.table, Key={"incident_id": {"S": incident_id}}, ConsistentRead=True
        ).get("Item")
        if not item:
            return None
        return item["token"]["S"], float(item["expires_at"]["N"])

    def delete(self, incident_id: str) -> None:
        """Forget the token (it was answered)."""
        self.client.delete_item(TableName=self.table, Key={"incident_id": {"S": incident_id}})


TOKEN_TABLE_KEY = [{"AttributeName": "incident_id", "KeyType": "HASH"}]
"""The token table's key schema (the template's ``TokenTable``)."""
TOKEN_TABLE_ATTRIBUTES = [{"AttributeName": "incident_id", "AttributeType": "S"}]
"""The token table's attribute definitions."""
