"""DynamoDB on the stand-in is atomic under concurrent requests, as DynamoDB is (moto_ext.dynamodb_atomic).

moto's threaded server runs requests side by side, and its
``TransactWriteItems`` undoes a failed transaction by restoring a copy of the
table taken when it began: a write another request made in between is undone
with it. Given a table large enough that the copy takes a while, counters
incremented while failing transactions run must all be counted, and a
condition that admits one writer must admit one only.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdcguard.infra.local.standin import LocalStandIn

pytestmark = pytest.mark.slow

INCREMENTS = 48
FAILING = 12


def _table(standin: LocalStandIn, items: int) -> tuple[Any, str]:
    ddb = standin.client("dynamodb")
    name = f"atomic-{uuid.uuid4().hex[:8]}"
    ddb.create_table(TableName=name, BillingMode="PAY_PER_REQUEST",
                     AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
                     KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}])
    # The counter first: a copy of the table that begins with it misses every increment made while it copies.
    ddb.put_item(TableName=name, Item={"pk": {"S": "counter"}, "n": {"N": "0"}})
    filler = "x" * 400
    for start in range(0, items, 25):
        ddb.batch_write_item(RequestItems={name: [
            {"PutRequest": {"Item": {"pk": {"S": f"filler-{n}"}, "data": {"S": filler}}}}
            for n in range(start, min(start + 25, items))]})
    return ddb, name


def test_writes_during_failing_transactions_are_all_kept(standin: LocalStandIn) -> None:
    ddb, table = _table(standin, 2_000)

    def increment(_: int) -> None:
        ddb.update_item(TableName=table, Key={"pk": {"S": "counter"}}, UpdateExpression="ADD n :one",
                        ExpressionAttributeValues={":one": {"N": "1"}})

    def failing_transaction(_: int) -> str:
        try:
            ddb.transact_write_items(TransactItems=[{"Put": {
                "TableName": table, "Item": {"pk": {"S": "filler-0"}},
                "ConditionExpression": "attribute_not_exists(pk)"}}])
        except ClientError as exc:
            return str(exc.response["Error"]["Code"])
        return "written"

    # Interleaved, so that increments land while transactions hold their copies of the table.
    work = [failing_transaction if n % (INCREMENTS // FAILING + 1) == 0 else increment
            for n in range(INCREMENTS + FAILING)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(lambda n: work[n](n), range(len(work))))
    assert {o for o in outcomes if o is not None} == {"TransactionCanceledException"}

    counter = ddb.get_item(TableName=table, Key={"pk": {"S": "counter"}}, ConsistentRead=True)["Item"]
    assert int(counter["n"]["N"]) == INCREMENTS


def test_a_conditional_transaction_admits_one_writer(standin: LocalStandIn) -> None:
    ddb, table = _table(standin, 1_000)

    def claim(n: int) -> bool:
        try:
            ddb.transact_write_items(TransactItems=[{"Put": {
                "TableName": table, "Item": {"pk": {"S": "lock"}, "owner": {"S": str(n)}},
                "ConditionExpression": "attribute_not_exists(pk)"}}])
        except ClientError:
            return False
        return True

    with ThreadPoolExecutor(max_workers=8) as pool:
        won = list(pool.map(claim, range(16)))
    assert won.count(True) == 1
    owner = ddb.get_item(TableName=table, Key={"pk": {"S": "lock"}}, ConsistentRead=True)["Item"]["owner"]["S"]
    assert won[int(owner)] is True


def test_a_request_waits_while_another_holds_the_backend(standin: LocalStandIn) -> None:
    # (The stand-in's server runs in this process: the test can hold the lock a request would take.)
    from sdcguard.infra.local.moto_ext import dynamodb_atomic

    ddb, table = _table(standin, 0)
    with ThreadPoolExecutor(max_workers=1) as pool, dynamodb_atomic.LOCK:
        pending = pool.submit(ddb.put_item, TableName=table, Item={"pk": {"S": "late"}})
        done, _ = wait([pending], timeout=1.0)
        assert not done  # held back while the lock is taken
    pending.result(timeout=30)
    assert "Item" in ddb.get_item(TableName=table, Key={"pk": {"S": "late"}}, ConsistentRead=True)
