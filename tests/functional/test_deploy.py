"""``sdcguard deploy`` and ``destroy`` against the local stand-in: the very code path used for AWS.

The deploy reaches the stand-in only through ``AWS_ENDPOINT_URL`` (as
``sdcguard local up`` prints it), and builds the package for this interpreter.
"""

from __future__ import annotations

import io
import json
import re
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdcguard.cli import main
from sdcguard.infra.deploy.deploy import DeployError, deploy
from sdcguard.infra.deploy.destroy import DestroyError, destroy
from sdcguard.infra.deploy.package import local_target
from sdcguard.infra.local.standin import LocalStandIn

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HANDLERS = sorted(p.stem for p in (ROOT / "lambdas" / "handlers").glob("*.py") if p.stem != "__init__")


@pytest.fixture
def aws(standin: LocalStandIn, monkeypatch: pytest.MonkeyPatch) -> LocalStandIn:
    """The process environment pointed at the stand-in, as `sdcguard local up` tells a shell to."""
    for key, value in standin.env.items():
        monkeypatch.setenv(key, value)
    return standin


def _overrides(name: str) -> dict[str, str]:
    return {
        "HyperPodClusterName": f"hp-{name}",
        "HyperPodClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdef123456",
        "EksClusterName": f"eks-{name}",
        "JobNamespace": "training",
        "JobName": "llama",
        "CheckpointBucket": f"ckpt-{name}",
        "CheckpointPrefix": "jobs/llama",
        "ReviewerEmail": "oncall@example.com",
        "EventBusName": f"bus-{name}",
        "ApprovalTimeoutSeconds": "600",
        "AllowAnyPublisher": "true",  # the stand-in evaluates no IAM: there is no training role to name
    }


def _stack_exists(aws: LocalStandIn, name: str) -> bool:
    try:
        stacks = aws.client("cloudformation").describe_stacks(StackName=name)["Stacks"]
    except ClientError:
        return False
    return any(s["StackStatus"] != "DELETE_COMPLETE" for s in stacks)


def test_deploy_stands_up_the_pipeline_then_updates_and_destroys_it(aws: LocalStandIn) -> None:
    name = f"dep-{uuid.uuid4().hex[:8]}"
    lines: list[str] = []

    # Given a fresh account, when the pipeline is deployed
    result = deploy(name, _overrides(name), progress=lines.append, poll_seconds=0.1)

    # then the stack is up, with the outputs the operators and the agent use,
    assert result.status == "CREATE_COMPLETE"
    assert result.changed
    assert result.package.target == local_target()
    outputs = result.outputs
    assert outputs["EventBusName"] == f"bus-{name}"
    assert outputs["IncidentStateMachineArn"].endswith(f":stateMachine:{name}-incident")
    assert outputs["DecideStateMachineArn"].endswith(f":stateMachine:{name}-decide")
    assert any(re.search(r"CREATE_COMPLETE\s+" + name, line) for line in lines), lines

    # every handler is a function running from the uploaded package, with its settings,
    lam = aws.client("lambda")
    for handler in HANDLERS:
        config = lam.get_function_configuration(FunctionName=f"{name}-{handler.replace('_', '-')}")
        assert config["Handler"] == f"sdcguard.lambdas.handlers.{handler}.handler"
        env = config["Environment"]["Variables"]
        assert env["LEDGER_TABLE"] == outputs["LedgerTableName"]
        assert env["TOPIC_ARN"] == outputs["TopicArn"]
        assert env["MODE"] == "normal"
        assert env["DECIDE_STATE_MACHINE_ARN"] == outputs["DecideStateMachineArn"]
    code = aws.client("s3").get_object(Bucket=result.code_bucket, Key=f"sdcguard/{name}/{result.package.key_name}")
    names = zipfile.ZipFile(io.BytesIO(code["Body"].read())).namelist()
    assert {"sdcguard/lambdas/handlers/record.py", "sdcguard/contract/alarm.py", "sdcguard/lineage/pointer.py"} <= set(names)
    assert any(n.startswith("pydantic_core/") for n in names)
    assert not any(n.startswith(("boto3/", "botocore/", "torch/")) for n in names)

    # both machines carry the function ARNs in place of every placeholder,
    sfn = aws.client("stepfunctions")
    for key in ("IncidentStateMachineArn", "DecideStateMachineArn"):
        definition = sfn.describe_state_machine(stateMachineArn=outputs[key])["definition"]
        assert "${" not in definition
        assert f":function:{name}-" in definition
        json.loads(definition)

    # and the rule on the bus starts the incident machine.
    events = aws.client("events")
    (rule,) = events.list_rules(EventBusName=outputs["EventBusName"])["Rules"]
    (target,) = events.list_targets_by_rule(Rule=rule["Name"], EventBusName=outputs["EventBusName"])["Targets"]
    assert target["Arn"] == outputs["IncidentStateMachineArn"]
    assert target["DeadLetterConfig"]["Arn"].endswith(outputs["DeadLetterQueueUrl"].rsplit("/", 1)[1])

    # When deployed again unchanged, nothing is rebuilt, uploaded or updated.
    began = time.monotonic()
    again = deploy(name, {}, poll_seconds=0.1)
    assert (again.changed, again.uploaded, again.package.cached) == (False, [], True)
    assert time.monotonic() - began < 10

    # When a parameter changes, the stack is updated and the functions see it.
    changed = deploy(name, {"Mode": "cordon_only"}, poll_seconds=0.1)
    assert changed.status == "UPDATE_COMPLETE"
    env = lam.get_function_configuration(FunctionName=f"{name}-cordon")["Environment"]["Variables"]
    assert env["MODE"] == "cordon_only"
    assert env["CHECKPOINT_PREFIX"] == "jobs/llama"  # kept from the first deploy
    assert (env["JOB_NAMESPACE"], env["JOB_NAME"]) == ("training", "llama")

    # When destroyed, the stack and its functions are gone.
    assert destroy(name, poll_seconds=0.1) == "DELETE_COMPLETE"
    assert not _stack_exists(aws, name)
    with pytest.raises(ClientError):
        lam.get_function_configuration(FunctionName=f"{name}-record")


