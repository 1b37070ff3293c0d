"""Checkpoints written and read by the training job, in the layout of ``sdcguard.contract.checkpoint``.

A save (every rank calls it, at the same step) writes:

- ``model.pt``, ``optimizer.pt`` and ``trainer.pt`` (step, data position and
  the caller's extra dict): replicated DDP state, written by rank 0 alone;
- ``rng-rank-NNNNN.pt``: each rank's own RNG states (torch CPU, CUDA when
  present, Python's ``random``), written by that rank;
- ``MANIFEST.json`` last, by rank 0, once every rank's object is stored: the
  sha256 and size of every object, the fingerprint the replicas agreed on
  before the save, and the last clean audit and fingerprint steps. Its
  presence commits the checkpoint; then rank 0 advances the resume pointer
  unless someone else (the pipeline) moved it since this job last saw it.

A load reads the resume pointer (or, without one, takes the newest committed
checkpoint), checks every object's sha256 before ``torch.load`` (always with
``weights_only=True``), restores the state, and, given a fingerprint function,
checks that the loaded state gives the manifest's fingerprint. Any failure on
any rank makes every rank raise :class:`CheckpointCorrupt`: the job refuses to
train from it.

Every collective runs in the ``group`` given (default: the whole world), on
the ``device`` given (the rank's; by default the GPU of ``LOCAL_RANK`` under
NCCL, the CPU under gloo), and "rank 0" is the group's first rank. A store that fails (an S3 outage) makes
every rank raise :class:`CheckpointSaveFailed` together, never a raw error on
one rank while the others go on; the guard retries and then applies its
policy (``GuardConfig.on_checkpoint_failure``). A failure to build the state
(a ``state_dict()`` or a state-dict hook that raises, an object that does not
pickle) is no storage failure and is never retried: the rank that failed
raises its own exception, with its traceback, and every other rank
:class:`CheckpointStateError`, which names it (see :func:`is_storage_error`).

Only replicated state is supported (plain DDP with an unsharded optimizer).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import random
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from sdcguard.contract.checkpoint import CheckpointManifest, ObjectDigest, ResumePointer, checkpoint_dir
from sdcguard.lineage.commit import commit, put_object, uncommit
from sdcguard.lineage.errors import CheckpointCorrupt, LineageError, PointerConflict
from sdcguard.lineage.listing import newest_committed
from sdcguard.lineage.pointer import advance_pointer, read_pointer
from sdcguard.lineage.store import ObjectStore, open_store, sha256_hex
from sdcguard.lineage.verify import check_fingerprint, read_manifest, read_verified

log = logging.getLogger(__name__)

MODEL = "model.pt"
_FINGERPRINT = re.compile(r"[0-9a-f]{16,128}")
OPTIMIZER = "optimizer.pt"
TRAINER = "trainer.pt"

# A hook that may alter an object's bytes after they were digested and before
# they are stored (fault injection for drills: sdcguard.agent.testing.inject.corrupt_checkpoint_bytes).
Corrupter = Callable[..., bytes]


def rng_name(rank: int) -> str:
    """The name of ``rank``'s RNG object inside a checkpoint folder."""
    return f"rng-rank-{rank:05d}.pt"


class CheckpointSaveFailed(LineageError):
    """A rank could not store its part of a checkpoint; the checkpoint was not committed."""


class CheckpointStateError(RuntimeError):
    """Another rank could not build its part of a checkpoint's state (not a storage failure: never retried).

    Raised on the ranks that did not fail; the failing rank raises its own exception. Nothing was committed."""

    def __init__(self, message: str, *, failed: dict[int, str]) -> None:
        super().__init__(message)
        self.failed = dict(failed)
        """What each failing rank raised, by rank: ``"TypeName: message"``."""


