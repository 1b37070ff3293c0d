"""Who a caller is on the stand-in's cluster, and what RBAC lets them do.

Identity, as EKS access entries decide it for the stand-in:

- a caller whose token was signed with temporary credentials (an
  ``X-Amz-Security-Token``: an assumed role, as every Lambda function of the
  pipeline has) is one of the pipeline's access entries. A role with an entry
  of its own (``AccessEntries.role_groups``, by the template's logical id of
  the role, which the role's name carries as one of its dash-separated parts,
  as CloudFormation names roles) is user and group of that entry (resolve and
  guard's ``KubernetesReadRole``: ``sdcguard-pipeline-read``, the template's
  ``KubernetesReadGroup``); any other is user ``PIPELINE_USER`` in the
  pipeline's groups (``AccessEntries.pipeline_groups``, the template's
  ``KubernetesGroup``);
- any other caller (long-term keys: the operator, the seed, the tests) is the
  cluster's creator, whom EKS makes a cluster admin (``system:masters``).

With no pipeline groups configured, every caller is an admin and nothing is
enforced. Admins may impersonate (``kubectl --as=... --as-group=...``), so
``kubectl auth can-i --as-group sdcguard-pipeline ...`` answers for the
pipeline as it does on a real cluster.

Authorization is Kubernetes RBAC over the Roles, ClusterRoles and their
bindings held in the store (read on every request, so a role patched through
the API takes effect at once): a request is allowed when a binding for the
user or one of the groups refers to a role with a rule matching the API
group, the resource (``pods/eviction`` for a subresource), the verb and,
where the rule names them, the object's name. A ClusterRoleBinding grants
its ClusterRole everywhere; a RoleBinding grants its Role (of its own
namespace) or its ClusterRole only in the binding's namespace, so a request
at the cluster scope (nodes, or a list across namespaces) is answered by
ClusterRoleBindings alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sdcguard.infra.local.eks.auth import Caller
from sdcguard.infra.local.eks.errors import ApiError
from sdcguard.infra.local.eks.objects import ObjectStore
from sdcguard.infra.local.eks.resources import CLUSTER_ROLE_BINDINGS, CLUSTER_ROLES, ROLE_BINDINGS, ROLES

MASTERS = "system:masters"
AUTHENTICATED = "system:authenticated"
ADMIN_USER = "kubernetes-admin"
PIPELINE_USER = "sdcguard-pipeline"
_RBAC_GROUP = "rbac.authorization.k8s.io"


@dataclass(frozen=True)
class Identity:
    """A Kubernetes user and its groups."""

    username: str
    groups: tuple[str, ...]

    @property
    def is_admin(self) -> bool:
        """Whether RBAC is bypassed (``system:masters``), as for a cluster's creator."""
        return MASTERS in self.groups


ADMIN = Identity(ADMIN_USER, (MASTERS, AUTHENTICATED))


def _no_role(_access_key_id: str) -> str | None:
    return None


