"""REST behaviour: what each verb does to the stored objects, transport aside.

Get, list (``labelSelector``, ``fieldSelector``, ``limit``, ``continue``),
create, replace (PUT), patch (JSON, merge and, for built-in kinds, strategic
merge) and delete, each honouring ``dryRun=All``; the two subresources
(``pods/eviction``, ``pods/log``); SelfSubjectAccessReviews; and the Table
form of a GET answer. What runs behind a stored object (a Job's pod and its
process) is the ``Workloads`` given to :class:`RestApi`, told of every
create and delete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from sdcguard.infra.local.eks import patch as patches
from sdcguard.infra.local.eks import rbac, tables
from sdcguard.infra.local.eks.errors import ApiError, not_found
from sdcguard.infra.local.eks.objects import ObjectStore
from sdcguard.infra.local.eks.resources import NAMESPACES, PODS, SELF_SUBJECT_ACCESS_REVIEWS, Resource
from sdcguard.infra.local.eks.routing import Target
from sdcguard.infra.local.eks.selectors import parse_field_selector, parse_label_selector


@dataclass(frozen=True)
class PlainText:
    """An answer sent as ``text/plain`` (a pod's log), not JSON."""

    text: str


def json_body(raw: bytes | None) -> Any:
    """A request body decoded as JSON; raises ApiError 400 when there is none or it is not JSON."""
    if raw is None:
        raise ApiError(400, "the request has no body (Content-Length is missing)")
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:
        raise ApiError(400, f"couldn't decode the request body as JSON: {exc}") from exc


@dataclass(frozen=True)
class Call:
    """One authorised REST request, as the REST layer needs it."""

    method: str
    target: Target
    query: dict[str, str]
    identity: rbac.Identity
    content_type: str = ""
    """The request's media type without parameters, lower case."""
    raw: bytes | None = None
    """The request body as sent; None when it had none."""

    def body(self) -> Any:
        """The body as JSON; raises ApiError 400 when there is none or it is not JSON."""
        return json_body(self.raw)

    def options(self) -> dict[str, Any]:
        """A DELETE's DeleteOptions (``propagationPolicy``, ...) from its body, or {} when it sent none."""
        try:
            body = json.loads(self.raw) if self.raw else None
        except ValueError:
            return {}  # a body nobody reads: ignored, as before Jobs needed one
        return body if isinstance(body, dict) else {}


class Workloads(Protocol):
    """What runs behind stored objects: told of every create and delete, and the source of pod logs."""

    def created(self, resource: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        """React to a stored object; returns the object as the creator should see it."""

    def deleted(self, resource: Resource, obj: dict[str, Any], options: dict[str, Any]) -> None:
        """React to a deleted object (``options``: the request's DeleteOptions)."""

    def log(self, namespace: str, name: str, query: dict[str, str]) -> str:
        """``pods/NAME/log``: the pod's output; raises ApiError as the API server does."""


class RestApi:
    """The verbs on ``store``'s objects, with ``workloads`` told of creates and deletes."""

    def __init__(self, store: ObjectStore, workloads: Workloads | None = None) -> None:
        self.store = store
        self.workloads = workloads

    def handle(self, call: Call) -> tuple[int, Any]:
        """Answer an authorised request: its status and body (JSON-able, or :class:`PlainText`).

        Raises ApiError as the API server answers: 404 for what does not
        exist, 405 for a verb a path does not take, 409, 415, 422 ...
        """
        method, target, query = call.method, call.target, call.query
        resource, namespace, name = target.resource, target.namespace, target.name
        dry_run = query.get("dryRun") == "All"
        if resource is SELF_SUBJECT_ACCESS_REVIEWS:
            if method != "POST" or name is not None:
                raise ApiError(405, f"{method} is not supported on {resource.plural}")
            return 201, rbac.access_review(self.store, call.identity, call.body())
        if target.subresource == "eviction":
            if method != "POST" or name is None:
                raise ApiError(405, f"{method} is not supported on pods/eviction")
            return self._evict(namespace, name, call.body(), dry_run)
        if target.subresource == "log":
            if method != "GET" or name is None or namespace is None:
                raise ApiError(405, f"{method} is not supported on pods/log")
            return self._log(namespace, name, query)
        if (
            resource.namespaced
            and namespace is not None
            and method in ("POST", "PUT", "PATCH")
            and not self.store.exists(NAMESPACES, None, namespace)
        ):
            raise not_found("namespaces", namespace)
        if name is None:
            if method == "GET":
                return 200, self._list(resource, namespace, query)
            if method == "POST":
                if resource.namespaced and namespace is None:
                    raise ApiError(405, f"create {resource.plural} in a namespace")
                created = self.store.create(resource, namespace, call.body(), dry_run=dry_run)
                if not dry_run and self.workloads is not None:
                    created = self.workloads.created(resource, created)
                return 201, created
            raise ApiError(405, f"{method} is not supported on a collection of {resource.plural}")
        if method == "GET":
            return 200, self.store.get(resource, namespace, name)
        if method == "PUT":
            body = call.body()
            return 200, self.store.update(resource, namespace, name, lambda _current: body, dry_run=dry_run)
        if method == "PATCH":
            body = call.body()
            return 200, self.store.update(
                resource,
                namespace,
                name,
                lambda current: apply_patch(resource, call.content_type, current, body),
                dry_run=dry_run,
            )
        if method == "DELETE":
            return 200, self._delete(resource, namespace, name, call.options(), dry_run)
        raise ApiError(405, f"{method} is not supported on {resource.plural}")

    def _delete(
        self, resource: Resource, namespace: str | None, name: str, options: dict[str, Any], dry_run: bool
    ) -> dict[str, Any]:
        deleted = self.store.get(resource, namespace, name) if dry_run else self.store.delete(resource, namespace, name)
        if not dry_run and self.workloads is not None:
            self.workloads.deleted(resource, deleted, options)
        if resource.group:
            return {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {
                    "name": name,
                    "group": resource.group,
                    "kind": resource.plural,
                    "uid": deleted["metadata"]["uid"],
                },
            }
        return deleted

    def _evict(self, namespace: str | None, name: str, body: Any, dry_run: bool) -> tuple[int, Any]:
        """``pods/eviction``: what ``kubectl drain`` posts. Nothing guards a pod here (no PodDisruptionBudgets), so the pod goes."""
        if not isinstance(body, dict) or body.get("kind", "Eviction") != "Eviction":
            raise ApiError(400, "the body of a pods/eviction request must be an Eviction")
        meta = body.get("metadata") or {}
        if meta.get("name", name) != name:
            raise ApiError(400, f"name in URL does not match name in Eviction object: {meta.get('name')} != {name}")
        dry_run = dry_run or "All" in ((body.get("deleteOptions") or {}).get("dryRun") or [])
        if dry_run:
            self.store.get(PODS, namespace, name)
        else:
            deleted = self.store.delete(PODS, namespace, name)
            if self.workloads is not None:
                self.workloads.deleted(PODS, deleted, body.get("deleteOptions") or {})
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _log(self, namespace: str, name: str, query: dict[str, str]) -> tuple[int, Any]:
        """``pods/NAME/log``: 404 for no such pod; the pod's output from whoever runs it."""
        self.store.get(PODS, namespace, name)
        if self.workloads is None:
            raise ApiError(400, f'container of pod "{name}" is not running here: the stand-in runs only Jobs\' pods')
        return 200, PlainText(self.workloads.log(namespace, name, query))

    def _list(self, resource: Resource, namespace: str | None, query: dict[str, str]) -> dict[str, Any]:
        items, revision = self.store.list(
            resource,
            namespace,
            parse_label_selector(query.get("labelSelector")),
            parse_field_selector(query.get("fieldSelector")),
        )
        metadata: dict[str, Any] = {"resourceVersion": revision}
        start = 0
        if query.get("continue"):
            try:
                start = int(query["continue"])
            except ValueError as exc:
                raise ApiError(400, f"invalid continue token {query['continue']!r}") from exc
        if query.get("limit"):
            try:
                limit = int(query["limit"])
            except ValueError as exc:
                raise ApiError(400, f"invalid limit {query['limit']!r}") from exc
            if limit > 0 and start + limit < len(items):
                metadata["continue"] = str(start + limit)
                metadata["remainingItemCount"] = len(items) - start - limit
                items = items[start : start + limit]
            else:
                items = items[start:]
        else:
            items = items[start:]
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": metadata,
            "items": items,
        }


def as_table(resource: Resource, body: dict[str, Any], version: str, include_object: str) -> dict[str, Any]:
    """A GET answer (one object or a list) as a Table; raises ApiError 400 for a bad ``includeObject``."""
    if body.get("kind", "").endswith("List") and "items" in body:
        objects, metadata = body["items"], body.get("metadata", {})
    else:
        objects, metadata = [body], {"resourceVersion": body.get("metadata", {}).get("resourceVersion", "")}
    try:
        return tables.to_table(resource, objects, metadata, version=version, include_object=include_object)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


def apply_patch(resource: Resource, content_type: str, current: dict[str, Any], body: Any) -> dict[str, Any]:
    """``current`` patched by ``body`` of media type ``content_type``; raises ApiError 415 for a type the
    resource does not take, or the patch's own error (400, 422)."""
    accepted = [patches.JSON_PATCH, patches.MERGE] + (
        [patches.STRATEGIC_MERGE] if resource.strategic_merge else []
    )
    if content_type not in accepted:
        raise ApiError(
            415,
            f"the body of the request was in an unknown format - accepted media types include: {', '.join(accepted)}",
        )
    try:
        if content_type == patches.JSON_PATCH:
            return patches.json_patch(current, body)
        if content_type == patches.MERGE:
            if not isinstance(body, dict):
                raise patches.PatchError("a merge patch must be a JSON object", code=400)
            result = patches.merge_patch(current, body)
            assert isinstance(result, dict)
            return result
        return patches.strategic_merge_patch(current, body, resource.merge_keys)
    except patches.PatchError as exc:
        raise ApiError(exc.code, str(exc)) from exc