def is_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure to store (worth a retry): the object store's own errors
    (:class:`sdcguard.lineage.errors.LineageError`), botocore's and boto3's client and endpoint errors, and
    :class:`OSError` (a connection refused or reset, a full disk). Anything else (a state-dict hook that raises,
    an object that does not pickle) is a bug a retry cannot fix."""
    if isinstance(exc, (LineageError, OSError)):
        return True
    # By module, so that the agent need not import botocore (a local-folder store works without it).
    return any(cls.__module__.split(".")[0] in ("botocore", "boto3") for cls in type(exc).__mro__)


STORED, STORE_FAILED, STATE_FAILED = 1, 0, 2
"""What a rank reports of its part of a save: stored, failed to store (retry), failed to build its state (raise)."""
_DESCRIPTION_BYTES = 240


def describe(exc: BaseException) -> str:
    """``"TypeName: message"``, as the other ranks' :class:`CheckpointStateError` names a failure."""
    return f"{type(exc).__name__}: {exc}"


def encode_description(text: str) -> torch.Tensor:
    """``text`` (UTF-8, cut to a fixed width) as int64s, to travel in a save's one all-gather."""
    row = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.int64, device="cpu")
    data = text.encode()[:_DESCRIPTION_BYTES]
    if data:
        row[:len(data)] = torch.tensor(list(data), dtype=torch.int64, device="cpu")
    return row


def decode_description(values: list[int]) -> str:
    """What :func:`encode_description` encoded (a character cut in half is dropped)."""
    return bytes(b for b in values[:_DESCRIPTION_BYTES] if b).decode(errors="ignore")


def raise_state_failure(where: str, rank: int, own: BaseException | None, failed: dict[int, str]) -> None:
    """Raise the save's state failure on this rank: its own exception where it failed (traceback intact), else
    :class:`CheckpointStateError` naming every failing rank and what it raised."""
    if rank in failed and own is not None:
        raise own
    named = "; ".join(f"rank {r}: {text}" for r, text in sorted(failed.items()))
    raise CheckpointStateError(f"{where}: rank(s) {sorted(failed)} could not build their checkpoint state "
                               f"({named}); nothing committed, not retried", failed=failed)


@dataclass(frozen=True)
class SaveResult:
    """What a save left behind."""

    step: int
    uri: str
    manifest: CheckpointManifest | None
    """The manifest on rank 0; None on the other ranks (they never see it)."""
    pointer_etag: str | None
    """The resume pointer's entity tag after the save (pass it to the next save)."""
    pointer_advanced: bool


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint that verified and whose state is now in the model and optimizer."""

    step: int
    """The first step to run."""
    uri: str
    manifest: CheckpointManifest
    source: Literal["pointer", "newest", "explicit"]
    data_position: Any
    extra: dict[str, Any] = field(default_factory=dict)
    pointer: ResumePointer | None = None
    pointer_etag: str | None = None


Group = dist.ProcessGroup | None


def _rank_world(group: Group = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _first_rank(group: Group) -> int:
    """The global rank of the group's rank 0 (what ``broadcast`` wants as its source)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def _collective_device(device: torch.device | None = None, group: Group = None) -> torch.device:
    """Where this rank's collective tensors live: ``device`` (the guard passes the rank's), else by the
    group's backend: for NCCL the GPU of ``LOCAL_RANK`` (the current device need not be the rank's: NCCL
    would then run the collective on another rank's GPU), the current one only without ``LOCAL_RANK`` or
    where that GPU is not visible; the CPU for gloo."""
    if device is not None:
        return device
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit() and int(local) < torch.cuda.device_count():
        return torch.device("cuda", int(local))
    return torch.device("cuda", torch.cuda.current_device())


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes, *, name: str, where: str, map_location: Any) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as exc:
        raise CheckpointCorrupt(f"{where}/{name}: torch.load(weights_only=True) refused it: {exc}") from exc


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, every CUDA device (if any), Python's ``random``."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (CUDA states only where CUDA is present)."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    python = state["python"]
    # torch.load turns the inner tuple into a list; random.setstate wants tuples.
    random.setstate((python[0], tuple(python[1]), python[2]))


