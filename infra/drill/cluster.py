"""The drill's own reads of the cluster (never under chaos), and its checks of what an incident left there."""

from __future__ import annotations

from typing import Any

from kubernetes import client as k8s

from sdcguard.contract import Incident, IncidentState
from sdcguard.contract.naming import NODE_PREFIX, instance_id_of
from sdcguard.contract.naming import node_name as hyperpod_node_name
from sdcguard.infra.drill.failure import DrillFailed
from sdcguard.infra.drill.job_run import Placement
from sdcguard.infra.drill.stage import Stage


def placements(stage: Stage) -> list[Placement]:
    """The job's pods and the nodes they run on now, in worker order (from the Kubernetes API)."""
    job = stage.seeded["job"]
    with stage.chaos.paused():
        api = stage.kube()
        try:
            pods = k8s.CoreV1Api(api).list_namespaced_pod(
                stage.seeded["namespace"], label_selector=f"training.kubeflow.org/job-name={job}").items
        finally:
            api.close()
    ordered = sorted(pods, key=lambda p: int(p.metadata.labels["training.kubeflow.org/replica-index"]))
    return [Placement(node_name=p.spec.node_name, pod=p.metadata.name) for p in ordered]


def instance_of(node_name: str) -> str:
    """The EC2 instance id in a HyperPod node name."""
    return instance_id_of(node_name) or node_name.removeprefix(NODE_PREFIX)


def node(stage: Stage, name: str) -> Any:
    """The Kubernetes node ``name`` as the API serves it now (raises the client's ApiException when absent)."""
    with stage.chaos.paused():
        api = stage.kube()
        try:
            return k8s.CoreV1Api(api).read_node(name)
        finally:
            api.close()


def job_suspended(stage: Stage) -> bool:
    """Whether the seeded PyTorchJob is suspended (``spec.runPolicy.suspend``)."""
    with stage.chaos.paused():
        api = stage.kube()
        try:
            job = k8s.CustomObjectsApi(api).get_namespaced_custom_object(
                "kubeflow.org", "v1", stage.seeded["namespace"], "pytorchjobs", stage.seeded["job"])
        finally:
            api.close()
    return bool(job.get("spec", {}).get("runPolicy", {}).get("suspend"))


def hyperpod_nodes(stage: Stage) -> dict[str, str]:
    """The HyperPod cluster's instances and their status, by instance id."""
    sm = stage.client("sagemaker")
    with stage.chaos.paused():
        pages = sm.get_paginator("list_cluster_nodes").paginate(ClusterName=stage.seeded["hyperpod_cluster"])
        return {n["InstanceId"]: n["InstanceStatus"]["Status"] for p in pages for n in p["ClusterNodeSummaries"]}


def replacement_chain(incident: Incident, old: str) -> list[str]:
    """``old`` and the instances that replaced it in turn (a new node that failed its qualification was
    replaced again), oldest first."""
    pairs = {r.old_instance_id: r.new_instance_id for r in incident.replacements}
    chain = [old]
    while (new := pairs.get(chain[-1])) is not None and new not in chain:
        chain.append(new)
    return chain


def check_replaced(stage: Stage, incident: Incident, fault_node: str, after: list[Placement],
                   old_instances: list[str], unqualified: list[str] | None = None) -> None:
    """After an approval: the faulty instance replaced (again, for each replacement that failed its
    qualification: ``unqualified`` node names) by one Running node the job now runs on.

    Raises :class:`DrillFailed` ("pipeline") listing every check that does not hold.
    """
    old = instance_of(fault_node)
    chain = replacement_chain(incident, old)
    new = chain[-1] if len(chain) > 1 else None
    rejected = {instance_of(n) for n in unqualified or []}
    hyperpod = hyperpod_nodes(stage)
    problems = []
    if new is None:
        problems.append(f"no replacement recorded for {old}")
    elif hyperpod.get(new) != "Running":
        problems.append(f"replacement {new} is {hyperpod.get(new)} in HyperPod")
    if len(incident.replacements) != len(chain) - 1:
        problems.append(f"{len(incident.replacements)} replacements recorded, not the {len(chain) - 1} of "
                        f"{' -> '.join(chain)}")
    if set(chain[1:-1]) != rejected:
        problems.append(f"replaced again: {chain[1:-1]}, failed qualification: {sorted(rejected)}")
    arrived = sorted({instance_of(p.node_name) for p in after} - set(old_instances))
    if len(arrived) != 1:
        problems.append(f"the job runs on {len(arrived)} new instances ({', '.join(arrived) or 'none'}), not one")
    for gone in chain[:-1]:
        if gone in hyperpod:
            problems.append(f"{gone} is still a HyperPod node")
        if any(instance_of(p.node_name) == gone for p in after):
            problems.append(f"a pod still runs on {hyperpod_node_name(gone)}")
    if new is not None and node(stage, hyperpod_node_name(new)).spec.unschedulable:
        problems.append(f"the new node {hyperpod_node_name(new)} is unschedulable")
    if problems:
        raise DrillFailed("pipeline", "; ".join(problems))


def check_held(stage: Stage, incident: Incident, unqualified: list[str]) -> tuple[list[str], list[str]]:
    """After an approval that ended NEEDS_ATTENTION: no replacement qualified, so the job was never resumed and
    stays suspended, and every new node that failed its qualification is cordoned, or gone from the cluster
    because the incident replaced it once more. Returns (cordoned, replaced again).

    Raises :class:`DrillFailed` ("pipeline") listing every check that does not hold.
    """
    problems = []
    if not unqualified:
        problems.append("the incident stopped for attention with no failed qualification recorded")
    if incident.entered(IncidentState.RESUMED) is not None:
        problems.append("the incident resumed the job before it stopped")
    if not job_suspended(stage):
        problems.append("the job is not suspended")
    replaced_away = {r.old_instance_id for r in incident.replacements}
    cordoned, gone = [], []
    for name in unqualified:
        try:
            held = bool(node(stage, name).spec.unschedulable)
        except k8s.ApiException as exc:
            if exc.status == 404 and instance_of(name) in replaced_away:
                gone.append(name)  # replaced once more: the node left the cluster
            else:
                problems.append(f"{name} cannot be read ({exc.status})")
            continue
        if held:
            cordoned.append(name)
        else:
            problems.append(f"{name} failed its qualification but is schedulable")
    if problems:
        raise DrillFailed("pipeline", "; ".join(problems))
    return cordoned, gone


def check_released(stage: Stage, incident: Incident, fault_node: str, pointer_before: Any,
                   pointer_after: Any) -> None:
    """After a rejection: the node released, nothing replaced, the pointer where it was.

    Raises :class:`DrillFailed` ("pipeline") listing every check that does not hold.
    """
    released = node(stage, fault_node)
    problems = []
    if released.spec.unschedulable:
        problems.append(f"{fault_node} is still cordoned")
    if incident.replacements:
        problems.append("a node was replaced on the reject path")
    if pointer_before != pointer_after:
        problems.append("the resume pointer moved on the reject path")
    if problems:
        raise DrillFailed("pipeline", "; ".join(problems))
