"""Resolution: suspect rank -> pod -> node -> EC2 instance, each link confirmed by the cluster.

An alarm is a claim, and anyone who can put an event on the bus can make one;
so nothing it names is believed. It must be about the one PyTorchJob the
deployment guards (``JOB_NAME``), and the suspect's pod is read through the
Kubernetes API: it must exist in the job's namespace, carry that job in its
job-name label, and run (``spec.nodeName``) on the node the alarm
names. That node is then traced to its instance: on HyperPod EKS clusters a
node is named ``hyperpod-i-0123456789abcdef0`` (:mod:`sdcguard.contract.naming`); a
renamed node is matched by its own name or addresses (never by a host name
the alarm supplies) against the private DNS names of the cluster's node list.
The instance must be one of the HyperPod cluster's nodes, and the node's
provider id, when it has one, must name it.

A tenant who may create pods in the job's namespace can write everything
above into a pod of its own: the job-name label, a controller
ownerReference to the PyTorchJob (its uid is readable) and ``spec.nodeName``.
So last, the pod must be the one the training operator made for the
suspect's rank (:func:`not_operators_pod`): named ``<job>-<master|worker>-<i>``
with that replica type and index, where ``i`` follows from the rank under
``ranks_per_node`` and the PyTorchJob's replica specs; ``Running``; and with
a ``status.hostIP`` among its node's ``status.addresses``, which only the
kubelet of the node that runs it writes. The admission policy shipped in
``infra/deploy/admission-policy.yaml`` keeps tenants from creating such
pods at all. Any mismatch touches nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import boto3
from kubernetes import client as k8s

from sdcguard.contract import Alarm, Incident, IncidentState, ResolvedSuspect, Suspect
from sdcguard.contract.naming import instance_id_of
from sdcguard.lambdas.errors import (
    NotInCluster,
    StaleAlarm,
    SuspectMismatch,
    SuspectNotOperatorPod,
    SuspectUnresolvable,
)
from sdcguard.lambdas.kube_errors import kubernetes_errors
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lambdas.record import check_job, check_scope
from sdcguard.lambdas.settings import Settings

JOB_NAME_LABELS = ("training.kubeflow.org/job-name", "job-name")
"""The Kubeflow training operator's job-name label on the pods it makes (and its older name)."""
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
"""The operator's labels naming which replica a pod is (``master``/``worker``, and its index among them)."""


@dataclass(frozen=True)
class Observed:
    """What the Kubernetes API says about one suspect's pod and the node it runs on."""

    pod_exists: bool
    job_name: str | None = None
    """The pod's job-name label."""
    node: str | None = None
    """The pod's ``spec.nodeName``."""
    node_exists: bool = False
    node_addresses: tuple[str, ...] = ()
    provider_id: str = ""
    owner_uid: str | None = None
    """The uid of the PyTorchJob that controls the pod (its ``ownerReferences``)."""
    created: datetime | None = None
    """The pod's ``metadata.creationTimestamp``."""
    replica_type: str | None = None
    """The pod's replica-type label (the operator's, lower case)."""
    replica_index: str | None = None
    """The pod's replica-index label."""
    phase: str | None = None
    """The pod's ``status.phase``."""
    host_ip: str | None = None
    """The pod's ``status.hostIP``: written by the kubelet of the node that runs it, never by the pod's creator."""


