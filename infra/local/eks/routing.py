"""Routing: which resource, namespace, name and subresource a request path names, and its RBAC verb.

Paths follow the Kubernetes API's layout: ``/api/v1/...`` for the core group,
``/apis/<group>/<version>/...`` for the others, ``namespaces/<ns>/`` before a
namespaced plural, a name, and for a few pod requests a subresource
(``pods/<name>/eviction``, ``pods/<name>/log``). A path outside that layout,
or naming what the server does not serve, is a 404 as on a real API server.
Discovery paths and the anonymous health paths are recognised here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from sdcguard.infra.local.eks import discovery
from sdcguard.infra.local.eks.errors import ApiError
from sdcguard.infra.local.eks.resources import RESOURCES, Resource

_CORE = "|".join(sorted(r.plural for r in RESOURCES.values() if not r.group))
_CORE_NAMESPACED = "|".join(sorted(r.plural for r in RESOURCES.values() if not r.group and r.namespaced))
_GROUPS = "|".join(sorted({re.escape(r.group) for r in RESOURCES.values() if r.group}))
_SUBRESOURCES = "|".join(sorted({sub for _parent, sub, *_rest in discovery.SUBRESOURCES}))
_ROUTES = (
    re.compile(
        rf"^/api/(?P<version>v1)/namespaces/(?P<ns>[^/]+)/(?P<plural>{_CORE_NAMESPACED})"
        rf"(?:/(?P<name>[^/]+)(?:/(?P<sub>{_SUBRESOURCES}))?)?$"
    ),
    re.compile(rf"^/api/(?P<version>v1)/(?P<plural>{_CORE})(?:/(?P<name>[^/]+))?$"),
    re.compile(
        rf"^/apis/(?P<group>{_GROUPS})/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
        r"(?:/(?P<name>[^/]+))?$"
    ),
    re.compile(rf"^/apis/(?P<group>{_GROUPS})/(?P<version>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$"),
)
DISCOVERY = re.compile(r"^/(?:api(?:/(?P<core_version>[^/]+))?|apis(?:/(?P<group>[^/]+)(?:/(?P<version>[^/]+))?)?)$")
"""Discovery paths: ``/api``, ``/api/v1``, ``/apis``, ``/apis/<group>``, ``/apis/<group>/<version>``."""
ANONYMOUS = ("/version", "/healthz", "/livez", "/readyz")
"""Paths answered without a token, as on EKS."""


@dataclass(frozen=True)
class Target:
    """What a request path names: a resource, its namespace and name where given, and a subresource."""

    resource: Resource
    namespace: str | None
    name: str | None
    subresource: str | None = None

    @property
    def rbac_resource(self) -> str:
        """The resource as RBAC names it: ``pods``, or ``pods/log`` for a subresource."""
        plural = self.resource.plural
        return f"{plural}/{self.subresource}" if self.subresource else plural


def route(path: str) -> Target:
    """The target of a resource path; raises ApiError 404 for a path the server does not serve."""
    for pattern in _ROUTES:
        match = pattern.match(path)
        if match:
            groups = match.groupdict()
            resource = RESOURCES.get((groups.get("group") or "", groups["plural"]))
            if resource is None or resource.version != groups["version"]:
                break
            namespace = unquote(groups["ns"]) if groups.get("ns") else None
            name = unquote(groups["name"]) if groups.get("name") else None
            if resource.namespaced and namespace is None and name is not None:
                break
            if not resource.namespaced and namespace is not None:
                break
            subresource = groups.get("sub")
            if subresource and (resource.plural, subresource) not in {
                (parent, sub) for parent, sub, *_rest in discovery.SUBRESOURCES
            }:
                break
            return Target(resource, namespace, name, subresource)
    raise ApiError(404, "the server could not find the requested resource", details={})


def verb(method: str, target: Target, query: dict[str, str]) -> str:
    """The RBAC verb of a request, as the API server derives it."""
    if method == "GET":
        if target.name is not None:
            return "get"
        return "watch" if query.get("watch") in ("true", "1") else "list"
    if method == "DELETE" and target.name is None:
        return "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())


def discovery_document(match: re.Match[str], accept: str | None, host: str) -> tuple[Any, str]:
    """The discovery answer for a matched discovery path and its Content-Type; raises ApiError 404 for what is not served."""
    core_version, group, version = match.group("core_version"), match.group("group"), match.group("version")
    if core_version is None and group is None:
        aggregated = discovery.aggregated_version(accept)
        core = match.group(0) == "/api"
        if aggregated is not None:
            return discovery.aggregated(core, aggregated), discovery.aggregated_content_type(aggregated)
        return (discovery.api_versions(host) if core else discovery.api_group_list()), "application/json"
    if core_version is not None:
        document = discovery.api_resource_list("", core_version)
    elif version is None:
        document = discovery.api_group(group)
    else:
        document = discovery.api_resource_list(group, version)
    if document is None:
        raise ApiError(404, "the server could not find the requested resource", details={})
    return document, "application/json"


def anonymous(path: str) -> Any:
    """The answer to one of the ``ANONYMOUS`` paths."""
    if path == "/version":
        return {
            "major": "1",
            "minor": "31",
            "gitVersion": "v1.31.0-eks-sdcguard-local",
            "platform": "linux/amd64",
        }
    return "ok"
