"""The in-memory object store behind the EKS stand-in, with ``resourceVersion`` and optimistic concurrency.

Every write bumps one store-wide counter and stamps it on the object, as etcd
revisions do; a write that carries a ``resourceVersion`` other than the
stored one is refused with 409 Conflict. Objects leave the store only as
deep copies, so callers can never mutate stored state behind the lock. Every
node written, however (REST, seed, replacement), gets the node lifecycle
controller's ``node.kubernetes.io/unschedulable`` taint in step with its
``spec.unschedulable`` (:func:`mirror_cordon`).
"""

from __future__ import annotations

import copy
import datetime as dt
import threading
import uuid
from collections.abc import Callable
from typing import Any

from sdcguard.infra.local.eks import errors
from sdcguard.infra.local.eks.resources import NODES, Resource, validate
from sdcguard.infra.local.eks.selectors import Predicate

Key = tuple[str, str, str, str]  # group, plural, namespace ("" when cluster-scoped), name
UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
"""The taint Kubernetes' node lifecycle controller keeps on every node whose ``spec.unschedulable`` is true."""


def mirror_cordon(resource: Resource, obj: dict[str, Any]) -> None:
    """Do to a written node what the node lifecycle controller does: add :data:`UNSCHEDULABLE_TAINT` while
    ``spec.unschedulable`` is true, remove it once it is not.

    On a cluster the controller writes it a moment after the cordon, as a
    write of its own; here it lands in the same write. Without it, code that
    reads a cordoned node's taints sees less than EKS shows (a release once
    took this taint for someone else's hold and kept every node cordoned).
    """
    spec = obj.get("spec")
    if resource is not NODES or not isinstance(spec, dict):
        return
    taints = spec.get("taints") or []
    key = UNSCHEDULABLE_TAINT["key"]
    mirrored = [t for t in taints if t.get("key") == key and t.get("effect") == "NoSchedule"]
    if spec.get("unschedulable") is True and not mirrored:
        spec["taints"] = [*taints, {**UNSCHEDULABLE_TAINT, "timeAdded": _now()}]
    elif spec.get("unschedulable") is not True and mirrored:
        kept = [t for t in taints if t not in mirrored]
        if kept:
            spec["taints"] = kept
        else:
            spec.pop("taints", None)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ObjectStore:
    """Kubernetes objects by resource, namespace and name; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._objects: dict[Key, dict[str, Any]] = {}
        self._revision = 0

    @staticmethod
    def _key(resource: Resource, namespace: str | None, name: str) -> Key:
        return (resource.group, resource.plural, (namespace or "") if resource.namespaced else "", name)

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    @property
    def resource_version(self) -> str:
        """The store's latest revision, as a list's ``metadata.resourceVersion``."""
        with self._lock:
            return str(self._revision)

    def _check_valid(self, resource: Resource, obj: Any, name: str) -> None:
        causes = validate(resource, obj)
        if causes:
            raise errors.invalid(resource.kind, resource.plural, name, causes, resource.group)

    def create(
        self, resource: Resource, namespace: str | None, obj: Any, *, dry_run: bool = False
    ) -> dict[str, Any]:
        """Store a new object and return it with uid, timestamps and resourceVersion.

        Raises ApiError 422 when invalid, 409 AlreadyExists when the name is taken.
        With ``dry_run`` everything is checked and nothing is stored.
        """
        name = obj.get("metadata", {}).get("name", "") if isinstance(obj, dict) else ""
        self._check_valid(resource, obj, name)
        stored = copy.deepcopy(obj)
        mirror_cordon(resource, stored)
        stored["apiVersion"] = resource.api_version
        stored["kind"] = resource.kind
        meta = stored["metadata"]
        if resource.namespaced:
            if meta.get("namespace") not in (None, namespace):
                raise errors.ApiError(
                    400,
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        with self._lock:
            key = self._key(resource, namespace, meta["name"])
            if key in self._objects:
                raise errors.already_exists(resource.plural, meta["name"], resource.group)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            meta["generation"] = 1
            if dry_run:
                return copy.deepcopy(stored)
            meta["resourceVersion"] = self._next_revision()
            self._objects[key] = stored
            return copy.deepcopy(stored)

    def get(self, resource: Resource, namespace: str | None, name: str) -> dict[str, Any]:
        """A copy of the stored object; raises ApiError 404 when there is none."""
        with self._lock:
            obj = self._objects.get(self._key(resource, namespace, name))
            if obj is None:
                raise errors.not_found(resource.plural, name, resource.group)
            return copy.deepcopy(obj)

    def exists(self, resource: Resource, namespace: str | None, name: str) -> bool:
        """Whether the object is stored."""
        with self._lock:
            return self._key(resource, namespace, name) in self._objects

    def list(
        self, resource: Resource, namespace: str | None = None, *predicates: Predicate
    ) -> tuple[list[dict[str, Any]], str]:
        """Copies of the objects of ``resource`` (in ``namespace``, or all) matching every predicate, by name, and the store's revision."""
        with self._lock:
            items = [
                copy.deepcopy(obj)
                for (group, plural, ns, _name), obj in sorted(self._objects.items())
                if group == resource.group
                and plural == resource.plural
                and (namespace is None or ns == namespace)
                and all(p(obj) for p in predicates)
            ]
            return items, str(self._revision)

    def update(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        change: Callable[[dict[str, Any]], Any],
        *,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Replace an object by ``change(copy of it)`` atomically and return the result.

        The result keeps the object's identity (name, namespace, uid,
        creationTimestamp). If it carries a ``metadata.resourceVersion``
        other than the stored one, nothing changes and ApiError 409 Conflict
        is raised; 404 when the object does not exist, 422 when the result is
        invalid, or whatever ``change`` raises. With ``dry_run`` the result is
        returned and not stored.
        """
        with self._lock:
            key = self._key(resource, namespace, name)
            current = self._objects.get(key)
            if current is None:
                raise errors.not_found(resource.plural, name, resource.group)
            result = change(copy.deepcopy(current))
            if not isinstance(result, dict) or not isinstance(result.get("metadata"), dict):
                raise errors.invalid(
                    resource.kind,
                    resource.plural,
                    name,
                    [{"reason": "FieldValueRequired", "message": "Required value", "field": "metadata"}],
                    resource.group,
                )
            meta = result["metadata"]
            if meta.get("name", name) != name:
                raise errors.ApiError(
                    400,
                    f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})",
                )
            sent_version = meta.get("resourceVersion")
            if sent_version not in (None, "") and str(sent_version) != current["metadata"]["resourceVersion"]:
                raise errors.conflict(resource.plural, name, resource.group)
            cur_meta = current["metadata"]
            meta["name"] = name
            for field in ("uid", "creationTimestamp", "namespace"):
                if field in cur_meta:
                    meta[field] = cur_meta[field]
            result["apiVersion"] = resource.api_version
            result["kind"] = resource.kind
            self._check_valid(resource, result, name)
            mirror_cordon(resource, result)
            generation = int(cur_meta.get("generation", 1))
            meta["resourceVersion"] = cur_meta["resourceVersion"]
            meta["generation"] = generation
            if result == current:
                # A no-op write does not bump the revision, as on a real API server.
                return copy.deepcopy(current)
            meta["generation"] = generation + 1 if result.get("spec") != current.get("spec") else generation
            if dry_run:
                return copy.deepcopy(result)
            meta["resourceVersion"] = self._next_revision()
            self._objects[key] = result
            return copy.deepcopy(result)

    def delete(self, resource: Resource, namespace: str | None, name: str) -> dict[str, Any]:
        """Remove an object and return what it was; raises ApiError 404 when there is none."""
        with self._lock:
            obj = self._objects.pop(self._key(resource, namespace, name), None)
            if obj is None:
                raise errors.not_found(resource.plural, name, resource.group)
            self._revision += 1
            return obj

    def transaction(self) -> threading.RLock:
        """The store's lock, for a caller that must make several changes atomically (e.g. a node replacement)."""
        return self._lock
