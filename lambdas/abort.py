"""An operator's end of an incident: abort one that runs, release one that stopped holding nodes.

``sdcguard incidents abort ID`` and ``release ID`` call these with the
operator's own credentials, so the ledger records who ended it (the caller's
identity from STS) and CloudTrail records the StopExecution and the node
patches under the same identity. Both free what the incident held: the
nodes it cordoned are uncordoned (a cordon someone else set is left), its
hold on the PyTorchJob is released (the job resumes when no other open
incident holds it), and it no longer counts toward the blast radius (a
replacement it already requested still counts for its 24 hours).

The job resumes only where resuming is safe: an incident that a reviewer
approved but whose resume pointer was never rewritten (APPROVED, REPLACING,
REPLACED, or stopped after that: ``ReplacementNotQualified``,
``NoSafeCheckpoint``) would resume from the checkpoint the pointer still
names, which may be inside the suspect window. Its job is left suspended
(:func:`unsafe_to_resume` says why, and the ledger's note and the command
say so) for a person to resume from a checkpoint before the suspect window.
An incident that reached the pointer rewrite, was rejected, or was never
approved resumes as before.

A replacement node that failed its qualification stays cordoned: it gave
wrong bits for the job's own computation, so only a person who has looked
at it uncordons it (``kubectl uncordon``); until then it counts as
quarantined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError
from kubernetes import client as k8s

from sdcguard.contract import Incident, IncidentState, ResumePointer
from sdcguard.contract.checkpoint import checkpoint_dir, step_of_dir
from sdcguard.lambdas import notify
from sdcguard.lambdas.blast_radius import STOPPED_HOLDING
from sdcguard.lambdas.cordon import uncordon_node
from sdcguard.lambdas.errors import IncidentNotWaiting, UnsafeResume
from sdcguard.lambdas.job import holds_job, leave_suspended, resume_job
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lineage.errors import LineageError, NoSafeCheckpoint
from sdcguard.lineage.pointer import rewrite_pointer
from sdcguard.lineage.selection import select_checkpoint
from sdcguard.lineage.store import open_store
from sdcguard.lineage.verify import missing_for_resume, verify_checkpoint

S = IncidentState
ABORT_ERROR = "AbortedByOperator"


@dataclass(frozen=True)
class Resume:
    """An operator's request to resume an approved incident's job from a checkpoint before the suspect window."""

    checkpoint: str | None = None
    """``--resume-from``: the checkpoint's step or folder; None: the pipeline's own rewrite (``--rewrite-pointer``),
    the newest verified checkpoint at or before the alarm's trusted step."""
"""The error an aborted execution ends with (its StopExecution names the operator in CloudTrail)."""


def unsafe_to_resume(incident: Incident) -> str | None:
    """Why resuming ``incident``'s job from its current pointer could resume into the suspect window, or None.

    A reviewer approved it (the fault was judged real, so the rollback is what makes resuming safe) and the
    pointer rewrite never ran: the pointer still names whatever the job last saved, possibly after the fault.
    """
    if (incident.entered(S.APPROVED) is None or incident.entered(S.POINTER_REWRITTEN) is not None
            or incident.checkpoint_after is not None):  # the pipeline's rewrite, or an operator's --resume-from
        return None
    trusted = incident.alarm.trusted_through_step()
    return (f"the job {incident.alarm.job.namespace}/{incident.alarm.job.job_name} stays suspended: the incident was "
            f"approved and its resume pointer was never rewritten, so it may still name a checkpoint inside the "
            f"suspect window (after step {trusted}); to resume, end it with --resume-from a checkpoint at or before "
            f"step {trusted}, or --rewrite-pointer")


def resume_step(checkpoint: str) -> int:
    """The step ``checkpoint`` names: ``1200``, ``checkpoints/step-000001200`` or its ``s3://`` folder. Raises
    :class:`UnsafeResume` for anything else."""
    text = checkpoint.strip().rstrip("/")
    if text.isdigit():
        return int(text)
    step = step_of_dir("/".join(text.rsplit("/", 2)[-2:]))
    if step is None or not (text == checkpoint_dir(step) or text.endswith(f"/{checkpoint_dir(step)}")):
        raise UnsafeResume(f"--resume-from {checkpoint!r}: not a checkpoint (give its step, e.g. 1200, or "
                           f"{checkpoint_dir(1200)}); nothing changed")
    return step


