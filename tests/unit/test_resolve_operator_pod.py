"""Resolve believes the training operator, not the pod: which pod the operator made for a rank, and what a
tenant's own pod cannot take from it (the name, the replica labels, the phase, the kubelet's hostIP)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from sdcguard.contract import Alarm
from sdcguard.lambdas.resolve import Observed, OperatorPod, not_operators_pod, operator_pod
from tests.events import load_event

NODE = "hyperpod-i-0123456789abcdef0"
NODE_IP = "10.0.7.9"


def alarm(**changes: Any) -> Alarm:
    detail = copy.deepcopy(load_event("alarm_ring_audit")["detail"])  # rank 3 of 6, 2 a node: pod gpt-pretrain-worker-1
    detail.update(changes)
    return Alarm.model_validate(detail)


def pytorchjob(*, master: int | None = None, workers: int = 3, nproc: str | None = "2") -> dict[str, Any]:
    specs: dict[str, Any] = {"Worker": {"replicas": workers}}
    if master is not None:
        specs["Master"] = {"replicas": master}
    spec: dict[str, Any] = {"pytorchReplicaSpecs": specs}
    if nproc is not None:
        spec["nprocPerNode"] = nproc
    return {"metadata": {"name": "gpt-pretrain", "uid": "uid-1"}, "spec": spec}


def operators(**changes: Any) -> Observed:
    """What the API shows of the operator's pod for rank 3 (worker 1), running on its node."""
    seen = Observed(
        pod_exists=True, job_name="gpt-pretrain", node=NODE, node_exists=True, node_addresses=(NODE_IP, NODE),
        owner_uid="uid-1", replica_type="worker", replica_index="1", phase="Running", host_ip=NODE_IP,
    )  # fmt: skip
    return dataclasses.replace(seen, **changes)


def test_the_operator_names_pods_by_node_index_masters_first() -> None:
    workers_only = pytorchjob()
    assert operator_pod(workers_only, "j", 0) == OperatorPod("j-worker-0", "worker", 0)
    assert operator_pod(workers_only, "j", 2) == OperatorPod("j-worker-2", "worker", 2)
    assert operator_pod(workers_only, "j", 3) is None
    with_master = pytorchjob(master=1, workers=2)
    assert operator_pod(with_master, "j", 0) == OperatorPod("j-master-0", "master", 0)
    assert operator_pod(with_master, "j", 1) == OperatorPod("j-worker-0", "worker", 0)
    assert operator_pod(with_master, "j", 2) == OperatorPod("j-worker-1", "worker", 1)
    assert operator_pod(with_master, "j", 3) is None


def test_the_operators_running_pod_on_its_node_is_believed() -> None:
    a = alarm()
    assert not_operators_pod(a.suspects[0], operators(), alarm=a, pytorchjob=pytorchjob()) is None


@pytest.mark.parametrize(
    ("case", "seen", "job", "named"),
    [
        # The forged pod: any name, the job's label and owner, spec.nodeName on another node.
        ("another name", operators(), pytorchjob(master=1), "node index 1 (rank // ranks_per_node 2) runs in pod gpt-pretrain-worker-0"),
        ("replica labels", operators(replica_index="0"), pytorchjob(), "replica labels type='worker' index='0'"),
        ("no replica labels", operators(replica_type=None, replica_index=None), pytorchjob(), "type=None index=None"),
        ("not running", operators(phase="Pending"), pytorchjob(), "is Pending, not Running"),
        ("no phase", operators(phase=None), pytorchjob(), "is without a phase, not Running"),
        ("hostIP of another node", operators(host_ip="10.0.1.1"), pytorchjob(), "status.hostIP '10.0.1.1' is none of node"),
        ("no hostIP", operators(host_ip=None), pytorchjob(), "status.hostIP None is none of node"),
        ("beyond the replicas", operators(), pytorchjob(workers=1), "node index 1 (rank // ranks_per_node 2) is beyond"),
        ("ranks_per_node", operators(), pytorchjob(nproc="4"), "ranks_per_node 2 is not the PyTorchJob's nprocPerNode 4"),
    ],
)
def test_a_pod_the_operator_did_not_make_for_the_rank_is_named(case: str, seen: Observed, job: dict[str, Any], named: str) -> None:
    a = alarm()
    reason = not_operators_pod(a.suspects[0], seen, alarm=a, pytorchjob=job)
    assert reason is not None, case
    assert reason.startswith("rank 3: pod gpt-pretrain-worker-1"), reason
    assert named in reason, reason


def test_a_forged_pod_name_is_refused_whatever_its_status_claims() -> None:
    # A pod named "evil" for rank 3, even with the status a running operator pod would have.
    a = alarm(suspects=[{"global_rank": 3, "local_rank": 1, "pod": "evil", "node": NODE, "host": "evil"}])
    reason = not_operators_pod(a.suspects[0], operators(), alarm=a, pytorchjob=pytorchjob())
    assert reason is not None
    assert "pod evil is not the pod the training operator made for that rank" in reason
    assert "runs in pod gpt-pretrain-worker-1" in reason


def test_a_non_numeric_nproc_per_node_is_not_compared() -> None:
    # "auto" or "gpu" leave the count to torchrun: the alarm's own ranks_per_node is all there is.
    a = alarm()
    assert not_operators_pod(a.suspects[0], operators(), alarm=a, pytorchjob=pytorchjob(nproc="auto")) is None
    assert not_operators_pod(a.suspects[0], operators(), alarm=a, pytorchjob=pytorchjob(nproc=None)) is None
