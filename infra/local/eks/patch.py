"""The three PATCH bodies the API server accepts: strategic merge, JSON merge (RFC 7386), JSON patch (RFC 6902).

Each takes the stored object and the decoded body and returns a new object,
leaving the input untouched; a body that cannot apply raises ``PatchError``
with the reason, which the server turns into a Status error.
"""

from __future__ import annotations

import copy
from typing import Any

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class PatchError(Exception):
    """A patch body that is malformed (``code`` 400) or does not apply to the object (``code`` 422)."""

    def __init__(self, message: str, code: int = 422) -> None:
        super().__init__(message)
        self.code = code


def merge_patch(original: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _strip_directives(value: Any) -> Any:
    """Drop ``$patch``-style directive keys from a value that is inserted as is."""
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def strategic_merge_patch(original: dict[str, Any], patch: Any, merge_keys: dict[str, str]) -> dict[str, Any]:
    """Kubernetes strategic merge: maps merge, lists listed in ``merge_keys`` merge by their key, other lists replace.

    Honours ``null`` (delete a key), ``$patch: replace|delete`` on maps and on
    list elements, and ``$deleteFromPrimitiveList/<field>``;
    ``$setElementOrder`` and ``$retainKeys`` only order or prune and are
    accepted without effect on order.
    """
    if not isinstance(patch, dict):
        raise PatchError("a strategic merge patch must be a JSON object", code=400)
    merged = _merge_map(original, patch, merge_keys, "")
    return merged if merged is not None else {}


def _merge_map(
    original: dict[str, Any] | None, patch: dict[str, Any], merge_keys: dict[str, str], path: str
) -> dict[str, Any] | None:
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return _strip_directives({k: v for k, v in patch.items() if k != "$patch"})
    if directive not in (None, "merge"):
        raise PatchError(f"unknown patch directive $patch: {directive!r} at {path or '<root>'}", code=400)
    result = copy.deepcopy(original) if isinstance(original, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if not isinstance(value, list):
                raise PatchError(f"{key} must be a list", code=400)
            current = result.get(field)
            if isinstance(current, list):
                result[field] = [item for item in current if item not in value]
            continue
        sub = f"{path}.{key}" if path else key
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            existing = result.get(key)
            merged = _merge_map(existing if isinstance(existing, dict) else None, value, merge_keys, sub)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and sub in merge_keys:
            existing_list = result.get(key)
            result[key] = _merge_list(
                existing_list if isinstance(existing_list, list) else [],
                value,
                merge_keys[sub],
                merge_keys,
                sub,
            )
        else:
            result[key] = _strip_directives(value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(
    original: list[Any], patch: list[Any], key: str, merge_keys: dict[str, str], path: str
) -> list[Any]:
    result = copy.deepcopy(original)
    for element in patch:
        if not isinstance(element, dict):
            raise PatchError(f"{path}: elements of a list merged by {key!r} must be objects", code=400)
        directive = element.get("$patch")
        if directive == "replace":
            # The list is replaced by the patch's other elements.
            return _strip_directives([e for e in patch if not (isinstance(e, dict) and e.get("$patch"))])
        if key not in element:
            raise PatchError(f"{path}: an element has no merge key {key!r}", code=400)
        index = next(
            (i for i, item in enumerate(result) if isinstance(item, dict) and item.get(key) == element[key]),
            None,
        )
        if directive == "delete":
            if index is not None:
                del result[index]
            continue
        if index is None:
            result.append(_strip_directives(element))
        else:
            merged = _merge_map(result[index], element, merge_keys, path)
            result[index] = merged if merged is not None else {}
    return result


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise PatchError(f"invalid JSON pointer {path!r}", code=400)
    if path == "":
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], op: str) -> tuple[Any, str]:
    if not parts:
        raise PatchError(f"{op} operation cannot target the document root")
    target = doc
    for part in parts[:-1]:
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise PatchError(f"{op} operation does not apply: doc is missing path: /{'/'.join(parts)}")
    return target, parts[-1]


def _get(doc: Any, parts: list[str], op: str) -> Any:
    target = doc
    for part in parts:
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise PatchError(f"{op} operation does not apply: doc is missing path: /{'/'.join(parts)}")
    return target


def _add(doc: Any, parts: list[str], value: Any, op: str) -> None:
    parent, last = _parent(doc, parts, op)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise PatchError(f"{op} operation does not apply: index {last} out of range")
    else:
        raise PatchError(f"{op} operation does not apply: parent of /{'/'.join(parts)} is not a container")


def _remove(doc: Any, parts: list[str], op: str) -> Any:
    parent, last = _parent(doc, parts, op)
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise PatchError(f"{op} operation does not apply: doc is missing key: /{'/'.join(parts)}")


def json_patch(original: dict[str, Any], patch: Any) -> dict[str, Any]:
    """RFC 6902: apply ``add``, ``remove``, ``replace``, ``move``, ``copy`` and ``test`` in order, all or nothing."""
    if not isinstance(patch, list):
        raise PatchError("json: cannot unmarshal object into Go value of type jsonpatch.Patch", code=400)
    doc = copy.deepcopy(original)
    for i, operation in enumerate(patch):
        if not isinstance(operation, dict) or "op" not in operation or "path" not in operation:
            raise PatchError(f"operation {i} must be an object with 'op' and 'path'", code=400)
        op = operation["op"]
        parts = _pointer(operation["path"])
        if op in ("add", "replace", "test") and "value" not in operation:
            raise PatchError(f"{op} operation {i} has no 'value'", code=400)
        if op == "add":
            _add(doc, parts, copy.deepcopy(operation["value"]), op)
        elif op == "remove":
            _remove(doc, parts, op)
        elif op == "replace":
            _remove(doc, parts, op)
            _add(doc, parts, copy.deepcopy(operation["value"]), op)
        elif op in ("move", "copy"):
            source = _pointer(operation.get("from"))
            value = _remove(doc, source, op) if op == "move" else copy.deepcopy(_get(doc, source, op))
            _add(doc, parts, value, op)
        elif op == "test":
            if _get(doc, parts, op) != operation["value"]:
                raise PatchError(f"testing value /{'/'.join(parts)} failed")
        else:
            raise PatchError(f"unexpected operation {op!r} at index {i}", code=400)
    if not isinstance(doc, dict):
        raise PatchError("the patched object is not a JSON object")
    return doc
