"""CloudFormation on the stand-in: state machines that run, substitutions, Ref of a bus
(moto_ext.stepfunctions_cfn, moto_ext.eventbus_ref)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdcguard.infra.local.standin import LocalStandIn

ASL = {
    "StartAt": "Greet",
    "States": {"Greet": {"Type": "Pass", "Result": {"said": "${Greeting}", "limit": "${Limit}"}, "End": True}},
}


def deploy(standin: LocalStandIn, resources: dict[str, Any], outputs: dict[str, Any]) -> dict[str, str]:
    name = f"stack-{uuid.uuid4().hex[:8]}"
    template = {"AWSTemplateFormatVersion": "2010-09-09", "Resources": resources, "Outputs": outputs}
    cfn = standin.client("cloudformation")
    cfn.create_stack(StackName=name, TemplateBody=json.dumps(template))
    stack = cfn.describe_stacks(StackName=name)["Stacks"][0]
    assert stack["StackStatus"] == "CREATE_COMPLETE", stack
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}


def run(standin: LocalStandIn, machine_arn: str) -> dict[str, Any]:
    sfn = standin.client("stepfunctions")
    arn = sfn.start_execution(stateMachineArn=machine_arn, input="{}")["executionArn"]
    deadline = time.monotonic() + 30
    while (described := sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return dict(described)


ROLE = {
    "Type": "AWS::IAM::Role",
    "Properties": {
        "AssumeRolePolicyDocument": {
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Principal": {"Service": "states.amazonaws.com"}, "Action": "sts:AssumeRole"}
            ],
        }
    },
}


@pytest.mark.parametrize("form", ["DefinitionString", "Definition", "DefinitionS3Location"])
def test_substituted_state_machine_runs(standin: LocalStandIn, form: str) -> None:
    properties: dict[str, Any] = {
        "RoleArn": {"Fn::GetAtt": ["Role", "Arn"]},
        "DefinitionSubstitutions": {"Greeting": "hello", "Limit": 3},
    }
    if form == "DefinitionString":
        properties["DefinitionString"] = json.dumps(ASL)
    elif form == "Definition":
        properties["Definition"] = ASL
    else:
        bucket = f"asl-{uuid.uuid4().hex[:8]}"
        standin.client("s3").create_bucket(Bucket=bucket)
        standin.client("s3").put_object(Bucket=bucket, Key="incident.asl.json", Body=json.dumps(ASL).encode())
        properties["DefinitionS3Location"] = {"Bucket": bucket, "Key": "incident.asl.json"}

    outputs = deploy(
        standin,
        {"Role": ROLE, "Machine": {"Type": "AWS::StepFunctions::StateMachine", "Properties": properties}},
        {"Ref": {"Value": {"Ref": "Machine"}}, "Arn": {"Value": {"Fn::GetAtt": ["Machine", "Arn"]}}},
    )

    assert outputs["Ref"] == outputs["Arn"]
    described = standin.client("stepfunctions").describe_state_machine(stateMachineArn=outputs["Arn"])
    assert "${" not in described["definition"]
    ended = run(standin, outputs["Arn"])
    assert ended["status"] == "SUCCEEDED"
    assert json.loads(ended["output"]) == {"said": "hello", "limit": "3"}


def test_missing_substitution_fails_the_stack(standin: LocalStandIn) -> None:
    name = f"stack-{uuid.uuid4().hex[:8]}"
    template = {
        "Resources": {
            "Role": ROLE,
            "Machine": {
                "Type": "AWS::StepFunctions::StateMachine",
                "Properties": {"RoleArn": {"Fn::GetAtt": ["Role", "Arn"]}, "Definition": ASL},
            },
        }
    }
    cfn = standin.client("cloudformation")
    before = standin.client("stepfunctions").list_state_machines()["stateMachines"]

    with pytest.raises(ClientError) as info:
        cfn.create_stack(StackName=name, TemplateBody=json.dumps(template))

    assert info.value.response["Error"]["Code"] == "ValidationError"
    assert "${Greeting}" in info.value.response["Error"]["Message"]
    assert standin.client("stepfunctions").list_state_machines()["stateMachines"] == before


def test_ref_of_an_event_bus_is_its_name(standin: LocalStandIn) -> None:
    bus = f"sdcguard-{uuid.uuid4().hex[:8]}"

    outputs = deploy(
        standin,
        {"Bus": {"Type": "AWS::Events::EventBus", "Properties": {"Name": bus}}},
        {"BusName": {"Value": {"Ref": "Bus"}}, "BusArn": {"Value": {"Fn::GetAtt": ["Bus", "Arn"]}}},
    )

    assert outputs["BusName"] == bus
    assert outputs["BusArn"].endswith(f":event-bus/{bus}")
    assert standin.client("events").describe_event_bus(Name=bus)["Name"] == bus