def check_resume_from(incident: Incident, checkpoint: str | None, *, s3: Any = None) -> int:
    """The step an operator may resume ``incident``'s job from: ``checkpoint``'s, once it verifies (its manifest
    and every object it lists, with what a resume needs) and lies at or before the alarm's trusted step; with
    ``checkpoint`` None, the step the pipeline's own rewrite would choose. Writes nothing.

    The checkpoints are the alarm's prefix, which the pipeline checked against the one prefix the stack
    guards when it planned the rollback (before the reviewers were asked); an incident without that plan
    has none to trust. Raises :class:`UnsafeResume` naming what is wrong.
    """
    if incident.rollback is None:
        raise UnsafeResume(f"incident {incident.incident_id} has no rollback plan: its checkpoint prefix was never "
                           "checked against the stack's, so nothing is resumed from it; nothing changed")
    trusted = incident.alarm.trusted_through_step()
    store = open_store(incident.alarm.checkpoint_prefix, client=s3)
    if checkpoint is None:
        try:
            return select_checkpoint(store, trusted).step
        except NoSafeCheckpoint as exc:
            raise UnsafeResume(f"nothing safe to resume from: {exc}; nothing changed") from None
    step = resume_step(checkpoint)
    if step > trusted:
        raise UnsafeResume(f"--resume-from {checkpoint!r}: step {step} is inside the suspect window (the alarm "
                           f"trusts the job through step {trusted}); nothing changed")
    try:
        manifest = verify_checkpoint(store, step)
    except LineageError as exc:
        raise UnsafeResume(f"--resume-from {checkpoint!r}: {exc}; nothing changed") from None
    missing = missing_for_resume(manifest)
    if missing:
        raise UnsafeResume(f"--resume-from {checkpoint!r}: its manifest lists no {', '.join(missing)} (a resume "
                           "needs them); nothing changed")
    return step


def point_at(incident: Incident, step: int, *, operator: str, s3: Any = None) -> ResumePointer:
    """Rewrite the job's resume pointer to the checkpoint at ``step`` (or an earlier one the pointer already
    names: the pointer never moves forward), as the pipeline's rewrite does. Raises :class:`UnsafeResume` when
    it no longer verifies."""
    store = open_store(incident.alarm.checkpoint_prefix, client=s3)
    try:
        return rewrite_pointer(store, trusted_through_step=step, written_by=operator[:256] or "operator",
                               reason=f"incident {incident.incident_id} ended by {operator}: resume from a "
                                      f"checkpoint at or before step {step}", incident_id=incident.incident_id)
    except NoSafeCheckpoint as exc:
        raise UnsafeResume(f"nothing safe to resume from at or before step {step}: {exc}") from None


