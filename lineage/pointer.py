"""The resume pointer ``<prefix>/RESUME.json``: which checkpoint the next start loads.

Two writers move it:

- the pipeline, after an alarm, with :func:`rewrite_pointer`: back to the newest
  verified checkpoint at or before the trusted step, and never forward (if the
  pointer is already older, for instance because a concurrent incident moved
  it, it stays there);
- the training job, after each committed save, with :func:`advance_pointer`:
  forward to the checkpoint it just wrote, but only if nobody else changed the
  pointer since the job last read or wrote it.

Every write is conditional on the entity tag read just before it, so a
concurrent writer never loses an update: the loser re-reads and re-chooses.
The previous value goes to the head of the new pointer's history (and bucket
versioning keeps the old object as well).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pydantic import ValidationError

from sdcguard.contract.checkpoint import POINTER_NAME, ResumePointer, checkpoint_dir
from sdcguard.lineage.errors import ObjectNotFound, PointerConflict, PointerCorrupt, PreconditionFailed
from sdcguard.lineage.selection import Selection, select_checkpoint
from sdcguard.lineage.store import ObjectStore

log = logging.getLogger(__name__)

# A conflict means another writer just succeeded; a few re-reads always settle
# it unless something writes the pointer in a tight loop.
MAX_ATTEMPTS = 8


def read_pointer(store: ObjectStore) -> tuple[ResumePointer | None, str | None]:
    """The current pointer and its entity tag, or ``(None, None)`` when there is none.

    Raises :class:`PointerCorrupt` if ``RESUME.json`` exists but is not a valid pointer.
    """
    try:
        data, etag = store.get_bytes(POINTER_NAME)
    except ObjectNotFound:
        return None, None
    try:
        return ResumePointer.model_validate_json(data), etag
    except ValidationError as exc:
        raise PointerCorrupt(f"{store.uri(POINTER_NAME)}: not a valid resume pointer: {exc}") from exc


@dataclass(frozen=True)
class PointerRewrite:
    """What :func:`rewrite_pointer_explained` wrote, and the choice behind it."""

    pointer: ResumePointer
    etag: str
    selection: Selection
    previous: ResumePointer | None
    written: bool
    """False when the pointer already held this incident's choice (a retried call writes nothing)."""


def rewrite_pointer(
    store: ObjectStore,
    *,
    trusted_through_step: int,
    reason: str,
    written_by: str,
    incident_id: str | None = None,
) -> ResumePointer:
    """Point the next start at the newest verified checkpoint at or before ``trusted_through_step``.

    See :func:`rewrite_pointer_explained`, which this returns the pointer of.
    """
    return rewrite_pointer_explained(
        store,
        trusted_through_step=trusted_through_step,
        reason=reason,
        written_by=written_by,
        incident_id=incident_id,
    ).pointer


def rewrite_pointer_explained(
    store: ObjectStore,
    *,
    trusted_through_step: int,
    reason: str,
    written_by: str,
    incident_id: str | None = None,
    max_attempts: int = MAX_ATTEMPTS,
) -> PointerRewrite:
    """Move the pointer back to a checkpoint that is safe for this alarm, with a conditional write.

    The target is the newest verified checkpoint at or before both
    ``trusted_through_step`` and the current pointer's step: the pointer never
    moves forward. A retried call for the same incident that finds its own
    choice in place writes nothing. A pointer that does not parse is replaced
    (bucket versioning keeps it) and the reason says so.

    Raises :class:`sdcguard.lineage.errors.NoSafeCheckpoint` when nothing qualifies (the
    pointer is left as it was), :class:`PointerConflict` if the pointer changed
    under every one of ``max_attempts`` attempts, and :class:`ValueError` for
    an empty ``reason`` or ``written_by``.
    """
    if not reason.strip():
        raise ValueError("reason: must not be empty")
    if not written_by.strip():
        raise ValueError("written_by: must not be empty")
    for attempt in range(1, max_attempts + 1):
        note = ""
        try:
            current, etag = read_pointer(store)
        except PointerCorrupt:
            current = None
            _, etag = store.get_bytes(POINTER_NAME)
            note = " (the previous RESUME.json did not parse and was replaced)"
        limit = trusted_through_step if current is None else min(trusted_through_step, current.step)
        selection = select_checkpoint(store, limit)
        if (
            current is not None
            and etag is not None
            and current.step == selection.step
            and incident_id is not None
            and current.incident_id == incident_id
        ):
            return PointerRewrite(current, etag, selection, current, written=False)
        if current is not None and current.step < trusted_through_step and selection.step == current.step:
            note += f" (kept step {current.step}: the pointer was already before step {trusted_through_step})"
        text = (reason + note)[:1024]
        if current is None:
            new = ResumePointer(
                checkpoint=checkpoint_dir(selection.step),
                step=selection.step,
                reason=text,
                written_by=written_by,
                incident_id=incident_id,
            )
        else:
            new = current.moved_to(selection.step, reason=text, written_by=written_by, incident_id=incident_id)
        try:
            new_etag = store.put_bytes(
                POINTER_NAME,
                new.model_dump_json(indent=2).encode(),
                if_match=etag,
                if_none_match=etag is None,
            )
        except PreconditionFailed:
            log.info("resume pointer changed while rewriting it (attempt %d); re-reading", attempt)
            time.sleep(0.01 * attempt)
            continue
        return PointerRewrite(new, new_etag, selection, current, written=True)
    raise PointerConflict(
        f"{store.uri(POINTER_NAME)} changed under each of {max_attempts} attempts; nothing was written"
    )


def advance_pointer(
    store: ObjectStore,
    step: int,
    *,
    expected_etag: str | None,
    reason: str,
    written_by: str,
) -> tuple[ResumePointer, str]:
    """Point the next start at the checkpoint the job just committed at ``step``.

    Writes only if the pointer is still the one the job last saw
    (``expected_etag``; None: there was none), so an incident's rewrite is
    never undone by a job that has not stopped yet. Returns the new pointer
    and its entity tag. Raises :class:`PointerConflict` if someone else moved
    it (nothing is written) and :class:`PointerCorrupt` if it does not parse.
    """
    current, etag = read_pointer(store)
    if etag != expected_etag:
        raise PointerConflict(
            f"{store.uri(POINTER_NAME)} was changed by {current.written_by if current else 'someone'} "
            f"since this job read it; leaving it at {current.checkpoint if current else 'nothing'}"
        )
    if current is None:
        new = ResumePointer(checkpoint=checkpoint_dir(step), step=step, reason=reason, written_by=written_by)
    else:
        new = current.moved_to(step, reason=reason, written_by=written_by)
    try:
        new_etag = store.put_bytes(
            POINTER_NAME, new.model_dump_json(indent=2).encode(), if_match=etag, if_none_match=etag is None
        )
    except PreconditionFailed as exc:
        raise PointerConflict(f"{store.uri(POINTER_NAME)} changed while the job was advancing it") from exc
    return new, new_etag
