"""EventBridge on the stand-in delivers to Step Functions and Lambda, shapes input, honours DISABLED and DLQs
(moto_ext.eventbridge_targets)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from sdcguard.infra.local.standin import LocalStandIn

ALARM_DETAIL = {"schema_version": "1", "detector": "ring_audit", "step": 120, "suspects": [{"rank": 3}]}


def bus_rule_machine(standin: LocalStandIn, state: str = "ENABLED") -> tuple[str, str, str]:
    suffix = uuid.uuid4().hex[:8]
    events = standin.client("events")
    bus = f"sdcguard-{suffix}"
    events.create_event_bus(Name=bus)
    rule = f"alarm-{suffix}"
    events.put_rule(
        Name=rule,
        EventBusName=bus,
        EventPattern=json.dumps({"source": ["sdcguard.agent"], "detail-type": ["SDC Alarm"]}),
        State=state,
    )
    machine = standin.client("stepfunctions").create_state_machine(
        name=f"incident-{suffix}",
        definition=json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Pass", "End": True}}}),
        roleArn="arn:aws:iam::123456789012:role/sfn",
    )["stateMachineArn"]
    return bus, rule, str(machine)


def put_alarm(standin: LocalStandIn, bus: str) -> None:
    response = standin.client("events").put_events(
        Entries=[
            {
                "Source": "sdcguard.agent",
                "DetailType": "SDC Alarm",
                "Detail": json.dumps(ALARM_DETAIL),
                "EventBusName": bus,
            }
        ]
    )
    assert response["FailedEntryCount"] == 0


def execution_inputs(standin: LocalStandIn, machine: str, expect: int, timeout: float = 10) -> list[Any]:
    sfn = standin.client("stepfunctions")
    deadline = time.monotonic() + timeout
    while True:
        executions = sfn.list_executions(stateMachineArn=machine)["executions"]
        if len(executions) >= expect or time.monotonic() > deadline:
            return [
                json.loads(sfn.describe_execution(executionArn=e["executionArn"])["input"]) for e in executions
            ]
        time.sleep(0.1)


def test_event_starts_an_execution_with_the_whole_event(standin: LocalStandIn) -> None:
    bus, rule, machine = bus_rule_machine(standin)
    standin.client("events").put_targets(Rule=rule, EventBusName=bus, Targets=[{"Id": "sfn", "Arn": machine}])

    put_alarm(standin, bus)

    [event] = execution_inputs(standin, machine, 1)
    assert event["source"] == "sdcguard.agent"
    assert event["detail-type"] == "SDC Alarm"
    assert event["detail"] == ALARM_DETAIL
    assert isinstance(event["time"], str)
    assert event["time"].endswith("Z")


def test_input_transformer_shapes_the_execution_input(standin: LocalStandIn) -> None:
    bus, rule, machine = bus_rule_machine(standin)
    standin.client("events").put_targets(
        Rule=rule,
        EventBusName=bus,
        Targets=[
            {
                "Id": "sfn",
                "Arn": machine,
                "InputTransformer": {
                    "InputPathsMap": {"alarm": "$.detail", "id": "$.id", "step": "$.detail.step"},
                    "InputTemplate": '{"alarm": <alarm>, "event_id": "<id>", "label": "step <step>", "rule": "<aws.events.rule-name>"}',
                },
            }
        ],
    )

    put_alarm(standin, bus)

    [given] = execution_inputs(standin, machine, 1)
    assert given["alarm"] == ALARM_DETAIL
    assert len(given["event_id"]) == 36
    assert given["label"] == "step 120"
    assert given["rule"] == rule


def test_input_path_and_constant_input(standin: LocalStandIn) -> None:
    bus, rule, machine = bus_rule_machine(standin)
    standin.client("events").put_targets(
        Rule=rule,
        EventBusName=bus,
        Targets=[
            {"Id": "path", "Arn": machine, "InputPath": "$.detail"},
            {"Id": "constant", "Arn": machine, "Input": '{"fixed": true}'},
        ],
    )

    put_alarm(standin, bus)

    inputs = execution_inputs(standin, machine, 2)
    assert sorted(inputs, key=json.dumps) == sorted([ALARM_DETAIL, {"fixed": True}], key=json.dumps)


def test_disabled_rule_delivers_nothing(standin: LocalStandIn) -> None:
    bus, rule, machine = bus_rule_machine(standin, state="DISABLED")
    events = standin.client("events")
    queue_url = standin.client("sqs").create_queue(QueueName=f"seen-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    queue_arn = standin.client("sqs").get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])[
        "Attributes"
    ]["QueueArn"]
    events.put_targets(
        Rule=rule, EventBusName=bus, Targets=[{"Id": "sfn", "Arn": machine}, {"Id": "sqs", "Arn": queue_arn}]
    )

    put_alarm(standin, bus)

    assert execution_inputs(standin, machine, 1, timeout=1) == []
    assert "Messages" not in standin.client("sqs").receive_message(QueueUrl=queue_url, WaitTimeSeconds=0)
    # and enabling it makes the same event deliver
    events.enable_rule(Name=rule, EventBusName=bus)
    put_alarm(standin, bus)
    assert len(execution_inputs(standin, machine, 1)) == 1


def test_failed_delivery_goes_to_the_dead_letter_queue(standin: LocalStandIn) -> None:
    bus, rule, machine = bus_rule_machine(standin)
    sqs = standin.client("sqs")
    dlq_url = sqs.create_queue(QueueName=f"dlq-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    missing = machine.rsplit(":", 1)[0] + ":no-such-machine"
    standin.client("events").put_targets(
        Rule=rule,
        EventBusName=bus,
        Targets=[{"Id": "gone", "Arn": missing, "DeadLetterConfig": {"Arn": dlq_arn}}],
    )

    put_alarm(standin, bus)

    received = sqs.receive_message(QueueUrl=dlq_url, MessageAttributeNames=["All"], WaitTimeSeconds=1)
    [message] = received["Messages"]
    assert json.loads(message["Body"])["detail"] == ALARM_DETAIL
    attributes = {k: v["StringValue"] for k, v in message["MessageAttributes"].items()}
    assert attributes["TARGET_ARN"] == missing
    assert attributes["RULE_ARN"].endswith(f"rule/{bus}/{rule}")
    assert attributes["ERROR_CODE"]


def test_lambda_target_is_invoked_with_the_event(standin: LocalStandIn) -> None:
    import io
    import zipfile

    bus, rule, _ = bus_rule_machine(standin)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("target.py", "def handler(event, context):\n    print('GOT', event['detail']['step'])\n")
    role = standin.client("iam").create_role(RoleName=f"t-{uuid.uuid4().hex[:8]}", AssumeRolePolicyDocument="{}")
    name = f"target-{uuid.uuid4().hex[:8]}"
    function_arn = standin.client("lambda").create_function(
        FunctionName=name,
        Runtime="python3.11",
        Role=role["Role"]["Arn"],
        Handler="target.handler",
        Code={"ZipFile": buffer.getvalue()},
        Timeout=30,
    )["FunctionArn"]
    standin.client("events").put_targets(Rule=rule, EventBusName=bus, Targets=[{"Id": "fn", "Arn": function_arn}])

    put_alarm(standin, bus)

    logs = standin.client("logs")
    deadline = time.monotonic() + 30
    messages: list[str] = []
    while time.monotonic() < deadline and not any("GOT 120" in m for m in messages):
        time.sleep(0.2)
        if logs.describe_log_groups(logGroupNamePrefix=f"/aws/lambda/{name}")["logGroups"]:
            messages = [e["message"] for e in logs.filter_log_events(logGroupName=f"/aws/lambda/{name}")["events"]]
    assert any("GOT 120" in m for m in messages)
