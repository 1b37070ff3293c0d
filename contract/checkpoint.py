"""The checkpoint manifest and the resume pointer.

A checkpoint lives under ``<prefix>/checkpoints/step-000001200/``: its state
objects, then ``MANIFEST.json``, written last, whose presence commits it. The
resume pointer ``<prefix>/RESUME.json`` says which checkpoint the next start
loads, why, and who wrote it.

A checkpoint's ``step`` is the first step a resumed job runs: it holds the
state after the updates of steps ``0 .. step-1``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Final, Literal

from pydantic import Field, field_validator, model_validator

from sdcguard.contract.alarm import Fingerprint, Name, Step, Strict, Text

MANIFEST_SCHEMA_VERSION: Final = "1"
POINTER_SCHEMA_VERSION: Final = "1"
MANIFEST_NAME = "MANIFEST.json"
POINTER_NAME = "RESUME.json"
CHECKPOINTS_DIR = "checkpoints"
POINTER_HISTORY_LIMIT = 50

_OBJECT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_CHECKPOINT_DIR = re.compile(r"^checkpoints/step-(\d{9,})$")


def checkpoint_dir(step: int) -> str:
    """The checkpoint's folder relative to the job prefix: ``checkpoints/step-000001200``."""
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    return f"{CHECKPOINTS_DIR}/step-{step:09d}"


def step_of_dir(name: str) -> int | None:
    """The step encoded in a checkpoint folder name, or None if it is not one."""
    match = _CHECKPOINT_DIR.match(name.rstrip("/"))
    return int(match.group(1)) if match else None


class ObjectDigest(Strict):
    """One state object of a checkpoint and the digest it must have."""

    name: str
    """File name inside the checkpoint folder (no slashes)."""
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    size: Annotated[int, Field(ge=0, strict=True)]

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not _OBJECT_NAME.match(value) or value == "MANIFEST.json":
            raise ValueError(f"not a plain object name: {value!r}")
        return value


class ShardedLayout(Strict):
    """How a sharded checkpoint (FSDP2 on a DeviceMesh, saved with torch.distributed.checkpoint) is laid out."""

    format: Literal["dcp"] = "dcp"
    """torch.distributed.checkpoint files: ``dcp.metadata`` and each rank's ``dcp__R_N.distcp``."""
    replicas: Annotated[int, Field(ge=1, strict=True)]
    """Replica groups of the mesh that saved it (1: pure FSDP)."""
    shards: Annotated[int, Field(ge=1, strict=True)]
    """Shards per replica group."""
    shard_fingerprints: Annotated[list[Fingerprint], Field(min_length=1, max_length=100_000)]
    """Per shard position, the fingerprint of its weights and optimizer state that every replica agreed on;
    the manifest's ``fingerprint`` combines them in this order."""

    @model_validator(mode="after")
    def _one_per_shard(self) -> ShardedLayout:
        if len(self.shard_fingerprints) != self.shards:
            raise ValueError(f"shard_fingerprints: {len(self.shard_fingerprints)} given for {self.shards} shards")
        return self


class CheckpointManifest(Strict):
    """Written last: its presence commits the checkpoint."""

    schema_version: Literal["1"] = MANIFEST_SCHEMA_VERSION
    step: Step
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    world_size: Annotated[int, Field(ge=1, strict=True)]
    fingerprint: Fingerprint
    """The weight (and optimizer-state) fingerprint all replicas agreed on before the save."""
    objects: Annotated[list[ObjectDigest], Field(min_length=1, max_length=10_000)]
    last_clean_audit_step: Step | None = None
    last_clean_fingerprint_step: Step | None = None
    written_by: Annotated[str, Field(max_length=256)] = ""
    sharding: ShardedLayout | None = None
    """Set for a sharded checkpoint (FSDP2); None for a replicated one (DDP)."""

    @model_validator(mode="after")
    def _unique_objects(self) -> CheckpointManifest:
        names = [o.name for o in self.objects]
        if len(names) != len(set(names)):
            raise ValueError("objects: names must be unique")
        return self


class PointerEntry(Strict):
    """One value the resume pointer held."""

    checkpoint: Annotated[str, Field(pattern=r"^checkpoints/step-\d{9,}$")]
    step: Step
    reason: Text
    written_by: Annotated[str, Field(min_length=1, max_length=256)]
    written_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    incident_id: Annotated[str, Field(max_length=128)] | None = None

    @model_validator(mode="after")
    def _dir_matches_step(self) -> PointerEntry:
        if step_of_dir(self.checkpoint) != self.step:
            raise ValueError(f"checkpoint: {self.checkpoint!r} does not hold step {self.step}")
        return self


class ResumePointer(PointerEntry):
    """``RESUME.json``: which checkpoint the next start loads, and the pointers before it."""

    schema_version: Literal["1"] = POINTER_SCHEMA_VERSION
    history: Annotated[list[PointerEntry], Field(max_length=POINTER_HISTORY_LIMIT)] = []
    """Earlier values, newest first (bucket versioning keeps the objects too)."""

    def entry(self) -> PointerEntry:
        """This pointer's current value without its history."""
        return PointerEntry(
            checkpoint=self.checkpoint,
            step=self.step,
            reason=self.reason,
            written_by=self.written_by,
            written_at=self.written_at,
            incident_id=self.incident_id,
        )

    def moved_to(
        self,
        step: int,
        *,
        reason: str,
        written_by: str,
        incident_id: str | None = None,
    ) -> ResumePointer:
        """A new pointer to ``step`` that keeps this one at the head of its history."""
        return ResumePointer(
            checkpoint=checkpoint_dir(step),
            step=step,
            reason=reason,
            written_by=written_by,
            incident_id=incident_id,
            history=[self.entry(), *self.history][:POINTER_HISTORY_LIMIT],
        )


__all__ = [
    "CHECKPOINTS_DIR",
    "MANIFEST_NAME",
    "POINTER_NAME",
    "CheckpointManifest",
    "Name",
    "ObjectDigest",
    "PointerEntry",
    "ResumePointer",
    "ShardedLayout",
    "checkpoint_dir",
    "step_of_dir",
]
