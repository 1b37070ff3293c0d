"""The choice of the checkpoint to resume from after an alarm.

The rule (the same for the pipeline and for ``sdcguard checkpoints select``):
the newest checkpoint whose step is at or before the trusted-through step, whose
manifest exists and lists every object a resume needs, and whose objects all
verify. A checkpoint's step is the first
step a resumed job runs (it holds the updates of steps ``0 .. step-1``), so a
checkpoint at step ``S <= T`` contains no update made after step ``T-1``; for an
alarm, ``T`` is :meth:`sdcguard.contract.Alarm.trusted_through_step`.

Only the candidates are read, newest first, until one verifies: with 10,000
checkpoints under a prefix the choice costs one delimited listing and the
reads of the checkpoints it rejects plus the one it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sdcguard.contract.checkpoint import CheckpointManifest, checkpoint_dir
from sdcguard.lineage.errors import CheckpointCorrupt, CheckpointIncomplete, NoSafeCheckpoint, PassedOver
from sdcguard.lineage.listing import checkpoint_steps
from sdcguard.lineage.store import ObjectStore
from sdcguard.lineage.verify import RESUME_OBJECTS, missing_for_resume, read_manifest, verify_objects


@dataclass(frozen=True)
class Selection:
    """The checkpoint chosen, and every newer one that was passed over with its reason."""

    step: int
    checkpoint: str
    """The folder relative to the job prefix: ``checkpoints/step-000001200``."""
    uri: str
    """The folder's full location."""
    manifest: CheckpointManifest
    trusted_through_step: int
    passed_over: list[PassedOver] = field(default_factory=list)
    """Newer checkpoints that were not chosen, newest first."""

    def to_dict(self, max_passed_over: int = 100) -> dict[str, Any]:
        """A JSON-ready summary; at most ``max_passed_over`` reasons (the newest), with the count left out."""
        shown = self.passed_over[:max_passed_over]
        return {
            "step": self.step,
            "checkpoint": self.checkpoint,
            "uri": self.uri,
            "trusted_through_step": self.trusted_through_step,
            "fingerprint": self.manifest.fingerprint,
            "created_at": self.manifest.created_at.isoformat(),
            "passed_over": [{"step": p.step, "reason": p.reason} for p in shown],
            "passed_over_omitted": len(self.passed_over) - len(shown),
        }


def select_checkpoint(
    store: ObjectStore, trusted_through_step: int, *, required: tuple[str, ...] = RESUME_OBJECTS
) -> Selection:
    """The newest committed, verified checkpoint at or before ``trusted_through_step`` that lists ``required``.

    Raises :class:`NoSafeCheckpoint` ("nothing safe to resume from", carrying
    every reason) when the prefix is empty, the trusted step is before the
    first checkpoint (or negative: nothing was ever clean), or every candidate
    is incomplete, lacks an object a resume needs, or is corrupt. Store errors
    other than missing objects propagate.
    """
    steps = checkpoint_steps(store)
    passed: list[PassedOver] = []
    for step in reversed(steps):
        if step > trusted_through_step:
            passed.append(
                PassedOver(step, f"step {step} is after the trusted step {trusted_through_step} (suspect window)")
            )
            continue
        try:
            manifest = read_manifest(store, step)
            missing = missing_for_resume(manifest, required)
            if missing:
                passed.append(
                    PassedOver(step, f"cannot be resumed from: its manifest lists no {', '.join(missing)} "
                               f"(a resume needs {', '.join(required)})")
                )
                continue
            verify_objects(store, manifest)
        except CheckpointIncomplete:
            passed.append(PassedOver(step, "incomplete: no manifest (never committed)"))
            continue
        except CheckpointCorrupt as exc:
            passed.append(PassedOver(step, f"does not verify: {exc}"))
            continue
        return Selection(
            step=step,
            checkpoint=checkpoint_dir(step),
            uri=store.uri(checkpoint_dir(step)),
            manifest=manifest,
            trusted_through_step=trusted_through_step,
            passed_over=passed,
        )
    raise NoSafeCheckpoint(
        _why_nothing(store, steps, trusted_through_step, passed),
        trusted_through_step=trusted_through_step,
        passed_over=passed,
    )


def _why_nothing(store: ObjectStore, steps: list[int], trusted: int, passed: list[PassedOver]) -> str:
    where = store.uri()
    if not steps:
        return f"nothing safe to resume from: no checkpoints under {where}"
    if trusted < 0:
        return f"nothing safe to resume from: no detector was ever clean (trusted step {trusted})"
    if trusted < steps[0]:
        return (
            f"nothing safe to resume from: the trusted step {trusted} is before the first checkpoint "
            f"(step {steps[0]}) under {where}: the suspect window covers every checkpoint"
        )
    bad = sum(1 for p in passed if p.step <= trusted)
    return (
        f"nothing safe to resume from: all {bad} checkpoint(s) at or before step {trusted} under {where} "
        "are incomplete, lack an object a resume needs, or fail verification"
    )
