"""What can go wrong with checkpoints and the resume pointer, as named exceptions.

Callers catch these by name: the pipeline's ``rewrite_pointer`` handler turns
:class:`NoSafeCheckpoint` into a recorded "needs attention" state, and the agent
refuses to train on :class:`CheckpointCorrupt`.
"""

from __future__ import annotations

from dataclasses import dataclass


class LineageError(Exception):
    """Base of every checkpoint-lineage error."""


class InvalidStoreUri(LineageError, ValueError):
    """A checkpoint location that is neither ``s3://bucket[/prefix]`` nor a local directory."""


class ObjectNotFound(LineageError, KeyError):
    """The object does not exist in the store."""

    def __str__(self) -> str:
        # KeyError quotes its argument; we carry a full sentence.
        return str(self.args[0]) if self.args else "object not found"


class PreconditionFailed(LineageError):
    """A conditional write lost: the object changed (If-Match) or already exists (If-None-Match)."""


class CheckpointIncomplete(LineageError):
    """A checkpoint folder without a manifest: it was never committed and is never used."""


class CheckpointCorrupt(LineageError):
    """A committed checkpoint that fails verification: unparseable manifest, changed bytes, wrong fingerprint."""


class PointerCorrupt(LineageError):
    """``RESUME.json`` exists but is not a valid resume pointer."""


class PointerConflict(LineageError):
    """The resume pointer kept changing under us (or changed since we read it): the write was not made."""


@dataclass(frozen=True)
class PassedOver:
    """A checkpoint that was not chosen, and why."""

    step: int
    reason: str


class NoSafeCheckpoint(LineageError):
    """Nothing safe to resume from: no committed, verified checkpoint at or before the trusted step."""

    def __init__(self, message: str, *, trusted_through_step: int, passed_over: list[PassedOver] | None = None):
        super().__init__(message)
        self.trusted_through_step = trusted_through_step
        self.passed_over = list(passed_over or [])
