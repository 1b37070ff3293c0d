"""Checking a checkpoint against its manifest.

A committed checkpoint is trusted only if its manifest parses, names the step
of its folder, and every object it lists is present with exactly the sha256 and
size recorded; and, once loaded, the weights give the fingerprint that all
replicas agreed on before the save (:func:`check_fingerprint`).
"""

from __future__ import annotations

import hmac

from pydantic import ValidationError

from contract.checkpoint import MANIFEST_NAME, CheckpointManifest, ObjectDigest, checkpoint_dir
from lineage.errors import CheckpointCorrupt, CheckpointIncomplete, ObjectNotFound
from lineage.store import ObjectStore


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


def verify_checkpoint(store: ObjectStore, step: int) -> CheckpointManifest:
    """The manifest of the checkpoint at ``step`` once every object it lists has verified.

    Objects are hashed as they stream in, never held whole. Raises
    :class:`CheckpointIncomplete` (no manifest) or :class:`CheckpointCorrupt`
    (a bad manifest, a missing object, or one whose bytes changed).
    """
    manifest = read_manifest(store, step)
    for expected in manifest.objects:
        key = f"{checkpoint_dir(step)}/{expected.name}"
        try:
            sha256, size = store.digest(key)
        except ObjectNotFound as exc:
            raise CheckpointCorrupt(f"{store.uri(key)}: listed in the manifest but missing") from exc
        check_object(expected, sha256, size, where=store.uri(key))
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
