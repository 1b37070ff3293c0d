"""Whole incidents on the stand-in: the template deployed by ``sdcguard deploy``, started by PutEvents.

Each test publishes an alarm on the deployed bus, as the agent does, and lets
the rule, the incident machine and the real handlers (run from the uploaded
package) do the rest; a reviewer decides by starting the decide machine, as
from the Step Functions console. The assertions are on what the pipeline
leaves behind: the HyperPod instances, the Kubernetes node and PyTorchJob, the
resume pointer, the ledger and the executions.
"""

from __future__ import annotations

import copy
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from sdcguard.contract import CheckpointManifest, Incident, IncidentState
from sdcguard.infra.deploy.deploy import deploy
from sdcguard.infra.local.moto_ext import hyperpod
from sdcguard.infra.local.seed import seed
from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lambdas.cordon import TAINT_KEY
from sdcguard.lambdas.eks_token import kubernetes_client
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lineage.commit import commit, put_object
from sdcguard.lineage.pointer import read_pointer
from sdcguard.lineage.pointer import rewrite_pointer as point_at
from sdcguard.lineage.store import open_store
from sdcguard.lineage.verify import RESUME_OBJECTS
from tests.events import load_event

pytestmark = pytest.mark.slow

S = IncidentState
NODES = 8
RANKS_PER_NODE = 2  # as seeded
REPEATS = 2  # the node checks' repetitions (NodeCheckRepeats)


@dataclass
class Pipeline:
    """One deployed stack guarding one seeded cluster."""

    standin: LocalStandIn
    stack: str
    outputs: dict[str, str]
    seeded: dict[str, Any]
    ledger: Ledger

    def node(self, index: int) -> dict[str, Any]:
        return dict(self.seeded["nodes"][index])

    @property
    def prefix(self) -> str:
        return str(self.seeded["job"])

    def store(self) -> Any:
        return open_store(f"s3://{self.seeded['bucket']}/{self.prefix}", client=self.standin.client("s3"))

    def kube(self) -> k8s.ApiClient:
        return kubernetes_client(self.seeded["eks_cluster"], eks=self.standin.client("eks"), sts=self.standin.client("sts"))

    def read_node(self, name: str) -> Any:
        return k8s.CoreV1Api(self.kube()).read_node(name)

    def unavailable_answers(self, name: str) -> int:
        """How many requests about the object ``name`` the local API server has answered with 503."""
        eks = self.standin.eks
        assert eks is not None
        return sum(1 for r in eks.requests if r.name == name and r.status == 503)

    def release(self, incident_id: str, execution: str | None = None) -> None:
        """Reject the incident as a reviewer would, so the job and the node are free for the next test."""
        assert self.decide(incident_id, "reject", "drill")["status"] == "SUCCEEDED"
        assert self.execution_end(execution or self.execution_of(incident_id))["status"] == "SUCCEEDED"

    def read_job(self, name: str | None = None) -> dict[str, Any]:
        job: dict[str, Any] = k8s.CustomObjectsApi(self.kube()).get_namespaced_custom_object(
            "kubeflow.org", "v1", self.seeded["namespace"], "pytorchjobs", name or self.seeded["job"]
        )
        return job

    def job_running(self) -> None:
        """Given: the job runs and no incident holds it."""
        k8s.CustomObjectsApi(self.kube()).patch_namespaced_custom_object(
            "kubeflow.org", "v1", self.seeded["namespace"], "pytorchjobs", self.seeded["job"],
            {"metadata": {"annotations": {"sdcguard.io/suspended-by": None}}, "spec": {"runPolicy": {"suspend": False}}},
        )  # fmt: skip

    def alarm(self, node_index: int, *, ring_clean: int) -> dict[str, Any]:
        """A ring-audit alarm (EventBridge detail) blaming one rank on node ``node_index``."""
        detail = copy.deepcopy(load_event("alarm_ring_audit")["detail"])
        node = self.node(node_index)
        detail.update(
            alarm_id=uuid.uuid4().hex,
            time=datetime.now(UTC).isoformat(),
            job={
                "hyperpod_cluster": self.seeded["hyperpod_cluster"],
                "eks_cluster": self.seeded["eks_cluster"],
                "namespace": self.seeded["namespace"],
                "job_name": self.seeded["job"],
            },
            step=ring_clean + 50,
            world_size=NODES * RANKS_PER_NODE,
            ranks_per_node=RANKS_PER_NODE,
            last_clean={
                "nonfinite_grad": ring_clean + 49,
                "ring_audit": ring_clean,
                "weight_fingerprint": ring_clean + 40,
                "reduced_grad": ring_clean + 49,
            },
            checkpoint_prefix=f"s3://{self.seeded['bucket']}/{self.prefix}",
            resume_pointer=f"s3://{self.seeded['bucket']}/{self.prefix}/RESUME.json",
            suspects=[
                {
                    "global_rank": node["ranks"][1],
                    "local_rank": 1,
                    "pod": node["pod"],
                    "node": node["node_name"],
                    "host": node["pod"],
                }
            ],
        )
        return dict(detail)

    def publish(self, *details: dict[str, Any]) -> None:
        """PutEvents on the deployed bus, as the agent does (10 entries per call)."""
        events = self.standin.client("events")
        entries = [
            {
                "EventBusName": self.outputs["EventBusName"],
                "Source": "sdcguard.agent",
                "DetailType": "SDC Alarm",
                "Detail": json.dumps(d),
            }
            for d in details
        ]
        for i in range(0, len(entries), 10):
            response = events.put_events(Entries=entries[i : i + 10])
            assert response["FailedEntryCount"] == 0, response

    def incident_for(self, alarm_id: str, *, timeout: float = 60) -> Incident:
        return wait_for(
            lambda: next((i for i in self.ledger.list() if i.alarm.alarm_id == alarm_id), None),
            timeout=timeout,
            what=f"the incident of alarm {alarm_id}",
        )

    def wait_state(self, incident_id: str, *states: IncidentState, timeout: float = 120) -> Incident:
        def reached() -> Incident | None:
            incident = self.ledger.get(incident_id)
            return incident if incident.state in states else None

        return wait_for(reached, timeout=timeout, what=f"{incident_id} in {', '.join(states)}")

    def decide(self, incident_id: str, decision: str, reason: str) -> dict[str, Any]:
        """Start the decide machine as a reviewer does from the console, and wait for it."""
        sfn = self.standin.client("stepfunctions")
        execution = sfn.start_execution(
            stateMachineArn=self.outputs["DecideStateMachineArn"],
            name=f"{decision}-{uuid.uuid4().hex[:12]}",
            input=json.dumps({"incident_id": incident_id, "decision": decision, "reason": reason, "reviewer": "oncall@example.com"}),
        )["executionArn"]
        return self.execution_end(execution)

    def executions(self) -> list[dict[str, Any]]:
        sfn = self.standin.client("stepfunctions")
        pages = sfn.get_paginator("list_executions").paginate(stateMachineArn=self.outputs["IncidentStateMachineArn"])
        return [e for page in pages for e in page["executions"]]

    def execution_of(self, incident_id: str, *, timeout: float = 60) -> str:
        """The incident machine's execution that opened ``incident_id`` (not a duplicate)."""
        sfn = self.standin.client("stepfunctions")

        def find() -> str | None:
            for e in self.executions():
                for event in sfn.get_execution_history(executionArn=e["executionArn"])["events"]:
                    details = event.get("stateEnteredEventDetails", {})
                    if details.get("name") == "Resolve" and incident_id in details.get("input", ""):
                        return str(e["executionArn"])
            return None

        return wait_for(find, timeout=timeout, what=f"the execution of {incident_id}")

    def execution_end(self, arn: str, *, timeout: float = 180) -> dict[str, Any]:
        sfn = self.standin.client("stepfunctions")

        def ended() -> dict[str, Any] | None:
            described: dict[str, Any] = sfn.describe_execution(executionArn=arn)
            return described if described["status"] != "RUNNING" else None

        return wait_for(ended, timeout=timeout, what=f"the end of {arn}")


