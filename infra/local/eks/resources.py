"""The resource kinds the stand-in serves and what makes an object of each valid.

Validation follows the API server's rules for the fields the pipeline writes
(names, labels, annotations, taints, ``spec.unschedulable``,
``spec.runPolicy.suspend``, a Job's pod template and deadlines) so that a handler that would be refused by a real
cluster is refused here too, with the same 422 ``Invalid`` shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class Resource:
    """One served resource: where it lives in the API and how its lists merge under strategic-merge patches."""

    plural: str
    kind: str
    group: str
    version: str
    namespaced: bool
    # Dotted paths (list indices dropped) of lists that merge by a key instead of being replaced.
    merge_keys: dict[str, str] = field(default_factory=dict)
    # Custom resources accept only JSON and JSON merge patches, as on a real cluster.
    strategic_merge: bool = True
    # What discovery says about it (``kubectl get no`` works through the short names).
    singular: str = ""
    short_names: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ("create", "delete", "get", "list", "patch", "update", "watch")
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        """``v1`` for the core group, ``group/version`` otherwise."""
        return f"{self.group}/{self.version}" if self.group else self.version


NODES = Resource(
    "nodes",
    "Node",
    "",
    "v1",
    namespaced=False,
    merge_keys={"status.conditions": "type", "status.addresses": "type", "metadata.ownerReferences": "uid"},
    singular="node",
    short_names=("no",),
)
NAMESPACES = Resource(
    "namespaces",
    "Namespace",
    "",
    "v1",
    namespaced=False,
    singular="namespace",
    short_names=("ns",),
    verbs=("create", "delete", "get", "list", "watch"),
)
PODS = Resource(
    "pods",
    "Pod",
    "",
    "v1",
    namespaced=True,
    merge_keys={
        "spec.containers": "name",
        "spec.initContainers": "name",
        "spec.volumes": "name",
        "spec.containers.env": "name",
        "spec.containers.ports": "containerPort",
        "spec.containers.volumeMounts": "mountPath",
        "status.conditions": "type",
        "metadata.ownerReferences": "uid",
    },
    singular="pod",
    short_names=("po",),
    categories=("all",),
)
# Events are served so that ``kubectl describe`` finds its (empty) list; nothing here writes them.
EVENTS = Resource(
    "events",
    "Event",
    "",
    "v1",
    namespaced=True,
    singular="event",
    short_names=("ev",),
    verbs=("create", "delete", "get", "list", "watch"),
)
# As the Kubeflow training operator's CRD declares it: no short names, no categories.
PYTORCHJOBS = Resource(
    "pytorchjobs",
    "PyTorchJob",
    "kubeflow.org",
    "v1",
    namespaced=True,
    strategic_merge=False,
    singular="pytorchjob",
)

# batch/v1 Jobs, which the stand-in runs for real (see ``jobs``): the pipeline's node checks.
JOBS = Resource(
    "jobs",
    "Job",
    "batch",
    "v1",
    namespaced=True,
    merge_keys={"status.conditions": "type", "metadata.ownerReferences": "uid"},
    singular="job",
    categories=("all",),
    verbs=("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"),
)

# RBAC, so that the stand-in can hold the repository's manifest and enforce it (see ``rbac``).
CLUSTER_ROLES = Resource(
    "clusterroles", "ClusterRole", "rbac.authorization.k8s.io", "v1", namespaced=False, singular="clusterrole"
)
CLUSTER_ROLE_BINDINGS = Resource(
    "clusterrolebindings",
    "ClusterRoleBinding",
    "rbac.authorization.k8s.io",
    "v1",
    namespaced=False,
    singular="clusterrolebinding",
)
# Their namespaced counterparts: a Role grants in its own namespace only; a RoleBinding there may refer
# to a Role of that namespace or to a ClusterRole (whose rules then apply in that namespace only).
ROLES = Resource("roles", "Role", "rbac.authorization.k8s.io", "v1", namespaced=True, singular="role")
ROLE_BINDINGS = Resource(
    "rolebindings", "RoleBinding", "rbac.authorization.k8s.io", "v1", namespaced=True, singular="rolebinding"
)
# Answered, never stored: what ``kubectl auth can-i`` asks.
SELF_SUBJECT_ACCESS_REVIEWS = Resource(
    "selfsubjectaccessreviews",
    "SelfSubjectAccessReview",
    "authorization.k8s.io",
    "v1",
    namespaced=False,
    singular="selfsubjectaccessreview",
    verbs=("create",),
)

RESOURCES: dict[tuple[str, str], Resource] = {
    (r.group, r.plural): r
    for r in (
        NODES,
        NAMESPACES,
        PODS,
        EVENTS,
        PYTORCHJOBS,
        JOBS,
        CLUSTER_ROLES,
        CLUSTER_ROLE_BINDINGS,
        ROLES,
        ROLE_BINDINGS,
        SELF_SUBJECT_ACCESS_REVIEWS,
    )
}


def _cause(field_path: str, message: str, reason: str = "FieldValueInvalid") -> dict[str, str]:
    return {"reason": reason, "message": message, "field": field_path}


def _label_key_problem(key: str) -> str | None:
    if not isinstance(key, str) or not key:
        return "name part must be non-empty"
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return (
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
            "with an alphanumeric character (at most 63 characters)"
        )
    return None


def _string_map(value: Any, path: str, causes: list[dict[str, str]], *, label_values: bool) -> None:
    if not isinstance(value, dict):
        causes.append(_cause(path, "must be a map of strings", "FieldValueTypeInvalid"))
        return
    for key, item in value.items():
        problem = _label_key_problem(key)
        if problem:
            causes.append(_cause(f"{path}", f'Invalid value: "{key}": {problem}'))
        if not isinstance(item, str):
            causes.append(_cause(f"{path}[{key}]", "must be a string", "FieldValueTypeInvalid"))
        elif label_values and (len(item) > 63 or not _LABEL_VALUE.match(item)):
            causes.append(
                _cause(
                    f"{path}[{key}]",
                    f'Invalid value: "{item}": a valid label must be an empty string or consist of '
                    "alphanumeric characters, '-', '_' or '.' (at most 63 characters)",
                )
            )


def _validate_metadata(resource: Resource, obj: dict[str, Any], causes: list[dict[str, str]]) -> None:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        causes.append(_cause("metadata", "Required value", "FieldValueRequired"))
        return
    name = meta.get("name")
    if not name:
        causes.append(_cause("metadata.name", "Required value: name is required", "FieldValueRequired"))
    elif not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        causes.append(
            _cause(
                "metadata.name",
                f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower case '
                "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
            )
        )
    elif resource is NAMESPACES and (len(name) > 63 or not _DNS_LABEL.match(name)):
        causes.append(_cause("metadata.name", f'Invalid value: "{name}": must be a lowercase RFC 1123 label'))
    if "labels" in meta and meta["labels"] is not None:
        _string_map(meta["labels"], "metadata.labels", causes, label_values=True)
    if "annotations" in meta and meta["annotations"] is not None:
        _string_map(meta["annotations"], "metadata.annotations", causes, label_values=False)


def _validate_node(spec: dict[str, Any], causes: list[dict[str, str]]) -> None:
    if "unschedulable" in spec and not isinstance(spec["unschedulable"], bool):
        causes.append(_cause("spec.unschedulable", "must be a boolean", "FieldValueTypeInvalid"))
    taints = spec.get("taints")
    if taints is None:
        return
    if not isinstance(taints, list):
        causes.append(_cause("spec.taints", "must be a list", "FieldValueTypeInvalid"))
        return
    seen: set[tuple[str, str]] = set()
    for i, taint in enumerate(taints):
        path = f"spec.taints[{i}]"
        if not isinstance(taint, dict):
            causes.append(_cause(path, "must be an object", "FieldValueTypeInvalid"))
            continue
        key = taint.get("key")
        problem = _label_key_problem(key) if isinstance(key, str) else "Required value"
        if problem:
            causes.append(_cause(f"{path}.key", problem))
        value = taint.get("value", "")
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(_cause(f"{path}.value", f"Invalid value: {value!r}: must be a valid label value"))
        effect = taint.get("effect")
        if effect not in TAINT_EFFECTS:
            causes.append(
                _cause(
                    f"{path}.effect",
                    f'Unsupported value: "{effect}": supported values: "NoSchedule", "PreferNoSchedule", "NoExecute"',
                    "FieldValueNotSupported",
                )
            )
        elif isinstance(key, str):
            if (key, effect) in seen:
                causes.append(
                    _cause(path, "taints must be unique by key and effect pair", "FieldValueDuplicate")
                )
            seen.add((key, effect))


def _validate_pod(spec: dict[str, Any], causes: list[dict[str, str]]) -> None:
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        causes.append(_cause("spec.containers", "Required value", "FieldValueRequired"))
    else:
        for i, container in enumerate(containers):
            if not isinstance(container, dict) or not container.get("name"):
                causes.append(_cause(f"spec.containers[{i}].name", "Required value", "FieldValueRequired"))
            elif not container.get("image"):
                causes.append(_cause(f"spec.containers[{i}].image", "Required value", "FieldValueRequired"))
    if "nodeName" in spec and not isinstance(spec["nodeName"], str):
        causes.append(_cause("spec.nodeName", "must be a string", "FieldValueTypeInvalid"))


def _validate_pytorchjob(spec: dict[str, Any], causes: list[dict[str, str]]) -> None:
    replicas = spec.get("pytorchReplicaSpecs")
    if not isinstance(replicas, dict) or not replicas:
        causes.append(_cause("spec.pytorchReplicaSpecs", "Required value", "FieldValueRequired"))
    run_policy = spec.get("runPolicy")
    if run_policy is None:
        return
    if not isinstance(run_policy, dict):
        causes.append(_cause("spec.runPolicy", "must be an object", "FieldValueTypeInvalid"))
    elif "suspend" in run_policy and not isinstance(run_policy["suspend"], bool):
        causes.append(
            _cause(
                "spec.runPolicy.suspend",
                f'Invalid value: "{run_policy["suspend"]}": spec.runPolicy.suspend in body must be of type boolean',
                "FieldValueTypeInvalid",
            )
        )


def _validate_job(spec: dict[str, Any], causes: list[dict[str, str]]) -> None:
    template = spec.get("template")
    if not isinstance(template, dict):
        causes.append(_cause("spec.template", "Required value", "FieldValueRequired"))
        return
    pod_spec = template.get("spec")
    if not isinstance(pod_spec, dict):
        causes.append(_cause("spec.template.spec", "Required value", "FieldValueRequired"))
        return
    nested: list[dict[str, str]] = []
    _validate_pod(pod_spec, nested)
    causes.extend({**c, "field": f"spec.template.{c['field']}"} for c in nested)
    restart = pod_spec.get("restartPolicy")
    if restart not in ("Never", "OnFailure"):
        causes.append(
            _cause(
                "spec.template.spec.restartPolicy",
                f'Unsupported value: "{restart or "Always"}": supported values: "OnFailure", "Never"',
                "FieldValueNotSupported",
            )
        )
    for key in ("activeDeadlineSeconds", "backoffLimit", "ttlSecondsAfterFinished"):
        value = spec.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0
                                  or (key == "activeDeadlineSeconds" and value == 0)):
            causes.append(_cause(f"spec.{key}", f"Invalid value: {value!r}: must be a positive integer"))


def validate(resource: Resource, obj: Any) -> list[dict[str, str]]:
    """Every problem with ``obj`` as an object of ``resource``, as Status causes; empty when valid."""
    if not isinstance(obj, dict):
        return [_cause("", "the object must be a JSON object", "FieldValueTypeInvalid")]
    causes: list[dict[str, str]] = []
    _validate_metadata(resource, obj, causes)
    spec = obj.get("spec", {})
    if spec is not None and not isinstance(spec, dict):
        causes.append(_cause("spec", "must be an object", "FieldValueTypeInvalid"))
        return causes
    spec = spec or {}
    if resource is NODES:
        _validate_node(spec, causes)
    elif resource is PODS:
        _validate_pod(spec, causes)
    elif resource is PYTORCHJOBS:
        _validate_pytorchjob(spec, causes)
    elif resource is JOBS:
        _validate_job(spec, causes)
    return causes
