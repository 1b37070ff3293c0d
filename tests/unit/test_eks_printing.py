"""The local EKS server's content negotiation and ages, as kubectl reads them."""

from __future__ import annotations

import pytest

from sdcguard.infra.local.eks.discovery import aggregated_version
from sdcguard.infra.local.eks.tables import human_duration, table_version

KUBECTL_DISCOVERY = (
    "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,"
    "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,application/json"
)
KUBECTL_GET = (
    "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,"
    "application/json"
)


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (KUBECTL_DISCOVERY, "v2"),
        ("application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,application/json", "v2beta1"),
        ("application/json", None),
        (None, None),
        ("application/json;g=apidiscovery.k8s.io;v=v3;as=APIGroupDiscoveryList", None),
    ],
)
def test_aggregated_discovery_only_when_asked_for(accept: str | None, expected: str | None) -> None:
    assert aggregated_version(accept) == expected


def test_tables_only_when_asked_for() -> None:
    assert table_version(KUBECTL_GET) == "v1"
    assert table_version("application/json") is None
    assert table_version("application/json;as=Table;v=v1;g=other.io") is None


@pytest.mark.parametrize(
    ("seconds", "printed"),
    [
        (-5, "<invalid>"), (-0.5, "0s"), (0, "0s"), (119, "119s"), (120, "2m"), (150, "2m30s"),
        (600, "10m"), (3 * 3600 - 1, "179m"), (3 * 3600, "3h"), (3 * 3600 + 600, "3h10m"),
        (8 * 3600, "8h"), (47 * 3600, "47h"), (48 * 3600, "2d"), (50 * 3600, "2d2h"),
        (8 * 86400, "8d"), (400 * 86400, "400d"), (731 * 86400, "2y1d"), (9 * 365 * 86400, "9y"),
    ],
)  # fmt: skip
def test_ages_read_as_kubectl_prints_them(seconds: float, printed: str) -> None:
    assert human_duration(seconds) == printed
