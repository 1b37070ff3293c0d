"""Checkpoints made without torch, for the lineage tests: a few objects and a manifest."""

from __future__ import annotations

from sdcguard.contract.checkpoint import CheckpointManifest, checkpoint_dir
from sdcguard.lineage.commit import commit, put_object
from sdcguard.lineage.store import ObjectStore


def fingerprint_for(step: int) -> str:
    """A distinct, valid 48-hex-digit fingerprint per step."""
    return f"{step:048x}"


def write_checkpoint(
    store: ObjectStore,
    step: int,
    *,
    committed: bool = True,
    objects: dict[str, bytes] | None = None,
    fingerprint: str | None = None,
) -> CheckpointManifest | None:
    """Write a checkpoint at ``step`` (objects, then the manifest unless ``committed`` is False)."""
    objects = objects or {
        "model.pt": f"weights at {step}".encode() * 10,
        "optimizer.pt": f"moments {step}".encode(),
        "trainer.pt": f"step {step}".encode(),
    }
    digests = [put_object(store, step, name, data) for name, data in objects.items()]
    if not committed:
        return None
    manifest = CheckpointManifest(
        step=step,
        world_size=2,
        fingerprint=fingerprint or fingerprint_for(step),
        objects=digests,
        last_clean_audit_step=step,
        last_clean_fingerprint_step=step,
        written_by="tests",
    )
    commit(store, manifest)
    return manifest


def object_key(step: int, name: str = "model.pt") -> str:
    """The key of one object of the checkpoint at ``step``."""
    return f"{checkpoint_dir(step)}/{name}"