def wait_for(probe: Callable[[], Any], *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)


def write_checkpoints(p: Pipeline, steps: list[int]) -> None:
    store = p.store()
    for step in steps:
        digests = [put_object(store, step, name, f"{name} at {step}".encode()) for name in RESUME_OBJECTS]
        commit(store, CheckpointManifest(step=step, world_size=NODES * RANKS_PER_NODE, fingerprint="ab" * 24, objects=digests))


def our_taints(node: Any) -> list[Any]:
    return [t for t in (node.spec.taints or []) if t.key == TAINT_KEY]


def hyperpod_nodes(p: Pipeline) -> dict[str, str]:
    sm = p.standin.client("sagemaker")
    summaries = sm.list_cluster_nodes(ClusterName=p.seeded["hyperpod_cluster"])["ClusterNodeSummaries"]
    return {n["InstanceId"]: n["InstanceStatus"]["Status"] for n in summaries}


def _deploy(standin: LocalStandIn, *, approval_timeout: int) -> Iterator[Pipeline]:
    suffix = uuid.uuid4().hex[:6]
    seeded = seed(standin, nodes=NODES, cluster=f"ex-{suffix}", job=f"job-{suffix}", minutes=30, faulty_node=1)
    saved = {k: os.environ.get(k) for k in standin.env}
    os.environ.update(standin.env)  # the deploy reaches the stand-in as `sdcguard local up` tells a shell to
    try:
        result = deploy(
            f"ex-{suffix}",
            {
                "HyperPodClusterName": seeded["hyperpod_cluster"],
                "EksClusterName": seeded["eks_cluster"],
                "JobNamespace": seeded["namespace"],
                "JobName": seeded["job"],
                "CheckpointBucket": seeded["bucket"],
                "CheckpointPrefix": seeded["job"],
                "EventBusName": f"bus-{suffix}",
                "ApprovalTimeoutSeconds": str(approval_timeout),
                "MaxQuarantinedNodes": str(NODES),
                "MaxReplacementsPerDay": "20",
                "ReplacementPollSeconds": "1",
                "ReplacementMaxPolls": "30",
                # The node checks' replay Jobs run as local processes on the stand-in: a tiny capsule, twice.
                "NodeCheckPollSeconds": "1",
                "NodeCheckMaxPolls": "60",
                "NodeCheckRepeats": str(REPEATS),
                "NodeCheckDeadlineSeconds": "120",
                "AllowAnyPublisher": "true",  # the tests publish as the stand-in's one principal
            },
            poll_seconds=0.1,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    pipeline = Pipeline(
        standin, result.stack_name, result.outputs, seeded, Ledger(result.outputs["LedgerTableName"], standin.client("dynamodb"))
    )
    write_checkpoints(pipeline, [0])  # a safe checkpoint for every alarm: the approval request shows the rollback
    yield pipeline


@pytest.fixture(scope="module")
def pipeline(standin: LocalStandIn) -> Iterator[Pipeline]:
    yield from _deploy(standin, approval_timeout=300)


@pytest.fixture(scope="module")
def impatient(standin: LocalStandIn) -> Iterator[Pipeline]:
    """A second stack whose reviewers have 3 seconds."""
    yield from _deploy(standin, approval_timeout=3)


def test_the_approve_path_replaces_the_node_rolls_back_and_resumes(pipeline: Pipeline) -> None:
    # Given a running job with checkpoints before and inside the suspect window,
    p, node = pipeline, pipeline.node(2)
    clean = 5000
    p.job_running()
    write_checkpoints(p, [clean - 1000, clean - 10, clean + 20])
    point_at(p.store(), trusted_through_step=clean + 20, reason="latest", written_by="agent")

    # when the agent publishes an alarm about node 2,
    alarm = p.alarm(2, ring_clean=clean)
    p.publish(alarm)
    incident = p.incident_for(alarm["alarm_id"])
    waiting = p.wait_state(incident.incident_id, S.AWAITING_APPROVAL)

    # the node is contained while the reviewers decide,
    assert waiting.instance_ids == [node["instance_id"]]
    assert p.read_job()["spec"]["runPolicy"]["suspend"] is True
    cordoned = p.read_node(node["node_name"])
    assert cordoned.spec.unschedulable is True
    assert [t.value for t in our_taints(cordoned)] == [incident.incident_id]

    # and when a reviewer approves from the console,
    decided = p.decide(incident.incident_id, "approve", "ring audit disagreed twice")
    assert decided["status"] == "SUCCEEDED", decided

    # the incident runs to its end:
    execution = p.execution_end(p.execution_of(incident.incident_id))
    assert execution["status"] == "SUCCEEDED", execution
    closed = p.ledger.get(incident.incident_id)
    assert closed.state == S.CLOSED
    assert closed.decision is not None
    assert (closed.decision.decision, closed.decision.reviewer) == ("approve", "oncall@example.com")
    assert closed.decision.execution_arn == decided["executionArn"]  # CloudTrail's StartExecution names the caller
    # a new instance replaced the old one, in HyperPod and in Kubernetes,
    (replacement,) = closed.replacements
    assert replacement.old_instance_id == node["instance_id"]
    assert replacement.new_instance_id
    instances = hyperpod_nodes(p)
    assert node["instance_id"] not in instances
    assert instances[replacement.new_instance_id] == "Running"
    fresh = p.read_node(f"hyperpod-{replacement.new_instance_id}")
    assert not fresh.spec.unschedulable
    # the pointer is on the last checkpoint before the suspect window, the old one kept,
    pointer, _ = read_pointer(p.store())
    assert pointer is not None
    assert (pointer.step, pointer.incident_id) == (clean - 10, incident.incident_id)
    assert pointer.history[0].step == clean + 20
    # and the job runs again.
    assert not p.read_job()["spec"]["runPolicy"].get("suspend")
    assert [t.state for t in closed.transitions][-4:] == [S.REPLACED, S.POINTER_REWRITTEN, S.RESUMED, S.CLOSED]


def test_the_reject_path_releases_the_node_and_leaves_the_pointer(pipeline: Pipeline) -> None:
    p, node = pipeline, pipeline.node(3)
    clean = 7000
    p.job_running()
    write_checkpoints(p, [clean - 10, clean + 20])
    point_at(p.store(), trusted_through_step=clean + 20, reason="latest", written_by="agent")
    pointer_before, _ = read_pointer(p.store())

    alarm = p.alarm(3, ring_clean=clean)
    p.publish(alarm)
    incident = p.incident_for(alarm["alarm_id"])
    p.wait_state(incident.incident_id, S.AWAITING_APPROVAL)
    assert p.read_node(node["node_name"]).spec.unschedulable is True

    decided = p.decide(incident.incident_id, "reject", "known flaky test job")
    assert decided["status"] == "SUCCEEDED", decided

    execution = p.execution_end(p.execution_of(incident.incident_id))
    assert execution["status"] == "SUCCEEDED", execution
    assert p.ledger.get(incident.incident_id).state == S.FALSE_ALARM
    released = p.read_node(node["node_name"])
    assert not released.spec.unschedulable
    assert our_taints(released) == []
    assert hyperpod_nodes(p)[node["instance_id"]] == "Running"  # not replaced
    assert not p.read_job()["spec"]["runPolicy"].get("suspend")
    pointer_after, _ = read_pointer(p.store())
    assert pointer_after == pointer_before


def test_a_decision_for_an_incident_that_does_not_wait_fails_and_changes_nothing(pipeline: Pipeline) -> None:
    before = len(pipeline.ledger.list())
    decided = pipeline.decide("inc-does-not-exist-000", "approve", "typo")
    assert decided["status"] == "FAILED"
    assert len(pipeline.ledger.list()) == before


def test_a_kubernetes_api_that_fails_transiently_then_recovers(pipeline: Pipeline) -> None:
    p, node = pipeline, pipeline.node(4)
    eks = p.standin.eks
    assert eks is not None
    p.job_running()
    # Given the API server answers the next two patches of the node with 503,
    eks.faults.fail_next("PATCH", "nodes", node["node_name"], status=503, times=2)
    failed_before = p.unavailable_answers(node["node_name"])

    alarm = p.alarm(4, ring_clean=9000)
    p.publish(alarm)
    incident = p.incident_for(alarm["alarm_id"])

    # the cordon is retried and the incident still reaches the reviewers with the node contained.
    waiting = p.wait_state(incident.incident_id, S.AWAITING_APPROVAL, S.FAILED)
    assert waiting.state == S.AWAITING_APPROVAL, waiting.failure
    assert p.unavailable_answers(node["node_name"]) - failed_before == 2
    assert p.read_node(node["node_name"]).spec.unschedulable is True
    p.release(incident.incident_id)


def test_a_kubernetes_api_that_fails_while_resolving_is_retried_by_the_resolve_state(pipeline: Pipeline) -> None:
    p, node = pipeline, pipeline.node(1)
    eks = p.standin.eks
    assert eks is not None
    p.job_running()
    # Given the API server answers the next read of the suspect's pod with 503,
    eks.faults.fail_next("GET", "pods", node["pod"], status=503, times=1)
    failed_before = p.unavailable_answers(node["pod"])

    alarm = p.alarm(1, ring_clean=27000)
    p.publish(alarm)
    incident = p.incident_for(alarm["alarm_id"])

    # the Resolve state retries it (TransientKubernetesError) and the incident reaches the reviewers, contained.
    waiting = p.wait_state(incident.incident_id, S.AWAITING_APPROVAL, S.FAILED, S.NEEDS_ATTENTION)
    assert waiting.state == S.AWAITING_APPROVAL, waiting.failure
    assert waiting.instance_ids == [node["instance_id"]]
    assert p.unavailable_answers(node["pod"]) - failed_before == 1
    execution = p.execution_of(incident.incident_id)
    history = p.standin.client("stepfunctions").get_execution_history(executionArn=execution)["events"]
    errors = [e["taskFailedEventDetails"]["error"] for e in history if e["type"] == "TaskFailed"]
    assert errors == ["TransientKubernetesError"]
    assert p.read_node(node["node_name"]).spec.unschedulable is True
    p.release(incident.incident_id, execution)


def test_a_replacement_that_fails_stops_safely_for_attention(pipeline: Pipeline) -> None:
    p, node = pipeline, pipeline.node(5)
    p.job_running()
    alarm = p.alarm(5, ring_clean=11000)
    p.publish(alarm)
    incident = p.incident_for(alarm["alarm_id"])
    p.wait_state(incident.incident_id, S.AWAITING_APPROVAL)

    # Given HyperPod's own recovery holds the instance (a reboot in progress),
    sm = p.standin.client("sagemaker")
    saved = hyperpod.timings.reboot_seconds
    hyperpod.timings.reboot_seconds = 60
    try:
        rebooting = sm.batch_reboot_cluster_nodes(ClusterName=p.seeded["hyperpod_cluster"], NodeIds=[node["instance_id"]])
        assert rebooting["Successful"] == [node["instance_id"]]
        # when a reviewer approves the replacement,
        assert p.decide(incident.incident_id, "approve", "replace it")["status"] == "SUCCEEDED"
        execution = p.execution_end(p.execution_of(incident.incident_id))
    finally:
        hyperpod.timings.reboot_seconds = saved

    # the incident stops for attention: nothing replaced, node still cordoned, job still suspended.
    assert execution["status"] == "FAILED", execution
    stopped = p.ledger.get(incident.incident_id)
    assert stopped.state == S.NEEDS_ATTENTION
    assert node["instance_id"] in hyperpod_nodes(p)
    assert p.read_node(node["node_name"]).spec.unschedulable is True
    assert p.read_job()["spec"]["runPolicy"]["suspend"] is True


STORM = 3 * NODES * RANKS_PER_NODE
"""Alarms in the storm: every rank of the job, three times over."""


def test_a_storm_of_duplicate_alarms_makes_one_incident(pipeline: Pipeline) -> None:
    p, node = pipeline, pipeline.node(6)
    eks = p.standin.eks
    assert eks is not None
    p.job_running()
    alarm = p.alarm(6, ring_clean=13000)
    # Every rank (and re-deliveries) reports the same fault, at once.
    storm = [{**alarm, "alarm_id": uuid.uuid4().hex, "publisher_rank": i % (NODES * RANKS_PER_NODE)} for i in range(STORM)]
    known = {e["executionArn"] for e in p.executions()}
    patches_before = len([r for r in eks.requests if r.method == "PATCH" and r.name == node["node_name"]])

    p.publish(*storm)

    started = wait_for(
        lambda: (new if len(new := [e for e in p.executions() if e["executionArn"] not in known]) >= STORM else None),
        timeout=120,
        what=f"{STORM} executions",
    )
    assert len(started) == STORM
    ids = {a["alarm_id"] for a in storm}
    incidents = wait_for(
        lambda: [i for i in p.ledger.list() if i.alarm.alarm_id in ids] or None, timeout=60, what="the incident"
    )
    (incident,) = incidents
    p.wait_state(incident.incident_id, S.AWAITING_APPROVAL)
    opener = p.execution_of(incident.incident_id)
    ended = [p.execution_end(e["executionArn"]) for e in started if e["executionArn"] != opener]
    assert len(ended) == STORM - 1
    assert {e["status"] for e in ended} == {"SUCCEEDED"}
    assert all(json.loads(e["output"])["duplicate"] is True for e in ended)
    assert p.ledger.get(incident.incident_id).duplicate_alarms == STORM - 1
    patches = [r for r in eks.requests if r.method == "PATCH" and r.name == node["node_name"]]
    assert len(patches) - patches_before == 1  # cordoned once
    p.release(incident.incident_id, opener)


def test_an_unanswered_approval_times_out_to_a_safe_stop(impatient: Pipeline) -> None:
    p, node = impatient, impatient.node(2)
    p.job_running()
    alarm = p.alarm(2, ring_clean=15000)
    p.publish(alarm)
    incident = p.incident_for(alarm["alarm_id"])
    p.wait_state(incident.incident_id, S.AWAITING_APPROVAL)

    # Nobody answers within the 3 seconds.
    execution = p.execution_end(p.execution_of(incident.incident_id), timeout=120)
    assert execution["status"] == "FAILED", execution
    stopped = p.ledger.get(incident.incident_id)
    assert stopped.state == S.NEEDS_ATTENTION
    assert p.read_node(node["node_name"]).spec.unschedulable is True  # still contained
    assert p.read_job()["spec"]["runPolicy"]["suspend"] is True
    assert node["instance_id"] in hyperpod_nodes(p)
    # and a late decision is refused.
    assert p.decide(incident.incident_id, "approve", "too late")["status"] == "FAILED"
    assert p.ledger.get(incident.incident_id).state == S.NEEDS_ATTENTION


# -- forged alarms: valid, for this cluster and job, naming what the cluster contradicts ----------------------


def plant(p: Pipeline, node: str, *, job: str | None = None) -> str:
    """A pod (of the guarded job unless ``job`` says another) on node ``node``, created if need be."""
    core = k8s.CoreV1Api(p.kube())
    try:
        core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}, "spec": {}})
    except k8s.ApiException as exc:
        if exc.status != 409:
            raise
    pod = f"planted-{uuid.uuid4().hex[:8]}"
    owner = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": job or p.seeded["job"],
             "uid": p.read_job()["metadata"]["uid"], "controller": True}  # as the training operator sets it
    core.create_namespaced_pod(
        p.seeded["namespace"],
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": pod, "labels": {"training.kubeflow.org/job-name": job or p.seeded["job"]},
                      "ownerReferences": [owner]},
         "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}},
    )  # fmt: skip
    return pod


