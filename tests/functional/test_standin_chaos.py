"""Chaos on the stand-in: a fraction of Kubernetes API and SageMaker HyperPod calls fail transiently.

The knobs the chaos drill (``sdcguard drill --chaos RATE``) turns: the EKS
server's ``faults.chaos`` and the HyperPod extension's ``hyperpod_faults.chaos``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from kubernetes import client as k8s

from sdcguard.infra.local.eks.bearer_token import eks_bearer_token, kubernetes_configuration
from sdcguard.infra.local.eks.faults import Chaos
from sdcguard.infra.local.eks.server import EksApiServer
from sdcguard.infra.local.moto_ext import hyperpod_faults
from sdcguard.infra.local.standin import LocalStandIn
from tests.functional.test_standin_hyperpod import create_cluster


def _faults_of(chaos: Chaos, operation: str, calls: int) -> list[int | None]:
    return [chaos.decide(operation, f"call-{i}") for i in range(calls)]


def test_the_same_seed_fails_the_same_calls_at_about_the_rate() -> None:
    first, again, other = Chaos(), Chaos(), Chaos()
    first.set(0.2, seed=7)
    again.set(0.2, seed=7)
    other.set(0.2, seed=8)

    # Another operation's calls in between do not move this operation's draws.
    seen = []
    for i in range(2000):
        seen.append(first.decide("PATCH nodes", f"call-{i}"))
        first.decide("GET pods", f"call-{i}")
    repeated = _faults_of(again, "PATCH nodes", 2000)

    assert seen == repeated
    assert seen != _faults_of(other, "PATCH nodes", 2000)
    failed = [s for s in seen if s is not None]
    assert 0.17 < len(failed) / len(seen) < 0.23
    assert set(failed) == {429, 500, 503}
    assert sum(first.tally().injected["PATCH nodes"].values()) == len(failed)
    assert Chaos().decide("GET pods", "off") is None  # off by default


def test_a_fault_counts_as_retried_only_when_the_same_call_comes_again() -> None:
    chaos = Chaos()
    chaos.set(1.0, seed=1)
    assert chaos.decide("PATCH nodes", "node-a") is not None
    assert chaos.decide("PATCH nodes", "node-b") is not None

    chaos.set(1.0, seed=1)  # counts start again
    chaos.decide("PATCH nodes", "node-a")
    chaos.decide("PATCH nodes", "node-a")
    chaos.decide("PATCH nodes", "node-b")
    chaos.rate = 0.0000001  # nothing more fails (the draws stay above it), calls still count
    assert chaos.decide("PATCH nodes", "node-a") is None
    with chaos.paused():
        assert chaos.decide("PATCH nodes", "node-b") is None  # an observer's read: not a retry

    tally = chaos.tally()
    assert tally.faults == 3
    assert tally.retried == {"PATCH nodes": 2}
    assert tally.outstanding == {"PATCH nodes": 1}


@pytest.mark.parametrize(("bad", "named"), [
    ({"rate": 1.5}, "rate"), ({"rate": -0.1}, "rate"), ({"rate": 0.1, "statuses": (200,)}, "statuses"),
    ({"rate": 0.1, "statuses": ()}, "statuses"), ({"rate": 0.1, "seed": "x"}, "seed"),
])
def test_chaos_refuses_knobs_out_of_range(bad: dict[str, Any], named: str) -> None:
    chaos = Chaos()
    with pytest.raises(ValueError, match=f"^{named}"):
        chaos.set(**bad)
    assert chaos.rate == 0.0


@pytest.fixture
def eks(standin: LocalStandIn) -> Iterator[EksApiServer]:
    assert standin.eks is not None
    yield standin.eks
    standin.eks.faults.chaos.off()


def test_kubernetes_calls_fail_transiently_and_a_retry_of_the_same_call_absorbs_the_fault(
    standin: LocalStandIn, eks: EksApiServer
) -> None:
    # Given an admin client of the stand-in's cluster and chaos on every call (5xx: no Retry-After wait),
    token = eks_bearer_token("chaos", standin.client("sts"))
    api = k8s.ApiClient(kubernetes_configuration(eks.url, eks.ca_data, token))
    core = k8s.CoreV1Api(api)
    name = f"chaos-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    eks.faults.chaos.set(1.0, seed=3, statuses=(500, 503))

    # when the same read is tried, failing, then let through,
    statuses = []
    for _ in range(3):
        with pytest.raises(k8s.ApiException) as failed:
            core.read_namespace(name)
        statuses.append(failed.value.status)
    eks.faults.chaos.rate = 0.0000001
    read = core.read_namespace(name)
    api.close()

    # each attempt failed as an API server under strain answers, and the retry absorbed all three.
    assert set(statuses) <= {500, 503}
    assert read.metadata.name == name
    tally = eks.faults.chaos.tally()
    assert tally.faults == 3
    assert tally.retried == {"GET namespaces": 3}
    assert tally.outstanding == {}
    recorded = [r.status for r in eks.requests if r.name == name and r.method == "GET"]
    assert recorded[-4:] == [*statuses, 200]


def test_hyperpod_calls_fail_as_sagemaker_does_and_botocore_retries_absorb_them(standin: LocalStandIn) -> None:
    cluster, ids = create_cluster(standin)
    once = standin.client("sagemaker", config=Config(retries={"mode": "standard", "max_attempts": 1}))
    patient = standin.client("sagemaker", config=Config(retries={"mode": "standard", "max_attempts": 10}))
    chaos = hyperpod_faults.chaos
    try:
        # Every status chaos uses, as SageMaker answers it (no retries: each error is seen).
        errors = set()
        for status in (429, 500, 503):
            chaos.set(1.0, seed=0, statuses=(status,))
            with pytest.raises(ClientError) as failed:
                once.list_cluster_nodes(ClusterName=cluster)
            error = failed.value.response
            errors.add((error["ResponseMetadata"]["HTTPStatusCode"], error["Error"]["Code"]))
        assert errors == {(400, "ThrottlingException"), (500, "InternalFailure"), (503, "ServiceUnavailable")}
        # A non-HyperPod SageMaker call is never failed.
        once.list_notebook_instances()

        # Under chaos at 0.5 every call still succeeds through botocore's retries,
        chaos.set(0.5, seed=11, statuses=(500, 503))
        for _ in range(10):
            listed = patient.list_cluster_nodes(ClusterName=cluster)["ClusterNodeSummaries"]
            assert sorted(n["InstanceId"] for n in listed) == sorted(ids)
        tally = chaos.tally()
    finally:
        chaos.off()

    # and the tally counts the faults, each absorbed by a resend of the same request.
    assert tally.faults > 0
    assert tally.retried == {"ListClusterNodes": tally.faults}
    assert tally.outstanding == {}
