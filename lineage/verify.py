"""Checking a checkpoint against its manifest.

A committed checkpoint is trusted only if its manifest parses, names the step
of its folder, and every object it lists is present with exactly the sha256 and
size recorded; and, once loaded, the weights give the fingerprint that all
replicas agreed on before the save (:func:`check_fingerprint`). A checkpoint a
job is to resume from must also list every object a resume loads
(:data:`RESUME_OBJECTS`).

On S3 an object is verified from the SHA256 checksum S3 computed and checked
when it stored the object (GetObjectAttributes), not by downloading it, so a
checkpoint of tens of GB verifies in one request per object.
"""

from __future__ import annotations

import hmac

from pydantic import ValidationError

from sdcguard.contract.checkpoint import MANIFEST_NAME, CheckpointManifest, ObjectDigest, checkpoint_dir
from sdcguard.lineage.errors import CheckpointCorrupt, CheckpointIncomplete, ObjectNotFound
from sdcguard.lineage.store import ObjectStore

RESUME_OBJECTS = ("model.pt", "optimizer.pt", "trainer.pt")
"""What a resume loads besides each rank's RNG: the weights, the optimizer's state, the trainer's
(step, data position). The agent's checkpoint writer names its objects so."""

SHARDED_RESUME_OBJECTS = ("dcp.metadata", "trainer.pt")
"""What a resume of a sharded checkpoint (``manifest.sharding`` set) needs besides the shard files the
metadata points at: the torch.distributed.checkpoint metadata and the trainer's state."""


def manifest_key(step: int) -> str:
    """The key of a checkpoint's manifest relative to the job prefix."""
    return f"{checkpoint_dir(step)}/{MANIFEST_NAME}"


def parse_manifest(data: bytes, *, step: int, where: str) -> CheckpointManifest:
    """The manifest in ``data``, which must be for ``step``.

    Raises :class:`CheckpointCorrupt` naming ``where`` if it is not valid JSON,
    does not match the contract, or is for another step.
    """
    try:
        manifest = CheckpointManifest.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise CheckpointCorrupt(f"{where}: manifest does not parse ({field}: {first['msg']})") from exc
    if manifest.step != step:
        raise CheckpointCorrupt(f"{where}: manifest is for step {manifest.step}, not {step}")
    return manifest


def read_manifest(store: ObjectStore, step: int) -> CheckpointManifest:
    """The manifest of the checkpoint at ``step``.

    Raises :class:`CheckpointIncomplete` when there is none (never committed)
    and :class:`CheckpointCorrupt` when it does not parse.
    """
    key = manifest_key(step)
    try:
        data, _ = store.get_bytes(key)
    except ObjectNotFound as exc:
        raise CheckpointIncomplete(f"{store.uri(checkpoint_dir(step))}: incomplete, no {MANIFEST_NAME}") from exc
    return parse_manifest(data, step=step, where=store.uri(key))


def check_object(expected: ObjectDigest, sha256: str, size: int, *, where: str) -> None:
    """Raises :class:`CheckpointCorrupt` unless ``sha256`` and ``size`` are what the manifest recorded."""
    if size != expected.size:
        raise CheckpointCorrupt(f"{where}: size {size} bytes, the manifest says {expected.size}")
    if sha256 != expected.sha256:
        raise CheckpointCorrupt(f"{where}: sha256 {sha256} does not match the manifest's {expected.sha256}")


def read_verified(store: ObjectStore, step: int, expected: ObjectDigest) -> bytes:
    """The bytes of one object of the checkpoint at ``step``, checked against the manifest.

    Raises :class:`CheckpointCorrupt` if it is missing or differs in any bit.
    """
    key = f"{checkpoint_dir(step)}/{expected.name}"
    try:
        data, sha256 = store.get_with_sha256(key)
    except ObjectNotFound as exc:
        raise CheckpointCorrupt(f"{store.uri(key)}: listed in the manifest but missing") from exc
    check_object(expected, sha256, len(data), where=store.uri(key))
    return data


def missing_for_resume(manifest: CheckpointManifest, required: tuple[str, ...] = RESUME_OBJECTS) -> list[str]:
    """The objects of ``required`` that ``manifest`` does not list (empty: a resume finds all it needs).

    For a sharded checkpoint the default ``required`` means :data:`SHARDED_RESUME_OBJECTS`."""
    if manifest.sharding is not None and required == RESUME_OBJECTS:
        required = SHARDED_RESUME_OBJECTS
    listed = {o.name for o in manifest.objects}
    return [name for name in required if name not in listed]


def verify_objects(store: ObjectStore, manifest: CheckpointManifest) -> None:
    """Check every object ``manifest`` lists against the store.

    Each object's sha256 comes from the store's own checksum when it keeps one
    (S3), else from its bytes, hashed as they stream in, never held whole.
    Raises :class:`CheckpointCorrupt` for a missing object or one whose bytes changed.
    """
    step = manifest.step
    for expected in manifest.objects:
        key = f"{checkpoint_dir(step)}/{expected.name}"
        try:
            found = store.stored_digest(key) or store.digest(key)
        except ObjectNotFound as exc:
            raise CheckpointCorrupt(f"{store.uri(key)}: listed in the manifest but missing") from exc
        check_object(expected, *found, where=store.uri(key))


def verify_checkpoint(store: ObjectStore, step: int) -> CheckpointManifest:
    """The manifest of the checkpoint at ``step`` once every object it lists has verified (:func:`verify_objects`).

    Raises :class:`CheckpointIncomplete` (no manifest) or :class:`CheckpointCorrupt`
    (a bad manifest, a missing object, or one whose bytes changed).
    """
    manifest = read_manifest(store, step)
    verify_objects(store, manifest)
    return manifest


def check_fingerprint(manifest: CheckpointManifest, actual: str, *, where: str = "") -> None:
    """Raises :class:`CheckpointCorrupt` unless ``actual`` (the fingerprint of the loaded state) is the manifest's.

    The manifest holds the fingerprint every replica agreed on before the save;
    a loaded state that gives another one is not the state that was checked.
    """
    if not hmac.compare_digest(actual.lower(), manifest.fingerprint.lower()):
        at = f"{where}: " if where else f"step {manifest.step}: "
        raise CheckpointCorrupt(
            f"{at}the loaded state's fingerprint {actual} differs from the manifest's {manifest.fingerprint}; "
            "refusing to train from it"
        )
