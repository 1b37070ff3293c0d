"""The CloudFormation template: lint-clean, no wildcard actions, wired to the agreed interfaces."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from sdcguard.infra.deploy.cfn_yaml import load_template

if TYPE_CHECKING:
    import boto3

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "infra" / "deploy" / "template.yaml"

# The handler modules agreed between the pipeline and the template.
HANDLERS = {
    "record", "resolve", "guard", "suspend_job", "cordon", "evidence", "request_approval", "replace",
    "replacement_status", "rewrite_pointer", "resume_job", "close", "release", "needs_attention", "fail",
    "decide", "start_node_check", "node_check_status", "reject_replacement",
}  # fmt: skip
# The environment every handler validates at cold start (lambdas/settings.py).
SETTINGS_ENV = {
    "LEDGER_TABLE", "TOKEN_TABLE", "IDEMPOTENCY_TABLE", "TOPIC_ARN", "HYPERPOD_CLUSTER", "EKS_CLUSTER", "JOB_NAMESPACE", "JOB_NAME",
    "CHECKPOINT_BUCKET", "CHECKPOINT_PREFIX", "MODE", "MAX_QUARANTINED_NODES", "MAX_REPLACEMENTS_PER_DAY",
    "APPROVAL_TIMEOUT_SECONDS", "DCGM_METRIC_NAMES", "DECIDE_STATE_MACHINE_ARN", "REPLACEMENT_POLL_SECONDS",
    "REPLACEMENT_MAX_POLLS", "MAX_ALARM_AGE_SECONDS", "POWERTOOLS_SERVICE_NAME", "POWERTOOLS_METRICS_NAMESPACE",
    "NODE_CHECK_REPEATS", "NODE_CHECK_DEADLINE_SECONDS", "NODE_CHECK_POLL_SECONDS", "NODE_CHECK_MAX_POLLS",
    "NODE_CHECK_IMAGE", "NODE_CHECK_ACCEPT_INJECTED_FAULTS", "NODE_CHECK_FACTORIES",
    "MAX_REPLACEMENT_ROUNDS", "DCGM_NAMESPACE", "CONTAINER_INSIGHTS_NAMESPACE",
}  # fmt: skip


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(TEMPLATE)


def _resources(template: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {name: r for name, r in template["Resources"].items() if r["Type"] == kind}


def policy_statements(template: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every IAM statement of the template (role policies, managed policies, resource policies)."""

    def walk(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if isinstance(node, dict):
            statements = node.get("Statement")
            if "Version" in node and statements is not None:
                for statement in statements if isinstance(statements, list) else [statements]:
                    yield where, statement
            for key, value in node.items():
                yield from walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from walk(value, f"{where}[{i}]")

    yield from walk(template["Resources"], "Resources")


def wildcard_actions(template: dict[str, Any]) -> list[str]:
    """Where a statement allows or denies an action pattern with ``*`` (or uses NotAction)."""
    found = []
    for where, statement in policy_statements(template):
        if "NotAction" in statement:
            found.append(f"{where}: NotAction")
        actions = statement.get("Action", [])
        for action in actions if isinstance(actions, list) else [actions]:
            if not isinstance(action, str) or "*" in action or "?" in action:
                found.append(f"{where}: {action!r}")
    return found


def test_cfn_lint_reports_nothing() -> None:
    result = subprocess.run(
        [str(Path(sys.executable).with_name("cfn-lint")), str(TEMPLATE)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_no_iam_statement_uses_a_wildcard_action(template: dict[str, Any]) -> None:
    statements = list(policy_statements(template))
    assert len(statements) > 20  # the walk really finds the policies
    assert wildcard_actions(template) == []


@pytest.mark.parametrize("action", ["s3:*", "*", "dynamodb:Get*", "sagemaker:BatchReplace?lusterNodes"])
def test_the_wildcard_check_catches_wildcards(template: dict[str, Any], action: str) -> None:
    policy = template["Resources"]["PointerRole"]["Properties"]["Policies"][0]["PolicyDocument"]
    tampered = {
        "Resources": {
            "R": {"Properties": {"PolicyDocument": {**policy, "Statement": [{"Effect": "Allow", "Action": [action]}]}}}
        }
    }
    assert wildcard_actions(tampered) == [f"Resources.R.Properties.PolicyDocument: {action!r}"]


def test_only_metrics_traces_and_task_tokens_have_a_resource_wildcard(template: dict[str, Any]) -> None:
    """Allowed actions on every resource: only those that have no resource-level permissions at all.

    A key policy's ``"*"`` means the key itself, so key policies are not
    counted; denies on ``"*"`` only narrow.
    """
    unscoped = set()
    for where, statement in policy_statements(template):
        if where.startswith("Resources.TopicKey.") or statement["Effect"] != "Allow":
            continue
        resources = statement.get("Resource", [])
        if resources == "*" or (isinstance(resources, list) and "*" in resources):
            actions = statement["Action"]
            unscoped.update(actions if isinstance(actions, list) else [actions])
    assert unscoped == {
        "cloudwatch:GetMetricData",
        "cloudwatch:ListMetrics",
        "xray:PutTraceSegments",
        "xray:PutTelemetryRecords",
        "states:SendTaskSuccess",  # the task token is the capability; IAM cannot scope it
    }


def test_one_function_per_handler_with_the_settings_environment(template: dict[str, Any]) -> None:
    functions = _resources(template, "AWS::Lambda::Function")
    handlers = {f["Properties"]["Handler"] for f in functions.values()}
    assert handlers == {f"sdcguard.lambdas.handlers.{name}.handler" for name in HANDLERS}
    for name, function in functions.items():
        props = function["Properties"]
        assert props["Runtime"] == "python3.12", name
        assert props["Code"] == {"S3Bucket": {"Ref": "CodeBucket"}, "S3Key": {"Ref": "CodeKey"}}, name
        assert set(props["Environment"]["Variables"]) == SETTINGS_ENV, name
        log_group = props["LoggingConfig"]["LogGroup"]["Ref"]
        assert template["Resources"][log_group]["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}


def test_agreed_parameters_and_outputs(template: dict[str, Any]) -> None:
    assert {
        "HyperPodClusterName", "EksClusterName", "JobNamespace", "JobName", "CheckpointBucket", "CheckpointPrefix",
        "ReviewerEmail", "Mode", "MaxQuarantinedNodes", "MaxReplacementsPerDay", "ApprovalTimeoutSeconds",
        "CodeBucket", "CodeKey", "EventBusName", "LambdaArchitecture", "TrainingRoleArn",
    } <= set(template["Parameters"])  # fmt: skip
    assert template["Parameters"]["EventBusName"]["Default"] == "sdcguard"
    assert {
        "EventBusName", "IncidentStateMachineArn", "DecideStateMachineArn", "LedgerTableName", "TopicArn",
        "DeadLetterQueueUrl",
    } <= set(template["Outputs"])  # fmt: skip


def test_the_rule_starts_the_incident_machine_with_retries_and_a_dead_letter_queue(
    template: dict[str, Any],
) -> None:
    rule = template["Resources"]["AlarmRule"]["Properties"]
    assert rule["EventPattern"] == {"source": ["sdcguard.agent"], "detail-type": ["SDC Alarm"]}
    (target,) = rule["Targets"]
    assert target["Arn"] == {"Ref": "IncidentStateMachine"}
    assert target["DeadLetterConfig"]["Arn"] == {"Fn::GetAtt": ["DeadLetterQueue", "Arn"]}
    assert target["RetryPolicy"]["MaximumRetryAttempts"] > 0


def test_ledger_keeps_history_and_expires_tokens(template: dict[str, Any]) -> None:
    ledger = template["Resources"]["LedgerTable"]
    assert ledger["DeletionPolicy"] == "Retain"
    props = ledger["Properties"]
    assert props["KeySchema"] == [{"AttributeName": "incident_id", "KeyType": "HASH"}]
    assert props["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
    assert props["TimeToLiveSpecification"] == {"AttributeName": "expires_at", "Enabled": True}
    idempotency = template["Resources"]["IdempotencyTable"]["Properties"]
    assert idempotency["KeySchema"] == [{"AttributeName": "id", "KeyType": "HASH"}]
    assert idempotency["TimeToLiveSpecification"]["AttributeName"] == "expiration"


def test_only_the_replace_role_may_replace_nodes(template: dict[str, Any]) -> None:
    holders = set()
    for where, statement in policy_statements(template):
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        if "sagemaker:BatchReplaceClusterNodes" in actions:
            holders.add(where.split(".")[1])
            assert statement["Resource"] == {"Ref": "HyperPodClusterArn"}
    assert holders == {"ReplaceRole"}


def test_kubernetes_roles_have_access_entries_in_the_rbac_groups(template: dict[str, Any]) -> None:
    entries = _resources(template, "AWS::EKS::AccessEntry")
    groups = {e["Properties"]["PrincipalArn"]["Fn::GetAtt"][0]: e["Properties"]["KubernetesGroups"] for e in entries.values()}
    # The replacement handlers ask HyperPod only (tests/functional/test_iam_inventory.py records it); the node
    # checks run Kubernetes Jobs; resolve and guard only read (KubernetesReadRole).
    assert groups == {
        "KubernetesRole": [{"Ref": "KubernetesGroup"}],
        "NodeCheckRole": [{"Ref": "KubernetesGroup"}],
        "KubernetesReadRole": [{"Ref": "KubernetesReadGroup"}],
    }
    assert template["Parameters"]["KubernetesGroup"]["Default"] == "sdcguard-pipeline"
    assert template["Parameters"]["KubernetesReadGroup"]["Default"] == "sdcguard-pipeline-read"


def test_settings_environment_matches_the_handlers_settings() -> None:
    from sdcguard.lambdas.settings import ENV

    assert set(ENV) | {"POWERTOOLS_SERVICE_NAME", "POWERTOOLS_METRICS_NAMESPACE"} == SETTINGS_ENV


# The node checks' parameters, the variable each sets and the default agreed with the handlers' settings.
NODE_CHECK_PARAMETERS = {
    "NodeCheckRepeats": ("NODE_CHECK_REPEATS", 5),
    "NodeCheckDeadlineSeconds": ("NODE_CHECK_DEADLINE_SECONDS", 900),
    "NodeCheckPollSeconds": ("NODE_CHECK_POLL_SECONDS", 15),  # 70 x 15 s covers the Job's 900 s deadline
    "NodeCheckMaxPolls": ("NODE_CHECK_MAX_POLLS", 70),  # and keeps the worst case under the history limit
    "MaxReplacementRounds": ("MAX_REPLACEMENT_ROUNDS", 2),
}


@pytest.mark.parametrize("parameter", sorted(NODE_CHECK_PARAMETERS))
def test_node_check_parameters_reach_every_function_with_the_settings_defaults_and_bounds(
    template: dict[str, Any], parameter: str
) -> None:
    from sdcguard.lambdas.settings import ENV, Settings

    variable, default = NODE_CHECK_PARAMETERS[parameter]
    declared = template["Parameters"][parameter]
    assert int(declared["Default"]) == default
    field = Settings.model_fields[ENV[variable]]
    assert field.default == default
    # A stack refuses at deploy whatever its functions would refuse at cold start.
    bounds = {type(m).__name__: m for m in field.metadata}
    assert bounds["Ge"].ge <= int(declared["MinValue"]) <= default <= int(declared["MaxValue"]) <= bounds["Le"].le
    for name, function in _resources(template, "AWS::Lambda::Function").items():
        assert function["Properties"]["Environment"]["Variables"][variable] == {"Ref": parameter}, name


def test_the_node_check_functions_read_capsules_only_and_reject_runs_with_the_cordon(template: dict[str, Any]) -> None:
    roles = {
        f["Properties"]["Handler"].split(".")[-2]: f["Properties"]["Role"]["Fn::GetAtt"][0]
        for f in _resources(template, "AWS::Lambda::Function").values()
    }
    assert (roles["start_node_check"], roles["node_check_status"]) == ("NodeCheckRole", "NodeCheckRole")
    assert roles["reject_replacement"] == roles["cordon"] == "KubernetesRole"  # it cordons a failed new node
    statements = template["Resources"]["NodeCheckRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
    s3 = [s for s in statements if any(a.startswith("s3:") for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]]))]
    assert [(s["Action"], s["Resource"]) for s in s3] == [
        ("s3:GetObject", {"Fn::Sub": "arn:${AWS::Partition}:s3:::${CheckpointBucket}/${CheckpointPrefix}/capsules/*"})
    ]


@pytest.mark.parametrize("name", sorted(HANDLERS))
def test_every_handler_module_has_a_handler_function(name: str) -> None:
    module = importlib.import_module(f"sdcguard.lambdas.handlers.{name}")
    assert callable(module.handler)


@pytest.mark.parametrize(
    ("machine", "asl"), [("IncidentStateMachine", "incident.asl.json"), ("DecideStateMachine", "decide.asl.json")]
)
def test_every_asl_placeholder_is_substituted(template: dict[str, Any], machine: str, asl: str) -> None:
    text = (ROOT / "stepfunctions" / asl).read_text()
    json.loads(text)
    placeholders = set(re.findall(r"\$\{([A-Za-z0-9]+)\}", text))
    props = template["Resources"][machine]["Properties"]
    substitutions = props["DefinitionSubstitutions"]
    assert placeholders == set(substitutions)
    for name, value in substitutions.items():
        if name == "TopicArn":  # the refused alarm's direct notification (nothing recorded carries the topic)
            assert value == {"Ref": "ReviewerTopic"}
            continue
        function = value["Fn::GetAtt"][0]
        assert name == f"{function}Arn"
        assert template["Resources"][function]["Type"] == "AWS::Lambda::Function"
    key = props["DefinitionS3Location"]["Key"]["Ref"]
    assert key in template["Parameters"]


# -- who may publish ------------------------------------------------------------------------------

ROLE = "arn:aws:iam::123456789012:role/trainer"


def failed_rules(template: dict[str, Any], parameters: dict[str, str]) -> list[str]:
    """The template's Rules whose assertion fails for ``parameters``, as CloudFormation evaluates them."""
    from sdcguard.infra.deploy.template_lint import SAMPLE_PARAMETERS, _Renderer

    renderer = _Renderer(template, {**SAMPLE_PARAMETERS, "TrainingRoleArn": "", **parameters})
    failed = []
    for name, rule in template["Rules"].items():
        if "RuleCondition" in rule and not renderer.render(rule["RuleCondition"]):
            continue
        if not all(renderer.render(a["Assert"]) for a in rule["Assertions"]):
            failed.append(name)
    return failed


@pytest.mark.parametrize(
    ("parameters", "refused"),
    [
        ({}, True),
        ({"AllowAnyPublisher": "true"}, False),
        ({"TrainingRoleArn": ROLE}, False),
        ({"TrainingRoleArn": ROLE, "AllowAnyPublisher": "true"}, True),
    ],
)
def test_the_bus_is_open_to_the_account_only_when_asked_for(
    template: dict[str, Any], parameters: dict[str, str], refused: bool
) -> None:
    from sdcguard.infra.deploy.deploy import DeployError, check_publisher

    assert bool(failed_rules(template, parameters)) is refused  # CloudFormation's Rules
    effective = {"TrainingRoleArn": "", "AllowAnyPublisher": "false", **parameters}
    if refused:
        with pytest.raises(DeployError, match=r"TrainingRoleArn|AllowAnyPublisher"):
            check_publisher(effective)  # and sdcguard deploy, before anything changes
    else:
        check_publisher(effective)
    assert template["Parameters"]["AllowAnyPublisher"]["Default"] == "false"


def test_with_a_training_role_only_it_may_put_events(template: dict[str, Any]) -> None:
    from sdcguard.infra.deploy.template_lint import template_policies

    policies = dict(template_policies(template, {"TrainingRoleArn": ROLE}))
    allow, deny = policies["EventBus"]["Statement"]
    assert (allow["Effect"], allow["Principal"], allow["Action"]) == ("Allow", {"AWS": ROLE}, "events:PutEvents")
    assert (deny["Effect"], deny["Principal"], deny["Action"]) == ("Deny", "*", "events:PutEvents")
    assert deny["Condition"] == {"ArnNotEquals": {"aws:PrincipalArn": ROLE}}
    assert "EventBus" not in dict(template_policies(template, {"TrainingRoleArn": "", "AllowAnyPublisher": "true"}))


class _NewStackSession:
    """A session on an account without the stack: CloudFormation answers, anything else fails the test."""

    region_name = "us-east-1"

    def client(self, name: str, **_: Any) -> Any:
        from botocore.exceptions import ClientError

        assert name == "cloudformation", f"deploy created a {name} client for a refused deployment"

        class Cfn:
            def describe_stacks(self, **_: Any) -> Any:
                raise ClientError({"Error": {"Code": "ValidationError", "Message": "Stack s does not exist"}}, "DescribeStacks")

        return Cfn()


NEW_STACK = {
    "HyperPodClusterName": "ml-cluster",
    "HyperPodClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdef123456",
    "EksClusterName": "ml-eks",
    "CheckpointBucket": "my-ckpts",
    "CheckpointPrefix": "jobs/llama",
}


def test_deploy_refuses_an_open_bus_before_packaging_or_uploading_anything() -> None:
    from sdcguard.infra.deploy.deploy import DeployError, deploy

    with pytest.raises(DeployError, match=r"TrainingRoleArn is empty.*AllowAnyPublisher=true"):
        # The fake answers region_name and a CloudFormation client, all a refused deploy may touch.
        deploy("s", NEW_STACK, session=cast("boto3.Session", _NewStackSession()))


# -- who may approve ------------------------------------------------------------------------------


def test_the_training_role_may_never_decide(template: dict[str, Any]) -> None:
    statements = template["Resources"]["TrainingPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    denied = {
        (a, json.dumps(s["Resource"], sort_keys=True))
        for s in statements
        if s["Effect"] == "Deny"
        for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])
    }
    assert denied == {
        ("states:StartExecution", json.dumps([{"Ref": "DecideStateMachine"}, {"Ref": "IncidentStateMachine"}], sort_keys=True)),
        ("lambda:InvokeFunction", json.dumps(
            {"Fn::Sub": "arn:${AWS::Partition}:lambda:${AWS::Region}:${AWS::AccountId}:function:${AWS::StackName}-*"})),
        ("states:SendTaskSuccess", '"*"'),
        ("states:SendTaskFailure", '"*"'),
        ("states:SendTaskHeartbeat", '"*"'),
    }
    allowed = {a for s in statements if s["Effect"] == "Allow" for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])}
    assert not {a for a in allowed if a.startswith("states:")}