def free_holdings(ledger: Ledger, api: Callable[[], k8s.ApiClient], incident: Incident) -> str:
    """Uncordon the nodes ``incident`` cordoned and release its hold on the job. Idempotent. Returns what became
    of the job, in a sentence.

    Only what it got to: no cordon before CORDONED (the Map may have cordoned
    some nodes just before it stopped, so from SUSPENDED on each node is looked
    at, and only sdcguard's own taint naming this incident is removed), no job
    before SUSPENDED; ``api`` is called only when the cluster must be touched.
    The job is resumed only when :func:`unsafe_to_resume` finds nothing against
    it; otherwise this incident's hold is dropped and the job left suspended.
    Raises :class:`TransientKubernetesError` and :class:`KubernetesObjectMissing`.
    """
    if incident.entered(S.SUSPENDED) is None:
        return "the job was never suspended"
    client = api()
    for suspect in incident.suspects:
        uncordon_node(client, suspect.node, incident.incident_id, still_open=lambda other: holds_job(ledger, other))
    job = incident.alarm.job
    unsafe = unsafe_to_resume(incident)
    if unsafe is not None:
        leave_suspended(client, job.namespace, job.job_name, incident.incident_id)
        return unsafe
    change = resume_job(client, job.namespace, job.job_name, incident.incident_id,
                        still_open=lambda other: holds_job(ledger, other))
    if change.held_by:
        return f"the job stays suspended for incident(s) {', '.join(change.held_by)}"
    return "the job resumes from its current resume pointer"


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
    resume: Resume | None = None,
    s3: Any = None,
) -> Incident:
    """Stop the incident's execution, record ABORTED by ``operator``, and free what it held.

    The job resumes only where that is safe (:func:`unsafe_to_resume`), or
    from ``resume``'s checkpoint, checked (:func:`check_resume_from`) before
    anything is stopped and written to the pointer after. Raises
    :class:`IncidentNotWaiting` for an incident that already ended (a stopped
    one that holds nodes is released with :func:`release_stopped`),
    :class:`UnsafeResume` for a ``resume`` that is not safe (nothing changed),
    and :class:`IncidentNotFound`. An incident already ABORTED is freed again
    (a retry after a failed uncordon) and returned.
    """
    incident = ledger.get(incident_id)
    if incident.state.terminal and incident.state != S.ABORTED:
        hint = " (it holds nodes: use `sdcguard incidents release`)" if incident.state in STOPPED_HOLDING else ""
        raise IncidentNotWaiting(f"incident {incident_id} already ended ({incident.state.value}){hint}; nothing changed")
    step = _checked(incident, resume, s3)
    execution = incident.opened_by
    if execution and incident.state != S.ABORTED:
        try:
            if sfn.describe_execution(executionArn=execution)["status"] == "RUNNING":
                sfn.stop_execution(executionArn=execution, error=ABORT_ERROR, cause=f"{operator}: {reason}"[:32768])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ExecutionDoesNotExist":
                raise
    pointed = _point(ledger, incident_id, step, operator, s3)
    # Freed before it is recorded as ended: an incident that failed to free what it held still counts.
    job = free_holdings(ledger, api, ledger.get(incident_id))
    now = datetime.now(UTC)
    note = f"aborted: {reason}" + (f" (execution {execution} stopped)" if execution else "") + f"; {job}"
    aborted = ledger.update(
        incident_id,
        lambda current: current
        if current.state == S.ABORTED
        else current.advance(S.ABORTED, actor=operator[:256], note=note[:1024], nodes_released_at=now, **pointed),
    )
    _tell(topic_arn, sns, aborted, f"aborted by {operator}: {reason}; {job}")
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
    resume: Resume | None = None,
    s3: Any = None,
) -> Incident:
    """Free the nodes and job an incident that stopped (NEEDS_ATTENTION, CONTAINED, FAILED) still holds; record RELEASED.

    The job resumes as :func:`abort_incident`'s does. Raises
    :class:`IncidentNotWaiting` for an incident still running (abort it) or
    one that holds nothing, :class:`UnsafeResume` (nothing changed), and
    :class:`IncidentNotFound`. One already RELEASED is freed again and returned.
    """
    incident = ledger.get(incident_id)
    if not incident.state.terminal:
        raise IncidentNotWaiting(
            f"incident {incident_id} is {incident.state.value}, still running: abort it (`sdcguard incidents abort`); "
            "nothing changed"
        )
    if incident.state not in (*STOPPED_HOLDING, S.RELEASED):
        raise IncidentNotWaiting(f"incident {incident_id} ended as {incident.state.value} and holds nothing; nothing changed")
    step = _checked(incident, resume, s3)
    pointed = _point(ledger, incident_id, step, operator, s3)
    job = free_holdings(ledger, api, ledger.get(incident_id))
    now = datetime.now(UTC)
    released = ledger.update(
        incident_id,
        lambda current: current
        if current.state == S.RELEASED
        else current.advance(S.RELEASED, actor=operator[:256], note=f"released: {reason}; {job}"[:1024],
                             nodes_released_at=now, **pointed),
    )
    _tell(topic_arn, sns, released, f"released by {operator}: {reason}; {job}")
    return released


def _checked(incident: Incident, resume: Resume | None, s3: Any) -> int | None:
    """The step ``resume`` resumes from, checked; None without one, or where resuming needs no rollback."""
    if resume is None or unsafe_to_resume(incident) is None:
        return None
    return check_resume_from(incident, resume.checkpoint, s3=s3)


def _point(ledger: Ledger, incident_id: str, step: int | None, operator: str, s3: Any) -> dict[str, object]:
    """The pointer rewritten to ``step`` (None: left alone), recorded on the incident at once (so that what it
    frees next sees a pointer before the suspect window); the fields the ending transition repeats."""
    if step is None:
        return {}
    pointer = point_at(ledger.get(incident_id), step, operator=operator, s3=s3)
    fields: dict[str, object] = {
        "checkpoint_before": pointer.history[0].checkpoint if pointer.history else None,
        "checkpoint_after": pointer.checkpoint, "resumed_from_step": pointer.step}
    ledger.update(incident_id, lambda current: current.model_copy(update=fields))
    return fields


def _tell(topic_arn: str | None, sns: Any, incident: Incident, what: str) -> None:
    if topic_arn:
        notify.publish(
            topic_arn,
            f"sdcguard: incident {incident.incident_id} {incident.state.value}",
            notify.describe(incident) + f"\n{notify.quote(what)}",
            incident=incident,
            client=sns,
        )