def another_job(p: Pipeline) -> str:
    """A second PyTorchJob, running, in the guarded namespace: one the stack does not guard."""
    name = f"another-{uuid.uuid4().hex[:8]}"
    k8s.CustomObjectsApi(p.kube()).create_namespaced_custom_object(
        "kubeflow.org", "v1", p.seeded["namespace"], "pytorchjobs",
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
         "spec": {"runPolicy": {"suspend": False},
                  "pytorchReplicaSpecs": {"Worker": {"replicas": 1, "template": {"spec": {"containers": [
                      {"name": "pytorch", "image": "busybox"}]}}}}}},
    )  # fmt: skip
    return name


def all_taints(p: Pipeline) -> dict[str, list[Any]]:
    """sdcguard's taints on every node of the (shared) Kubernetes API."""
    return {n.metadata.name: our_taints(n) for n in k8s.CoreV1Api(p.kube()).list_node().items}


def forged(p: Pipeline, *, pod: str, node: str, ring_clean: int, job: str | None = None) -> dict[str, Any]:
    detail = p.alarm(0, ring_clean=ring_clean)
    detail["suspects"][0].update(pod=pod, node=node, host=pod)
    if job is not None:
        detail["job"]["job_name"] = job
    return detail


def test_forged_alarms_cordon_nothing_and_suspend_nothing(pipeline: Pipeline) -> None:
    p = pipeline
    p.job_running()
    victim, elsewhere = p.node(7), p.node(6)
    other = another_job(p)
    cases = {
        # a pod of the job, but on another node than the one the alarm would have cordoned
        "pod on another node": (forged(p, pod=elsewhere["pod"], node=victim["node_name"], ring_clean=21000), "runs on node"),
        # a pod on the node, but not of the guarded job
        "pod outside the job": (
            forged(p, pod=plant(p, victim["node_name"], job="not-the-job"), node=victim["node_name"], ring_clean=22000),
            "is not a pod of PyTorchJob",
        ),
        # a pod of the job on a node that is no HyperPod node of the cluster
        "non-HyperPod node": (
            forged(p, pod=plant(p, "ip-10-77-0-1.ec2.internal"), node="ip-10-77-0-1.ec2.internal", ring_clean=23000),
            "neither a HyperPod node name",
        ),
        # another PyTorchJob of the guarded namespace, consistent with its own pod: not the job the stack guards
        "another job of the namespace": (
            forged(p, pod=plant(p, victim["node_name"], job=other), node=victim["node_name"], ring_clean=25000, job=other),
            f"this pipeline guards {p.seeded['namespace']}/{p.seeded['job']!r} (JobName / JOB_NAME)",
        ),
    }
    taints_before = all_taints(p)
    p.publish(*(detail for detail, _ in cases.values()))

    for what, (detail, reason) in cases.items():
        incident = p.incident_for(detail["alarm_id"])
        execution = p.execution_end(p.execution_of(incident.incident_id))
        stopped = p.ledger.get(incident.incident_id)
        assert execution["status"] == "FAILED", what  # StoppedForAttention
        assert stopped.state == S.NEEDS_ATTENTION, what
        assert stopped.failure is not None
        assert reason in stopped.failure.cause, (what, stopped.failure)
        assert stopped.suspects == [], what
        assert S.GUARDED not in [t.state for t in stopped.transitions], what
    # Nothing was cordoned, and the job runs on, not claimed by any of them.
    assert all_taints(p) == taints_before
    for job in (p.read_job(), p.read_job(other)):
        assert not job["spec"]["runPolicy"].get("suspend"), job["metadata"]["name"]
        assert not (job["metadata"].get("annotations") or {}).get("sdcguard.io/suspended-by")


