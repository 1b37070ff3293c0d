"""The stand-in enforces IAM: a role's credentials do what its identity policies allow, and nothing else."""

from __future__ import annotations

import io
import json
import textwrap
import uuid
import zipfile
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from sdcguard.infra.local.moto_ext import iam_enforcement
from sdcguard.infra.local.moto_ext.iam_policy import Request, evaluate
from sdcguard.infra.local.standin import LocalStandIn

TRUST = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}]})  # fmt: skip


def role(standin: LocalStandIn, *statements: dict[str, Any]) -> str:
    iam = standin.client("iam")
    name = f"r-{uuid.uuid4().hex[:8]}"
    arn = str(iam.create_role(RoleName=name, AssumeRolePolicyDocument=TRUST)["Role"]["Arn"])
    iam.put_role_policy(RoleName=name, PolicyName="p",
                        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": list(statements)}))  # fmt: skip
    return arn


def client_as(standin: LocalStandIn, role_arn: str, service: str) -> Any:
    env = standin.role_env(role_arn, "test")
    return boto3.client(
        service, endpoint_url=standin.endpoint_url, region_name=standin.region,  # type: ignore[call-overload]
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        aws_session_token=env["AWS_SESSION_TOKEN"],
    )  # fmt: skip


def table(standin: LocalStandIn) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    standin.client("dynamodb").create_table(
        TableName=name, KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}], BillingMode="PAY_PER_REQUEST",
    )  # fmt: skip
    return name, f"arn:aws:dynamodb:us-east-1:123456789012:table/{name}"


def denied(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ClientError) as caught:
        call(*args, **kwargs)
    error = caught.value.response["Error"]
    assert error["Code"] in ("AccessDenied", "AccessDeniedException"), error
    return str(error["Message"])


def test_a_role_does_what_its_policy_allows_on_its_resources_and_nothing_else(standin: LocalStandIn) -> None:
    mine, mine_arn = table(standin)
    other, _ = table(standin)
    arn = role(standin, {"Effect": "Allow", "Action": ["dynamodb:PutItem", "dynamodb:GetItem"], "Resource": mine_arn})
    ddb = client_as(standin, arn, "dynamodb")
    item = {"id": {"S": "a"}}

    ddb.put_item(TableName=mine, Item=item)
    assert ddb.get_item(TableName=mine, Key=item)["Item"] == item
    message = denied(ddb.delete_item, TableName=mine, Key=item)
    assert "dynamodb:DeleteItem" in message
    assert mine_arn in message
    assert "assumed-role/" in message
    denied(ddb.put_item, TableName=other, Item=item)
    # The stand-in's own credentials stay an administrator's: set-up and assertions are never refused.
    assert standin.client("dynamodb").get_item(TableName=other, Key=item).get("Item") is None
    assert "Item" in standin.client("dynamodb").get_item(TableName=mine, Key=item)


def test_an_explicit_deny_wins_and_a_transaction_is_judged_item_by_item(standin: LocalStandIn) -> None:
    mine, _mine_arn = table(standin)
    other, other_arn = table(standin)
    arn = role(
        standin,
        {"Effect": "Allow", "Action": "dynamodb:*", "Resource": "*"},
        {"Effect": "Deny", "Action": "dynamodb:PutItem", "Resource": other_arn},
    )
    ddb = client_as(standin, arn, "dynamodb")
    item = {"id": {"S": "a"}}

    ddb.put_item(TableName=mine, Item=item)
    assert "explicit deny" in denied(ddb.put_item, TableName=other, Item=item)
    denied(ddb.transact_write_items, TransactItems=[{"Put": {"TableName": mine, "Item": item}},
                                                     {"Put": {"TableName": other, "Item": item}}])  # fmt: skip
    assert "Item" not in standin.client("dynamodb").get_item(TableName=other, Key=item)


