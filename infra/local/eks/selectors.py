"""Label and field selectors, as ``?labelSelector=`` and ``?fieldSelector=`` spell them.

Label selectors support the equality forms (``k=v``, ``k==v``, ``k!=v``) and
the set forms (``k in (a,b)``, ``k notin (a,b)``, ``k``, ``!k``); field
selectors support ``=``, ``==`` and ``!=`` on any dotted path of the object
(``spec.nodeName``, ``metadata.name``, ``status.phase``, ...). Requirements
are joined by commas and all must hold.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from sdcguard.infra.local.eks.errors import ApiError

Predicate = Callable[[dict[str, Any]], bool]

_SET_FORM = re.compile(r"^\s*(\S+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_requirements(text: str) -> list[str]:
    """Split on commas that are not inside a ``( ... )`` value set."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _equality(text: str, kind: str) -> tuple[str, str, str]:
    for op in ("!=", "==", "="):
        if op in text:
            key, _, value = text.partition(op)
            key, value = key.strip(), value.strip()
            if not key:
                raise ApiError(400, f"unable to parse requirement: {kind} selector {text!r} has no key")
            return key, ("!=" if op == "!=" else "="), value
    raise ApiError(400, f"unable to parse requirement: {kind} selector {text!r} has no operator")


def _label_holds(labels: dict[str, str], key: str, op: str, values: frozenset[str]) -> bool:
    if op == "exists":
        return key in labels
    if op == "!exists":
        return key not in labels
    if op in ("in", "="):
        return labels.get(key) in values
    return labels.get(key) not in values  # notin, !=


def parse_label_selector(text: str | None) -> Predicate:
    """A predicate on an object's ``metadata.labels``; raises ApiError(400) for a malformed selector."""
    if not text:
        return lambda _obj: True
    requirements: list[tuple[str, str, frozenset[str]]] = []
    for requirement in _split_requirements(text):
        set_form = _SET_FORM.match(requirement)
        if set_form:
            key, op, values_text = set_form.groups()
            requirements.append((key, op, frozenset(v.strip() for v in values_text.split(",") if v.strip())))
        elif requirement.startswith("!") and not any(c in requirement for c in "=()"):
            requirements.append((requirement[1:].strip(), "!exists", frozenset()))
        elif not any(c in requirement for c in "=!() "):
            requirements.append((requirement, "exists", frozenset()))
        else:
            key, op, value = _equality(requirement, "label")
            requirements.append((key, op, frozenset([value])))

    def matches(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(_label_holds(labels, key, op, values) for key, op, values in requirements)

    return matches


def _field_value(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        # Field selectors compare the string form, as the API server renders it.
        return "true" if value else "false"
    return str(value)


def parse_field_selector(text: str | None) -> Predicate:
    """A predicate on dotted fields of an object; raises ApiError(400) for a malformed selector."""
    if not text:
        return lambda _obj: True
    requirements = [_equality(r, "field") for r in _split_requirements(text)]

    def matches(obj: dict[str, Any]) -> bool:
        return all((_field_value(obj, key) == value) == (op == "=") for key, op, value in requirements)

    return matches
