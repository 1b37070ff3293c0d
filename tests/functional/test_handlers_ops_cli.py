"""The operator CLI on the stand-in: incidents (table, JSON, show) and approve/reject through the decide machine.

The decide machine is the real ``stepfunctions/decide.asl.json`` with its
handler deployed as a Lambda function from this tree's code; the incident
waits on a real task token of a running execution.
"""

from __future__ import annotations

import io
import json
import os
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sdcguard.cli import main
from sdcguard.contract import Alarm, Incident, IncidentState, ResolvedSuspect
from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lambdas.ledger import OPEN_INDEX_ATTRIBUTES, OPEN_INDEX_DEFINITION, Ledger
from sdcguard.lambdas.task_tokens import TOKEN_TABLE_ATTRIBUTES, TOKEN_TABLE_KEY, TaskTokens
from tests.events import load_event
from tests.functional.task_token import waiting_token

S = IncidentState
ROOT = Path(__file__).resolve().parents[2]
TO_WAITING = [S.RESOLVED, S.GUARDED, S.SUSPENDED, S.CORDONED, S.EVIDENCE_COLLECTED, S.AWAITING_APPROVAL]


@dataclass
class Setup:
    standin: LocalStandIn
    ledger: Ledger
    table: str
    machine: str
    tokens: TaskTokens


def code_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.write(ROOT / "sdcguard" / "__init__.py", "sdcguard/__init__.py")
        for package in ("lambdas", "contract", "lineage"):
            for path in (ROOT / package).rglob("*"):
                if path.is_file() and "__pycache__" not in path.parts:
                    archive.write(path, f"sdcguard/{path.relative_to(ROOT).as_posix()}")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def setup(standin: LocalStandIn) -> Iterator[Setup]:
    suffix = uuid.uuid4().hex[:6]
    ddb = standin.client("dynamodb")
    table = f"cli-ledger-{suffix}"
    ddb.create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "incident_id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "incident_id", "AttributeType": "S"}, *OPEN_INDEX_ATTRIBUTES],
        GlobalSecondaryIndexes=[OPEN_INDEX_DEFINITION],
        BillingMode="PAY_PER_REQUEST",
    )
    tokens = f"cli-tokens-{suffix}"
    ddb.create_table(
        TableName=tokens, KeySchema=TOKEN_TABLE_KEY, AttributeDefinitions=TOKEN_TABLE_ATTRIBUTES,
        BillingMode="PAY_PER_REQUEST",
    )
    role = standin.client("iam").create_role(RoleName=f"decide-{suffix}", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    # What the template's DecideRole grants (the stand-in evaluates the function's calls against it).
    standin.client("iam").put_role_policy(
        RoleName=f"decide-{suffix}",
        PolicyName="decide",
        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["dynamodb:GetItem", "dynamodb:UpdateItem"],
             "Resource": f"arn:aws:dynamodb:us-east-1:123456789012:table/{table}"},
            {"Effect": "Allow", "Action": ["dynamodb:GetItem", "dynamodb:DeleteItem"],
             "Resource": f"arn:aws:dynamodb:us-east-1:123456789012:table/{tokens}"},
            {"Effect": "Allow", "Action": "states:SendTaskSuccess", "Resource": "*"},
            {"Effect": "Allow", "Action": "states:DescribeExecution",
             "Resource": f"arn:aws:states:us-east-1:123456789012:execution:cli-{suffix}-decide:*"},
        ]}),
    )  # fmt: skip
    function = standin.client("lambda").create_function(
        FunctionName=f"decide-{suffix}",
        Runtime="python3.11",
        Role=role,
        Handler="sdcguard.lambdas.handlers.decide.handler",
        Code={"ZipFile": code_zip()},
        Timeout=60,
        Environment={
            "Variables": {
                "LEDGER_TABLE": table,
                "TOKEN_TABLE": tokens,
                "IDEMPOTENCY_TABLE": f"unused-{suffix}",
                "TOPIC_ARN": f"arn:aws:sns:us-east-1:123456789012:unused-{suffix}",
                "HYPERPOD_CLUSTER": "ml-cluster",
                "EKS_CLUSTER": "ml-eks",
                "CHECKPOINT_BUCKET": "ckpt-bucket",
                # the machine created below: the decide function confirms its executions
                "DECIDE_STATE_MACHINE_ARN": f"arn:aws:states:us-east-1:123456789012:stateMachine:cli-{suffix}-decide",
                "POWERTOOLS_TRACE_DISABLED": "true",
            }
        },
    )["FunctionArn"]
    definition = (ROOT / "stepfunctions" / "decide.asl.json").read_text().replace("${DecideFunctionArn}", function)
    machine = standin.client("stepfunctions").create_state_machine(
        name=f"cli-{suffix}-decide", definition=definition, roleArn=role
    )["stateMachineArn"]
    assert machine.endswith(f":stateMachine:cli-{suffix}-decide")
    saved = {k: os.environ.get(k) for k in standin.env}
    os.environ.update(standin.env)
    try:
        yield Setup(standin, Ledger(table, standin.client("dynamodb")), table, machine, TaskTokens(tokens, ddb))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def open_incident(setup: Setup, *, waiting: bool, **alarm: Any) -> str:
    """An incident from the stored ring-audit alarm (in a window of its own), optionally waiting on a real token."""
    detail = {**load_event("alarm_ring_audit")["detail"], **alarm}
    window = int(uuid.uuid4().int % 1_000_000)
    detail["last_clean"] = {"ring_audit": window, "weight_fingerprint": window + 40}
    detail["step"] = window + 50
    incident, _ = setup.ledger.open(Alarm.model_validate(detail), mode="normal")
    suspect = ResolvedSuspect(
        global_rank=3, pod="gpt-pretrain-worker-1", node="hyperpod-i-0123456789abcdef0", instance_id="i-0123456789abcdef0"
    )

    def moved(state: IncidentState) -> Callable[[Incident], Incident]:
        if state == S.RESOLVED:
            return lambda i: i.advance(state, actor="test", suspects=[suspect])
        return lambda i: i.advance(state, actor="test")

    for state in TO_WAITING if waiting else TO_WAITING[:2]:
        setup.ledger.update(incident.incident_id, moved(state))
    if waiting:
        setup.tokens.put(incident.incident_id, real_token(setup), expires_at=time.time() + 120)
    return incident.incident_id