def observe(api: k8s.ApiClient, namespace: str, suspects: list[Suspect]) -> dict[int, Observed]:
    """Read each suspect's pod (in ``namespace``) and the node it runs on; by global rank.

    Reads only (pods get, nodes get). Raises :class:`TransientKubernetesError`.
    """
    core = k8s.CoreV1Api(api)
    out: dict[int, Observed] = {}
    for suspect in suspects:
        pod = _read(lambda s=suspect: core.read_namespaced_pod(s.pod, namespace), f"pod {namespace}/{suspect.pod}")
        if pod is None:
            out[suspect.global_rank] = Observed(pod_exists=False)
            continue
        labels = pod.metadata.labels or {}
        job = next((labels[k] for k in JOB_NAME_LABELS if k in labels), None)
        node_name = pod.spec.node_name if pod.spec else None
        node = _read(lambda n=node_name: core.read_node(n), f"node {node_name}") if node_name else None
        addresses = tuple(a.address for a in (node.status.addresses or [])) if node is not None and node.status else ()
        owner = next(
            (o.uid for o in (pod.metadata.owner_references or []) if o.kind == "PyTorchJob" and o.controller),
            None,
        )
        out[suspect.global_rank] = Observed(
            pod_exists=True,
            job_name=job,
            node=node_name,
            node_exists=node is not None,
            node_addresses=addresses,
            provider_id=(node.spec.provider_id or "") if node is not None and node.spec else "",
            owner_uid=owner,
            created=pod.metadata.creation_timestamp,
            replica_type=labels.get(REPLICA_TYPE_LABEL),
            replica_index=labels.get(REPLICA_INDEX_LABEL),
            phase=pod.status.phase if pod.status else None,
            host_ip=pod.status.host_ip if pod.status else None,
        )
    return out


def _read(call: Any, what: str) -> Any:
    with kubernetes_errors(what):
        try:
            return call()
        except k8s.exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise


