"""Gap: moto's EKS clusters have a made-up endpoint and a random CA.

The handlers reach a cluster the way they reach a real one: DescribeCluster
for ``endpoint`` and ``certificateAuthority.data``, then HTTPS with a bearer
token. Here every cluster moto knows (existing or created later) answers with
the local EKS API server's URL and CA once ``point_at`` has been called.

Hook: ``EKSBackend.describe_cluster``.
"""

from __future__ import annotations

from typing import Any

from moto.eks.models import EKSBackend

_original_describe_cluster = EKSBackend.describe_cluster


class _Target:
    endpoint: str | None = None
    ca_data: str | None = None


target = _Target()


def point_at(endpoint: str, ca_data: str) -> None:
    """Make DescribeCluster of every cluster return ``endpoint`` and ``ca_data`` (base64 PEM)."""
    target.endpoint = endpoint
    target.ca_data = ca_data


def describe_cluster(self: EKSBackend, name: str) -> Any:
    """``describe_cluster`` with the local EKS API server's endpoint and CA."""
    cluster = _original_describe_cluster(self, name)
    if target.endpoint is not None and target.ca_data is not None:
        cluster.endpoint = target.endpoint
        cluster.certificate_authority = {"data": target.ca_data}
    return cluster


def install() -> None:
    """Route DescribeCluster through ``describe_cluster``."""
    EKSBackend.describe_cluster = describe_cluster  # type: ignore[method-assign]
