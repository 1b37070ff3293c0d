"""Resolution: suspect rank -> pod -> node -> EC2 instance, confirmed against HyperPod.

On HyperPod EKS clusters a node is named ``hyperpod-i-0123456789abcdef0``; the
instance id is in the name. When it is not (a renamed node), the node is
matched against the cluster's own node list by private DNS host name. Either
way the instance must be one of the HyperPod cluster's nodes, or nothing is
touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import boto3

from contract import Alarm, Incident, IncidentState, ResolvedSuspect
from contract.naming import instance_id_of
from lambdas.errors import NotInCluster, SuspectUnresolvable
from lambdas.ledger import Ledger


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


def resolve_suspects(alarm: Alarm, nodes: dict[str, ClusterNode]) -> list[ResolvedSuspect]:
    """Each suspect traced to an instance of the cluster whose node list is ``nodes``.

    Raises :class:`SuspectUnresolvable` when the alarm names no suspect (not
    localised) or a suspect's node cannot be traced to an instance, and
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
            match = by_dns.get(suspect.node) or by_dns.get(suspect.host)
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


def resolve_incident(ledger: Ledger, incident_id: str, *, sagemaker: Any = None, actor: str = "resolve") -> Incident:
    """Resolve the incident's suspects and record them (RECORDED -> RESOLVED).

    Idempotent: an incident already resolved is returned unchanged. Raises
    :class:`SuspectUnresolvable` and :class:`NotInCluster` and records nothing.
    """
    incident = ledger.get(incident_id)
    if incident.entered(IncidentState.RESOLVED):
        return incident
    nodes = list_cluster_nodes(incident.alarm.job.hyperpod_cluster, sagemaker)
    suspects = resolve_suspects(incident.alarm, nodes)
    note = ", ".join(f"rank {s.global_rank} -> {s.instance_id}" for s in suspects)
    return ledger.update(
        incident_id,
        lambda current: current
        if current.entered(IncidentState.RESOLVED)
        else current.advance(IncidentState.RESOLVED, actor=actor, note=note, suspects=suspects),
    )
