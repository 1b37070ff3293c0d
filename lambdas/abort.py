"""An operator's end of an incident: abort one that runs, release one that stopped holding nodes.

``sdcguard incidents abort ID`` and ``release ID`` call these with the
operator's own credentials, so the ledger records who ended it (the caller's
identity from STS) and CloudTrail records the StopExecution and the node
patches under the same identity. Both free what the incident held: the
nodes it cordoned are uncordoned (a cordon someone else set is left), its
hold on the PyTorchJob is released (the job resumes when no other open
incident holds it), and it no longer counts toward the blast radius (a
replacement it already requested still counts for its 24 hours).

A replacement node that failed its qualification stays cordoned: it gave
wrong bits for the job's own computation, so only a person who has looked
at it uncordons it (``kubectl uncordon``); until then it counts as
quarantined.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError
from kubernetes import client as k8s

from sdcguard.contract import Incident, IncidentState
from sdcguard.lambdas import notify
from sdcguard.lambdas.blast_radius import STOPPED_HOLDING
from sdcguard.lambdas.cordon import uncordon_node
from sdcguard.lambdas.errors import IncidentNotWaiting
from sdcguard.lambdas.job import holds_job, resume_job
from sdcguard.lambdas.ledger import Ledger

S = IncidentState
ABORT_ERROR = "AbortedByOperator"
"""The error an aborted execution ends with (its StopExecution names the operator in CloudTrail)."""


def free_holdings(ledger: Ledger, api: Callable[[], k8s.ApiClient], incident: Incident) -> None:
    """Uncordon the nodes ``incident`` cordoned and release its hold on the job. Idempotent.

    Only what it got to: no cordon before CORDONED (the Map may have cordoned
    some nodes just before it stopped, so from SUSPENDED on each node is looked
    at, and only sdcguard's own taint naming this incident is removed), no job
    before SUSPENDED; ``api`` is called only when the cluster must be touched.
    Raises :class:`TransientKubernetesError` and :class:`KubernetesObjectMissing`.
    """
    if incident.entered(S.SUSPENDED) is None:
        return
    client = api()
    for suspect in incident.suspects:
        uncordon_node(client, suspect.node, incident.incident_id)
    job = incident.alarm.job
    resume_job(client, job.namespace, job.job_name, incident.incident_id, still_open=lambda other: holds_job(ledger, other))


def abort_incident(
    ledger: Ledger,
    api: Callable[[], k8s.ApiClient],
    incident_id: str,
    *,
    operator: str,
    reason: str,
    sfn: Any,
    topic_arn: str | None = None,
    sns: Any = None,
) -> Incident:
    """Stop the incident's execution, record ABORTED by ``operator``, and free what it held.

    Raises :class:`IncidentNotWaiting` for an incident that already ended (a
    stopped one that holds nodes is released with :func:`release_stopped`),
    and :class:`IncidentNotFound`. An incident already ABORTED is freed again
    (a retry after a failed uncordon) and returned.
    """
    incident = ledger.get(incident_id)
    if incident.state.terminal and incident.state != S.ABORTED:
        hint = " (it holds nodes: use `sdcguard incidents release`)" if incident.state in STOPPED_HOLDING else ""
        raise IncidentNotWaiting(f"incident {incident_id} already ended ({incident.state.value}){hint}; nothing changed")
    execution = incident.opened_by
    if execution and incident.state != S.ABORTED:
        try:
            if sfn.describe_execution(executionArn=execution)["status"] == "RUNNING":
                sfn.stop_execution(executionArn=execution, error=ABORT_ERROR, cause=f"{operator}: {reason}"[:32768])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ExecutionDoesNotExist":
                raise
    # Freed before it is recorded as ended: an incident that failed to free what it held still counts.
    free_holdings(ledger, api, ledger.get(incident_id))
    now = datetime.now(UTC)
    note = f"aborted: {reason}" + (f" (execution {execution} stopped)" if execution else "")
    aborted = ledger.update(
        incident_id,
        lambda current: current
        if current.state == S.ABORTED
        else current.advance(S.ABORTED, actor=operator[:256], note=note[:1024], nodes_released_at=now),
    )
    _tell(topic_arn, sns, aborted, f"aborted by {operator}: {reason}")
    return aborted


def release_stopped(
    ledger: Ledger,
    api: Callable[[], k8s.ApiClient],
    incident_id: str,
    *,
    operator: str,
    reason: str,
    topic_arn: str | None = None,
    sns: Any = None,
) -> Incident:
    """Free the nodes and job an incident that stopped (NEEDS_ATTENTION, CONTAINED, FAILED) still holds; record RELEASED.

    Raises :class:`IncidentNotWaiting` for an incident still running (abort it)
    or one that holds nothing, and :class:`IncidentNotFound`. One already
    RELEASED is freed again and returned.
    """
    incident = ledger.get(incident_id)
    if not incident.state.terminal:
        raise IncidentNotWaiting(
            f"incident {incident_id} is {incident.state.value}, still running: abort it (`sdcguard incidents abort`); "
            "nothing changed"
        )
    if incident.state not in (*STOPPED_HOLDING, S.RELEASED):
        raise IncidentNotWaiting(f"incident {incident_id} ended as {incident.state.value} and holds nothing; nothing changed")
    free_holdings(ledger, api, incident)
    now = datetime.now(UTC)
    released = ledger.update(
        incident_id,
        lambda current: current
        if current.state == S.RELEASED
        else current.advance(S.RELEASED, actor=operator[:256], note=f"released: {reason}"[:1024], nodes_released_at=now),
    )
    _tell(topic_arn, sns, released, f"released by {operator}: {reason}")
    return released


def _tell(topic_arn: str | None, sns: Any, incident: Incident, what: str) -> None:
    if topic_arn:
        notify.publish(
            topic_arn,
            f"sdcguard: incident {incident.incident_id} {incident.state.value}",
            notify.describe(incident) + f"\n{notify.quote(what)}",
            incident=incident,
            client=sns,
        )