def _status_all(failed: bool, group: Group = None, device: torch.device | None = None) -> bool:
    """Whether any rank failed (a collective when distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64, device=_collective_device(device, group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _gather_digests(digest: ObjectDigest | None, world: int, group: Group = None,
                    device: torch.device | None = None, *, status: int | None = None, description: str = "",
                    ) -> tuple[list[ObjectDigest | None], dict[int, int], dict[int, str]]:
    """Every rank's RNG object digest (None where that rank failed), what each rank reports (``STORED``,
    ``STORE_FAILED``, ``STATE_FAILED``) and the failing ranks' descriptions: one all-gather of int64s."""
    row = torch.zeros(34 + _DESCRIPTION_BYTES, dtype=torch.int64, device="cpu")
    row[0] = status if status is not None else (STORED if digest is not None else STORE_FAILED)
    if digest is not None:
        row[1] = digest.size
        row[2:34] = torch.tensor(list(bytes.fromhex(digest.sha256)), dtype=torch.int64, device="cpu")
    row[34:] = encode_description(description)
    if world == 1:
        rows = [row]
    else:
        where = _collective_device(device, group)
        rows = [torch.empty_like(row, device=where) for _ in range(world)]
        dist.all_gather(rows, row.to(where), group=group)
    out: list[ObjectDigest | None] = []
    statuses: dict[int, int] = {}
    descriptions: dict[int, str] = {}
    for rank, r in enumerate(rows):
        values = r.cpu().tolist()
        statuses[rank] = values[0]
        if values[0] != STORED:
            out.append(None)
            descriptions[rank] = decode_description(values[34:])
            continue
        out.append(ObjectDigest(name=rng_name(rank), sha256=bytes(values[2:34]).hex(), size=values[1]))
    return out, statuses, descriptions


def _put(store: ObjectStore, step: int, name: str, data: bytes, corrupt: Corrupter | None, rank: int) -> ObjectDigest:
    if corrupt is None:
        return put_object(store, step, name, data)
    digest = ObjectDigest(name=name, sha256=sha256_hex(data), size=len(data))
    store.put_bytes(f"{checkpoint_dir(step)}/{name}", corrupt(data, step=step, rank=rank))
    return digest


