"""Writing a checkpoint: objects first, each with its sha256, then the manifest that commits it.

Torch-free, so the agent's writer and the tests share the one sequence that
makes a checkpoint trustworthy: a reader that sees the manifest sees objects
whose digests it lists.
"""

from __future__ import annotations

from sdcguard.contract.checkpoint import CheckpointManifest, ObjectDigest, checkpoint_dir
from sdcguard.lineage.store import ObjectStore, sha256_hex
from sdcguard.lineage.verify import manifest_key


def put_object(store: ObjectStore, step: int, name: str, data: bytes) -> ObjectDigest:
    """Store one state object of the checkpoint at ``step`` and return its digest for the manifest.

    Raises :class:`ValueError` (from the contract) for a name that is not a
    plain file name, before anything is written.
    """
    digest = ObjectDigest(name=name, sha256=sha256_hex(data), size=len(data))
    store.put_bytes(f"{checkpoint_dir(step)}/{name}", data, sha256=digest.sha256)
    return digest


def uncommit(store: ObjectStore, step: int) -> None:
    """Remove the manifest at ``step`` (if any) before its objects are overwritten.

    A job that resumes from an earlier checkpoint writes the same steps again;
    without this, a reader could pair the old manifest with new objects (which
    would fail verification, but would also hide the old checkpoint's state).
    """
    store.delete(manifest_key(step))


def commit(store: ObjectStore, manifest: CheckpointManifest) -> str:
    """Write the manifest last, which commits the checkpoint; returns its entity tag."""
    return store.put_bytes(manifest_key(manifest.step), manifest.model_dump_json(indent=2).encode())
