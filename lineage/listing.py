"""Which checkpoints exist under a job prefix, and which of them are committed.

Built for prefixes holding thousands of checkpoints: one paginated listing,
no per-checkpoint requests. :func:`checkpoint_steps` lists with a ``/``
delimiter, so S3 returns one entry per checkpoint folder rather than one per
object; :func:`list_checkpoints` lists every key once to learn which folders
hold a manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sdcguard.contract.checkpoint import CHECKPOINTS_DIR, MANIFEST_NAME, checkpoint_dir, step_of_dir
from sdcguard.lineage.store import ObjectStore


@dataclass(frozen=True)
class CheckpointFolder:
    """One ``checkpoints/step-NNNNNNNNN/`` folder as the listing saw it."""

    step: int
    objects: tuple[str, ...] = field(default=())
    """Names of the objects in the folder, sorted."""

    @property
    def dir(self) -> str:
        """The folder relative to the job prefix: ``checkpoints/step-000001200``."""
        return checkpoint_dir(self.step)

    @property
    def committed(self) -> bool:
        """Whether the manifest is there: a folder without one is an incomplete checkpoint."""
        return MANIFEST_NAME in self.objects


def checkpoint_steps(store: ObjectStore) -> list[int]:
    """The steps of every checkpoint folder (committed or not), ascending; folders with other names are ignored."""
    steps = {step_of_dir(d) for d in store.list_dirs(f"{CHECKPOINTS_DIR}/")}
    return sorted(s for s in steps if s is not None)


def list_checkpoints(store: ObjectStore) -> list[CheckpointFolder]:
    """Every checkpoint folder with the objects it holds, ascending by step."""
    folders: dict[int, list[str]] = {}
    for key in store.list(f"{CHECKPOINTS_DIR}/"):
        folder, _, name = key.rpartition("/")
        step = step_of_dir(folder)
        if step is not None and name:
            folders.setdefault(step, []).append(name)
    return [CheckpointFolder(step, tuple(sorted(names))) for step, names in sorted(folders.items())]


def newest_committed(store: ObjectStore) -> int | None:
    """The step of the newest committed checkpoint (manifest present, not verified), or None."""
    for step in reversed(checkpoint_steps(store)):
        if store.exists(f"{checkpoint_dir(step)}/{MANIFEST_NAME}"):
            return step
    return None
