"""Release takes back only what sdcguard's cordon added, on the local EKS API server.

Kubernetes' node lifecycle controller taints every unschedulable node with
``node.kubernetes.io/unschedulable:NoSchedule`` (and removes it once the node is
schedulable again); the stand-in's API server does the same on every node write,
so these nodes carry it as on EKS.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from kubernetes import client as k8s

from sdcguard.infra.local.eks.bearer_token import eks_bearer_token, kubernetes_configuration
from sdcguard.infra.local.eks.server import EksApiServer
from sdcguard.lambdas.cordon import HEALTH_LABEL, TAINT_KEY, cordon_node, uncordon_node

CONTROLLER_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def api() -> Iterator[k8s.ApiClient]:
    sts = boto3.client(
        "sts", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
    )
    with EksApiServer() as server:
        yield k8s.ApiClient(
            kubernetes_configuration(server.url, server.ca_data, eks_bearer_token("c", sts, expires_in=900))
        )


def new_node(api: k8s.ApiClient, *, unschedulable: bool = False) -> str:
    name = f"hyperpod-i-0{uuid.uuid4().hex[:16]}"
    spec: dict[str, Any] = {"unschedulable": True} if unschedulable else {}
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {HEALTH_LABEL: "Schedulable"}},
        "spec": spec,
    }
    k8s.CoreV1Api(api).create_node(body)
    return name


def add_taint(api: k8s.ApiClient, node: str, taint: dict[str, str]) -> None:
    core = k8s.CoreV1Api(api)
    taints = [
        {k: v for k, v in {"key": t.key, "value": t.value, "effect": t.effect}.items() if v is not None}
        for t in core.read_node(node).spec.taints or []
    ]
    core.patch_node(node, {"spec": {"taints": [*taints, taint]}})


def cordoned_by_us(api: k8s.ApiClient, node: str, incident: str) -> None:
    """Cordon as sdcguard does; the API server adds the node lifecycle controller's taint, as on EKS."""
    assert cordon_node(api, node, incident).changed
    taints = k8s.CoreV1Api(api).read_node(node).spec.taints or []
    assert [(t.key, t.effect) for t in taints if t.key == CONTROLLER_TAINT["key"]] == [
        (CONTROLLER_TAINT["key"], CONTROLLER_TAINT["effect"])
    ]


def state(api: k8s.ApiClient, node: str) -> tuple[bool, list[str], list[str]]:
    """The node's cordon, its taint keys other than the controller's, and sdcguard's annotations.

    The controller's taint is there exactly while the node is cordoned (checked here, not returned).
    """
    read = k8s.CoreV1Api(api).read_node(node)
    mirrored = [t for t in read.spec.taints or [] if t.key == CONTROLLER_TAINT["key"]]
    assert len(mirrored) == int(bool(read.spec.unschedulable)), read.spec.taints
    keys = [t.key for t in read.spec.taints or [] if t.key != CONTROLLER_TAINT["key"]]
    ours = sorted(k for k in read.metadata.annotations or {} if k.startswith("sdcguard.io/"))
    return bool(read.spec.unschedulable), keys, ours


def incident() -> str:
    return f"sdc-{uuid.uuid4().hex[:20]}"


def test_release_frees_a_node_we_cordoned_though_the_controller_mirrors_our_cordon_as_a_taint(
    api: k8s.ApiClient,
) -> None:
    # Given a node that was schedulable, cordoned by an incident (the controller adding its taint),
    node, held = new_node(api), incident()
    cordoned_by_us(api, node, held)
    assert state(api, node) == (
        True,
        [TAINT_KEY],
        sorted(["sdcguard.io/incident", "sdcguard.io/cordoned-at", "sdcguard.io/was-unschedulable"]),
    )
    # when the incident releases it,
    assert uncordon_node(api, node, held).changed
    # it is schedulable again, with nothing of sdcguard's left on it.
    assert state(api, node) == (False, [], [])


def test_release_leaves_a_node_that_was_cordoned_before_us_cordoned(api: k8s.ApiClient) -> None:
    # Given a node someone had cordoned before the incident cordoned it too,
    node, held = new_node(api, unschedulable=True), incident()
    cordoned_by_us(api, node, held)
    # when the incident releases it, only our taint and annotations go: their cordon stays.
    assert uncordon_node(api, node, held).changed
    assert state(api, node) == (True, [], [])


@pytest.mark.parametrize(
    "theirs",
    [
        {"key": "ops/maintenance", "value": "disk", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"},
    ],
    ids=["an-operators-taint", "out-of-service"],
)
def test_release_leaves_a_taint_someone_else_added_while_we_held_the_node(
    api: k8s.ApiClient, theirs: dict[str, str]
) -> None:
    # Given a node cordoned by an incident, and someone else's taint added while the incident held it,
    node, held = new_node(api), incident()
    cordoned_by_us(api, node, held)
    add_taint(api, node, theirs)
    # when the incident releases it, their taint stays, and so does the cordon.
    assert uncordon_node(api, node, held).changed
    assert state(api, node) == (True, [theirs["key"]], [])


def test_release_leaves_a_node_hyperpod_marked_unhealthy_while_we_held_it(api: k8s.ApiClient) -> None:
    node, held = new_node(api), incident()
    cordoned_by_us(api, node, held)
    k8s.CoreV1Api(api).patch_node(
        node, {"metadata": {"labels": {HEALTH_LABEL: "UnschedulablePendingReplacement"}}}
    )
    assert uncordon_node(api, node, held).changed
    assert state(api, node) == (True, [], [])


def test_release_by_another_incident_touches_nothing(api: k8s.ApiClient) -> None:
    node, held = new_node(api), incident()
    cordoned_by_us(api, node, held)
    assert not uncordon_node(api, node, incident()).changed
    assert state(api, node)[:2] == (True, [TAINT_KEY])