def save_checkpoint(
    store: ObjectStore,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    fingerprint: str,
    data_position: Any = None,
    extra: dict[str, Any] | None = None,
    last_clean_audit_step: int | None = None,
    last_clean_fingerprint_step: int | None = None,
    pointer_etag: str | None = None,
    advance: bool = True,
    written_by: str = "",
    corrupt: Corrupter | None = None,
    group: Group = None,
    device: torch.device | None = None,
) -> SaveResult:
    """Save the state a resumed job needs to run ``step`` next; every rank calls it together.

    ``fingerprint`` is the hex fingerprint all replicas agreed on just before
    (the guard's weight check). ``data_position`` and ``extra`` must be plain
    values (numbers, strings, tensors, lists, dicts). With ``advance``, rank 0
    moves the resume pointer to this checkpoint if it is still at
    ``pointer_etag`` (what this job last read or wrote); if someone else moved
    it, it stays where they put it and a warning is logged.

    Raises :class:`ValueError` for a negative step, and
    :class:`CheckpointSaveFailed` on every rank when any rank failed to store
    its part (:func:`is_storage_error`) or rank 0 failed to commit the
    manifest (nothing is committed then; the cause is chained). When a rank
    could not build its state (``state_dict()`` raised, an object would not
    pickle), that rank raises its own exception and every other rank
    :class:`CheckpointStateError`; nothing is committed, and no caller should
    retry it. A failure to move the pointer after the
    commit is logged, not raised: the checkpoint is there, the pointer lags.
    """
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise ValueError(f"fingerprint: {fingerprint!r} is not 16-128 lowercase hex digits")
    rank, world = _rank_world(group)
    where = store.uri(checkpoint_dir(step))
    problem: BaseException | None = None
    status = STORED
    own: ObjectDigest | None = None
    replicated: list[ObjectDigest] = []
    parts: list[tuple[str, bytes]] = []
    try:
        # The state first, apart from the store: a failure here is a bug a retry cannot fix.
        if rank == 0:
            module = _unwrap(model)
            parts.append((MODEL, _to_bytes(module.state_dict())))
            if optimizer is not None:
                parts.append((OPTIMIZER, _to_bytes(optimizer.state_dict())))
            trainer = {"step": step, "data_position": data_position, "extra": dict(extra or {})}
            parts.append((TRAINER, _to_bytes(trainer)))
        rng = _to_bytes(rng_state())
    except Exception as exc:
        problem, status = exc, STATE_FAILED
        log.exception("rank %d could not build its part of %s", rank, where)
    if problem is None:
        try:
            if rank == 0:
                # Uncommit first: a reader must never pair an old manifest with new objects.
                uncommit(store, step)
                replicated = [_put(store, step, name, data, corrupt, rank) for name, data in parts]
            own = _put(store, step, rng_name(rank), rng, corrupt, rank)
        except Exception as exc:
            problem, own = exc, None
            status = STORE_FAILED if is_storage_error(exc) else STATE_FAILED
            if status == STORE_FAILED:
                log.error("rank %d could not store its part of %s: %s", rank, where, exc)
            else:
                log.exception("rank %d failed storing its part of %s (not a storage error)", rank, where)
    digests, statuses, descriptions = _gather_digests(own, world, group, device, status=status,
                                                      description=describe(problem) if problem else "")
    # Every rank sees the same gathered rows, so every rank reaches the same verdict here.
    state_failed = {r: descriptions[r] for r, s in statuses.items() if s == STATE_FAILED}
    if state_failed:
        raise_state_failure(where, rank, problem, state_failed)
    failed_ranks = [r for r, d in enumerate(digests) if d is None]
    if failed_ranks:
        raise CheckpointSaveFailed(f"{where}: rank(s) {failed_ranks} failed to store their part; not committed") from problem
    manifest: CheckpointManifest | None = None
    etag_after = pointer_etag
    advanced = False
    if rank == 0:
        try:
            manifest = CheckpointManifest(
                step=step,
                world_size=world,
                fingerprint=fingerprint,
                objects=[*replicated, *(d for d in digests if d is not None)],
                last_clean_audit_step=last_clean_audit_step,
                last_clean_fingerprint_step=last_clean_fingerprint_step,
                written_by=(written_by or f"sdcguard agent rank 0 on {socket.gethostname()}")[:256],
            )
            commit(store, manifest)
        except Exception as exc:
            problem = exc
    if _status_all(problem is not None, group, device):
        raise CheckpointSaveFailed(f"{where}: rank 0 could not commit the manifest: {problem}") from problem
    if rank == 0 and advance:
        try:
            _, etag_after = advance_pointer(
                store,
                step,
                expected_etag=pointer_etag,
                reason=f"checkpoint saved at step {step}",
                written_by=manifest.written_by if manifest else "sdcguard agent",
            )
            advanced = True
        except PointerConflict as exc:
            log.warning("checkpoint %s saved, resume pointer left alone: %s", where, exc)
        except Exception as exc:  # the checkpoint is committed; a later save moves the pointer
            log.error("checkpoint %s saved, but the resume pointer could not be moved: %s", where, exc)
    return SaveResult(step, where, manifest, etag_after, advanced)


Source = Literal["pointer", "newest", "explicit"]
_SOURCES: tuple[Source, ...] = ("pointer", "newest", "explicit")


def _agree_on_step(store: ObjectStore, step: int | None, group: Group = None, device: torch.device | None = None,
                   ) -> tuple[int | None, Source, ResumePointer | None, str | None]:
    """Rank 0 (of ``group``) chooses the checkpoint (``_choose_step``) and tells the others: every rank gets the
    step (None: a fresh start) and its source; the pointer and its etag are rank 0's alone.

    Raises on every rank when rank 0 could not read the store: its own error on rank 0, CheckpointCorrupt
    on the others (told, so that no rank waits forever on rank 0)."""
    rank, world = _rank_world(group)
    chosen: int | None = None
    source: Source = "pointer"
    pointer: ResumePointer | None = None
    etag: str | None = None
    unreadable: Exception | None = None
    if rank == 0:
        try:
            chosen, source, pointer, etag = _choose_step(store, step)
        except Exception as exc:
            unreadable = exc
    if world > 1:
        code = -2 if unreadable is not None else (-1 if chosen is None else chosen)
        box = torch.tensor([code, _SOURCES.index(source)], dtype=torch.int64,
                           device=_collective_device(device, group))
        dist.broadcast(box, src=_first_rank(group), group=group)
        value, kind = box.cpu().tolist()
        if value == -2 and unreadable is None:
            raise CheckpointCorrupt(f"{store.uri()}: rank 0 could not read the resume pointer or the listing")
        chosen = None if value < 0 else int(value)
        source = _SOURCES[kind]
    if unreadable is not None:
        raise unreadable
    return chosen, source, pointer, etag


