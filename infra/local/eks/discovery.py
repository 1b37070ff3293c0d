"""API discovery: the documents a Kubernetes client reads before its first request.

kubectl (and client-go, k9s, Lens) first asks ``/api`` and ``/apis`` which
groups, versions and resources exist, then maps ``kubectl get no`` to
``/api/v1/nodes``. Two forms exist, chosen by the ``Accept`` header:

- the aggregated one (``apidiscovery.k8s.io/v2``, or ``v2beta1``): ``/api``
  and ``/apis`` each answer one ``APIGroupDiscoveryList`` holding every
  resource, so a client needs two requests;
- the legacy one: ``/api`` (``APIVersions``), ``/apis`` (``APIGroupList``),
  and a resource list per group version (``/api/v1``,
  ``/apis/kubeflow.org/v1``), plus ``/apis/<group>`` (``APIGroup``).

Everything is derived from ``resources.RESOURCES``, so a resource the server
serves is a resource discovery lists, with the verbs the server answers.
"""

from __future__ import annotations

from typing import Any

from sdcguard.infra.local.eks.resources import RESOURCES, Resource

AGGREGATED_KIND = "APIGroupDiscoveryList"
AGGREGATED_VERSIONS = ("v2", "v2beta1")

# Subresources served beside the resources: (parent plural, subresource, group, version, kind, verbs).
# ``kubectl drain`` evicts through pods/eviction when discovery lists it; ``kubectl logs`` reads pods/log.
SUBRESOURCES: tuple[tuple[str, str, str, str, str, tuple[str, ...]], ...] = (
    ("pods", "eviction", "policy", "v1", "Eviction", ("create",)),
    ("pods", "log", "", "v1", "Pod", ("get",)),
)


def watchable() -> frozenset[str]:
    """The plurals whose collections can be watched (``watch`` among their verbs)."""
    return frozenset(r.plural for r in RESOURCES.values() if "watch" in r.verbs)


def aggregated_version(accept: str | None) -> str | None:
    """The aggregated discovery version (``v2`` or ``v2beta1``) the ``Accept`` header asks for first, or None for the legacy form."""
    for media_range in (accept or "").split(","):
        params = dict(
            part.strip().partition("=")[::2] for part in media_range.split(";")[1:] if "=" in part
        )
        if (
            params.get("g") == "apidiscovery.k8s.io"
            and params.get("as") == AGGREGATED_KIND
            and params.get("v") in AGGREGATED_VERSIONS
        ):
            return params["v"]
    return None


def aggregated_content_type(version: str) -> str:
    """The ``Content-Type`` a client checks before it parses an aggregated answer."""
    return f"application/json;g=apidiscovery.k8s.io;v={version};as={AGGREGATED_KIND}"


def _groups() -> dict[str, dict[str, list[Resource]]]:
    """group -> version -> resources, core group first, in a stable order."""
    out: dict[str, dict[str, list[Resource]]] = {}
    for resource in sorted(RESOURCES.values(), key=lambda r: (r.group != "", r.group, r.plural)):
        out.setdefault(resource.group, {}).setdefault(resource.version, []).append(resource)
    return out


def _aggregated_resource(resource: Resource) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "resource": resource.plural,
        "responseKind": {"group": resource.group, "version": resource.version, "kind": resource.kind},
        "scope": "Namespaced" if resource.namespaced else "Cluster",
        "singularResource": resource.singular,
        "verbs": list(resource.verbs),
    }
    if resource.short_names:
        entry["shortNames"] = list(resource.short_names)
    if resource.categories:
        entry["categories"] = list(resource.categories)
    subresources = [
        {
            "subresource": sub,
            "responseKind": {"group": group, "version": version, "kind": kind},
            "verbs": list(verbs),
        }
        for parent, sub, group, version, kind, verbs in SUBRESOURCES
        if parent == resource.plural and resource.group == ""
    ]
    if subresources:
        entry["subresources"] = subresources
    return entry


def aggregated(core: bool, version: str = "v2") -> dict[str, Any]:
    """The aggregated document for ``/api`` (``core``) or ``/apis``."""
    items = [
        {
            "metadata": {"name": group} if group else {},
            "versions": [
                {
                    "version": group_version,
                    "resources": [_aggregated_resource(r) for r in resources],
                    "freshness": "Current",
                }
                for group_version, resources in versions.items()
            ],
        }
        for group, versions in _groups().items()
        if (group == "") == core
    ]
    return {
        "kind": AGGREGATED_KIND,
        "apiVersion": f"apidiscovery.k8s.io/{version}",
        "metadata": {},
        "items": items,
    }


def api_versions(server_address: str) -> dict[str, Any]:
    """Legacy ``/api``: the core group's versions."""
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def _api_group(group: str, versions: dict[str, list[Resource]]) -> dict[str, Any]:
    listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": listed, "preferredVersion": listed[0]}


def api_group_list() -> dict[str, Any]:
    """Legacy ``/apis``: every named group."""
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_api_group(group, versions) for group, versions in _groups().items() if group],
    }


def api_group(group: str) -> dict[str, Any] | None:
    """Legacy ``/apis/<group>``, or None for a group the server does not serve."""
    versions = _groups().get(group) if group else None
    if not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_api_group(group, versions)}


def _legacy_resource(resource: Resource) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": resource.plural,
        "singularName": resource.singular,
        "namespaced": resource.namespaced,
        "kind": resource.kind,
        "verbs": list(resource.verbs),
    }
    if resource.short_names:
        entry["shortNames"] = list(resource.short_names)
    if resource.categories:
        entry["categories"] = list(resource.categories)
    return entry


def api_resource_list(group: str, version: str) -> dict[str, Any] | None:
    """Legacy ``/api/v1`` or ``/apis/<group>/<version>``, or None for one the server does not serve."""
    resources = _groups().get(group, {}).get(version)
    if not resources:
        return None
    listed = [_legacy_resource(r) for r in resources]
    for resource in resources:
        for parent, sub, sub_group, sub_version, kind, verbs in SUBRESOURCES:
            if parent == resource.plural and group == "":
                listed.append(
                    {
                        "name": f"{parent}/{sub}",
                        "singularName": "",
                        "namespaced": resource.namespaced,
                        "group": sub_group,
                        "version": sub_version,
                        "kind": kind,
                        "verbs": list(verbs),
                    }
                )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": listed,
    }
