"""Sharded checkpoints of an FSDP2 job: torch.distributed.checkpoint (DCP) files under a manifest.

A save (every rank calls it, at the same step) writes, in the layout of
``sdcguard.contract.checkpoint``:

- ``dcp__R_N.distcp``: the shards rank R holds of the weights and optimizer
  state, written by DCP on that rank (DCP writes a shard that several replicas
  hold once, on one of them), and ``dcp.metadata``, DCP's index, by rank 0.
  DCP's own names (``__R_N.distcp``, ``.metadata``) are not plain object
  names, so each is stored under ``dcp`` + its name;
- ``trainer.pt`` (rank 0: step, data position, the caller's extra dict) and
  ``rng-rank-NNNNN.pt`` (each rank's RNG), as for DDP;
- ``MANIFEST.json`` last, by rank 0, once every rank's objects are stored:
  every object's sha256 and size, the fingerprint all replicas agreed on (one
  digest of every shard) and, under ``sharding``, the mesh's shape and the
  agreed fingerprint of each shard position.

DCP writes to a local staging folder that is then stored object by object
(so the same code writes to S3 or a folder). A load reads the manifest on
every rank, refuses a checkpoint of another mesh shape, and fetches only the
shard files this rank's load plan reads, each verified against its sha256
before DCP opens it; then it checks this rank's loaded shards against the
manifest's fingerprint of its shard position, and the combined digest. Any
failure on any rank makes every rank raise :class:`sdcguard.lineage.errors.CheckpointCorrupt`.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sdcguard.agent.checkpoint import (
    TRAINER,
    CheckpointSaveFailed,
    Corrupter,
    LoadedCheckpoint,
    SaveResult,
    _agree_on_step,
    _collective_device,
    _from_bytes,
    _status_all,
    _to_bytes,
    rng_name,
    rng_state,
    set_rng_state,
)
from sdcguard.contract.checkpoint import CheckpointManifest, ObjectDigest, ShardedLayout, checkpoint_dir
from sdcguard.lineage.commit import commit, uncommit
from sdcguard.lineage.errors import CheckpointCorrupt, PointerConflict
from sdcguard.lineage.pointer import advance_pointer, read_pointer
from sdcguard.lineage.store import ObjectStore, open_store, sha256_hex
from sdcguard.lineage.verify import check_fingerprint, read_manifest, read_verified

log = logging.getLogger(__name__)

PREFIX = "dcp"
"""Stored names are DCP's file names behind this prefix: ``dcp.metadata``, ``dcp__0_0.distcp``."""
METADATA = PREFIX + ".metadata"
MAX_OBJECTS_PER_RANK = 32
_NAME_BYTES = 200


class CheckpointLayoutMismatch(CheckpointCorrupt):
    """The checkpoint was saved by another layout (DDP, or a mesh of another shape): refused, not resharded."""


def _put(store: ObjectStore, step: int, name: str, data: bytes, corrupt: Corrupter | None,
         rank: int) -> ObjectDigest:
    digest = ObjectDigest(name=name, sha256=sha256_hex(data), size=len(data))
    stored = corrupt(data, step=step, rank=rank) if corrupt is not None else data
    store.put_bytes(f"{checkpoint_dir(step)}/{name}", stored, sha256=digest.sha256 if corrupt is None else None)
    return digest


def _gather_objects(mine: list[ObjectDigest] | None, world: int) -> list[list[ObjectDigest] | None]:
    """Every rank's stored objects (None where a rank failed): one all-gather of fixed-width int64 rows."""
    per = 1 + 32 + _NAME_BYTES
    row = torch.zeros(2 + MAX_OBJECTS_PER_RANK * per, dtype=torch.int64, device="cpu")
    if mine is not None:
        if len(mine) > MAX_OBJECTS_PER_RANK:
            raise CheckpointSaveFailed(f"{len(mine)} objects on one rank; at most {MAX_OBJECTS_PER_RANK}")
        row[0], row[1] = 1, len(mine)
        for i, d in enumerate(mine):
            base = 2 + i * per
            name = d.name.encode()
            row[base] = d.size
            row[base + 1:base + 33] = torch.tensor(list(bytes.fromhex(d.sha256)), dtype=torch.int64,
                                                           device="cpu")
            row[base + 33:base + 33 + len(name)] = torch.tensor(list(name), dtype=torch.int64, device="cpu")
    device = _collective_device()
    rows = [torch.empty_like(row, device=device) for _ in range(world)]
    dist.all_gather(rows, row.to(device))
    out: list[list[ObjectDigest] | None] = []
    for r in rows:
        values = r.cpu().tolist()
        if not values[0]:
            out.append(None)
            continue
        digests = []
        for i in range(values[1]):
            base = 2 + i * per
            text = bytes(b for b in values[base + 33:base + 33 + _NAME_BYTES] if b).decode()
            digests.append(ObjectDigest(name=text, sha256=bytes(values[base + 1:base + 33]).hex(),
                                        size=values[base]))
        out.append(digests)
    return out


