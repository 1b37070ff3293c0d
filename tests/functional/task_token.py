"""A real Step Functions task token from a waiting execution on the stand-in, for tests of the approval path."""

from __future__ import annotations

import json
import time
import uuid

from sdcguard.infra.local.standin import LocalStandIn


def waiting_token(standin: LocalStandIn, timeout_seconds: int = 120) -> tuple[str, str]:
    """Start an execution that waits on ``.waitForTaskToken``; return (its token, its execution ARN).

    The token is real: SendTaskSuccess with it ends that execution, and it
    expires after ``timeout_seconds``. Raises AssertionError if the execution
    never hands its token out.
    """
    sqs = standin.client("sqs")
    queue = sqs.create_queue(QueueName=f"tokens-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    sfn = standin.client("stepfunctions")
    definition = {
        "StartAt": "Wait",
        "States": {
            "Wait": {
                "Type": "Task",
                "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
                "Parameters": {"QueueUrl": queue, "MessageBody": {"token.$": "$$.Task.Token"}},
                "TimeoutSeconds": timeout_seconds,
                "End": True,
            }
        },
    }
    machine = sfn.create_state_machine(
        name=f"approval-{uuid.uuid4().hex[:8]}", definition=json.dumps(definition),
        roleArn="arn:aws:iam::123456789012:role/sfn",
    )["stateMachineArn"]
    execution = sfn.start_execution(stateMachineArn=machine, name=uuid.uuid4().hex, input="{}")["executionArn"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for message in sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=1).get("Messages", []):
            return str(json.loads(message["Body"])["token"]), execution
    raise AssertionError("the waiting execution never sent its token")