def test_a_pod_forged_as_the_operators_cordons_nothing_and_suspends_nothing(pipeline: Pipeline) -> None:
    # Given a tenant's pod as in the issue: the job-name label, a controller ownerReference to the PyTorchJob's
    # uid and spec.nodeName on a HyperPod node of the cluster, named by an alarm with a rank (of node 0) whose
    # real pod runs elsewhere,
    p = pipeline
    p.job_running()
    victim, real = p.node(6), p.node(0)
    detail = forged(p, pod=plant(p, victim["node_name"]), node=victim["node_name"], ring_clean=27000)
    taints_before = all_taints(p)
    # when the alarm is published,
    p.publish(detail)
    incident = p.incident_for(detail["alarm_id"])
    execution = p.execution_end(p.execution_of(incident.incident_id))
    # the incident stops for attention and says why,
    stopped = p.ledger.get(incident.incident_id)
    assert execution["status"] == "FAILED"  # StoppedForAttention
    assert stopped.state == S.NEEDS_ATTENTION
    assert stopped.failure is not None
    assert stopped.failure.error == "SuspectNotOperatorPod"
    assert "is not the pod the training operator made for that rank" in stopped.failure.cause
    assert f"runs in pod {real['pod']}" in stopped.failure.cause
    assert stopped.suspects == []
    assert S.GUARDED not in [t.state for t in stopped.transitions]
    # and nothing is cordoned or suspended.
    assert all_taints(p) == taints_before
    assert not p.read_node(victim["node_name"]).spec.unschedulable
    job = p.read_job()
    assert not job["spec"]["runPolicy"].get("suspend")
    assert not (job["metadata"].get("annotations") or {}).get("sdcguard.io/suspended-by")