@dataclass(frozen=True)
class AccessEntries:
    """How callers map to identities (see the module docstring); no pipeline groups: everyone is an admin."""

    pipeline_groups: tuple[str, ...] = field(default_factory=tuple)
    role_groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Roles with an access entry of their own: the template's logical id of the role -> the entry's groups."""
    role_of: Callable[[str], str | None] = _no_role
    """The name of the role whose temporary credentials an access key id belongs to; None when unknown."""

    def identity(self, caller: Caller) -> Identity:
        """The identity of a verified caller."""
        if not (caller.temporary and self.pipeline_groups):
            return ADMIN
        parts = (self.role_of(caller.access_key_id) or "").split("-")
        for logical_id, groups in self.role_groups.items():
            if logical_id in parts and groups:
                return Identity(groups[0], (*groups, AUTHENTICATED))
        return Identity(PIPELINE_USER, (*self.pipeline_groups, AUTHENTICATED))


def impersonate(identity: Identity, user: str | None, groups: Sequence[str]) -> Identity:
    """The identity a request asks to act as (``Impersonate-User``/``-Group``), or ``identity`` when it asks none.

    Only admins may impersonate; raises ApiError 403 for anyone else, and 400
    for groups without a user, as the API server does.
    """
    if not user and not groups:
        return identity
    if not user:
        raise ApiError(400, "requested impersonation of groups without a user")
    if not identity.is_admin:
        raise ApiError(
            403,
            f'users "{user}" is forbidden: User "{identity.username}" cannot impersonate resource "users" '
            'in API group "" at the cluster scope',
            reason="Forbidden",
            details={"name": user, "kind": "users"},
        )
    return Identity(user, (*groups, AUTHENTICATED))


def _matches(values: Any, wanted: str) -> bool:
    return isinstance(values, list) and ("*" in values or wanted in values)


def _rule_allows(rule: dict[str, Any], group: str, resource: str, verb: str, name: str | None) -> bool:
    names = rule.get("resourceNames") or []
    return (
        _matches(rule.get("apiGroups"), group)
        and _matches(rule.get("resources"), resource)
        and _matches(rule.get("verbs"), verb)
        and (not names or (name is not None and name in names))
    )


def _binds(binding: dict[str, Any], identity: Identity) -> bool:
    for subject in binding.get("subjects") or []:
        kind, name = subject.get("kind"), subject.get("name")
        if (kind == "User" and name == identity.username) or (kind == "Group" and name in identity.groups):
            return True
    return False


def _granted_by(
    store: ObjectStore, binding: dict[str, Any], namespace: str | None, group: str, resource: str, verb: str,
    name: str | None,
) -> bool:
    """Whether the role ``binding`` refers to (a Role of ``namespace``, or a ClusterRole) has a matching rule."""
    ref = binding.get("roleRef") or {}
    if ref.get("apiGroup", _RBAC_GROUP) != _RBAC_GROUP:
        return False
    kind, role_name = ref.get("kind"), str(ref.get("name"))
    if kind == "ClusterRole":
        role_resource, role_namespace = CLUSTER_ROLES, None
    elif kind == "Role" and namespace is not None:
        role_resource, role_namespace = ROLES, namespace
    else:
        return False
    if not store.exists(role_resource, role_namespace, role_name):
        return False
    role = store.get(role_resource, role_namespace, role_name)
    return any(_rule_allows(rule, group, resource, verb, name) for rule in role.get("rules") or [])


def granting(
    store: ObjectStore,
    identity: Identity,
    verb: str,
    group: str,
    resource: str,
    name: str | None = None,
    namespace: str | None = None,
) -> dict[str, Any] | None:
    """The first binding that lets ``identity`` do ``verb`` (see :func:`allowed`), or None when none does."""
    bindings: list[tuple[dict[str, Any], str | None]] = [(b, None) for b in store.list(CLUSTER_ROLE_BINDINGS)[0]]
    if namespace is not None:
        bindings += [(b, namespace) for b in store.list(ROLE_BINDINGS, namespace)[0]]
    # A RoleBinding (listed from the request's namespace only) grants its role's rules there and nowhere else.
    for binding, binding_namespace in bindings:
        if _binds(binding, identity) and _granted_by(store, binding, binding_namespace, group, resource, verb, name):
            return binding
    return None


def allowed(
    store: ObjectStore,
    identity: Identity,
    verb: str,
    group: str,
    resource: str,
    name: str | None = None,
    namespace: str | None = None,
) -> bool:
    """Whether RBAC in ``store`` lets ``identity`` do ``verb`` on ``resource`` (``plural`` or ``plural/sub``) of
    ``group`` in ``namespace`` (None: at the cluster scope, where only ClusterRoleBindings count)."""
    return identity.is_admin or granting(store, identity, verb, group, resource, name, namespace) is not None


def forbidden(
    identity: Identity, verb: str, group: str, resource: str, namespace: str | None, name: str | None
) -> ApiError:
    """403, worded as the API server words an RBAC refusal."""
    plural, _, sub = resource.partition("/")
    what = f"{plural}.{group}" if group else plural
    subject = f'{what} "{name}"' if name else what
    scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    kind = f'resource "{plural}"' + (f' with subresource "{sub}"' if sub else "")
    details: dict[str, Any] = {"kind": plural, "group": group}
    if name:
        details["name"] = name
    return ApiError(
        403,
        f'{subject} is forbidden: User "{identity.username}" cannot {verb} {kind} in API group "{group}" {scope}',
        reason="Forbidden",
        details=details,
    )


def access_review(store: ObjectStore, identity: Identity, body: Any) -> dict[str, Any]:
    """Answer a SelfSubjectAccessReview for ``identity``; raises ApiError 400 for a body that is not one."""
    # The kind may be left out: the URL names it.
    if not isinstance(body, dict) or body.get("kind", "SelfSubjectAccessReview") != "SelfSubjectAccessReview":
        raise ApiError(400, "the body must be a SelfSubjectAccessReview")
    spec = body.get("spec") or {}
    attributes = spec.get("resourceAttributes")
    if not isinstance(attributes, dict):
        if spec.get("nonResourceAttributes") is not None:
            allow, reason = identity.is_admin, "non-resource URLs are allowed to admins only here"
            return _review(body, allow, reason if not allow else "")
        raise ApiError(400, "spec.resourceAttributes or spec.nonResourceAttributes is required")
    resource = str(attributes.get("resource", ""))
    if attributes.get("subresource"):
        resource = f"{resource}/{attributes['subresource']}"
    verb, group = str(attributes.get("verb", "")), str(attributes.get("group", ""))
    name, namespace = attributes.get("name") or None, attributes.get("namespace") or None
    if identity.is_admin:
        return _review(body, True, "the caller is in system:masters")
    binding = granting(store, identity, verb, group, resource, name, namespace)
    if binding is None:
        return _review(body, False, "")
    ref = binding.get("roleRef") or {}
    where = binding["metadata"].get("namespace")
    kind = f'RoleBinding "{binding["metadata"]["name"]}/{where}"' if where else (
        f'ClusterRoleBinding "{binding["metadata"]["name"]}"'
    )
    return _review(body, True, f'RBAC: allowed by {kind} of {ref.get("kind")} "{ref.get("name")}"')


def _review(body: dict[str, Any], allow: bool, reason: str) -> dict[str, Any]:
    status: dict[str, Any] = {"allowed": allow}
    if reason:
        status["reason"] = reason
    return {
        "kind": "SelfSubjectAccessReview",
        "apiVersion": "authorization.k8s.io/v1",
        "metadata": {},
        "spec": body.get("spec") or {},
        "status": status,
    }