class _VerifyingReader(FileSystemReader):
    """DCP's file reader over a staging folder that fetches, and verifies, only the files a read plan needs."""

    def __init__(self, path: Path, fetch: Callable[[str], None]) -> None:
        super().__init__(path)
        self._fetch = fetch

    def read_data(self, plan: Any, planner: Any) -> Any:
        for relative in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            self._fetch(relative)
        return super().read_data(plan, planner)


class ShardPositions(Protocol):
    """What a sharded checkpoint needs of the job's mesh (sdcguard.agent.sharded's ``ShardedDataParallel`` offers it)."""

    replicas: int
    """Replica groups in the mesh."""
    shards: int
    """Shard positions per replica group."""
    coordinate: tuple[int, int]
    """(replica group, shard position) of this rank."""
    agreed_shards: list[str]
    """Each shard position's fingerprint at the replicas' last agreement."""
    @property
    def split(self) -> tuple[int, int, int]:
        """(replicas, FSDP shards, TP ranks): how the positions were made (a TP checkpoint resumes on the same)."""
        ...

    def local_fingerprint_hex(self) -> str:
        """This rank's fingerprint of its shards, as hex."""
        ...


class ShardedCheckpointWriter:
    """Saves and loads one FSDP2 job's sharded checkpoints; the same ``save``/``load`` as CheckpointWriter.

    ``positions`` gives the mesh's shape and the per-shard fingerprints (its last
    agreement, and this rank's after a load).
    """

    def __init__(self, prefix: str | ObjectStore, *, positions: ShardPositions, client: Any = None, written_by: str = "",
                 advance_pointer: bool = True, corrupt: Corrupter | None = None) -> None:
        self.store = prefix if isinstance(prefix, ObjectStore) else open_store(prefix, client=client)
        self.positions = positions
        self.written_by = written_by
        self.advance_pointer = advance_pointer
        self.corrupt = corrupt
        self.pointer_etag: str | None = None
        self._pointer_known = False

    # -- save -----------------------------------------------------------------------------------------

    def save(self, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             fingerprint: str, data_position: Any = None, extra: dict[str, Any] | None = None,
             last_clean_audit_step: int | None = None, last_clean_fingerprint_step: int | None = None,
             ) -> SaveResult:
        """Save the state a resumed job needs to run ``step`` next; every rank calls it together.

        Raises :class:`CheckpointSaveFailed` on every rank when any rank could
        not write or store its part, or rank 0 could not commit (nothing is
        committed then). The pointer moves as for DDP checkpoints.
        """
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        if optimizer is None:
            raise ValueError("optimizer: a sharded checkpoint needs the optimizer (its state is sharded too)")
        store, rank, world = self.store, dist.get_rank(), dist.get_world_size()
        where = store.uri(checkpoint_dir(step))
        if rank == 0 and not self._pointer_known:
            self.pointer_etag = read_pointer(store)[1]
            self._pointer_known = True
        problem: BaseException | None = None
        stored: list[ObjectDigest] | None = []  # None once this rank failed
        staging = Path(tempfile.mkdtemp(prefix="sdcguard-dcp-"))
        try:
            if rank == 0:
                uncommit(store, step)  # a reader must never pair an old manifest with new objects
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state},
                     storage_writer=FileSystemWriter(staging, single_file_per_rank=True, sync_files=False,
                                                     thread_count=1))
        except (Exception, CheckpointException) as exc:  # DCP raises on every rank when one fails
            problem = exc
        if problem is None:
            try:
                assert stored is not None
                for path in sorted(p for p in staging.iterdir() if p.is_file() and not p.name.endswith(".tmp")):
                    stored.append(_put(store, step, PREFIX + path.name, path.read_bytes(), self.corrupt, rank))
                if rank == 0:
                    # The mesh's split: the manifest records the replicas and positions, not how FSDP and TP
                    # made the positions, which a resume must match.
                    trainer = {"step": step, "data_position": data_position, "extra": dict(extra or {}),
                               "mesh": list(self.positions.split)}
                    stored.append(_put(store, step, TRAINER, _to_bytes(trainer), self.corrupt, rank))
                stored.append(_put(store, step, rng_name(rank), _to_bytes(rng_state()), self.corrupt, rank))
            except Exception as exc:
                problem = exc
        shutil.rmtree(staging, ignore_errors=True)
        if problem is not None:
            log.error("rank %d could not store its part of %s: %s", rank, where, problem)
            stored = None
        gathered = _gather_objects(stored, world)
        failed = [r for r, objects in enumerate(gathered) if objects is None]
        if failed:
            raise CheckpointSaveFailed(f"{where}: rank(s) {failed} failed to store their part; not committed") \
                from problem
        manifest: CheckpointManifest | None = None
        if rank == 0:
            try:
                manifest = CheckpointManifest(
                    step=step, world_size=world, fingerprint=fingerprint,
                    objects=[d for objects in gathered if objects for d in objects],
                    last_clean_audit_step=last_clean_audit_step,
                    last_clean_fingerprint_step=last_clean_fingerprint_step,
                    written_by=(self.written_by or f"sdcguard agent rank 0 on {socket.gethostname()}")[:256],
                    sharding=ShardedLayout(replicas=self.positions.replicas, shards=self.positions.shards,
                                           shard_fingerprints=list(self.positions.agreed_shards)),
                )
                commit(store, manifest)
            except Exception as exc:
                problem = exc
        if _status_all(problem is not None):
            raise CheckpointSaveFailed(f"{where}: rank 0 could not commit the manifest: {problem}") from problem
        advanced = False
        if rank == 0 and self.advance_pointer:
            try:
                _, self.pointer_etag = advance_pointer(
                    store, step, expected_etag=self.pointer_etag, reason=f"checkpoint saved at step {step}",
                    written_by=manifest.written_by if manifest else "sdcguard agent")
                advanced = True
            except PointerConflict as exc:
                log.warning("checkpoint %s saved, resume pointer left alone: %s", where, exc)
            except Exception as exc:  # committed; a later save moves the pointer
                log.error("checkpoint %s saved, but the resume pointer could not be moved: %s", where, exc)
        return SaveResult(step, where, manifest, self.pointer_etag, advanced)

    # -- load -----------------------------------------------------------------------------------------

    def load(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             step: int | None = None, fingerprint_fn: Callable[[], str] | None = None,
             restore_rng: bool = True) -> LoadedCheckpoint | None:
        """Load the checkpoint to resume from (``step``, else the pointer's, else the newest committed one).

        Returns None when there is none. Raises :class:`CheckpointLayoutMismatch`
        on every rank for a checkpoint of another mesh shape or a replicated
        (DDP) one, and :class:`CheckpointCorrupt` on every rank when a file it
        reads fails its sha256, this rank's loaded shards differ from the
        fingerprint the replicas agreed on for its shard position, or
        ``fingerprint_fn`` (a collective) differs from the manifest's.
        """
        if optimizer is None:
            raise ValueError("optimizer: a sharded checkpoint needs the optimizer (its state is sharded too)")
        store, rank = self.store, dist.get_rank()
        chosen, source, pointer, etag = _agree_on_step(self.store, step)
        if rank == 0:
            self.pointer_etag = etag if source == "pointer" else read_pointer(store)[1]
            self._pointer_known = True
        if chosen is None:
            return None
        where = store.uri(checkpoint_dir(chosen))
        problem: Exception | None = None
        manifest: CheckpointManifest | None = None
        try:
            manifest = read_manifest(store, chosen)
            self._check_layout(manifest, where)
        except Exception as exc:
            problem = exc
        if _status_all(problem is not None):
            raise problem or CheckpointCorrupt(f"{where}: another rank could not read or accept its manifest")
        assert manifest is not None
        trainer: dict[str, Any] = {}
        failure: BaseException | None = None
        try:
            trainer = self._load_state(store, chosen, manifest, model, optimizer, restore_rng, where)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            failure = exc
        if _status_all(failure is not None):
            raise _as_corrupt(failure, where) if failure else CheckpointCorrupt(
                f"{where}: another rank could not verify or load its shards; refusing to train")
        assert manifest.sharding is not None
        mine = self.positions.local_fingerprint_hex()
        expected = manifest.sharding.shard_fingerprints[self.positions.coordinate[1]]
        if mine != expected:
            problem = CheckpointCorrupt(f"{where}: rank {rank}'s loaded shard (position {self.positions.coordinate[1]}) "
                                        f"has fingerprint {mine}, the replicas agreed on {expected} before the "
                                        "save; refusing to train from it")
        if _status_all(problem is not None):
            raise problem or CheckpointCorrupt(f"{where}: another rank's loaded shard has the wrong fingerprint")
        if fingerprint_fn is not None:
            try:
                check_fingerprint(manifest, fingerprint_fn(), where=where)
            except CheckpointCorrupt as exc:
                problem = exc
            if _status_all(problem is not None):
                raise problem or CheckpointCorrupt(f"{where}: the loaded shards do not give the manifest's digest")
        log.info("resumed from %s (%s) at step %d", where, source, chosen)
        return LoadedCheckpoint(step=chosen, uri=where, manifest=manifest, source=source,
                                data_position=trainer.get("data_position"), extra=dict(trainer.get("extra") or {}),
                                pointer=pointer, pointer_etag=etag)

    def _check_layout(self, manifest: CheckpointManifest, where: str) -> None:
        layout, mesh = manifest.sharding, self.positions
        if layout is None:
            raise CheckpointLayoutMismatch(f"{where}: a replicated (DDP) checkpoint; this job is sharded "
                                           f"({mesh.replicas} x {mesh.shards}): refusing to load it")
        if (layout.replicas, layout.shards) != (mesh.replicas, mesh.shards):
            raise CheckpointLayoutMismatch(
                f"{where}: saved by {layout.replicas} replica group(s) of {layout.shards} shard(s); this job runs "
                f"{mesh.replicas} of {mesh.shards}. Its per-shard fingerprints apply only to the mesh that saved "
                "it: start the job on the same mesh shape (a replaced node keeps it)")

    def _load_state(self, store: ObjectStore, step: int, manifest: CheckpointManifest, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, restore_rng: bool, where: str) -> dict[str, Any]:
        by_name = {o.name: o for o in manifest.objects}
        staging = Path(tempfile.mkdtemp(prefix="sdcguard-dcp-"))

        def fetch(relative: str) -> None:
            name = PREFIX + relative
            if name not in by_name:
                raise CheckpointCorrupt(f"{where}: DCP reads {relative}, which the manifest does not list")
            target = staging / relative
            if not target.exists():
                target.write_bytes(read_verified(store, step, by_name[name]))

        def load(name: str) -> Any:
            if name not in by_name:
                raise CheckpointCorrupt(f"{where}: the manifest lists no {name}")
            return _from_bytes(read_verified(store, step, by_name[name]), name=name, where=where,
                               map_location="cpu")

        try:
            fetch(METADATA[len(PREFIX):])
            trainer = load(TRAINER)
            if trainer.get("step") != step:
                raise CheckpointCorrupt(f"{where}/{TRAINER}: holds step {trainer.get('step')}, not {step}")
            saved = tuple(trainer.get("mesh") or ())
            if saved and saved != tuple(self.positions.split):
                # Before anything is loaded: the same positions made by another FSDP x TP split hold other bits.
                raise CheckpointLayoutMismatch(
                    f"{where}: saved by a mesh of {saved[0]} replica(s) x {saved[1]} shard(s) x TP {saved[2]}; "
                    f"this job runs {' x '.join(map(str, self.positions.split))}. Its per-position fingerprints "
                    "apply only to that split: start the job on the same mesh shape")
            model_state, optim_state = get_state_dict(model, optimizer)
            # DCP loads in place, into the tensors of these two dicts.
            dcp.load({"model": model_state, "optim": optim_state}, storage_reader=_VerifyingReader(staging, fetch))
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
            if restore_rng:
                if rng_name(dist.get_rank()) in by_name:
                    set_rng_state(load(rng_name(dist.get_rank())))
                else:
                    log.warning("%s holds no RNG state for rank %d; it keeps its own", where, dist.get_rank())
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return dict(trainer)


def _as_corrupt(problem: BaseException, where: str) -> BaseException:
    """DCP wraps a rank's failure in its CheckpointException on every rank: say what it was, as CheckpointCorrupt."""
    if isinstance(problem, CheckpointCorrupt):
        return problem
    causes = getattr(problem, "failures", None)
    if isinstance(causes, dict):
        for rank, cause in sorted(causes.items()):
            exc = cause[0] if isinstance(cause, tuple) else cause
            if isinstance(exc, CheckpointCorrupt):
                return CheckpointCorrupt(f"{exc} (read by rank {rank})")
    return CheckpointCorrupt(f"{where}: could not load it: {problem}")


__all__ = ["CheckpointLayoutMismatch", "ShardedCheckpointWriter"]