def test_an_end_handler_that_fails_still_ends_with_a_notification(pipeline: Pipeline) -> None:
    p = pipeline
    p.job_running()
    sqs, sns, lam = p.standin.client("sqs"), p.standin.client("sns"), p.standin.client("lambda")
    queue = sqs.create_queue(QueueName=f"inbox-{uuid.uuid4().hex[:6]}")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sns.subscribe(TopicArn=p.outputs["TopicArn"], Protocol="sqs", Endpoint=queue_arn)
    function = f"{p.stack}-needs-attention"  # the template's FunctionName
    saved = {k: str(v) for k, v in lam.get_function_configuration(FunctionName=function)["Environment"]["Variables"].items()}
    # Given the needs-attention handler cannot reach its ledger,
    lam.update_function_configuration(FunctionName=function, Environment={"Variables": {**saved, "LEDGER_TABLE": "no-such-ledger"}})
    try:
        # when a forged alarm stops for attention,
        detail = forged(p, pod="no-such-pod", node=p.node(5)["node_name"], ring_clean=24000)
        p.publish(detail)
        incident = p.incident_for(detail["alarm_id"])
        execution = p.execution_end(p.execution_of(incident.incident_id))
    finally:
        lam.update_function_configuration(FunctionName=function, Environment={"Variables": saved})

    # the execution still ends, and the reviewers are told by the state machine itself.
    assert execution["status"] == "FAILED"
    history = p.standin.client("stepfunctions").get_execution_history(executionArn=execution["executionArn"])["events"]
    entered = [e["stateEnteredEventDetails"]["name"] for e in history if "stateEnteredEventDetails" in e]
    assert entered[-2:] == ["NotifyAttentionDirectly", "StoppedForAttention"]
    assert p.ledger.get(incident.incident_id).state == S.RECORDED  # the handler could not record it
    bodies = wait_for(
        lambda: [json.loads(m["Body"]) for m in sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10).get("Messages", [])] or None,
        timeout=30,
        what="the direct notification",
    )
    (message,) = [b for b in bodies if incident.incident_id in b["Message"]]
    assert "could not record or announce it" in message["Message"]
    assert message["Subject"] == "sdcguard: incident stopped for attention (not recorded)"