def test_refused_parameters_create_nothing(aws: LocalStandIn) -> None:
    name = f"bad-{uuid.uuid4().hex[:8]}"
    without_bucket = _overrides(name)
    del without_bucket["CheckpointBucket"]
    with pytest.raises(DeployError, match=r"missing parameter.*CheckpointBucket"):
        deploy(name, without_bucket, poll_seconds=0.1)
    unknown_cluster = {**_overrides(name), "HyperPodClusterName": "no-such-cluster"}
    del unknown_cluster["HyperPodClusterArn"]
    with pytest.raises(DeployError, match=r"HyperPod cluster 'no-such-cluster' not found"):
        deploy(name, unknown_cluster, poll_seconds=0.1)
    assert not _stack_exists(aws, name)


def test_the_cli_deploys_prints_json_and_destroys(aws: LocalStandIn, capsys: pytest.CaptureFixture[str]) -> None:
    name = f"cli-{uuid.uuid4().hex[:8]}"
    sm = aws.client("sagemaker")
    cluster = f"hp-{name}"
    sm.create_cluster(
        ClusterName=cluster,
        InstanceGroups=[
            {
                "InstanceCount": 1,
                "InstanceGroupName": "workers",
                "InstanceType": "ml.p5.48xlarge",
                "ThreadsPerCore": 1,
                "LifeCycleConfig": {"SourceS3Uri": "s3://sagemaker-lifecycle/scripts", "OnCreate": "on_create.sh"},
                "ExecutionRole": "arn:aws:iam::123456789012:role/hyperpod",
            }
        ],
    )
    overrides = _overrides(name)
    del overrides["HyperPodClusterArn"]  # looked up by name
    args = ["deploy", "--stack-name", name, "--json", "--parameter-overrides", *(f"{k}={v}" for k, v in overrides.items())]
    assert main(args) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["status"] == "CREATE_COMPLETE"
    assert summary["outputs"]["EventBusName"] == f"bus-{name}"
    assert "creating stack" in captured.err
    params = aws.client("cloudformation").describe_stacks(StackName=name)["Stacks"][0]["Parameters"]
    arn = {p["ParameterKey"]: p["ParameterValue"] for p in params}["HyperPodClusterArn"]
    assert arn == sm.describe_cluster(ClusterName=cluster)["ClusterArn"]

    assert main(["destroy", "--stack-name", name]) == 0
    assert f"stack {name}: DELETE_COMPLETE" in capsys.readouterr().out
    assert not _stack_exists(aws, name)
    with pytest.raises(DestroyError, match="no stack named"):
        destroy(name)


def test_an_alarm_the_rule_cannot_deliver_lands_in_the_dead_letter_queue(aws: LocalStandIn) -> None:
    name = f"dlq-{uuid.uuid4().hex[:8]}"
    outputs = deploy(name, _overrides(name), poll_seconds=0.1).outputs
    # Given the incident machine is gone (deleted by hand, say),
    aws.client("stepfunctions").delete_state_machine(stateMachineArn=outputs["IncidentStateMachineArn"])
    detail = {"schema_version": "1", "alarm_id": uuid.uuid4().hex}

    # when the agent publishes an alarm,
    aws.client("events").put_events(
        Entries=[
            {
                "EventBusName": outputs["EventBusName"],
                "Source": "sdcguard.agent",
                "DetailType": "SDC Alarm",
                "Detail": json.dumps(detail),
            }
        ]
    )

    # the event is kept in the dead-letter queue, with the reason.
    sqs = aws.client("sqs")
    deadline = time.monotonic() + 30
    messages: list[dict[str, str]] = []
    while not messages and time.monotonic() < deadline:
        messages = sqs.receive_message(
            QueueUrl=outputs["DeadLetterQueueUrl"], MessageAttributeNames=["All"], WaitTimeSeconds=1
        ).get("Messages", [])
    (message,) = messages
    assert json.loads(message["Body"])["detail"] == detail
    attributes: Any = message["MessageAttributes"]
    assert attributes["TARGET_ARN"]["StringValue"] == outputs["IncidentStateMachineArn"]
    destroy(name, poll_seconds=0.1)
