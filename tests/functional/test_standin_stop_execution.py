"""StopExecution on the stand-in ends an execution that waits on a task token, as Step Functions does.

moto alone leaves such an execution RUNNING until the task times out and
accepts SendTaskSuccess with its token (:mod:`sdcguard.infra.local.moto_ext.stepfunctions_stop`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdcguard.infra.local.standin import LocalStandIn


def waiting(standin: LocalStandIn, *, heartbeat: bool) -> tuple[str, str]:
    """(token, execution ARN) of an execution waiting on ``.waitForTaskToken``, with or without a heartbeat."""
    sqs = standin.client("sqs")
    queue = sqs.create_queue(QueueName=f"stop-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    task: dict[str, Any] = {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "Parameters": {"QueueUrl": queue, "MessageBody": {"token.$": "$$.Task.Token"}},
        "TimeoutSeconds": 300,
        # What a Catch does if the task fails: the stop must not lead here.
        "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Caught"}],
        "End": True,
    }
    if heartbeat:  # as the incident machine's approval task (HeartbeatSecondsPath)
        task["HeartbeatSeconds"] = 240
    definition = {"StartAt": "Wait", "States": {"Wait": task, "Caught": {"Type": "Pass", "End": True}}}
    sfn = standin.client("stepfunctions")
    machine = sfn.create_state_machine(
        name=f"stop-{uuid.uuid4().hex[:8]}",
        definition=json.dumps(definition),
        roleArn="arn:aws:iam::123456789012:role/sfn",
    )["stateMachineArn"]
    execution = sfn.start_execution(stateMachineArn=machine, input="{}")["executionArn"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for message in sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=1).get("Messages", []):
            return str(json.loads(message["Body"])["token"]), execution
    raise AssertionError("the execution never sent its token")


def _code(call: Any) -> str:
    with pytest.raises(ClientError) as caught:
        call()
    return str(caught.value.response["Error"]["Code"])


@pytest.mark.parametrize("heartbeat", [False, True], ids=["timeout", "heartbeat"])
def test_stop_execution_aborts_a_task_token_wait_at_once_and_kills_the_token(
    standin: LocalStandIn, heartbeat: bool
) -> None:
    token, execution = waiting(standin, heartbeat=heartbeat)
    sfn = standin.client("stepfunctions")

    stopped = sfn.stop_execution(executionArn=execution, error="AbortedByOperator", cause="oncall: wrong job")

    described = sfn.describe_execution(executionArn=execution)
    assert described["status"] == "ABORTED"  # at once, not when the task would have timed out
    assert described["stopDate"] == stopped["stopDate"]
    for answer in (
        lambda: sfn.send_task_success(taskToken=token, output="{}"),
        lambda: sfn.send_task_failure(taskToken=token, error="Rejected"),
        lambda: sfn.send_task_heartbeat(taskToken=token),
    ):
        assert _code(answer) == "TaskTimedOut"
    time.sleep(0.5)  # the woken task has ended by now
    events = [e["type"] for e in sfn.get_execution_history(executionArn=execution)["events"]]
    assert events[-1] == "ExecutionAborted"
    assert "TaskSucceeded" not in events
    assert "PassStateEntered" not in events  # the Catch never ran
    assert sfn.describe_execution(executionArn=execution)["status"] == "ABORTED"


def test_a_token_that_no_execution_issued_is_still_invalid(standin: LocalStandIn) -> None:
    sfn = standin.client("stepfunctions")
    assert (
        _code(lambda: sfn.send_task_success(taskToken="not-a-token-" + uuid.uuid4().hex, output="{}"))
        == "InvalidToken"
    )


def test_a_running_wait_is_still_answered(standin: LocalStandIn) -> None:
    token, execution = waiting(standin, heartbeat=True)
    sfn = standin.client("stepfunctions")
    sfn.send_task_success(taskToken=token, output=json.dumps({"decision": "approve"}))
    deadline = time.monotonic() + 10
    while (
        sfn.describe_execution(executionArn=execution)["status"] == "RUNNING" and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    described = sfn.describe_execution(executionArn=execution)
    assert (described["status"], json.loads(described["output"])) == ("SUCCEEDED", {"decision": "approve"})