def test_a_refused_alarm_whose_fail_handler_fails_still_ends_with_a_notification(pipeline: Pipeline) -> None:
    p = pipeline
    sqs, sns, lam, sfn = (p.standin.client(s) for s in ("sqs", "sns", "lambda", "stepfunctions"))
    queue = sqs.create_queue(QueueName=f"inbox-{uuid.uuid4().hex[:6]}")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sns.subscribe(TopicArn=p.outputs["TopicArn"], Protocol="sqs", Endpoint=queue_arn)
    function = f"{p.stack}-fail"  # the template's FunctionName
    saved = {k: str(v) for k, v in lam.get_function_configuration(FunctionName=function)["Environment"]["Variables"].items()}
    gone = p.outputs["TopicArn"].rsplit(":", 1)[0] + ":no-such-topic"
    known = {e["executionArn"] for e in p.executions()}
    # Given the fail handler cannot announce anything (its topic does not exist),
    lam.update_function_configuration(FunctionName=function, Environment={"Variables": {**saved, "TOPIC_ARN": gone}})
    try:
        # when an alarm for another cluster is refused before any incident is opened,
        detail = p.alarm(0, ring_clean=26000)
        detail["job"]["hyperpod_cluster"] = "someone-elses-cluster"
        p.publish(detail)
        arn = wait_for(
            lambda: next(
                (e["executionArn"] for e in p.executions() if e["executionArn"] not in known
                 and detail["alarm_id"] in sfn.describe_execution(executionArn=e["executionArn"])["input"]),
                None,
            ),
            timeout=60,
            what="the refused alarm's execution",
        )  # fmt: skip
        execution = p.execution_end(arn)
    finally:
        lam.update_function_configuration(FunctionName=function, Environment={"Variables": saved})

    # the execution still ends, having told the reviewers itself, on the stack's topic.
    assert execution["status"] == "FAILED"
    history = sfn.get_execution_history(executionArn=arn)["events"]
    entered = [e["stateEnteredEventDetails"]["name"] for e in history if "stateEnteredEventDetails" in e]
    assert entered == ["Record", "AlarmRefused", "NotifyRefusalDirectly", "Refused"]
    bodies = wait_for(
        lambda: [json.loads(m["Body"]) for m in sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10).get("Messages", [])] or None,
        timeout=30,
        what="the direct notification",
    )
    (message,) = [b for b in bodies if arn in b["Message"]]
    assert message["Subject"] == "sdcguard: alarm refused (not announced)"
    assert "refused (NotInCluster)" in message["Message"]
    assert "someone-elses-cluster" not in message["Message"]  # the alarm's own strings stay in the execution
    assert all(i.alarm.alarm_id != detail["alarm_id"] for i in p.ledger.list())  # nothing was opened


def execution_of_alarm(p: Pipeline, alarm_id: str, known: set[str]) -> str:
    """The incident machine's execution, not among ``known``, that the alarm ``alarm_id`` started."""
    sfn = p.standin.client("stepfunctions")
    return str(wait_for(
        lambda: next(
            (e["executionArn"] for e in p.executions() if e["executionArn"] not in known
             and alarm_id in sfn.describe_execution(executionArn=e["executionArn"])["input"]),
            None,
        ),
        timeout=60,
        what=f"the execution of alarm {alarm_id}",
    ))  # fmt: skip


def entered_states(p: Pipeline, arn: str) -> list[str]:
    history = p.standin.client("stepfunctions").get_execution_history(executionArn=arn)["events"]
    return [e["stateEnteredEventDetails"]["name"] for e in history if "stateEnteredEventDetails" in e]