def test_the_reviewer_policy_may_start_the_decide_machine_and_nothing_that_acts(template: dict[str, Any]) -> None:
    policy = template["Resources"]["ReviewerPolicy"]
    assert policy["Type"] == "AWS::IAM::ManagedPolicy"
    assert template["Outputs"]["ReviewerPolicyArn"]["Value"] == {"Ref": "ReviewerPolicy"}
    statements = {s["Sid"]: s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    assert statements["Decide"]["Action"] == "states:StartExecution"
    assert statements["Decide"]["Resource"] == {"Ref": "DecideStateMachine"}
    actions = {a for s in statements.values() for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])}
    assert all(s["Effect"] == "Allow" for s in statements.values())
    # A reviewer decides through the decide machine only: no task tokens, no writes, no nodes.
    assert actions == {"states:StartExecution", "states:DescribeExecution", "dynamodb:GetItem", "dynamodb:Scan",
                       "cloudformation:DescribeStacks"}  # fmt: skip


def test_the_functions_are_named_under_the_prefix_the_training_role_may_not_invoke(template: dict[str, Any]) -> None:
    for name, function in _resources(template, "AWS::Lambda::Function").items():
        assert function["Properties"]["FunctionName"]["Fn::Sub"].startswith("${AWS::StackName}-"), name


