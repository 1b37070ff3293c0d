"""The template's roles on the stand-in, for code that runs in the test process: its policies, its credentials.

:func:`create_role` renders one role's (or managed policy's) policy
documents from ``infra/deploy/template.yaml`` with the names a test uses for
the stack's resources, and creates that role in the stand-in's IAM.
:class:`ActingWithRoles` then signs every AWS call made while acting as an
actor (:meth:`tests.functional.recorded_calls.Recorder.acting_as`) with that
actor's role's temporary credentials, so the stand-in evaluates it against
the role's policies as AWS would evaluate the deployed function's calls.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import botocore.signers
from botocore.credentials import Credentials

from sdcguard.infra.local.moto_ext import iam_enforcement
from sdcguard.infra.local.standin import LocalStandIn
from tests.functional import recorded_calls

ACCOUNT = "123456789012"
REGION = "us-east-1"
UNRESOLVED = "arn:aws:unresolved:::"  # a resource a test gave no name for: it matches nothing


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


class _Drop:
    """AWS::NoValue."""


def render(node: Any, values: dict[str, str], unresolved: set[str]) -> Any:
    """``node`` with its intrinsic functions resolved from ``values`` (names as in the template: ``X``, ``X.Arn``)."""
    pseudo = {"AWS::Partition": "aws", "AWS::Region": REGION, "AWS::AccountId": ACCOUNT, **values}

    def lookup(name: str) -> str:
        if name in pseudo:
            return pseudo[name]
        unresolved.add(name)
        return UNRESOLVED + name

    if isinstance(node, list):
        return [v for v in (render(n, values, unresolved) for n in node) if not isinstance(v, _Drop)]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (key, arg), = node.items()
        if key == "Ref":
            return _Drop() if arg == "AWS::NoValue" else lookup(arg)
        if key == "Fn::GetAtt":
            return lookup(".".join(_as_list(arg)) if isinstance(arg, list) else arg)
        if key == "Fn::Sub":
            text, local = (arg, {}) if isinstance(arg, str) else (arg[0], arg[1])
            return re.sub(r"\$\{([^}!]+)\}", lambda m: str(local.get(m.group(1)) or lookup(m.group(1))), text)
        if key == "Fn::If":
            condition, yes, no = arg
            return render(yes if values.get(f"Condition:{condition}") == "true" else no, values, unresolved)
        if key == "Fn::Select":
            index, items = arg
            return render(items, values, unresolved)[int(index)]
        if key == "Fn::Split":
            separator, text = arg
            return str(render(text, values, unresolved)).split(separator)
        if key == "Fn::Join":
            separator, items = arg
            return separator.join(str(i) for i in render(items, values, unresolved))
    out = {k: render(v, values, unresolved) for k, v in node.items()}
    return {k: v for k, v in out.items() if not isinstance(v, _Drop)}


def policy_documents(template: dict[str, Any], logical: str, values: dict[str, str],
                     leave_out: tuple[str, str] | None = None) -> tuple[list[dict[str, Any]], set[str]]:  # fmt: skip
    """The rendered policy documents of role or managed policy ``logical``, and the names left unresolved.

    ``leave_out`` = (Sid, action) removes one action from one statement, to
    show what happens without that grant.
    """
    props = template["Resources"][logical]["Properties"]
    raw = [p["PolicyDocument"] for p in props.get("Policies", [])] if "Policies" in props else [props["PolicyDocument"]]
    unresolved: set[str] = set()
    documents = [render(d, values, unresolved) for d in raw]
    # "Resource@Sid" names a statement's resource outright, for a test whose resources are not named as the
    # stack names them (a decide machine not called <stack>-decide).
    for document in documents:
        for statement in _as_list(document["Statement"]):
            override = values.get(f"Resource@{statement.get('Sid')}")
            if override is not None:
                statement["Resource"] = override
    if leave_out is not None:
        sid, action = leave_out
        found = False
        for document in documents:
            for statement in _as_list(document["Statement"]):
                if statement.get("Sid") == sid and action in _as_list(statement["Action"]):
                    statement["Action"] = [a for a in _as_list(statement["Action"]) if a != action]
                    found = True
            document["Statement"] = [s for s in _as_list(document["Statement"]) if s.get("Action")]
        assert found, f"{logical} has no statement {sid} granting {action}"
    return documents, unresolved


def create_role(standin: LocalStandIn, template: dict[str, Any], logical: str, values: dict[str, str],
                leave_out: tuple[str, str] | None = None) -> str:  # fmt: skip
    """Create a role with ``logical``'s rendered policies in the stand-in's IAM; returns its ARN."""
    documents, _ = policy_documents(template, logical, values, leave_out)
    iam = standin.client("iam")
    name = f"{logical}-{uuid.uuid4().hex[:6]}"
    trust = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}]}  # fmt: skip
    arn = str(iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"])
    for index, document in enumerate(documents):
        iam.put_role_policy(RoleName=name, PolicyName=f"p{index}", PolicyDocument=json.dumps(document))
    return arn


def role_name(arn: str) -> str:
    return arn.rsplit("/", 1)[1]


class ActingWithRoles:
    """While installed, a call made acting as an actor that has a role is signed with that role's credentials."""

    def __init__(self, standin: LocalStandIn) -> None:
        self.standin = standin
        self.roles: dict[str, str] = {}  # actor -> role ARN
        self._credentials: dict[str, Credentials] = {}

    def give(self, actor: str, role_arn: str) -> None:
        """From now on, ``actor`` calls AWS as ``role_arn``."""
        env = iam_enforcement.assume(role_arn, actor)
        self.roles[actor] = role_arn
        self._credentials[actor] = Credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env["AWS_SESSION_TOKEN"])

    @contextlib.contextmanager
    def installed(self) -> Iterator[ActingWithRoles]:
        original = botocore.signers.RequestSigner.get_auth_instance
        credentials = self._credentials

        @functools.wraps(original)
        def get_auth_instance(signer: Any, *args: Any, **kwargs: Any) -> Any:
            actor = recorded_calls._actor.get()
            if actor in credentials:
                kwargs["request_credentials"] = credentials[actor]
            return original(signer, *args, **kwargs)

        botocore.signers.RequestSigner.get_auth_instance = get_auth_instance  # type: ignore[method-assign,assignment]
        try:
            yield self
        finally:
            botocore.signers.RequestSigner.get_auth_instance = original  # type: ignore[method-assign]

    def refusals(self, since: int = 0) -> dict[str, list[tuple[str, str, str]]]:
        """What the stand-in refused each actor's role (decisions after index ``since``)."""
        by_role = {role_name(arn): actor for actor, arn in self.roles.items()}
        out: dict[str, list[tuple[str, str, str]]] = {}
        for decision in iam_enforcement.snapshot()[since:]:
            if decision.role in by_role and not decision.allowed:
                out.setdefault(by_role[decision.role], []).append((decision.action, decision.resource, decision.reason))
        return out
