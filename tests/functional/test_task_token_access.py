"""A stored approval task token is readable by request_approval's role and the decide role, and by no other.

Each role is the template's, rendered for the handler scenarios' tables, and
every call is signed with its credentials while the stand-in enforces IAM.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lambdas.errors import IncidentNotFound
from sdcguard.lambdas.task_tokens import TaskTokens
from tests.functional import test_handlers_pipeline as pipeline
from tests.functional.recorded_calls import Recorder
from tests.functional.template_roles import ActingWithRoles, create_role
from tests.functional.test_iam_inventory import TEMPLATE, world_values

world = pipeline.world


def _ledger_users() -> list[str]:
    """Every role and managed policy granted a DynamoDB action on the ledger, apart from the two that handle tokens."""
    users = set()
    for name, resource in TEMPLATE["Resources"].items():
        props = resource.get("Properties", {})
        documents = [p["PolicyDocument"] for p in props.get("Policies", [])] + (
            [props["PolicyDocument"]] if resource["Type"] == "AWS::IAM::ManagedPolicy" else []
        )
        for document in documents:
            for statement in document["Statement"]:
                actions = (
                    statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
                )
                if (
                    statement["Effect"] == "Allow"
                    and any(a.startswith("dynamodb:") for a in actions)
                    and "LedgerTable" in str(statement.get("Resource"))
                ):
                    users.add(name)
    return sorted(users - {"ApprovalRole", "DecideRole"})


OTHERS = _ledger_users()


def _code(call: Any) -> str:
    with pytest.raises(ClientError) as caught:
        call()
    return str(caught.value.response["Error"]["Code"])


def test_the_ledger_is_used_by_the_roles_this_covers() -> None:
    assert {
        "LedgerRole",
        "KubernetesRole",
        "EvidenceRole",
        "ReplaceRole",
        "PointerRole",
        "ReviewerPolicy",
    } <= set(OTHERS)


@pytest.mark.parametrize("other", OTHERS)
def test_only_the_approval_and_decide_roles_read_a_task_token(
    standin: LocalStandIn, world: pipeline.World, other: str
) -> None:
    values = world_values(world)
    acting = ActingWithRoles(standin)
    for actor, role in (("writer", "ApprovalRole"), ("decider", "DecideRole"), ("other", other)):
        acting.give(actor, create_role(standin, TEMPLATE, role, values))
    tokens = world.tokens
    incident_id = f"sdc-{uuid.uuid4().hex[:16]}"
    with acting.installed():
        # Given a token that request_approval's role stored,
        with Recorder.acting_as("writer"):
            tokens.put(incident_id, "a-live-token", expires_at=2_000_000_000)
        # another role is refused reading it, scanning for it and overwriting it,
        with Recorder.acting_as("other"):
            assert _code(lambda: tokens.get(incident_id)) == "AccessDeniedException"
            assert _code(lambda: tokens.client.scan(TableName=tokens.table)) == "AccessDeniedException"
            assert (
                _code(lambda: tokens.put(incident_id, "forged", expires_at=2_000_000_000))
                == "AccessDeniedException"
            )
            if (
                other != "ReviewerPolicy"
            ):  # while it still reads the ledger (the refusal is the token's, not the table's)
                with pytest.raises(IncidentNotFound):
                    world.ledger.get(incident_id)
        # and the decide role reads it and, once it is answered, deletes it.
        with Recorder.acting_as("decider"):
            assert tokens.get(incident_id) == ("a-live-token", 2_000_000_000.0)
            tokens.delete(incident_id)
            assert tokens.get(incident_id) is None
    refused = {(action, resource.rsplit("/", 1)[1]) for action, resource, _ in acting.refusals()["other"]}
    assert refused == {(a, tokens.table) for a in ("dynamodb:GetItem", "dynamodb:Scan", "dynamodb:PutItem")}
    assert set(acting.refusals()) == {"other"}


def test_an_empty_token_table_setting_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="TOKEN_TABLE"):
        TaskTokens("")
