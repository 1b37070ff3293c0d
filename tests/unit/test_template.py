"""The CloudFormation template: lint-clean, no wildcard actions, wired to the agreed interfaces."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.deploy.cfn_yaml import load_template

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "infra" / "deploy" / "template.yaml"

# The handler modules agreed between the pipeline and the template.
HANDLERS = {
    "record", "resolve", "guard", "suspend_job", "cordon", "evidence", "request_approval", "replace",
    "replacement_status", "rewrite_pointer", "resume_job", "close", "release", "needs_attention", "fail",
    "decide",
}  # fmt: skip
# The environment every handler validates at cold start (lambdas/settings.py).
SETTINGS_ENV = {
    "LEDGER_TABLE", "IDEMPOTENCY_TABLE", "TOPIC_ARN", "HYPERPOD_CLUSTER", "EKS_CLUSTER", "JOB_NAMESPACE",
    "CHECKPOINT_BUCKET", "CHECKPOINT_PREFIX", "MODE", "MAX_QUARANTINED_NODES", "MAX_REPLACEMENTS_PER_DAY",
    "APPROVAL_TIMEOUT_SECONDS", "DCGM_METRIC_NAMES", "DECIDE_STATE_MACHINE_ARN", "REPLACEMENT_POLL_SECONDS",
    "REPLACEMENT_MAX_POLLS", "POWERTOOLS_SERVICE_NAME", "POWERTOOLS_METRICS_NAMESPACE",
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


def test_only_metrics_and_traces_have_a_resource_wildcard(template: dict[str, Any]) -> None:
    unscoped = set()
    for _, statement in policy_statements(template):
        resources = statement.get("Resource", [])
        if resources == "*" or (isinstance(resources, list) and "*" in resources):
            actions = statement["Action"]
            unscoped.update(actions if isinstance(actions, list) else [actions])
    assert unscoped == {
        "cloudwatch:GetMetricData",
        "cloudwatch:ListMetrics",
        "xray:PutTraceSegments",
        "xray:PutTelemetryRecords",
    }


def test_one_function_per_handler_with_the_settings_environment(template: dict[str, Any]) -> None:
    functions = _resources(template, "AWS::Lambda::Function")
    handlers = {f["Properties"]["Handler"] for f in functions.values()}
    assert handlers == {f"lambdas.handlers.{name}.handler" for name in HANDLERS}
    for name, function in functions.items():
        props = function["Properties"]
        assert props["Runtime"] == "python3.12", name
        assert props["Code"] == {"S3Bucket": {"Ref": "CodeBucket"}, "S3Key": {"Ref": "CodeKey"}}, name
        assert set(props["Environment"]["Variables"]) == SETTINGS_ENV, name
        log_group = props["LoggingConfig"]["LogGroup"]["Ref"]
        assert template["Resources"][log_group]["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}


def test_agreed_parameters_and_outputs(template: dict[str, Any]) -> None:
    assert {
        "HyperPodClusterName", "EksClusterName", "JobNamespace", "CheckpointBucket", "CheckpointPrefix",
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


def test_kubernetes_roles_have_access_entries_in_the_rbac_group(template: dict[str, Any]) -> None:
    entries = _resources(template, "AWS::EKS::AccessEntry")
    principals = {e["Properties"]["PrincipalArn"]["Fn::GetAtt"][0] for e in entries.values()}
    assert principals == {"KubernetesRole", "ReplaceRole"}
    for entry in entries.values():
        assert entry["Properties"]["KubernetesGroups"] == [{"Ref": "KubernetesGroup"}]
    assert template["Parameters"]["KubernetesGroup"]["Default"] == "sdcguard-pipeline"


def test_settings_environment_matches_the_handlers_settings() -> None:
    from lambdas.settings import ENV

    assert set(ENV) | {"POWERTOOLS_SERVICE_NAME", "POWERTOOLS_METRICS_NAMESPACE"} == SETTINGS_ENV


@pytest.mark.parametrize("name", sorted(HANDLERS))
def test_every_handler_module_has_a_handler_function(name: str) -> None:
    module = importlib.import_module(f"lambdas.handlers.{name}")
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
        function = value["Fn::GetAtt"][0]
        assert name == f"{function}Arn"
        assert template["Resources"][function]["Type"] == "AWS::Lambda::Function"
    key = props["DefinitionS3Location"]["Key"]["Ref"]
    assert key in template["Parameters"]