def test_s3_objects_under_a_prefix_and_listing_only_with_the_prefix_condition(standin: LocalStandIn) -> None:
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    standin.client("s3").create_bucket(Bucket=bucket)
    arn = role(
        standin,
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"], "Resource": f"arn:aws:s3:::{bucket}/job/*"},
        {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}",
         "Condition": {"StringLike": {"s3:prefix": ["job/*", "job"]}}},
    )  # fmt: skip
    s3 = client_as(standin, arn, "s3")

    s3.put_object(Bucket=bucket, Key="job/a", Body=b"1")
    assert s3.get_object(Bucket=bucket, Key="job/a")["Body"].read() == b"1"
    assert s3.list_objects_v2(Bucket=bucket, Prefix="job/")["KeyCount"] == 1
    denied(s3.put_object, Bucket=bucket, Key="elsewhere/a", Body=b"1")
    denied(s3.list_objects_v2, Bucket=bucket, Prefix="elsewhere/")
    denied(s3.list_objects_v2, Bucket=bucket)
    denied(s3.delete_object, Bucket=bucket, Key="job/a")


def test_a_function_runs_with_its_execution_roles_credentials(standin: LocalStandIn) -> None:
    mine, mine_arn = table(standin)
    arn = role(standin, {"Effect": "Allow", "Action": "dynamodb:PutItem", "Resource": mine_arn})
    code = textwrap.dedent(f"""
        import boto3
        def handler(event, context):
            who = boto3.client("sts").get_caller_identity()["Arn"]
            ddb = boto3.client("dynamodb")
            ddb.put_item(TableName="{mine}", Item={{"id": {{"S": "f"}}}})
            try:
                ddb.delete_item(TableName="{mine}", Key={{"id": {{"S": "f"}}}})
            except Exception as exc:
                return {{"who": who, "refused": type(exc).__name__ + ": " + str(exc)}}
            return {{"who": who, "refused": None}}
    """)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("fn.py", code)
    name = f"f-{uuid.uuid4().hex[:8]}"
    lam = standin.client("lambda")
    lam.create_function(FunctionName=name, Runtime="python3.11", Role=arn, Handler="fn.handler",
                        Code={"ZipFile": buffer.getvalue()}, Timeout=60)  # fmt: skip

    out = json.loads(lam.invoke(FunctionName=name, Payload=b"{}")["Payload"].read())

    assert out["who"].startswith(f"arn:aws:sts::123456789012:assumed-role/{arn.rsplit('/', 1)[1]}/"), out
    assert "dynamodb:DeleteItem" in (out["refused"] or ""), out
    assert "Item" in standin.client("dynamodb").get_item(TableName=mine, Key={"id": {"S": "f"}})
    refusals = [d for d in iam_enforcement.snapshot() if d.role == arn.rsplit("/", 1)[1] and not d.allowed]
    assert [(d.action, d.resource) for d in refusals] == [("dynamodb:DeleteItem", mine_arn)]


@pytest.mark.parametrize(
    ("condition", "context", "allowed"),
    [
        ({"StringEquals": {"dynamodb:Select": "SPECIFIC_ATTRIBUTES"}}, {"dynamodb:select": "SPECIFIC_ATTRIBUTES"}, True),
        ({"StringEquals": {"dynamodb:Select": "SPECIFIC_ATTRIBUTES"}}, {}, False),
        ({"StringEqualsIfExists": {"dynamodb:Select": "SPECIFIC_ATTRIBUTES"}}, {}, True),
        ({"ForAllValues:StringEquals": {"dynamodb:Attributes": ["a", "b"]}}, {"dynamodb:attributes": ["a"]}, True),
        ({"ForAllValues:StringEquals": {"dynamodb:Attributes": ["a", "b"]}}, {"dynamodb:attributes": ["a", "c"]}, False),
        ({"ArnNotEquals": {"aws:PrincipalArn": "arn:x"}}, {"aws:principalarn": "arn:y"}, True),
        ({"NumericLessThan": {"s3:max-keys": "10"}}, {"s3:max-keys": "5"}, False),  # not evaluated: never allows
    ],
)
def test_conditions(condition: dict[str, Any], context: dict[str, Any], allowed: bool) -> None:
    policy = {"Statement": [{"Effect": "Allow", "Action": "x:Y", "Resource": "*", "Condition": condition}]}

    assert evaluate([policy], Request("x:Y", "arn:r", context)).allowed is allowed