def _choose_step(store: ObjectStore, step: int | None) -> tuple[int | None, Source, ResumePointer | None, str | None]:
    if step is not None:
        return step, "explicit", None, None
    pointer, etag = read_pointer(store)
    if pointer is not None:
        return pointer.step, "pointer", pointer, etag
    return newest_committed(store), "newest", None, None


def load_checkpoint(
    store: ObjectStore,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    fingerprint_fn: Callable[[], str] | None = None,
    restore_rng: bool = True,
    map_location: Any = "cpu",
    group: Group = None,
    device: torch.device | None = None,
) -> LoadedCheckpoint | None:
    """Load the checkpoint to resume from into ``model`` and ``optimizer``; every rank calls it together.

    The checkpoint is ``step`` if given, else the resume pointer's, else the
    newest committed one; rank 0 decides and tells the others. Returns None
    when there is no pointer and no committed checkpoint (a fresh start).
    Every object is checked against the manifest's sha256 and size before it
    is unpickled; ``fingerprint_fn`` (a collective, if it is one, called on
    every rank after loading) must return the manifest's fingerprint.

    Raises :class:`CheckpointCorrupt` on every rank if anything fails on any
    rank: a missing manifest or object, changed bytes, a fingerprint that
    differs. The model may be partly loaded then; do not train from it.
    """
    rank, world = _rank_world(group)
    chosen, source, pointer, etag = _agree_on_step(store, step, group, device)
    if chosen is None:
        return None
    where = store.uri(checkpoint_dir(chosen))
    problem: Exception | None = None
    loaded: LoadedCheckpoint | None = None
    try:
        loaded = _load_verified(store, chosen, rank, world, model, optimizer, restore_rng, map_location, where)
    except Exception as exc:
        # Held until every rank has reported, so that no rank waits forever on one that gave up.
        problem = exc
    if _status_all(problem is not None, group, device):
        raise problem or CheckpointCorrupt(f"{where}: another rank could not verify or load it; refusing to train")
    assert loaded is not None
    if fingerprint_fn is not None:
        actual = fingerprint_fn()
        try:
            check_fingerprint(loaded.manifest, actual, where=where)
        except CheckpointCorrupt as exc:
            problem = exc
        if _status_all(problem is not None, group, device):
            raise problem or CheckpointCorrupt(f"{where}: another rank's loaded state has the wrong fingerprint")
    log.info("resumed from %s (%s) at step %d", where, source, chosen)
    return LoadedCheckpoint(
        step=chosen,
        uri=where,
        manifest=loaded.manifest,
        source=source,
        data_position=loaded.data_position,
        extra=loaded.extra,
        pointer=pointer,
        pointer_etag=etag,
    )


