"""Lambda on the stand-in runs the deployed package's real handler (moto_ext.lambda_runner)."""

from __future__ import annotations

import base64
import io
import json
import time
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from sdcguard.infra.local.standin import LocalStandIn

HANDLER_SOURCE = '''
import os

import boto3

MARKER = "{marker}"


class SuspectUnresolvable(Exception):
    pass


def handler(event, context):
    print("handling", event)
    if event.get("ping"):
        return {{"marker": MARKER}}
    if event.get("fail"):
        raise SuspectUnresolvable("rank 3 has no node")
    if event.get("sleep"):
        import time
        time.sleep(event["sleep"])
    return {{
        "marker": MARKER,
        "event": event,
        "pid": os.getpid(),
        "function": context.function_name,
        "remaining_ms": context.get_remaining_time_in_millis(),
        "mode": os.environ.get("MODE"),
        "endpoint": os.environ.get("AWS_ENDPOINT_URL"),
        "buckets": [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]],
    }}
'''


def package(marker: str) -> bytes:
    """A deployment package whose ``lambdas`` package shadows the working tree's."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("sdcguard/__init__.py", "")
        archive.writestr("sdcguard/lambdas/__init__.py", "")
        archive.writestr("sdcguard/lambdas/handlers/__init__.py", "")
        archive.writestr("sdcguard/lambdas/handlers/probe.py", HANDLER_SOURCE.format(marker=marker))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def role_arn(standin: LocalStandIn) -> str:
    iam = standin.client("iam")
    name = f"lambda-{uuid.uuid4().hex[:8]}"
    arn = str(iam.create_role(RoleName=name, AssumeRolePolicyDocument="{}")["Role"]["Arn"])
    # The probe lists the buckets, with its role's credentials: the stand-in enforces IAM.
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:ListAllMyBuckets", "Resource": "*"}]}
    iam.put_role_policy(RoleName=name, PolicyName="probe", PolicyDocument=json.dumps(policy))
    return arn


def create(standin: LocalStandIn, role_arn: str, code: dict[str, Any], timeout: int = 30) -> str:
    name = f"probe-{uuid.uuid4().hex[:8]}"
    standin.client("lambda").create_function(
        FunctionName=name,
        Runtime="python3.11",
        Role=role_arn,
        Handler="sdcguard.lambdas.handlers.probe.handler",
        Code=code,
        Timeout=timeout,
        Environment={"Variables": {"MODE": "dry_run"}},
    )
    return name


def invoke(standin: LocalStandIn, name: str, event: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    response = standin.client("lambda").invoke(FunctionName=name, Payload=json.dumps(event), LogType="Tail")
    return json.loads(response["Payload"].read()), response


def test_zip_handler_runs_with_the_functions_environment(standin: LocalStandIn, role_arn: str) -> None:
    bucket = f"seen-{uuid.uuid4().hex[:8]}"
    standin.client("s3").create_bucket(Bucket=bucket)
    name = create(standin, role_arn, {"ZipFile": package("zip-1")})

    result, response = invoke(standin, name, {"step": 7})

    assert "FunctionError" not in response
    assert result["marker"] == "zip-1"  # the package's handler, not the working tree's
    assert result["event"] == {"step": 7}
    assert result["function"] == name
    assert result["mode"] == "dry_run"
    assert result["endpoint"] == standin.endpoint_url
    assert bucket in result["buckets"]  # its boto3 calls reach the stand-in
    assert 0 < result["remaining_ms"] <= 30_000
    assert "handling {'step': 7}" in base64.b64decode(response["LogResult"]).decode()


def test_handler_exception_comes_back_as_lambda_reports_it(standin: LocalStandIn, role_arn: str) -> None:
    name = create(standin, role_arn, {"ZipFile": package("zip-err")})

    error, response = invoke(standin, name, {"fail": True})

    assert response["FunctionError"] == "Unhandled"
    assert error["errorType"] == "SuspectUnresolvable"
    assert error["errorMessage"] == "rank 3 has no node"
    assert any("probe.py" in frame for frame in error["stackTrace"])
    assert not any("lambda_worker" in frame for frame in error["stackTrace"])


def test_worker_stays_warm_and_restarts_when_the_code_changes(standin: LocalStandIn, role_arn: str) -> None:
    lam = standin.client("lambda")
    name = create(standin, role_arn, {"ZipFile": package("v1")})
    first, _ = invoke(standin, name, {})
    second, _ = invoke(standin, name, {})
    assert first["pid"] == second["pid"]

    lam.update_function_code(FunctionName=name, ZipFile=package("v2"))
    third, _ = invoke(standin, name, {})

    assert third["marker"] == "v2"
    assert third["pid"] != first["pid"]


def test_concurrent_invocations_run_side_by_side(standin: LocalStandIn, role_arn: str) -> None:
    name = create(standin, role_arn, {"ZipFile": package("parallel")})
    invoke(standin, name, {"ping": True})  # one warm worker to start from

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: invoke(standin, name, {"sleep": 3})[0], range(2)))

    # Like Lambda, a second concurrent invocation gets a sandbox of its own.
    assert results[0]["pid"] != results[1]["pid"]
    assert {r["marker"] for r in results} == {"parallel"}


def test_s3_code_runs(standin: LocalStandIn, role_arn: str) -> None:
    bucket = f"code-{uuid.uuid4().hex[:8]}"
    s3 = standin.client("s3")
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="pkg/lambda.zip", Body=package("from-s3"))
    name = create(standin, role_arn, {"S3Bucket": bucket, "S3Key": "pkg/lambda.zip"})

    result, _ = invoke(standin, name, {})

    assert result["marker"] == "from-s3"


def test_timeout_ends_the_invocation_with_lambdas_error(standin: LocalStandIn, role_arn: str) -> None:
    name = create(standin, role_arn, {"ZipFile": package("slow")}, timeout=1)

    error, response = invoke(standin, name, {"sleep": 5})

    assert response["FunctionError"] == "Unhandled"
    assert error["errorType"] == "Sandbox.Timedout"
    # and the next invocation gets a fresh worker
    result, response = invoke(standin, name, {"ping": True})
    assert "FunctionError" not in response
    assert result["marker"] == "slow"


def test_output_lands_in_the_functions_log_group(standin: LocalStandIn, role_arn: str) -> None:
    name = create(standin, role_arn, {"ZipFile": package("logs")})
    invoke(standin, name, {"note": "find-me"})
    logs = standin.client("logs")

    messages = [
        event["message"]
        for stream in logs.describe_log_streams(logGroupName=f"/aws/lambda/{name}")["logStreams"]
        for event in logs.get_log_events(
            logGroupName=f"/aws/lambda/{name}", logStreamName=stream["logStreamName"]
        )["events"]
    ]

    assert any("find-me" in message for message in messages)
    assert any(message.startswith("REPORT RequestId:") for message in messages)


def test_event_invocation_runs_in_the_background(standin: LocalStandIn, role_arn: str) -> None:
    name = create(standin, role_arn, {"ZipFile": package("async")})

    response = standin.client("lambda").invoke(
        FunctionName=name, InvocationType="Event", Payload=json.dumps({"note": "async-run"})
    )

    assert response["StatusCode"] == 202
    logs = standin.client("logs")
    deadline = time.monotonic() + 30
    found = False
    while time.monotonic() < deadline and not found:
        found = any(
            "async-run" in event["message"]
            for event in logs.filter_log_events(logGroupName=f"/aws/lambda/{name}").get("events", [])
        ) if logs.describe_log_groups(logGroupNamePrefix=f"/aws/lambda/{name}")["logGroups"] else False
        time.sleep(0.1)
    assert found
