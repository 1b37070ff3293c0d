"""Record: open the incident for an alarm, or count a duplicate into the one already open."""

from __future__ import annotations

from dataclasses import dataclass

from contract import Alarm, Incident
from lambdas.errors import NotInCluster
from lambdas.ledger import Ledger
from lambdas.settings import Settings


@dataclass(frozen=True)
class Recorded:
    """The outcome of recording an alarm."""

    incident: Incident
    duplicate: bool


def record_alarm(ledger: Ledger, alarm: Alarm, settings: Settings, *, actor: str = "record") -> Recorded:
    """Open (or deduplicate into) the incident of ``alarm``.

    Raises :class:`NotInCluster`, writing nothing, for an alarm about another
    HyperPod or EKS cluster (or another namespace, when one is configured).
    """
    job = alarm.job
    if job.hyperpod_cluster != settings.hyperpod_cluster or job.eks_cluster != settings.eks_cluster:
        raise NotInCluster(
            f"alarm {alarm.alarm_id} is for HyperPod {job.hyperpod_cluster} / EKS {job.eks_cluster}; "
            f"this pipeline guards HyperPod {settings.hyperpod_cluster} / EKS {settings.eks_cluster}"
        )
    if settings.job_namespace and job.namespace != settings.job_namespace:
        raise NotInCluster(
            f"alarm {alarm.alarm_id} is for namespace {job.namespace}; this pipeline guards {settings.job_namespace}"
        )
    incident, created = ledger.open(alarm, mode=settings.mode, actor=actor)
    return Recorded(incident=incident, duplicate=not created)
