"""Rewrite the job's resume pointer to the last pre-suspect checkpoint (through lineage)."""

from __future__ import annotations

from typing import Any

from sdcguard.contract import Incident, IncidentState, RollbackPlan
from sdcguard.lambdas.errors import IncidentNotWaiting, PointerOutsidePrefix
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lineage.errors import PointerCorrupt
from sdcguard.lineage.pointer import read_pointer, rewrite_pointer
from sdcguard.lineage.selection import select_checkpoint
from sdcguard.lineage.store import open_store

S = IncidentState
WRITER = "sdcguard-pipeline"


def allowed_prefix(checkpoint_prefix: str, *, bucket: str, prefix: str) -> bool:
    """Whether the alarm's ``s3://`` checkpoint prefix is exactly the bucket/prefix this stack guards.

    Not any prefix under it: an alarm naming ``<prefix>/other-job`` would
    otherwise move another job's pointer (or one an attacker planted there).
    A trailing ``/`` on either side does not matter; an empty prefix is the bucket's root.
    """
    guarded = f"s3://{bucket}/{prefix.strip('/')}".rstrip("/")
    return checkpoint_prefix.rstrip("/") == guarded


def plan_rollback(incident: Incident, *, checkpoint_bucket: str, checkpoint_prefix: str, s3: Any = None) -> RollbackPlan:
    """Where approving ``incident`` will move the job's resume pointer, computed now, writing nothing.

    The same choice :func:`rewrite_for_incident` makes after the replacement
    (the newest verified checkpoint at or before both the alarm's trusted step
    and the current pointer), so the reviewers see it before they decide and a
    job with nothing safe to resume from is found before anything is replaced.
    Raises :class:`PointerOutsidePrefix` and ``sdcguard.lineage.errors.NoSafeCheckpoint``.
    """
    location = incident.alarm.checkpoint_prefix
    if not allowed_prefix(location, bucket=checkpoint_bucket, prefix=checkpoint_prefix):
        raise PointerOutsidePrefix(
            f"checkpoints at {location} are not s3://{checkpoint_bucket}/{checkpoint_prefix.strip('/')}, "
            "the one prefix this pipeline guards; nothing can be rolled back"
        )
    store = open_store(location, client=s3)
    try:
        current, _etag = read_pointer(store)
    except PointerCorrupt:
        current = None  # the rewrite replaces a pointer that does not parse
    trusted = incident.alarm.trusted_through_step()
    selection = select_checkpoint(store, trusted if current is None else min(trusted, current.step))
    return RollbackPlan(
        pointer_from=current.checkpoint if current is not None else None,
        to=selection.checkpoint,
        to_step=selection.step,
        alarm_step=incident.alarm.step,
    )


def rewrite_for_incident(
    ledger: Ledger,
    incident_id: str,
    *,
    checkpoint_bucket: str,
    checkpoint_prefix: str,
    s3: Any = None,
    actor: str = "rewrite_pointer",
) -> Incident:
    """Point the job at the last checkpoint at or before the alarm's trusted step; record before/after.

    Idempotent: an incident whose pointer is already rewritten is returned as
    it is. Raises :class:`PointerOutsidePrefix`, :class:`IncidentNotWaiting`
    (nothing replaced yet) and ``sdcguard.lineage.errors.NoSafeCheckpoint``.
    """
    incident = ledger.get(incident_id)
    if incident.state == S.POINTER_REWRITTEN or incident.entered(S.POINTER_REWRITTEN):
        return incident
    if incident.state != S.REPLACED:
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; the pointer moves only after replacement")
    location = incident.alarm.checkpoint_prefix
    if not allowed_prefix(location, bucket=checkpoint_bucket, prefix=checkpoint_prefix):
        raise PointerOutsidePrefix(
            f"checkpoints at {location} are not s3://{checkpoint_bucket}/{checkpoint_prefix.strip('/')}, "
            "the one prefix this pipeline guards; the pointer is left as it is"
        )
    store = open_store(location, client=s3)
    trusted = incident.alarm.trusted_through_step()
    pointer = rewrite_pointer(
        store,
        trusted_through_step=trusted,
        reason=f"incident {incident_id}: {incident.alarm.detector.value} alarm at step {incident.alarm.step}; "
        f"trusted through step {trusted}",
        written_by=WRITER,
        incident_id=incident_id,
    )
    return ledger.update(
        incident_id,
        lambda current: current
        if current.state != S.REPLACED
        else current.advance(
            S.POINTER_REWRITTEN,
            actor=actor,
            note=f"resume pointer -> {pointer.checkpoint}",
            # The pointer keeps the value it replaced at the head of its history.
            checkpoint_before=pointer.history[0].checkpoint if pointer.history else None,
            checkpoint_after=pointer.checkpoint,
            resumed_from_step=pointer.step,
        ),
    )
