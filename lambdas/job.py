"""Suspend and resume the PyTorchJob (``spec.runPolicy.suspend``).

A job we suspend carries an annotation naming the incident; resuming only
un-suspends a job that this incident suspended, so a job someone else paused
stays paused.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes import client as k8s

from contract import IncidentState
from lambdas.errors import IncidentNotWaiting
from lambdas.kube_errors import kubernetes_errors
from lambdas.ledger import Ledger

S = IncidentState

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
ANNOTATION_SUSPENDED_BY = "sdcguard.io/suspended-by"


@dataclass(frozen=True)
class JobChange:
    """What a suspend or resume did."""

    job: str
    changed: bool
    suspended: bool
    """The job's ``spec.runPolicy.suspend`` afterwards."""


def _read(api: k8s.CustomObjectsApi, namespace: str, name: str) -> dict:
    return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def _suspended(job: dict) -> bool:
    return bool(job.get("spec", {}).get("runPolicy", {}).get("suspend"))


def suspend_job(api: k8s.ApiClient, namespace: str, name: str, incident_id: str) -> JobChange:
    """Suspend the PyTorchJob ``namespace/name`` for ``incident_id``.

    Idempotent: an already suspended job is not patched again (and, if someone
    else suspended it, not claimed). Raises :class:`KubernetesObjectMissing`
    and :class:`TransientKubernetesError`.
    """
    custom = k8s.CustomObjectsApi(api)
    with kubernetes_errors(f"pytorchjob {namespace}/{name}"):
        job = _read(custom, namespace, name)
        if _suspended(job):
            return JobChange(name, changed=False, suspended=True)
        body = {
            "metadata": {"annotations": {ANNOTATION_SUSPENDED_BY: incident_id}},
            "spec": {"runPolicy": {"suspend": True}},
        }
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body)
    return JobChange(name, changed=True, suspended=True)


def resume_job(api: k8s.ApiClient, namespace: str, name: str, incident_id: str) -> JobChange:
    """Un-suspend the PyTorchJob if ``incident_id`` suspended it.

    Idempotent: a running job is left alone; a job suspended by someone else
    stays suspended. Raises :class:`KubernetesObjectMissing` and
    :class:`TransientKubernetesError`.
    """
    custom = k8s.CustomObjectsApi(api)
    with kubernetes_errors(f"pytorchjob {namespace}/{name}"):
        job = _read(custom, namespace, name)
        owner = (job.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SUSPENDED_BY)
        if not _suspended(job) or owner != incident_id:
            return JobChange(name, changed=False, suspended=_suspended(job))
        body = {
            "metadata": {"annotations": {ANNOTATION_SUSPENDED_BY: None}},
            "spec": {"runPolicy": {"suspend": False}},
        }
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body)
    return JobChange(name, changed=True, suspended=False)


def suspend_for_incident(ledger: Ledger, api: k8s.ApiClient, incident_id: str, *, actor: str = "suspend_job") -> JobChange:
    """Suspend the incident's job and record it (GUARDED -> SUSPENDED). Idempotent.

    Raises :class:`IncidentNotWaiting` when the incident was not guarded.
    """
    incident = ledger.get(incident_id)
    if incident.state not in (S.GUARDED, S.SUSPENDED):
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; the job is suspended after the guard")
    job = incident.alarm.job
    change = suspend_job(api, job.namespace, job.job_name, incident_id)
    note = f"suspended {job.namespace}/{job.job_name}" + ("" if change.changed else " (already suspended)")
    ledger.update(
        incident_id,
        lambda current: current if current.state != S.GUARDED else current.advance(S.SUSPENDED, actor=actor, note=note),
    )
    return change


def resume_for_incident(ledger: Ledger, api: k8s.ApiClient, incident_id: str, *, actor: str = "resume_job") -> JobChange:
    """Resume the incident's job and record it (POINTER_REWRITTEN -> RESUMED). Idempotent.

    Raises :class:`IncidentNotWaiting` when the pointer has not been rewritten.
    """
    incident = ledger.get(incident_id)
    if incident.state not in (S.POINTER_REWRITTEN, S.RESUMED):
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; the job resumes after the pointer rewrite")
    job = incident.alarm.job
    change = resume_job(api, job.namespace, job.job_name, incident_id)
    note = f"resumed {job.namespace}/{job.job_name} from {incident.checkpoint_after}"
    ledger.update(
        incident_id,
        lambda current: current if current.state != S.POINTER_REWRITTEN else current.advance(S.RESUMED, actor=actor, note=note),
    )
    return change