def test_the_pointer_role_writes_the_resume_pointer_and_nothing_else(template: dict[str, Any]) -> None:
    writes = [
        statement["Resource"]
        for where, statement in policy_statements(template)
        if where.split(".")[1] == "PointerRole" and "s3:PutObject" in (
            statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        )
    ]  # fmt: skip
    assert writes == [{"Fn::Sub": "arn:${AWS::Partition}:s3:::${CheckpointBucket}/${CheckpointPrefix}/RESUME.json"}]


def test_the_topic_has_a_policy_of_its_own(template: dict[str, Any]) -> None:
    (policy,) = _resources(template, "AWS::SNS::TopicPolicy").values()
    assert policy["Properties"]["Topics"] == [{"Ref": "ReviewerTopic"}]
    statements = {st["Sid"]: st for st in policy["Properties"]["PolicyDocument"]["Statement"]}
    assert statements["AlarmsPublish"]["Condition"] == {"StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}}
    assert statements["TlsOnly"]["Effect"] == "Deny"


def test_no_role_deletes_from_the_ledger(template: dict[str, Any]) -> None:
    deleters = set()
    for where, statement in policy_statements(template):
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement.get("Resource", []) if isinstance(statement.get("Resource"), list) else [statement.get("Resource")]
        if statement["Effect"] == "Allow" and "dynamodb:DeleteItem" in actions and {"Fn::GetAtt": ["LedgerTable", "Arn"]} in resources:
            deleters.add(where.split(".")[1])
    assert deleters == set()  # the audit trail: no role deletes from the ledger (answered tokens go from TokenTable)


def test_one_approval_timeout_everywhere(template: dict[str, Any]) -> None:
    from sdcguard.lambdas.settings import Settings

    default = int(template["Parameters"]["ApprovalTimeoutSeconds"]["Default"])
    assert Settings.model_fields["approval_timeout_seconds"].default == default
    for page in ("docs/pipeline.md", "docs/deploying.md"):
        text = (ROOT / page).read_text()
        assert f"{default}" in text or f"{default:,}" in text, page
        assert "86400" not in text, page
        assert "86,400" not in text, page


def test_a_reviewer_reads_incidents_and_never_a_task_token(template: dict[str, Any]) -> None:
    from sdcguard.lambdas.ledger import INCIDENT_ATTRIBUTES

    statements = {s["Sid"]: s for s in template["Resources"]["ReviewerPolicy"]["Properties"]["PolicyDocument"]["Statement"]}
    read = statements["ReadIncidents"]
    attributes = read["Condition"]["ForAllValues:StringEquals"]["dynamodb:Attributes"]
    assert attributes == list(INCIDENT_ATTRIBUTES)
    assert "token" not in attributes
    assert read["Condition"]["StringEqualsIfExists"]["dynamodb:Select"] == "SPECIFIC_ATTRIBUTES"


def test_the_decide_role_confirms_the_decide_execution(template: dict[str, Any]) -> None:
    statements = {
        s["Sid"]: s
        for s in template["Resources"]["DecideRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
    }
    confirm = statements["ConfirmTheDecideExecution"]
    assert confirm["Action"] == "states:DescribeExecution"
    assert confirm["Resource"]["Fn::Sub"].endswith(":execution:${AWS::StackName}-decide:*")


def test_task_tokens_are_answered_by_the_decide_role_alone(template: dict[str, Any]) -> None:
    holders = set()
    for where, statement in policy_statements(template):
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        if statement["Effect"] == "Allow" and {"states:SendTaskSuccess", "states:SendTaskFailure"} & set(actions):
            holders.add(where.split(".")[1])
            # Task-token actions have no resource type: a statement scoped to a machine never matches.
            assert statement["Resource"] == "*"
    assert holders == {"DecideRole"}


# -- every failure path alerts --------------------------------------------------------------------


def test_failed_and_timed_out_executions_and_dead_letters_alarm_to_the_topic(template: dict[str, Any]) -> None:
    alarms = _resources(template, "AWS::CloudWatch::Alarm")
    watched = set()
    for alarm in alarms.values():
        props = alarm["Properties"]
        assert props["AlarmActions"] == [{"Ref": "ReviewerTopic"}]
        assert props["ComparisonOperator"] == "GreaterThanThreshold"
        assert props["Threshold"] == 0
        assert props["TreatMissingData"] == "notBreaching"  # no executions is no trouble
        (dimension,) = props["Dimensions"]
        watched.add((props["Namespace"], props["MetricName"], json.dumps(dimension["Value"], sort_keys=True)))
    machine = {m: json.dumps({"Ref": m}) for m in ("IncidentStateMachine", "DecideStateMachine")}
    assert watched == {
        ("AWS/SQS", "ApproximateNumberOfMessagesVisible", json.dumps({"Fn::GetAtt": ["DeadLetterQueue", "QueueName"]})),
        ("AWS/States", "ExecutionsFailed", machine["IncidentStateMachine"]),
        ("AWS/States", "ExecutionsTimedOut", machine["IncidentStateMachine"]),
        ("AWS/States", "ExecutionsAborted", machine["IncidentStateMachine"]),  # a StopExecution leaves the ledger open
        ("AWS/States", "ExecutionsFailed", machine["DecideStateMachine"]),
        ("AWS/States", "ExecutionsTimedOut", machine["DecideStateMachine"]),
    }


def test_cloudwatch_may_publish_to_the_encrypted_topic(template: dict[str, Any]) -> None:
    # The AWS managed key alias/aws/sns cannot be used by CloudWatch alarms: the topic needs a key of its own.
    assert template["Resources"]["ReviewerTopic"]["Properties"]["KmsMasterKeyId"] == {"Ref": "TopicKey"}
    key = template["Resources"]["TopicKey"]["Properties"]
    assert key["EnableKeyRotation"] is True
    alarms = next(s for s in key["KeyPolicy"]["Statement"] if s["Sid"] == "AlarmsPublish")
    assert alarms["Principal"] == {"Service": "cloudwatch.amazonaws.com"}
    assert set(alarms["Action"]) == {"kms:GenerateDataKey", "kms:Decrypt"}


# -- the ledger's index of open incidents -------------------------------------------------------------


def test_the_ledger_has_the_indexes_the_guard_and_the_evidence_query(template: dict[str, Any]) -> None:
    from sdcguard.lambdas.ledger import (
        OPEN_INDEX_ATTRIBUTES,
        OPEN_INDEX_DEFINITION,
        SUSPECT_INDEX_ATTRIBUTES,
        SUSPECT_INDEX_DEFINITION,
    )

    props = template["Resources"]["LedgerTable"]["Properties"]
    assert props["GlobalSecondaryIndexes"] == [OPEN_INDEX_DEFINITION, SUSPECT_INDEX_DEFINITION]
    assert all(a in props["AttributeDefinitions"] for a in [*OPEN_INDEX_ATTRIBUTES, *SUSPECT_INDEX_ATTRIBUTES])
    # The guard's and replace's roles may query the open incidents, the evidence role an instance's incidents; nothing else
    # queries the ledger, and no pipeline role may scan it.
    queries: dict[str, list[Any]] = {}
    for where, statement in policy_statements(template):
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        role = where.split(".")[1]
        if role.endswith("Role"):
            assert "dynamodb:Scan" not in actions, where
        if "dynamodb:Query" in actions:
            resources = statement.get("Resource", []) if isinstance(statement.get("Resource"), list) else [statement.get("Resource")]
            queries.setdefault(role, []).extend(resources)
    index_arn = "${{LedgerTable.Arn}}/index/{}".format
    assert queries == {
        "KubernetesRole": [{"Fn::Sub": index_arn(OPEN_INDEX_DEFINITION["IndexName"])}],  # reject_replacement: the limits
        "KubernetesReadRole": [{"Fn::Sub": index_arn(OPEN_INDEX_DEFINITION["IndexName"])}],  # the guard
        "ReplaceRole": [{"Fn::Sub": index_arn(OPEN_INDEX_DEFINITION["IndexName"])}],  # the limits again, at replace
        "EvidenceRole": [{"Fn::Sub": index_arn(SUSPECT_INDEX_DEFINITION["IndexName"])}],
    }


# -- the linters ----------------------------------------------------------------------------------------


def test_check_runs_checkov_and_parliament_on_the_template() -> None:
    from sdcguard.infra.check import checks

    labels = {label: command for label, command in checks()}
    assert labels["checkov"][-2:] == ["checkov", "infra/deploy/template.yaml"]
    assert labels["iam policies (parliament)"][-2:] == ["parliament", "infra/deploy/template.yaml"]


def _tampered(template: dict[str, Any], tmp_path: Path, change: Any) -> Path:
    import yaml

    tampered = json.loads(json.dumps(template))
    change(tampered)
    path = tmp_path / "template.yaml"
    path.write_text(yaml.safe_dump(tampered))
    return path


def test_parliament_passes_the_template_and_fails_a_policy_that_cannot_work(
    template: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sdcguard.infra.deploy.template_lint import run

    assert run("parliament", [TEMPLATE]) == 0

    def scope_tokens_to_the_machine(t: dict[str, Any]) -> None:  # what the template did before: never matches
        statements = t["Resources"]["DecideRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
        answer = next(s for s in statements if s["Sid"] == "AnswerApproval")
        answer["Resource"] = {"Fn::Sub": "arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}:stateMachine:x"}

    def misspell(t: dict[str, Any]) -> None:
        statements = t["Resources"]["TrainingPolicy"]["Properties"]["PolicyDocument"]["Statement"]
        statements[1]["Action"] = [*statements[1]["Action"], "s3:GetObjekt"]

    for change, issue in ((scope_tokens_to_the_machine, "RESOURCE_MISMATCH at DecideRole"), (misspell, "UNKNOWN_ACTION at TrainingPolicy")):
        assert run("parliament", [_tampered(template, tmp_path, change)]) == 1
        assert issue in capsys.readouterr().out


def test_a_justification_must_give_a_reason_and_must_still_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from sdcguard.infra.deploy.template_lint import EXCEPTIONS, load_exceptions, run

    entries = load_exceptions()
    assert all(len(e["reason"].split()) >= 8 for tool in entries.values() for e in tool)
    no_reason = tmp_path / "no-reason.yaml"
    no_reason.write_text(yaml.safe_dump({"parliament": [{"check": "RESOURCE_STAR", "where": "TopicKey.*"}]}))
    with pytest.raises(ValueError, match="needs reason"):
        load_exceptions(no_reason)
    stale = tmp_path / "stale.yaml"
    data = yaml.safe_load(EXCEPTIONS.read_text())
    data["parliament"].append({"check": "RESOURCE_STAR", "where": "NoSuchRole.*", "reason": "a justification of nothing at all"})
    stale.write_text(yaml.safe_dump(data))
    assert run("parliament", [TEMPLATE], exceptions=stale) == 1
    assert "RESOURCE_STAR at NoSuchRole.*, which no longer occurs" in capsys.readouterr().out


def test_botocore_knows_the_replace_action_parliament_does_not() -> None:
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    assert "BatchReplaceClusterNodes" in model.operation_names


def test_a_missing_checkov_fails_the_check_and_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sdcguard.infra.deploy.template_lint import run

    monkeypatch.setenv("SDCGUARD_CHECKOV", str(tmp_path / "no-checkov"))
    assert run("checkov", [TEMPLATE]) == 2
    assert ".venv/tools/checkov" in capsys.readouterr().err


def _checkov_or_skip() -> None:
    from sdcguard.infra.deploy.template_lint import ToolMissing, checkov_binary

    try:
        checkov_binary()
    except ToolMissing as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_checkov_passes_the_template_and_fails_an_unencrypted_queue(
    template: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sdcguard.infra.deploy.template_lint import run

    _checkov_or_skip()
    assert run("checkov", [TEMPLATE]) == 0

    def plain_queue(t: dict[str, Any]) -> None:
        t["Resources"]["DeadLetterQueue"]["Properties"].pop("SqsManagedSseEnabled")
        t["Resources"]["Spare"] = {"Type": "AWS::SQS::Queue", "Properties": {}}

    assert run("checkov", [_tampered(template, tmp_path, plain_queue)]) == 1
    assert "CKV_AWS_27 at AWS::SQS::Queue.Spare" in capsys.readouterr().out


def test_the_node_check_image_is_taken_by_digest_only(template: dict[str, Any]) -> None:
    import re

    from sdcguard.lambdas.settings import IMAGE_BY_DIGEST

    declared = template["Parameters"]["NodeCheckImage"]
    assert declared["AllowedPattern"] == IMAGE_BY_DIGEST  # the stack refuses what the functions would refuse
    assert declared["Default"] == ""
    digest = "0123456789abcdef" * 4
    for good in ("", f"registry.example/sdcguard/node-check@sha256:{digest}", f"registry.example:5000/a/b@sha256:{digest}"):
        assert re.fullmatch(IMAGE_BY_DIGEST, good), good
    for bad in ("registry.example/sdcguard/node-check:latest", f"node-check@sha256:{digest[:-1]}",
                f"node-check@sha256:{digest.upper()}", f"node-check:1.0@sha512:{digest}", f"@sha256:{digest}"):  # fmt: skip
        assert not re.fullmatch(IMAGE_BY_DIGEST, bad), bad
    assert template["Parameters"]["NodeCheckAcceptInjectedFaults"] == {
        "Type": "String", "Default": "false", "AllowedValues": ["true", "false"],
        "Description": template["Parameters"]["NodeCheckAcceptInjectedFaults"]["Description"],
    }  # fmt: skip