def _load_verified(
    store: ObjectStore,
    step: int,
    rank: int,
    world: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    restore_rng: bool,
    map_location: Any,
    where: str,
) -> LoadedCheckpoint:
    manifest = read_manifest(store, step)
    by_name = {o.name: o for o in manifest.objects}
    if rank == 0:
        # Rank 0 vouches for the objects it does not load itself (the other ranks' RNG).
        for digest in manifest.objects:
            if digest.name.startswith("rng-rank-") and digest.name != rng_name(0):
                read_verified(store, step, digest)

    def load(name: str) -> Any:
        if name not in by_name:
            raise CheckpointCorrupt(f"{where}: the manifest lists no {name}")
        return _from_bytes(read_verified(store, step, by_name[name]), name=name, where=where, map_location=map_location)

    trainer = load(TRAINER)
    if trainer.get("step") != step:
        raise CheckpointCorrupt(f"{where}/{TRAINER}: holds step {trainer.get('step')}, not {step}")
    try:
        _unwrap(model).load_state_dict(load(MODEL))
        if optimizer is not None:
            optimizer.load_state_dict(load(OPTIMIZER))
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointCorrupt(f"{where}: its state does not fit this model/optimizer: {exc}") from exc
    if restore_rng:
        if rng_name(rank) in by_name:
            set_rng_state(load(rng_name(rank)))
        else:
            log.warning("%s was saved by %d ranks; rank %d keeps its own RNG state", where, manifest.world_size, rank)
    if manifest.world_size != world:
        log.warning("%s was saved by %d ranks, loading into %d", where, manifest.world_size, world)
    return LoadedCheckpoint(
        step=step,
        uri=where,
        manifest=manifest,
        source="explicit",
        data_position=trainer.get("data_position"),
        extra=dict(trainer.get("extra") or {}),
    )


class CheckpointWriter:
    """Saves and loads one job's checkpoints, remembering the resume pointer it last saw.

    ``prefix`` is ``s3://bucket/prefix`` or a directory (or an ObjectStore);
    ``client`` is the S3 client to use. Load before the first save, so that
    the pointer this job resumed from is the one its saves may advance.
    """

    def __init__(
        self,
        prefix: str | ObjectStore,
        *,
        client: Any = None,
        written_by: str = "",
        advance_pointer: bool = True,
        corrupt: Corrupter | None = None,
        group: Group = None,
        device: torch.device | None = None,
    ) -> None:
        self.group = group
        self.device = device
        """Where this rank's collective tensors live (the guard passes the rank's device); None: by the backend,
        for NCCL the GPU of LOCAL_RANK."""
        self.store = prefix if isinstance(prefix, ObjectStore) else open_store(prefix, client=client)
        self.written_by = written_by
        self.advance_pointer = advance_pointer
        self.corrupt = corrupt
        self.pointer_etag: str | None = None
        self._pointer_known = False

    def load(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
        fingerprint_fn: Callable[[], str] | None = None,
        restore_rng: bool = True,
    ) -> LoadedCheckpoint | None:
        """:func:`load_checkpoint` on this job's prefix; remembers the pointer it found."""
        loaded = load_checkpoint(
            self.store, model=model, optimizer=optimizer, step=step, fingerprint_fn=fingerprint_fn,
            restore_rng=restore_rng, group=self.group, device=self.device,
        )
        rank, _ = _rank_world(self.group)
        if rank == 0:
            self.pointer_etag = loaded.pointer_etag if loaded and loaded.source == "pointer" else read_pointer(self.store)[1]
            self._pointer_known = True
        return loaded

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        fingerprint: str,
        data_position: Any = None,
        extra: dict[str, Any] | None = None,
        last_clean_audit_step: int | None = None,
        last_clean_fingerprint_step: int | None = None,
    ) -> SaveResult:
        """:func:`save_checkpoint` on this job's prefix, advancing the pointer from the one last seen."""
        rank, _ = _rank_world(self.group)
        if rank == 0 and not self._pointer_known:
            # A job that never loaded starts from whatever pointer exists now.
            self.pointer_etag = read_pointer(self.store)[1]
            self._pointer_known = True
        result = save_checkpoint(
            self.store, step, model=model, optimizer=optimizer, fingerprint=fingerprint,
            data_position=data_position, extra=extra, last_clean_audit_step=last_clean_audit_step,
            last_clean_fingerprint_step=last_clean_fingerprint_step, pointer_etag=self.pointer_etag,
            advance=self.advance_pointer, written_by=self.written_by, corrupt=self.corrupt, group=self.group,
            device=self.device,
        )
        self.pointer_etag = result.pointer_etag
        return result


__all__ = [
    "CheckpointCorrupt",
    "CheckpointSaveFailed",
    "CheckpointStateError",
    "CheckpointWriter",
    "LoadedCheckpoint",
    "SaveResult",
    "check_fingerprint",
    "is_storage_error",
    "load_checkpoint",
    "rng_name",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