def test_a_record_that_wrote_then_failed_ends_as_record_failed_and_the_next_delivery_contains(
    pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moto.dynamodb.exceptions import MockValidationException
    from moto.dynamodb.models import DynamoDBBackend

    p = pipeline
    p.job_running()
    detail = p.alarm(0, ring_clean=35_000)
    refused = p.alarm(0, ring_clean=36_000)
    refused["job"]["hyperpod_cluster"] = "someone-elses-cluster"
    known = {e["executionArn"] for e in p.executions()}
    # Given the ledger applies the record's write of this alarm and then answers it with an error
    # (a client error, which neither botocore nor the Record state retries),
    table, write = p.outputs["LedgerTableName"], DynamoDBBackend.put_item
    failed_after_writing: list[str] = []

    def write_then_fail(self: Any, table_name: str, item_attrs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        written = write(self, table_name, item_attrs, *args, **kwargs)
        if table_name == table and not failed_after_writing and detail["alarm_id"] in item_attrs.get("body", {}).get("S", ""):
            failed_after_writing.append(item_attrs["incident_id"]["S"])
            raise MockValidationException("the stand-in failed this request after applying it")
        return written

    monkeypatch.setattr(DynamoDBBackend, "put_item", write_then_fail)
    # when the alarm arrives (and, beside it, one that opens nothing: another cluster's),
    p.publish(detail, refused)
    arn, refused_arn = (execution_of_alarm(p, d["alarm_id"], known) for d in (detail, refused))
    execution, refusal = p.execution_end(arn), p.execution_end(refused_arn)
    monkeypatch.undo()

    # the execution ends as RecordFailed, not as "nothing was opened", with the incident it opened FAILED,
    assert (execution["status"], execution.get("error")) == ("FAILED", "RecordFailed")
    assert entered_states(p, arn) == ["Record", "AlarmRefused", "WasAnythingOpened", "RecordFailed"]
    (opened,) = failed_after_writing
    failed = p.ledger.get(opened)
    assert (failed.state, failed.opened_by, failed.failure and failed.failure.state) == (S.FAILED, arn, "Record")
    # while the alarm that opened nothing still ends as refused;
    assert (refusal["status"], refusal.get("error")) == ("FAILED", "AlarmRefused")
    assert entered_states(p, refused_arn) == ["Record", "AlarmRefused", "WasAnythingOpened", "Refused"]
    # and the same alarm delivered again is not swallowed by the failed incident: it opens a linked one,
    # which contains the node.
    p.publish(detail)
    repeat = wait_for(
        lambda: next((i for i in p.ledger.list() if i.alarm.alarm_id == detail["alarm_id"] and i.incident_id != opened), None),
        timeout=60,
        what="the incident of the re-delivered alarm",
    )
    waiting = p.wait_state(repeat.incident_id, S.AWAITING_APPROVAL)
    assert waiting.repeat_of is not None
    assert (waiting.repeat_of.incident_id, waiting.repeat_of.state) == (opened, S.FAILED)
    assert [t.value for t in our_taints(p.read_node(p.node(0)["node_name"]))] == [repeat.incident_id]
    p.release(repeat.incident_id)


def test_invoking_the_replace_function_directly_with_an_approval_replaces_nothing(pipeline: Pipeline) -> None:
    # Given an incident awaiting approval,
    p, node = pipeline, pipeline.node(6)
    p.job_running()
    alarm = p.alarm(6, ring_clean=15_000)
    p.publish(alarm)
    incident = p.incident_for(alarm["alarm_id"])
    p.wait_state(incident.incident_id, S.AWAITING_APPROVAL)
    execution = p.execution_of(incident.incident_id)
    before = hyperpod_nodes(p)

    # when someone invokes the deployed replace and release functions with a decision of their own,
    forged = {"decision": "approve", "reviewer": "mallory", "reason": "trust me"}
    answers = [
        p.standin.client("lambda").invoke(
            FunctionName=f"{p.stack}-{name}", Payload=json.dumps({"incident_id": incident.incident_id, **extra})
        )
        for name, extra in (
            ("replace", {"instance_id": node["instance_id"], "decision": forged}),
            ("release", {"decision": {**forged, "decision": "reject"}}),
        )
    ]

    # each answers IncidentNotWaiting, nothing is replaced, and the incident keeps waiting on the reviewers.
    for answer in answers:
        assert answer.get("FunctionError"), answer
        assert json.loads(answer["Payload"].read())["errorType"] == "IncidentNotWaiting"
    assert hyperpod_nodes(p) == before
    waiting = p.ledger.get(incident.incident_id)
    assert (waiting.state, waiting.decision, waiting.replacements) == (S.AWAITING_APPROVAL, None, [])
    assert p.read_node(node["node_name"]).spec.unschedulable is True
    assert p.standin.client("stepfunctions").describe_execution(executionArn=execution)["status"] == "RUNNING"
    p.release(incident.incident_id, execution)


def test_the_same_fault_after_a_rejection_opens_a_linked_incident_that_contains_again(pipeline: Pipeline) -> None:
    # Given an alarm of one run of the job, rejected by a reviewer: node released, job resumed,
    p, node = pipeline, pipeline.node(7)
    p.job_running()
    alarm = p.alarm(7, ring_clean=16_000)
    alarm["alarm_id"] = f"{uuid.uuid4().int >> 64:016x}-{alarm['step']}-ring_audit"
    p.publish(alarm)
    rejected = p.incident_for(alarm["alarm_id"])
    p.wait_state(rejected.incident_id, S.AWAITING_APPROVAL)
    p.release(rejected.incident_id)
    assert p.ledger.get(rejected.incident_id).state == S.FALSE_ALARM
    assert not p.read_node(node["node_name"]).spec.unschedulable

    # when the same fault alarms again on the same node,
    again = {**alarm, "time": datetime.now(UTC).isoformat()}
    p.publish(again)

    # a new incident, linked to the rejected one, contains the node again and waits for the reviewers,
    repeat = wait_for(
        lambda: next((i for i in p.ledger.list() if i.repeat_of and i.repeat_of.incident_id == rejected.incident_id), None),
        timeout=60,
        what="the repeat incident",
    )
    waiting = p.wait_state(repeat.incident_id, S.AWAITING_APPROVAL)
    assert waiting.repeat_of is not None
    assert waiting.repeat_of.decided_by == "oncall@example.com"
    assert p.read_node(node["node_name"]).spec.unschedulable is True
    assert p.read_job()["spec"]["runPolicy"]["suspend"] is True
    # and the rejected incident counted nothing.
    assert p.ledger.get(rejected.incident_id).duplicate_alarms == 0
    p.release(repeat.incident_id)


# -- the node checks (issue 26): the capsule replayed on the suspect, and on every replacement -------------------

# A persistent fault of the simulated GPU (agent/testing/inject.py's spec): it fires on the tiny capsule's step.
PERSISTENT = "kind=finite_activation,node={node},step=0,repeat=50"


def put_capsule(p: Pipeline, alarm: dict[str, Any], tmp_path: Path) -> str:
    """The suspect's replay capsule where the agent writes it for ``alarm`` (tests/capsules.py's tiny model's),
    its manifest last, as the agent commits it."""
    from tests.capsules import write

    written = write(tmp_path)
    assert written.written, written.reason
    local = Path(written.location)
    rank = alarm["suspects"][0]["global_rank"]
    key = f"{p.prefix}/capsules/step-{alarm['step']:09d}-rank-{rank:05d}"
    files = sorted((f for f in local.rglob("*") if f.is_file()), key=lambda f: (f.name == "CAPSULE.json", str(f)))
    for f in files:
        p.standin.client("s3").put_object(Bucket=p.seeded["bucket"], Key=f"{key}/{f.relative_to(local).as_posix()}", Body=f.read_bytes())
    return f"s3://{p.seeded['bucket']}/{key}"


def entered(p: Pipeline, execution: str) -> list[str]:
    history = p.standin.client("stepfunctions").get_execution_history(executionArn=execution, maxResults=1000)["events"]
    return [e["stateEnteredEventDetails"]["name"] for e in history if "stateEnteredEventDetails" in e]


def check_jobs(p: Pipeline, incident_id: str) -> list[str]:
    """The node checks' Jobs of ``incident_id`` still in the cluster."""
    jobs = k8s.BatchV1Api(p.kube()).list_namespaced_job(p.seeded["namespace"], label_selector=f"sdcguard.io/incident={incident_id}")
    return [j.metadata.name for j in jobs.items]


def test_the_fault_reproduces_on_the_suspect_and_the_job_resumes_onto_a_replacement_that_qualified(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    # Given a suspect node whose GPU gets the capsule's step wrong every time, and the alarm's capsule,
    p, node = pipeline, pipeline.node(3)
    eks = p.standin.eks
    assert eks is not None
    p.job_running()
    alarm = p.alarm(3, ring_clean=31_000)
    capsule = put_capsule(p, alarm, tmp_path)
    eks.node_faults.set({node["node_name"]: PERSISTENT.format(node=node["node_name"])}, replacements_inherit=False)
    try:
        # when the agent alarms,
        p.publish(alarm)
        incident = p.incident_for(alarm["alarm_id"])
        waiting = p.wait_state(incident.incident_id, S.AWAITING_APPROVAL, S.FAILED, S.NEEDS_ATTENTION)
        assert waiting.state == S.AWAITING_APPROVAL, waiting.failure

        # the reviewers are asked with the fault reproduced on the cordoned suspect,
        (reproduced,) = [c for c in waiting.node_checks if c.purpose == "reproduce"]
        assert (reproduced.node, reproduced.state, reproduced.capsule) == (node["node_name"], "failed", capsule)
        assert reproduced.summary == f"reproduced {REPEATS}/{REPEATS}: persistent"
        assert (reproduced.matched, reproduced.reproduced) == (0, REPEATS)

        # and once approved, the new node replays the capsule right before the job resumes onto it.
        assert p.decide(incident.incident_id, "approve", "reproduced on the node")["status"] == "SUCCEEDED"
        execution = p.execution_end(p.execution_of(incident.incident_id), timeout=300)
    finally:
        eks.node_faults.clear()
    assert execution["status"] == "SUCCEEDED", execution
    closed = p.ledger.get(incident.incident_id)
    assert closed.state == S.CLOSED
    (replacement,) = closed.replacements
    new_node = f"hyperpod-{replacement.new_instance_id}"
    (qualified,) = [c for c in closed.node_checks if c.purpose == "qualify"]
    assert (qualified.node, qualified.instance_id, qualified.state) == (new_node, replacement.new_instance_id, "passed")
    assert qualified.summary == f"qualified {REPEATS}/{REPEATS} on {new_node}"
    states = entered(p, execution["executionArn"])
    assert states.index("CheckReproduce") < states.index("CollectEvidence") < states.index("RequestApproval")
    assert states.index("ReplacementDone") < states.index("CheckQualify") < states.index("RewritePointer") < states.index("ResumeJob")
    assert not p.read_job()["spec"]["runPolicy"].get("suspend")
    assert check_jobs(p, incident.incident_id) == []  # each Job deleted once its answer was recorded


def test_a_replacement_that_fails_its_qualification_is_never_resumed_onto(pipeline: Pipeline, tmp_path: Path) -> None:
    # Given a faulty suspect whose replacements inherit its fault (a bad batch of hardware),
    p, node = pipeline, pipeline.node(4)
    eks = p.standin.eks
    assert eks is not None
    p.job_running()
    alarm = p.alarm(4, ring_clean=33_000)
    put_capsule(p, alarm, tmp_path)
    pointer_before, _ = read_pointer(p.store())
    eks.node_faults.set({node["node_name"]: PERSISTENT.format(node=node["node_name"])}, replacements_inherit=True)
    try:
        # when a reviewer approves the replacement,
        p.publish(alarm)
        incident = p.incident_for(alarm["alarm_id"])
        waiting = p.wait_state(incident.incident_id, S.AWAITING_APPROVAL, S.FAILED, S.NEEDS_ATTENTION)
        assert waiting.state == S.AWAITING_APPROVAL, waiting.failure
        assert p.decide(incident.incident_id, "approve", "replace it")["status"] == "SUCCEEDED"
        execution = p.execution_end(p.execution_of(incident.incident_id), timeout=300)
    finally:
        eks.node_faults.clear()

    # each new node fails its qualification and is cordoned; after the last round allowed (2), the incident stops
    # for attention with the job still suspended and the pointer where it was.
    assert execution["status"] == "FAILED", execution
    stopped = p.ledger.get(incident.incident_id)
    assert stopped.state == S.NEEDS_ATTENTION
    assert stopped.failure is not None
    assert stopped.failure.error == "ReplacementNotQualified"
    assert stopped.failure.state == "QualifyReplacement"  # where it stopped, though the ledger still says REPLACED
    assert "cordoned" in stopped.failure.cause
    checks = [c for c in stopped.node_checks if c.purpose == "qualify"]
    assert [c.state for c in checks] == ["failed", "failed"]
    assert len({c.node for c in checks}) == 2  # the first replacement, then its replacement
    assert all(c.summary == f"not qualified on {c.node}: {REPEATS}/{REPEATS} repetitions wrong" for c in checks)
    last = p.read_node(checks[-1].node)
    assert last.spec.unschedulable is True
    assert [t.value for t in our_taints(last)] == [incident.incident_id]
    assert p.read_job()["spec"]["runPolicy"]["suspend"] is True
    pointer_after, _ = read_pointer(p.store())
    assert pointer_after == pointer_before
    states = entered(p, execution["executionArn"])
    assert states.count("RejectReplacement") == 2
    assert states.count("ReplaceUnqualified") == 1
    assert states[-3:] == ["ReplacementNotQualified", "NeedsAttention", "StoppedForAttention"]
    assert "RewritePointer" not in states
    assert "ResumeJob" not in states
    assert check_jobs(p, incident.incident_id) == []


def test_aborting_an_incident_that_waits_for_approval_ends_its_execution_at_once(pipeline: Pipeline) -> None:
    from botocore.exceptions import ClientError

    from sdcguard.lambdas.abort import abort_incident
    from sdcguard.lambdas.task_tokens import TaskTokens

    # Given an incident whose execution waits on the reviewers' task token,
    p, node = pipeline, pipeline.node(1)
    p.job_running()
    alarm = p.alarm(1, ring_clean=23_000)
    p.publish(alarm)
    incident = p.incident_for(alarm["alarm_id"])
    p.wait_state(incident.incident_id, S.AWAITING_APPROVAL)
    execution = p.execution_of(incident.incident_id)
    sfn = p.standin.client("stepfunctions")
    environment = p.standin.client("lambda").get_function_configuration(FunctionName=f"{p.stack}-decide")["Environment"]
    stored = TaskTokens(environment["Variables"]["TOKEN_TABLE"], p.standin.client("dynamodb")).get(incident.incident_id)
    assert stored is not None

    # when an operator aborts it,
    aborted = abort_incident(p.ledger, p.kube, incident.incident_id, operator="oncall", reason="wrong job", sfn=sfn)

    # its execution is ABORTED at once (StopExecution ends the token wait, as on AWS), nothing else ran after it,
    assert sfn.describe_execution(executionArn=execution)["status"] == "ABORTED"
    assert aborted.state == S.ABORTED
    assert not p.read_node(node["node_name"]).spec.unschedulable
    assert not p.read_job()["spec"]["runPolicy"].get("suspend")
    # the token is dead,
    with pytest.raises(ClientError) as refused:
        sfn.send_task_success(taskToken=stored[0], output="{}")
    assert refused.value.response["Error"]["Code"] == "TaskTimedOut"
    # and a reviewer who approves late changes nothing.
    assert p.decide(incident.incident_id, "approve", "late")["status"] == "FAILED"
    time.sleep(1)  # had the execution gone on, its next state would have written by now
    assert p.ledger.get(incident.incident_id).state == S.ABORTED
    history = sfn.get_execution_history(executionArn=execution, maxResults=1000)["events"]
    assert history[-1]["type"] == "ExecutionAborted"
    entered = [e["stateEnteredEventDetails"]["name"] for e in history if "stateEnteredEventDetails" in e]
    assert entered[-1] == "RequestApproval"  # its Catch (ApprovalTimedOut, NeedsAttention) never ran
