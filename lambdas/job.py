"""Suspend and resume the PyTorchJob (``spec.runPolicy.suspend``).

A job we suspend carries an annotation naming the incidents that hold it
suspended (comma-separated, in the order they came); a second incident on a
job already suspended by a first adds itself. Resuming removes the incident
from that list and un-suspends the job only when no other incident named
there is still open; a job someone else paused (no annotation) stays paused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kubernetes import client as k8s

from sdcguard.contract import IncidentState
from sdcguard.lambdas.blast_radius import STOPPED_HOLDING
from sdcguard.lambdas.errors import IncidentNotFound, IncidentNotWaiting
from sdcguard.lambdas.kube_errors import kubernetes_errors
from sdcguard.lambdas.ledger import Ledger

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
    held_by: tuple[str, ...] = ()
    """The incidents holding the job suspended afterwards."""


def _read(api: k8s.CustomObjectsApi, namespace: str, name: str) -> dict:
    return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def _suspended(job: dict) -> bool:
    return bool(job.get("spec", {}).get("runPolicy", {}).get("suspend"))


def holders(job: dict) -> list[str]:
    """The incidents the job's annotation names as holding it suspended."""
    value = (job.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SUSPENDED_BY) or ""
    return [h for h in (part.strip() for part in value.split(",")) if h]


def _metadata(job: dict, held: list[str] | None) -> dict:
    # The resource version makes the patch conditional: a concurrent change to
    # the list is a 409, retried, never a lost holder.
    version = job.get("metadata", {}).get("resourceVersion")
    meta: dict = {"annotations": {ANNOTATION_SUSPENDED_BY: ",".join(held) if held else None}}
    if version:
        meta["resourceVersion"] = version
    return meta


def suspend_job(api: k8s.ApiClient, namespace: str, name: str, incident_id: str) -> JobChange:
    """Suspend the PyTorchJob ``namespace/name`` for ``incident_id``, or join the incidents holding it.

    Idempotent. A job suspended by someone else (no sdcguard annotation) is
    not claimed. Raises :class:`KubernetesObjectMissing` and
    :class:`TransientKubernetesError`.
    """
    custom = k8s.CustomObjectsApi(api)
    with kubernetes_errors(f"pytorchjob {namespace}/{name}"):
        job = _read(custom, namespace, name)
        held = holders(job)
        if _suspended(job) and (not held or incident_id in held):
            return JobChange(name, changed=False, suspended=True, held_by=tuple(held))
        if _suspended(job):
            held = [*held, incident_id]
            body: dict = {"metadata": _metadata(job, held)}
        else:
            held = [incident_id]  # a running job: whatever the annotation said is stale
            body = {"metadata": _metadata(job, held), "spec": {"runPolicy": {"suspend": True}}}
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body)
    return JobChange(name, changed=True, suspended=True, held_by=tuple(held))


def resume_job(
    api: k8s.ApiClient,
    namespace: str,
    name: str,
    incident_id: str,
    *,
    still_open: Callable[[str], bool] = lambda _: True,
) -> JobChange:
    """Release ``incident_id``'s hold on the PyTorchJob; un-suspend it when no other holder is ``still_open``.

    Idempotent: a running job, or one this incident does not hold, is left
    alone (a job suspended by someone else stays suspended). Raises
    :class:`KubernetesObjectMissing` and :class:`TransientKubernetesError`.
    """
    custom = k8s.CustomObjectsApi(api)
    with kubernetes_errors(f"pytorchjob {namespace}/{name}"):
        job = _read(custom, namespace, name)
        held = holders(job)
        if not _suspended(job) or incident_id not in held:
            return JobChange(name, changed=False, suspended=_suspended(job), held_by=tuple(held))
        others = [h for h in held if h != incident_id and still_open(h)]
        if others:
            custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"metadata": _metadata(job, others)})
            return JobChange(name, changed=False, suspended=True, held_by=tuple(others))
        body = {"metadata": _metadata(job, None), "spec": {"runPolicy": {"suspend": False}}}
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body)
    return JobChange(name, changed=True, suspended=False)


def leave_suspended(api: k8s.ApiClient, namespace: str, name: str, incident_id: str) -> JobChange:
    """Drop ``incident_id`` from the job's holders and leave it suspended, whoever else holds it.

    With no holder left the annotation goes and the job stays suspended as one someone else paused (nothing of
    the pipeline resumes it: a person does). Idempotent. Raises :class:`KubernetesObjectMissing` and
    :class:`TransientKubernetesError`.
    """
    custom = k8s.CustomObjectsApi(api)
    with kubernetes_errors(f"pytorchjob {namespace}/{name}"):
        job = _read(custom, namespace, name)
        held = holders(job)
        if incident_id not in held:
            return JobChange(name, changed=False, suspended=_suspended(job), held_by=tuple(held))
        others = [h for h in held if h != incident_id]
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                              {"metadata": _metadata(job, others or None)})
    return JobChange(name, changed=False, suspended=_suspended(job), held_by=tuple(others))


def holds_job(ledger: Ledger, incident_id: str) -> bool:
    """Whether ``incident_id`` still holds its job suspended: open, or stopped for a human (the safe stops
    keep the job suspended until someone acts). An incident the ledger does not know holds nothing."""
    try:
        incident = ledger.get(incident_id)
    except IncidentNotFound:
        return False
    return not incident.state.terminal or incident.state in STOPPED_HOLDING


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
    change = resume_job(api, job.namespace, job.job_name, incident_id, still_open=lambda other: holds_job(ledger, other))
    note = f"resumed {job.namespace}/{job.job_name} from {incident.checkpoint_after}"
    if change.held_by:
        note = f"{job.namespace}/{job.job_name} stays suspended for incident(s) {', '.join(change.held_by)}; pointer at {incident.checkpoint_after}"
    ledger.update(
        incident_id,
        lambda current: current if current.state != S.POINTER_REWRITTEN else current.advance(S.RESUMED, actor=actor, note=note),
    )
    return change
