"""Step Functions on the stand-in: Lambda errors caught by name, nameless executions (moto_ext.stepfunctions_cfn)."""

from __future__ import annotations

import io
import json
import time
import uuid
import zipfile
from typing import Any

from sdcguard.infra.local.standin import LocalStandIn

HANDLER = '''
class SuspectUnresolvable(Exception):
    pass


def handler(event, context):
    if event.get("rank") is None:
        raise SuspectUnresolvable("no rank in the alarm")
    return {"node": "hyperpod-i-0123456789abcdef0", "rank": event["rank"]}
'''


def wait_for_end(standin: LocalStandIn, execution_arn: str, timeout: float = 60) -> dict[str, Any]:
    sfn = standin.client("stepfunctions")
    deadline = time.monotonic() + timeout
    while True:
        described = sfn.describe_execution(executionArn=execution_arn)
        if described["status"] != "RUNNING" or time.monotonic() > deadline:
            return dict(described)
        time.sleep(0.1)


def deploy_resolver(standin: LocalStandIn) -> str:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("resolver.py", HANDLER)
    role = standin.client("iam").create_role(RoleName=f"fn-{uuid.uuid4().hex[:8]}", AssumeRolePolicyDocument="{}")
    name = f"resolve-{uuid.uuid4().hex[:8]}"
    created = standin.client("lambda").create_function(
        FunctionName=name,
        Runtime="python3.11",
        Role=role["Role"]["Arn"],
        Handler="resolver.handler",
        Code={"ZipFile": buffer.getvalue()},
        Timeout=30,
    )
    return str(created["FunctionArn"])


def machine(standin: LocalStandIn, definition: dict[str, Any]) -> str:
    created = standin.client("stepfunctions").create_state_machine(
        name=f"sm-{uuid.uuid4().hex[:8]}",
        definition=json.dumps(definition),
        roleArn="arn:aws:iam::123456789012:role/sfn",
    )
    return str(created["stateMachineArn"])


def resolve_machine(function_arn: str) -> dict[str, Any]:
    return {
        "StartAt": "Resolve",
        "States": {
            "Resolve": {
                "Type": "Task",
                "Resource": "arn:aws:states:::lambda:invoke",
                "Parameters": {"FunctionName": function_arn, "Payload.$": "$"},
                "OutputPath": "$.Payload",
                "Catch": [
                    {"ErrorEquals": ["SuspectUnresolvable"], "ResultPath": "$.error", "Next": "Unresolvable"}
                ],
                "End": True,
            },
            "Unresolvable": {"Type": "Pass", "Result": "caught", "ResultPath": "$.outcome", "End": True},
        },
    }


def test_lambda_task_result_flows_through(standin: LocalStandIn) -> None:
    arn = machine(standin, resolve_machine(deploy_resolver(standin)))

    started = standin.client("stepfunctions").start_execution(stateMachineArn=arn, input=json.dumps({"rank": 3}))
    ended = wait_for_end(standin, started["executionArn"])

    assert ended["status"] == "SUCCEEDED"
    assert json.loads(ended["output"]) == {"node": "hyperpod-i-0123456789abcdef0", "rank": 3}


def test_handler_exception_is_caught_by_its_class_name(standin: LocalStandIn) -> None:
    arn = machine(standin, resolve_machine(deploy_resolver(standin)))

    started = standin.client("stepfunctions").start_execution(stateMachineArn=arn, input=json.dumps({"job": "j"}))
    ended = wait_for_end(standin, started["executionArn"])

    assert ended["status"] == "SUCCEEDED"
    output = json.loads(ended["output"])
    assert output["outcome"] == "caught"
    assert output["error"]["Error"] == "SuspectUnresolvable"
    assert json.loads(output["error"]["Cause"])["errorMessage"] == "no rank in the alarm"


def test_uncaught_handler_exception_fails_the_execution_with_its_name(standin: LocalStandIn) -> None:
    function_arn = deploy_resolver(standin)
    arn = machine(
        standin,
        {"StartAt": "Resolve", "States": {"Resolve": {"Type": "Task", "Resource": function_arn, "End": True}}},
    )

    started = standin.client("stepfunctions").start_execution(stateMachineArn=arn, input="{}")
    ended = wait_for_end(standin, started["executionArn"])

    assert ended["status"] == "FAILED"
    assert ended["error"] == "SuspectUnresolvable"


def test_executions_without_a_name_get_unique_names(standin: LocalStandIn) -> None:
    arn = machine(standin, {"StartAt": "Done", "States": {"Done": {"Type": "Succeed"}}})
    sfn = standin.client("stepfunctions")

    first = sfn.start_execution(stateMachineArn=arn, input="{}")["executionArn"]
    second = sfn.start_execution(stateMachineArn=arn, input="{}")["executionArn"]

    assert first != second
    assert not first.endswith(":None")
    assert not second.endswith(":None")
    assert wait_for_end(standin, first)["status"] == "SUCCEEDED"
    assert wait_for_end(standin, second)["status"] == "SUCCEEDED"