def real_token(setup: Setup) -> str:
    return waiting_token(setup.standin)[0]


def test_incidents_lists_as_json_and_as_a_table(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    incident_id = open_incident(setup, waiting=False)
    assert main(["incidents", "--json", "--table", setup.table]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[incident_id]["state"] == "GUARDED"
    assert rows[incident_id]["detector"] == "ring_audit"
    assert rows[incident_id]["instance_ids"] == ["i-0123456789abcdef0"]
    assert main(["incidents", "--table", setup.table]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["ID", "STATE", "DETECTOR", "STEP", "JOB", "INSTANCES", "CREATED"]
    assert any(line.startswith(incident_id) and "GUARDED" in line for line in table)


def test_incidents_show_prints_the_timeline(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    incident_id = open_incident(setup, waiting=False, fault_persistence="persistent")
    assert main(["incidents", "--table", setup.table, "show", incident_id]) == 0
    out = capsys.readouterr().out
    assert "state      GUARDED" in out
    assert "fault      persistent: the suspect replayed its computation and got it wrong again" in out
    assert "instance i-0123456789abcdef0" in out
    assert [line.split()[1] for line in out.split("timeline\n")[1].splitlines()] == ["RECORDED", "RESOLVED", "GUARDED"]
    assert main(["incidents", "--table", setup.table, "show", "sdc-nosuchincident000"]) == 1
    assert "no incident 'sdc-nosuchincident000'" in capsys.readouterr().err


def test_incidents_show_takes_its_options_after_the_subcommand(
    setup: Setup, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    incident_id = open_incident(setup, waiting=False)
    monkeypatch.delenv("SDCGUARD_LEDGER_TABLE", raising=False)
    assert main(["incidents", "show", incident_id, "--table", setup.table]) == 0
    assert "state      GUARDED" in capsys.readouterr().out
    assert main(["incidents", "show", incident_id, "--table", setup.table, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["incident_id"] == incident_id
    # A table given before the sub-command is not overwritten by the sub-command's defaults.
    assert main(["incidents", "--table", setup.table, "--json", "show", incident_id]) == 0
    assert json.loads(capsys.readouterr().out)["incident_id"] == incident_id


def test_approve_starts_the_decide_machine_as_the_caller(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    incident_id = open_incident(setup, waiting=True)
    caller = setup.standin.client("sts").get_caller_identity()["Arn"]
    argv = ["approve", incident_id, "--reason", "Xid 79", "--table", setup.table, "--state-machine-arn", setup.machine]
    assert main(argv) == 0
    assert f"approved incident {incident_id} as {caller}" in capsys.readouterr().out
    incident = setup.ledger.get(incident_id)
    assert incident.state == S.APPROVED
    assert incident.decision is not None
    assert (incident.decision.reviewer, incident.decision.reason) == (caller, "Xid 79")
    # the decide execution that delivered it, which CloudTrail's StartExecution event ties to the caller
    machine_name = setup.machine.rsplit(":", 1)[1]
    assert incident.decision.execution_arn is not None
    assert f":execution:{machine_name}:{incident_id}-approve-" in incident.decision.execution_arn
    assert main(["incidents", "show", incident_id, "--table", setup.table]) == 0
    assert f"           through {incident.decision.execution_arn}" in capsys.readouterr().out

    assert main(argv) == 1  # a second decision: a clear message, nothing changed
    err = capsys.readouterr().err
    assert f"incident {incident_id} is not waiting for approval (it is APPROVED, after approve by {caller})" in err
    assert setup.ledger.get(incident_id).decision == incident.decision


def test_reject_records_the_decision_and_says_so(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    incident_id = open_incident(setup, waiting=True)
    argv = ["reject", incident_id, "--reason", "known flaky test job", "--table", setup.table,
            "--state-machine-arn", setup.machine]
    assert main(argv) == 0
    assert f"rejected incident {incident_id} as " in capsys.readouterr().out
    incident = setup.ledger.get(incident_id)
    assert incident.state == S.REJECTED
    assert incident.decision is not None
    assert incident.decision.decision == "reject"


def test_reject_of_an_incident_that_never_waited_changes_nothing(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    incident_id = open_incident(setup, waiting=False)
    argv = ["reject", incident_id, "--reason", "noise", "--table", setup.table, "--state-machine-arn", setup.machine]
    assert main(argv) == 1
    assert "not waiting for approval (it is GUARDED)" in capsys.readouterr().err
    assert setup.ledger.get(incident_id).state == S.GUARDED


def test_an_expired_approval_is_reported_as_such(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    incident_id = open_incident(setup, waiting=True)
    setup.tokens.put(incident_id, "a-token-that-no-execution-holds", expires_at=time.time() + 60)
    argv = ["approve", incident_id, "--reason", "late", "--table", setup.table, "--state-machine-arn", setup.machine]
    assert main(argv) == 1
    assert f"the approval request of incident {incident_id} has expired" in capsys.readouterr().err
    assert setup.ledger.get(incident_id).state == S.AWAITING_APPROVAL


def test_abort_ends_a_running_incident_as_the_caller_and_the_list_shows_only_open_ones(
    setup: Setup, capsys: pytest.CaptureFixture[str]
) -> None:
    running = open_incident(setup, waiting=False)
    caller = setup.standin.client("sts").get_caller_identity()["Arn"]
    assert main(["incidents", "show", running, "--table", setup.table]) == 0
    assert f"next       running; to stop it and free what it holds: sdcguard incidents abort {running}" in capsys.readouterr().out
    # release is for stopped incidents: a clear refusal, nothing changed
    assert main(["incidents", "release", running, "--reason", "r", "--table", setup.table]) == 1
    assert "still running: abort it" in capsys.readouterr().err
    assert main(["incidents", "abort", running, "--reason", "wrong job", "--table", setup.table]) == 0
    assert f"aborted incident {running} as {caller}: wrong job" in capsys.readouterr().out
    aborted = setup.ledger.get(running)
    assert (aborted.state, aborted.transitions[-1].actor) == (S.ABORTED, caller)
    assert aborted.nodes_released_at is not None
    # the list shows the open incidents; --all the ended ones too
    assert main(["incidents", "--json", "--table", setup.table]) == 0
    assert running not in {r["id"] for r in json.loads(capsys.readouterr().out)}
    assert main(["incidents", "--json", "--all", "--table", setup.table]) == 0
    assert running in {r["id"] for r in json.loads(capsys.readouterr().out)}


def test_show_names_the_execution_and_the_error_without_a_stack_trace(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    from sdcguard.contract import Failure
    from sdcguard.lambdas.close import record_failure

    incident_id = open_incident(setup, waiting=False)
    execution = "arn:aws:states:us-east-1:123456789012:execution:sdcguard-incident:run-1"
    setup.ledger.update(incident_id, lambda i: i.model_copy(update={"opened_by": execution}))
    cause = json.dumps({"errorMessage": "rank 3: pod p runs on node x", "errorType": "SuspectMismatch",
                        "stackTrace": ['  File "/var/task/lambdas/resolve.py", line 1\n']})  # fmt: skip
    sns = setup.standin.client("sns")
    topic = sns.create_topic(Name=f"t-{uuid.uuid4().hex[:6]}")["TopicArn"]
    record_failure(setup.ledger, incident_id, Failure(state="Pipeline", error="SuspectMismatch", cause=cause), topic_arn=topic, sns=sns)
    assert main(["incidents", "show", incident_id, "--table", setup.table]) == 0
    out = capsys.readouterr().out
    assert "stopped    in SuspendJob: SuspectMismatch: rank 3: pod p runs on node x" in out
    assert "stackTrace" not in out
    assert f"execution  {execution}" in out
    assert f"sdcguard incidents release {incident_id}" in out