def read_pytorchjob(api: k8s.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The PyTorchJob ``namespace/name`` as the API returns it, or None when there is no such job.

    Raises :class:`TransientKubernetesError`.
    """
    job: dict[str, Any] | None = _read(
        lambda: k8s.CustomObjectsApi(api).get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name),
        f"PyTorchJob {namespace}/{name}",
    )
    return job


def job_uid(api: k8s.ApiClient, namespace: str, name: str) -> str | None:
    """The PyTorchJob's ``metadata.uid`` (this incarnation of the job), or None when there is no such job.

    Raises :class:`TransientKubernetesError`.
    """
    return uid_of(read_pytorchjob(api, namespace, name))


def uid_of(job: dict[str, Any] | None) -> str | None:
    """``metadata.uid`` of a PyTorchJob as read, or None (no job, or no uid)."""
    return None if job is None else str((job.get("metadata") or {}).get("uid") or "") or None


@dataclass(frozen=True)
class OperatorPod:
    """The pod the training operator makes for one node's ranks: ``<job>-<replica type>-<index>``."""

    name: str
    replica_type: str
    """``master`` or ``worker`` (the operator's label values are lower case)."""
    index: int


def operator_pod(pytorchjob: dict[str, Any], job_name: str, node_index: int) -> OperatorPod | None:
    """The pod that runs the ranks of node ``node_index`` (rank // ranks_per_node), or None beyond the replicas.

    The operator gives the Master replicas node ranks 0.. and the Workers the
    ones after them (torchrun's ``--node-rank`` is the pod's ``RANK``), so with
    one Master node 0 is ``<job>-master-0`` and node 3 ``<job>-worker-2``;
    without a Master, node ``i`` is ``<job>-worker-<i>``.
    """
    specs = (pytorchjob.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    masters = _replicas(specs.get("Master")) if "Master" in specs else 0
    workers = _replicas(specs.get("Worker")) if "Worker" in specs else 0
    if node_index < masters:
        return OperatorPod(f"{job_name}-master-{node_index}", "master", node_index)
    if node_index < masters + workers:
        return OperatorPod(f"{job_name}-worker-{node_index - masters}", "worker", node_index - masters)
    return None


def _replicas(spec: Any) -> int:
    value = (spec or {}).get("replicas", 1) if isinstance(spec, dict) else 0
    return value if isinstance(value, int) and value >= 0 else 0


def not_operators_pod(suspect: Suspect, seen: Observed, *, alarm: Alarm, pytorchjob: dict[str, Any]) -> str | None:
    """Why ``suspect``'s pod is not the one the training operator made for its rank, or None when it is.

    Everything checked here is what a pod created by someone else cannot
    take from the operator's: the name (unique in the namespace, so the real
    pod's cannot be taken while it exists), the replica labels that go with
    it, the phase and the ``status.hostIP`` (the kubelet's). A job whose
    ``nprocPerNode`` is a number must agree with the alarm's ``ranks_per_node``:
    the rank-to-pod arithmetic depends on it.
    """
    where = f"rank {suspect.global_rank}: pod {suspect.pod}"
    per_node = str((pytorchjob.get("spec") or {}).get("nprocPerNode") or "")
    if per_node.isdigit() and int(per_node) != alarm.ranks_per_node:
        return f"{where}: the alarm's ranks_per_node {alarm.ranks_per_node} is not the PyTorchJob's nprocPerNode {per_node}"
    node_index = suspect.global_rank // alarm.ranks_per_node
    expected = operator_pod(pytorchjob, alarm.job.job_name, node_index)
    if expected is None:
        return f"{where}: node index {node_index} (rank // ranks_per_node {alarm.ranks_per_node}) is beyond the PyTorchJob's replicas"
    if suspect.pod != expected.name:
        return (
            f"{where} is not the pod the training operator made for that rank: node index {node_index} "
            f"(rank // ranks_per_node {alarm.ranks_per_node}) runs in pod {expected.name}"
        )
    labels = (seen.replica_type, seen.replica_index)
    if labels != (expected.replica_type, str(expected.index)):
        return (
            f"{where} carries replica labels type={seen.replica_type!r} index={seen.replica_index!r}, "
            f"not the operator's {expected.replica_type!r} {expected.index}"
        )
    if seen.phase != "Running":
        return f"{where} is {seen.phase or 'without a phase'}, not Running"
    if not seen.host_ip or seen.host_ip not in seen.node_addresses:
        return (
            f"{where}: its status.hostIP {seen.host_ip!r} is none of node {seen.node}'s addresses "
            f"{list(seen.node_addresses)} (the kubelet of another node runs it, or none does)"
        )
    return None


def check_fresh(alarm: Alarm, *, max_age_seconds: float, now: datetime | None = None) -> None:
    """Raises :class:`StaleAlarm` when ``alarm`` was raised more than ``max_age_seconds`` ago.

    A spooled alarm republished hours later, or a re-delivered one, may be
    about hardware that has long been replaced, or a job that long moved on:
    it is recorded and stops for attention, touching nothing.
    """
    now = now or datetime.now(UTC)
    raised = alarm.time if alarm.time.tzinfo is not None else alarm.time.replace(tzinfo=UTC)
    age = (now - raised).total_seconds()
    if age > max_age_seconds:
        raise StaleAlarm(
            f"alarm {alarm.alarm_id} was raised {age:.0f} s ago, more than MAX_ALARM_AGE_SECONDS={max_age_seconds:g}; "
            "nothing touched"
        )


RESTART_SLACK_SECONDS = 60.0
"""How much later than the alarm a pod may have been created and still be the pod that raised it (clock skew)."""


def stale(suspect: Suspect, seen: Observed, *, alarm: Alarm, uid: str | None) -> str | None:
    """Why ``suspect``'s pod is not the one of the run that raised ``alarm``, or None.

    The pod must belong to the PyTorchJob as it is now (its owner's uid is the
    job's ``uid``: not a pod of an earlier job of the same name), and must not
    have been created after the alarm (a restarted pod is a later run; what it
    runs was never checked by this alarm's detectors).
    """
    where = f"rank {suspect.global_rank}: pod {suspect.pod}"
    if uid is not None and seen.owner_uid != uid:
        return f"{where} belongs to PyTorchJob uid {seen.owner_uid!r}, not to the job's current uid {uid!r}"
    raised = alarm.time if alarm.time.tzinfo is not None else alarm.time.replace(tzinfo=UTC)
    if seen.created is not None and (seen.created - raised).total_seconds() > RESTART_SLACK_SECONDS:
        return f"{where} was created at {seen.created.isoformat()}, after the alarm ({raised.isoformat()}): a later run"
    return None


def mismatch(suspect: Suspect, seen: Observed, *, namespace: str, job_name: str) -> str | None:
    """Why the cluster contradicts what the alarm says about ``suspect``, or None when it agrees."""
    where = f"rank {suspect.global_rank}: pod {suspect.pod}"
    if not seen.pod_exists:
        return f"{where} does not exist in namespace {namespace}"
    if seen.job_name != job_name:
        label = f"job-name label {seen.job_name!r}" if seen.job_name is not None else "no job-name label"
        return f"{where} is not a pod of PyTorchJob {namespace}/{job_name} (it has {label})"
    if seen.node != suspect.node:
        return f"{where} runs on node {seen.node!r}, not on node {suspect.node!r} that the alarm names"
    if not seen.node_exists:
        return f"{where}: its node {seen.node!r} does not exist"
    if seen.owner_uid is None:
        return f"{where} is not controlled by a PyTorchJob (no ownerReferences to one)"
    return None


@dataclass(frozen=True)
class ClusterNode:
    """One node of the HyperPod cluster as ``ListClusterNodes`` reports it."""

    instance_id: str
    instance_group: str
    status: str
    private_dns: str = ""
    launch_time: float = 0.0


def instance_id_from_node_name(node: str) -> str | None:
    """The instance id in a HyperPod node name (``hyperpod-i-...``), or None."""
    return instance_id_of(node)


def list_cluster_nodes(cluster: str, client: Any = None) -> dict[str, ClusterNode]:
    """Every node of the HyperPod cluster by instance id (all pages).

    Raises botocore's ``ClientError`` (e.g. ``ResourceNotFound`` for an unknown cluster).
    """
    client = client or boto3.client("sagemaker")
    nodes: dict[str, ClusterNode] = {}
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"ClusterName": cluster, "MaxResults": 100}
        if token:
            kwargs["NextToken"] = token
        page = client.list_cluster_nodes(**kwargs)
        for summary in page.get("ClusterNodeSummaries", []):
            launch = summary.get("LaunchTime")
            nodes[summary["InstanceId"]] = ClusterNode(
                instance_id=summary["InstanceId"],
                instance_group=summary.get("InstanceGroupName", ""),
                status=summary.get("InstanceStatus", {}).get("Status", ""),
                private_dns=summary.get("PrivateDnsHostname", ""),
                launch_time=launch.timestamp() if launch is not None else 0.0,
            )
        token = page.get("NextToken")
        if not token:
            return nodes


def resolve_suspects(
    alarm: Alarm, nodes: dict[str, ClusterNode], *, node_addresses: Mapping[str, tuple[str, ...]] | None = None
) -> list[ResolvedSuspect]:
    """Each suspect's node traced to an instance of the cluster whose node list is ``nodes``.

    A node not named ``hyperpod-<instance id>`` is matched by its name, or by
    one of its own ``node_addresses`` (as the Kubernetes API reports them),
    against the cluster's private DNS names; the alarm's ``host`` is never
    used. Raises :class:`SuspectUnresolvable` when the alarm names no suspect
    (not localised) or a suspect's node cannot be traced to an instance, and
    :class:`NotInCluster` when the instance is not one of the cluster's nodes.
    """
    if not alarm.suspects:
        raise SuspectUnresolvable(
            f"alarm {alarm.alarm_id} is not localised (detector {alarm.detector.value}): no node to act on"
        )
    by_dns = {n.private_dns: n for n in nodes.values() if n.private_dns}
    resolved: list[ResolvedSuspect] = []
    for suspect in sorted(alarm.suspects, key=lambda s: s.global_rank):
        instance_id = instance_id_from_node_name(suspect.node)
        if instance_id is None:
            names = (suspect.node, *(node_addresses or {}).get(suspect.node, ()))
            match = next((by_dns[n] for n in names if n in by_dns), None)
            if match is None:
                raise SuspectUnresolvable(
                    f"rank {suspect.global_rank}: node {suspect.node!r} is neither a HyperPod node name "
                    f"nor the host name of a node of cluster {alarm.job.hyperpod_cluster}"
                )
            instance_id = match.instance_id
        node = nodes.get(instance_id)
        if node is None:
            raise NotInCluster(
                f"rank {suspect.global_rank}: instance {instance_id} (node {suspect.node}) is not a node "
                f"of HyperPod cluster {alarm.job.hyperpod_cluster}"
            )
        resolved.append(
            ResolvedSuspect(
                global_rank=suspect.global_rank,
                pod=suspect.pod,
                node=suspect.node,
                instance_id=instance_id,
                instance_group=node.instance_group,
            )
        )
    return resolved


def resolve_incident(
    ledger: Ledger,
    incident_id: str,
    settings: Settings,
    *,
    kubernetes: k8s.ApiClient,
    sagemaker: Any = None,
    actor: str = "resolve",
) -> Incident:
    """Resolve the incident's suspects, each confirmed by the cluster, and record them (RECORDED -> RESOLVED).

    Idempotent: an incident already resolved is returned unchanged. Records
    nothing and raises :class:`NotInCluster` (an alarm outside what the
    settings guard, an alarm for another job than ``JOB_NAME``, or an instance that is not the cluster's),
    :class:`SuspectMismatch` (the pod is missing, not of the job, or on
    another node; the node's provider id names another instance) and
    :class:`SuspectUnresolvable` (not localised, or a node that is no HyperPod node),
    :class:`SuspectNotOperatorPod` (not the pod the training operator made for the rank: :func:`not_operators_pod`) and
    :class:`StaleAlarm` (older than ``MAX_ALARM_AGE_SECONDS``, the job gone, or a pod of another run:
    :func:`check_fresh`, :func:`stale`).
    """
    incident = ledger.get(incident_id)
    if incident.entered(IncidentState.RESOLVED):
        return incident
    alarm = incident.alarm
    check_scope(alarm, settings)
    check_job(alarm, settings)
    check_fresh(alarm, max_age_seconds=settings.max_alarm_age_seconds)
    if not alarm.suspects:
        resolve_suspects(alarm, {})  # raises: not localised
    job = alarm.job
    observed = observe(kubernetes, job.namespace, list(alarm.suspects))
    ordered = sorted(alarm.suspects, key=lambda s: s.global_rank)
    reasons = [
        reason
        for suspect in ordered
        if (reason := mismatch(suspect, observed[suspect.global_rank], namespace=job.namespace, job_name=settings.job_name))
    ]
    if reasons:
        raise SuspectMismatch(f"alarm {alarm.alarm_id} does not match the cluster; nothing touched: " + "; ".join(reasons))
    pytorchjob = read_pytorchjob(kubernetes, job.namespace, job.job_name)
    uid = uid_of(pytorchjob)
    if pytorchjob is None or uid is None:
        raise StaleAlarm(f"alarm {alarm.alarm_id}: PyTorchJob {job.namespace}/{job.job_name} no longer exists; nothing touched")
    earlier_run = [r for s in ordered if (r := stale(s, observed[s.global_rank], alarm=alarm, uid=uid))]
    if earlier_run:
        raise StaleAlarm(
            f"alarm {alarm.alarm_id} is from a run of the job that is not the current one; nothing touched: "
            + "; ".join(earlier_run)
        )
    nodes = list_cluster_nodes(job.hyperpod_cluster, sagemaker)
    addresses = {s.node: observed[s.global_rank].node_addresses for s in alarm.suspects}
    # The node to act on is the one Kubernetes says the pod runs on (checked equal to the alarm's above).
    suspects = [
        s.model_copy(update={"node": observed[s.global_rank].node})
        for s in resolve_suspects(alarm, nodes, node_addresses=addresses)
    ]
    for s in suspects:
        provider = observed[s.global_rank].provider_id
        if provider and s.instance_id not in provider:
            raise SuspectMismatch(
                f"rank {s.global_rank}: node {s.node} is instance {provider!r} to Kubernetes, "
                f"not {s.instance_id}; nothing touched"
            )
    # Last, so that what a cluster contradicts is named as before; it is what a tenant's own pod cannot fake.
    forged = [r for s in ordered if (r := not_operators_pod(s, observed[s.global_rank], alarm=alarm, pytorchjob=pytorchjob))]
    if forged:
        raise SuspectNotOperatorPod(
            f"alarm {alarm.alarm_id} names a pod the training operator did not make for its rank; nothing touched: "
            + "; ".join(forged)
        )
    note = ", ".join(f"rank {s.global_rank} -> pod {s.pod} on {s.node} -> {s.instance_id}" for s in suspects)
    # Indexed before they are recorded: an incident that names an instance is always in its history.
    ledger.index_suspects(incident_id, [s.instance_id for s in suspects])
    return ledger.update(
        incident_id,
        lambda current: current
        if current.entered(IncidentState.RESOLVED)
        else current.advance(IncidentState.RESOLVED, actor=actor, note=note[:1024], suspects=suspects, job_uid=uid),
    )
