"""The template keeps approval task tokens in a table of their own, granted to two roles only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sdcguard.infra.deploy.cfn_yaml import load_template
from sdcguard.lambdas.task_tokens import TOKEN_TABLE_ATTRIBUTES, TOKEN_TABLE_KEY

TEMPLATE = Path(__file__).resolve().parents[2] / "infra" / "deploy" / "template.yaml"


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(TEMPLATE)


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def dynamodb_grants(template: dict[str, Any]) -> list[tuple[str, set[str], list[Any]]]:
    """(role or policy, DynamoDB actions, resources) of every Allow statement that grants a DynamoDB action."""
    out = []
    for name, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        if resource["Type"] == "AWS::IAM::Role":
            documents = [p["PolicyDocument"] for p in props.get("Policies", [])]
        elif resource["Type"] == "AWS::IAM::ManagedPolicy":
            documents = [props["PolicyDocument"]]
        else:
            continue
        for document in documents:
            for statement in _as_list(document["Statement"]):
                actions = {a for a in _as_list(statement["Action"]) if a.startswith("dynamodb:")}
                if statement["Effect"] == "Allow" and actions:
                    out.append((name, actions, _as_list(statement["Resource"])))
    return out


def token_grants(template: dict[str, Any]) -> dict[str, set[str]]:
    """Role -> the actions it is granted on the token table (a ``*`` resource counts as the token table)."""
    out: dict[str, set[str]] = {}
    for name, actions, resources in dynamodb_grants(template):
        if {"Fn::GetAtt": ["TokenTable", "Arn"]} in resources or "*" in resources:
            out.setdefault(name, set()).update(actions)
    return out


def test_the_token_table_is_keyed_by_incident_and_expires(template: dict[str, Any]) -> None:
    props = template["Resources"]["TokenTable"]["Properties"]
    assert props["KeySchema"] == TOKEN_TABLE_KEY
    assert props["AttributeDefinitions"] == TOKEN_TABLE_ATTRIBUTES
    assert props["TimeToLiveSpecification"] == {"AttributeName": "expires_at", "Enabled": True}
    assert props["SSESpecification"] == {"SSEEnabled": True}


def test_only_the_approval_and_decide_roles_are_granted_the_token_table(template: dict[str, Any]) -> None:
    assert token_grants(template) == {
        "ApprovalRole": {"dynamodb:GetItem", "dynamodb:PutItem"},
        "DecideRole": {"dynamodb:GetItem", "dynamodb:DeleteItem"},
    }


def test_the_check_sees_a_token_grant_given_to_another_role(template: dict[str, Any]) -> None:
    resources = template["Resources"]
    statement = {
        "Effect": "Allow",
        "Action": "dynamodb:GetItem",
        "Resource": {"Fn::GetAtt": ["TokenTable", "Arn"]},
    }
    widened = {
        **template,
        "Resources": {
            **resources,
            "LedgerRole": {
                **resources["LedgerRole"],
                "Properties": {
                    **resources["LedgerRole"]["Properties"],
                    "Policies": [{"PolicyName": "x", "PolicyDocument": {"Statement": [statement]}}],
                },
            },
        },
    }
    assert "LedgerRole" in token_grants(widened)


def test_every_function_is_told_the_token_table(template: dict[str, Any]) -> None:
    for name, resource in template["Resources"].items():
        if resource["Type"] == "AWS::Lambda::Function":
            assert resource["Properties"]["Environment"]["Variables"]["TOKEN_TABLE"] == {
                "Ref": "TokenTable"
            }, name
