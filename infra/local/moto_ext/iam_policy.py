"""IAM identity-policy evaluation for the stand-in (the part of IAM that decides Allow or Deny).

What AWS does for a request made by one identity in its own account, with
identity-based policies only: an explicit ``Deny`` that matches wins; else an
``Allow`` that matches permits; else the request is implicitly denied. A
statement matches when its ``Action``/``NotAction`` matches the action
(case-insensitive, ``*`` and ``?`` wildcards), its ``Resource``/``NotResource``
matches the resource ARN (case-sensitive wildcards), and every condition
holds for the request's context keys.

Conditions: the String, Arn, Bool and Null operators, their ``IfExists``
forms, and the ``ForAnyValue:``/``ForAllValues:`` set qualifiers. Any other
operator (Numeric, Date, IpAddress, Binary) is not evaluated: an ``Allow``
statement that needs it does not apply, a ``Deny`` statement that needs it
applies, and the reason says so, so the stand-in never permits what AWS
might refuse. Policy variables (``${aws:username}``) are not substituted.
Not modelled: resource-based policies, session policies, permission
boundaries, SCPs and cross-account access.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

ContextValue = str | list[str]


@dataclass(frozen=True)
class Request:
    """One action on one resource, with the request's condition context keys (lower-case names)."""

    action: str
    resource: str
    context: dict[str, ContextValue] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Verdict:
    """The outcome for one request: allowed or not, and the statement (or its absence) that decided."""

    allowed: bool
    reason: str


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


@functools.lru_cache(maxsize=4096)
def _pattern(glob: str, ignore_case: bool) -> re.Pattern[str]:
    # IAM's wildcards are * and ? only (fnmatch would also read [...] as a class).
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in glob)
    return re.compile(f"^{body}$", re.IGNORECASE | re.DOTALL if ignore_case else re.DOTALL)


def _matches(glob: str, value: str, *, ignore_case: bool = False) -> bool:
    return _pattern(glob, ignore_case).match(value) is not None


def _documents(policy: Any) -> list[dict[str, Any]]:
    document = json.loads(policy) if isinstance(policy, str) else policy
    return [document] if isinstance(document, dict) else []


_STRING_OPS = {
    "StringEquals": lambda p, v: p == v,
    "StringNotEquals": lambda p, v: p == v,
    "StringEqualsIgnoreCase": lambda p, v: p.lower() == v.lower(),
    "StringNotEqualsIgnoreCase": lambda p, v: p.lower() == v.lower(),
    "StringLike": lambda p, v: _matches(p, v),
    "StringNotLike": lambda p, v: _matches(p, v),
    "ArnEquals": lambda p, v: p == v,
    "ArnNotEquals": lambda p, v: p == v,
    "ArnLike": lambda p, v: _matches(p, v),
    "ArnNotLike": lambda p, v: _matches(p, v),
    "Bool": lambda p, v: p.lower() == v.lower(),
}
_NEGATED = {"StringNotEquals", "StringNotEqualsIgnoreCase", "StringNotLike", "ArnNotEquals", "ArnNotLike"}


class _Unsupported(Exception):
    """A condition operator the stand-in does not evaluate."""


def _condition_holds(operator: str, key: str, expected: list[str], context: dict[str, ContextValue]) -> bool:
    qualifier, _, op = operator.rpartition(":")
    if_exists = op.endswith("IfExists")
    op = op.removesuffix("IfExists")
    present = key.lower() in context
    actual = context.get(key.lower())
    values = [str(v) for v in _as_list(actual)]
    if op == "Null":
        want_absent = str(expected[0]).lower() == "true"
        return want_absent != present
    if op not in _STRING_OPS:
        raise _Unsupported(operator)
    test = _STRING_OPS[op]
    negated = op in _NEGATED
    expected_text = [str(e).lower() if op == "Bool" else str(e) for e in expected]

    def one(value: str) -> bool:
        hit = any(test(e, value) for e in expected_text)
        return not hit if negated else hit

    if qualifier == "ForAllValues":
        return all(one(v) for v in values)  # true when the key is absent or empty, as on AWS
    if qualifier == "ForAnyValue":
        return any(one(v) for v in values)
    if qualifier:
        raise _Unsupported(operator)
    if not present:
        # A missing key: IfExists makes the condition hold; a negated operator holds too (nothing equals it).
        return if_exists or negated
    if negated:
        return all(one(v) for v in values)
    return any(one(v) for v in values)


def _conditions_hold(conditions: dict[str, Any], context: dict[str, ContextValue]) -> bool:
    return all(
        _condition_holds(operator, key, [str(v) for v in _as_list(expected)], context)
        for operator, keys in conditions.items()
        for key, expected in keys.items()
    )


def _statement_applies(statement: dict[str, Any], request: Request) -> bool:
    if "Action" in statement:
        actions, negated = _as_list(statement["Action"]), False
    elif "NotAction" in statement:
        actions, negated = _as_list(statement["NotAction"]), True
    else:
        return False
    if any(_matches(a, request.action, ignore_case=True) for a in actions) == negated:
        return False
    if "Resource" in statement or "NotResource" in statement:
        negated = "Resource" not in statement
        resources = _as_list(statement["NotResource" if negated else "Resource"])
        if any(_matches(r, request.resource) for r in resources) == negated:
            return False
    return _conditions_hold(statement.get("Condition") or {}, request.context)


def evaluate(policies: list[Any], request: Request) -> Verdict:
    """Whether the identity whose policies are ``policies`` (JSON text or parsed documents) may make ``request``."""
    allowed_by: str | None = None
    for policy in policies:
        for document in _documents(policy):
            for index, statement in enumerate(_as_list(document.get("Statement"))):
                name = statement.get("Sid") or f"statement {index}"
                deny = statement.get("Effect") == "Deny"
                try:
                    applies = _statement_applies(statement, request)
                except _Unsupported as exc:
                    if deny:
                        return Verdict(False, f"the Deny statement {name} has a condition the stand-in does not "
                                              f"evaluate ({exc}); it is taken to apply")  # fmt: skip
                    continue
                if applies and deny:
                    return Verdict(False, f"with an explicit deny in an identity-based policy ({name})")
                if applies and allowed_by is None:
                    allowed_by = name
    if allowed_by is not None:
        return Verdict(True, f"allowed by {allowed_by}")
    return Verdict(False, f"because no identity-based policy allows the {request.action} action")

