"""The replay capsule: a failing step's computation, packed so that any node can recompute it bit for bit.

On a localised alarm from a recomputation-based check (the ring audit, a
confirmation), the agent holds everything a recomputation needs: the weights
and buffers the step started from (the update was skipped), the suspect's
micro-batch(es), the settings that make the recomputation bit-exact, and the
healthy recomputation's result. :func:`write_capsule` stores them beside the
checkpoints, under ``<checkpoint prefix>/capsules/step-<step>-rank-<rank>/``:

- ``state.pt``: the module's ``state_dict`` (weights and buffers);
- ``batch-000.pt``, ...: each micro-batch as saved by ``torch.save``, its
  tensors' fingerprints recorded in the manifest;
- ``CAPSULE.json`` last (its presence commits the capsule): the sha256 and
  size of every object, the replay settings (seed, step, rank, autocast
  dtype, GradScaler scale, threads, determinism flags, training mode), the
  environment signature, the expected loss bits and per-parameter gradient
  fingerprints, the factory that rebuilds the model in a fresh process, and
  the sha256 of the manifest's own content, so that a changed byte anywhere
  refuses the capsule instead of passing as a "reproduced" fault.

:func:`load_capsule` verifies all of it before anything is loaded
(``torch.load`` always with ``weights_only=True``) and raises
:class:`CapsuleCorrupt` otherwise: a corrupt capsule is never used.
:mod:`sdcguard.agent.capsule_replay` recomputes a capsule on a device and compares
the bits (``sdcguard replay``).

The factory is ``package.module:function``: ``function(**factory_args)``
returns ``(model, loss_fn)``, the bare module (any weights: the capsule's are
loaded into it, strictly) and ``loss_fn(module, batch)``. It must be
importable where the replay runs (the training image), never a ``__main__``
function.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from sdcguard.agent import fingerprint as fp
from sdcguard.agent.determinism import Fp32Precision, fp32_precisions
from sdcguard.agent.recompute import Recomputation
from sdcguard.agent.ring_audit import bits_to_hex, loss_bits
from sdcguard.contract.checkpoint import ObjectDigest
from sdcguard.lineage.errors import CheckpointCorrupt, LineageError, ObjectNotFound
from sdcguard.lineage.store import ObjectStore, open_store, sha256_hex
from sdcguard.lineage.verify import check_object

log = logging.getLogger(__name__)

CAPSULE_SCHEMA_VERSION: Final = "1"
MANIFEST_NAME: Final = "CAPSULE.json"
STATE_NAME: Final = "state.pt"
CAPSULES_DIR: Final = "capsules"

FACTORY_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""``package.module:function``: how a capsule names the factory that rebuilds the model."""

Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{48}$")]
FactoryArg = str | int | float | bool | None


# -- errors ----------------------------------------------------------------------------------------------


class CapsuleError(Exception):
    """Base of every capsule error."""


class CapsuleNotFound(CapsuleError):
    """No committed capsule (no ``CAPSULE.json``) at the location."""


class CapsuleCorrupt(CapsuleError):
    """A capsule that fails verification: its manifest, or an object it lists, is missing or changed."""


# -- what a capsule records ------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplaySettings(_Model):
    """Everything besides weights and data that the recomputation's bits depend on."""

    seed: Annotated[int, Field(ge=0, strict=True)]
    """``GuardConfig.seed``: the base of the per-(step, rank) seeds."""
    step: Annotated[int, Field(ge=0, strict=True)]
    """The step whose computation this is."""
    rank: Annotated[int, Field(ge=0, strict=True)]
    """The rank whose micro-batch(es) these are (the suspect): the forward is seeded for (seed, step, rank)."""
    autocast_dtype: Literal["bfloat16", "float16"] | None = None
    """``GuardConfig.autocast_dtype``: every forward runs under ``torch.autocast`` with it."""
    grad_scale: str | None = None
    """The GradScaler's scale at the step, as ``float.hex`` (exact); None without a GradScaler."""
    threads: Annotated[int, Field(ge=1, strict=True)]
    """Intra-op threads (recomputation is bit-identical only with equal counts)."""
    deterministic: bool
    """``torch.are_deterministic_algorithms_enabled()``."""
    warn_only: bool
    """``torch.is_deterministic_algorithms_warn_only_enabled()``."""
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    tf32_matmul: bool
    """cuBLAS may round fp32 operands to TF32 (``torch.backends.cuda.matmul.allow_tf32``)."""
    tf32_cudnn: bool
    """cuDNN may round fp32 operands to TF32 (``torch.backends.cudnn.allow_tf32``)."""
    float32_matmul_precision: str
    """``torch.get_float32_matmul_precision()``'s word for ``fp32_precision`` where that is set (the legacy
    getter raises once a script has used the per-backend settings)."""
    fp32_precision: dict[str, Fp32Precision] | None = None
    """Each backend's fp32 precision (``sdcguard.agent.determinism.fp32_precisions``); None in a capsule written
    before it was recorded (the legacy fields above then apply)."""
    sdpa_flash: bool = True
    sdpa_mem_efficient: bool = True
    sdpa_math: bool = True
    sdpa_cudnn: bool = True
    """The SDPA backends enabled (``torch.backends.cuda.*_sdp_enabled()``): each picks other kernels."""
    cublas_workspace: str | None = None
    """``CUBLAS_WORKSPACE_CONFIG`` of the writing process."""
    training: bool = True
    """The module's training mode (dropout and batch norm behave by it)."""
    eager: bool = False
    """Compiled code ran eagerly (``GuardConfig.product_checks``: the checks see only eager operators), so the
    replay runs it eagerly too (``sdcguard.agent.replay.autocast_and_stance``)."""
    device_type: str
    """The device type the computation ran on ("cuda", "cpu"): a capsule replays on the same kind."""

    @classmethod
    def capture(cls, module: nn.Module, *, seed: int, step: int, rank: int,
                autocast_dtype: Literal["bfloat16", "float16"] | None = None,
                grad_scale: float | torch.Tensor | None = None, eager: bool = False) -> ReplaySettings:
        """The settings in force in this process for ``rank``'s computation at ``step`` on ``module``.

        The thread count and the determinism flags are read from torch as they
        are now; ``grad_scale`` is the GradScaler's scale (a tensor is read
        back once). Raises :class:`ValueError` for a negative seed, step or rank.
        """
        for name, value in (("seed", seed), ("step", step), ("rank", rank)):
            if value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        scale = None if grad_scale is None else float(grad_scale).hex()
        first = next(iter(module.parameters()), None)
        precisions = fp32_precisions()
        legacy = {"bf16": "medium", "tf32": "high"}.get(precisions["cpu.matmul"], "highest")
        return cls(
            seed=seed, step=step, rank=rank, autocast_dtype=autocast_dtype, grad_scale=scale,
            threads=torch.get_num_threads(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            tf32_matmul=precisions["cuda.matmul"] == "tf32",
            tf32_cudnn=precisions["cuda.conv"] == "tf32",
            float32_matmul_precision=legacy,
            fp32_precision=precisions,
            sdpa_flash=torch.backends.cuda.flash_sdp_enabled(),
            sdpa_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
            sdpa_math=torch.backends.cuda.math_sdp_enabled(),
            sdpa_cudnn=torch.backends.cuda.cudnn_sdp_enabled(),
            cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            training=module.training,
            eager=eager,
            device_type=first.device.type if first is not None else "cpu",
        )


class Expected(_Model):
    """The healthy recomputation's result: what a replay on healthy hardware must give, bit for bit."""

    loss_bits: int
    """The loss as the int64 view of its fp64 value (:func:`sdcguard.agent.ring_audit.loss_bits`)."""
    loss: str
    """The same value as ``float.hex``, for people."""
    grads: dict[str, Hex]
    """Each trainable parameter's local-gradient fingerprint (:func:`sdcguard.agent.fingerprint.to_hex`), by name, in
    the order the recomputation takes the parameters."""

    @classmethod
    def from_recomputation(cls, recomputation: Recomputation) -> Expected:
        """The loss bits and gradient fingerprints of a recomputation (:func:`sdcguard.agent.recompute.recompute_step`)."""
        names = list(recomputation.grads)
        lanes = fp.fingerprint_many([recomputation.grads[n] for n in names]).cpu() if names else None
        bits = int(loss_bits(recomputation.loss))
        return cls(loss_bits=bits, loss=bits_to_hex(bits),
                   grads={n: fp.to_hex(lanes[i]) for i, n in enumerate(names)} if lanes is not None else {})

    @classmethod
    def from_record(cls, record: torch.Tensor, names: Sequence[str]) -> Expected:
        """From an audit record (:func:`sdcguard.agent.ring_audit.audit_record` or ``owner_record``): the loss bits, then
        3 lanes per parameter in the order of ``names``. Raises :class:`ValueError` when the lengths differ."""
        values = record.detach().reshape(-1).cpu()
        if values.numel() != 1 + fp.LANES * len(names):
            raise ValueError(f"record: {values.numel()} values for {len(names)} parameters "
                             f"(expected {1 + fp.LANES * len(names)})")
        bits = int(values[0])
        rows = values[1:].reshape(-1, fp.LANES)
        return cls(loss_bits=bits, loss=bits_to_hex(bits), grads={n: fp.to_hex(rows[i]) for i, n in enumerate(names)})


class CapsuleManifest(_Model):
    """``CAPSULE.json``: what the capsule holds and the digest each part must have."""

    format: Literal["sdcguard-capsule"] = "sdcguard-capsule"
    schema_version: Literal["1"] = CAPSULE_SCHEMA_VERSION
    created: str
    """When it was written (ISO 8601, UTC)."""
    factory: Annotated[str, Field(pattern=FACTORY_SPEC.pattern)]
    """``package.module:function`` returning ``(model, loss_fn)``."""
    factory_args: dict[str, FactoryArg] = Field(default_factory=dict)
    """Keyword arguments of the factory (JSON values)."""
    settings: ReplaySettings
    signature: dict[str, str]
    """The writing process's environment signature (``sdcguard.agent.determinism.environment_signature``)."""
    expected: Expected
    batches: list[list[Hex]]
    """Per micro-batch, the fingerprint of each of its tensors in traversal order."""
    objects: list[ObjectDigest]
    origin: dict[str, str] = Field(default_factory=dict)
    """Where it came from, for people: detector, suspect rank, node, pod, the alarm's id."""


def capsule_dir(step: int, rank: int) -> str:
    """A capsule's folder relative to the checkpoint prefix: ``capsules/step-000001200-rank-00003``."""
    if step < 0 or rank < 0:
        raise ValueError(f"step, rank: must be >= 0, got {step}, {rank}")
    return f"{CAPSULES_DIR}/step-{step:09d}-rank-{rank:05d}"


def batch_name(index: int) -> str:
    """The object name of micro-batch ``index``."""
    return f"batch-{index:03d}.pt"


# -- writing ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CapsuleResult:
    """What :func:`write_capsule` did: written (where, how big) or not (and why, for the alarm)."""

    written: bool
    location: str
    """Where the capsule is (or would have been)."""
    size_bytes: int
    """The objects' total size (an estimate when it was refused before serialising)."""
    reason: str = ""
    """Why nothing was written (empty when written)."""
    manifest: CapsuleManifest | None = None

    def describe(self) -> str:
        """One sentence for the alarm's message."""
        if self.written:
            return f"replay capsule at {self.location} ({self.size_bytes} bytes): `sdcguard replay {self.location}`"
        return f"no replay capsule: {self.reason}"


_SCALARS = (str, int, float, bool, type(None))


def _leaves(obj: Any, path: str = "batch") -> Iterator[torch.Tensor]:
    """The tensors of a micro-batch in traversal order; ValueError naming the part that torch.load
    (weights_only) could not read back."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, tuple | list):
        for i, item in enumerate(obj):
            yield from _leaves(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            if not isinstance(key, str | int):
                raise ValueError(f"{path}: a dict key of type {type(key).__name__} cannot be stored")
            yield from _leaves(item, f"{path}[{key!r}]")
    elif not isinstance(obj, _SCALARS):
        raise ValueError(f"{path}: a {type(obj).__name__} cannot be stored; return tensors, tuples, lists, "
                         f"dicts and plain values from batch_for")


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The micro-batch with ``fn`` applied to every tensor, its structure kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _compacted(batches: Sequence[Any]) -> list[Any]:
    """The micro-batches detached and on the CPU, each tensor as it is (torch.save keeps a view's layout,
    and inputs and targets sliced from one tensor share one storage) unless it is a view of a storage
    much larger than the batches use (a slice of a whole data set): that one is cloned, or the capsule
    would carry the data set."""
    used: dict[tuple[str, int], int] = {}
    for t in (t for b in batches for t in _leaves(b)):
        used[_storage_key(t)] = used.get(_storage_key(t), 0) + t.numel() * t.element_size()

    def own(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.untyped_storage().nbytes() > 2 * used[_storage_key(t)] + 4096:
            t = t.clone()
        return t.cpu()

    return [map_tensors(b, own) for b in batches]


def batch_digests(batch: Any) -> list[str]:
    """The fingerprint (hex) of each tensor of a micro-batch, in traversal order (device-independent).
    Raises :class:`ValueError` for a part that a capsule cannot store."""
    tensors = [t.detach() for t in _leaves(batch)]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = [""] * len(tensors)
    for members in by_device.values():
        lanes = fp.fingerprint_many([tensors[i] for i in members]).cpu()
        for row, i in enumerate(members):
            out[i] = fp.to_hex(lanes[row])
    return out


def estimated_bytes(state_bytes: int, batches: Sequence[Any]) -> int:
    """What a capsule of a state of ``state_bytes`` bytes and these micro-batches would hold, before
    anything is serialised: the size :func:`write_capsule` compares with the cap first. Under a mesh the
    state is not gathered yet when this is asked (sdcguard.agent.sharded_capsule), so its size comes from the global
    shapes. Raises :class:`ValueError` for a micro-batch a capsule cannot store."""
    stored = _compacted(batches)
    return state_bytes + _storage_bytes([t for b in stored for t in _leaves(b)])


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes ``torch.save`` writes for these tensors' data, each storage once (views share theirs)."""
    return sum({_storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def _serialise(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _manifest_bytes(manifest: CapsuleManifest) -> bytes:
    body = manifest.model_dump(mode="json")
    return json.dumps({**body, "manifest_sha256": sha256_hex(_canonical(body))}, indent=2).encode()


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def write_capsule(
    location: str | ObjectStore,
    *,
    module: nn.Module,
    batches: Sequence[Any],
    settings: ReplaySettings,
    expected: Expected,
    signature: Mapping[str, str],
    factory: str,
    factory_args: Mapping[str, FactoryArg] | None = None,
    cap_bytes: int,
    origin: Mapping[str, str] | None = None,
) -> CapsuleResult:
    """Store a capsule of ``module``'s state and ``batches`` under ``location`` (the checkpoint prefix:
    ``s3://bucket/prefix`` or a folder, or its store) at ``capsules/step-<step>-rank-<rank>/``.

    ``module`` is the bare module (``ddp.module``) as the failing step started
    from it; ``batches`` are the suspect's K micro-batches; ``expected`` the
    healthy recomputation's result (:meth:`Expected.from_recomputation` or
    :meth:`Expected.from_record`), whose parameter names must be ``module``'s
    trainable ones. Called on one rank; it runs no collective.

    Never raises for what the alarm must survive: a capsule over
    ``cap_bytes``, a micro-batch that cannot be stored, or a store that fails
    give a result with ``written=False`` and the reason (nothing partial is
    written over the cap; after a failed store, objects without a manifest
    may remain, which no reader uses). Raises :class:`ValueError` for a
    factory that is not ``package.module:function``, a negative cap, no
    micro-batch, or expected names that are not the module's trainable parameters.
    """
    if cap_bytes < 0:
        raise ValueError(f"cap_bytes: must be >= 0, got {cap_bytes}")
    if not FACTORY_SPEC.match(factory):
        raise ValueError(f"factory: {factory!r} is not package.module:function")
    if not batches:
        raise ValueError("batches: a step has at least one micro-batch")
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    if sorted(trainable) != sorted(expected.grads):
        raise ValueError(f"expected: its {len(expected.grads)} gradient names are not the module's "
                         f"{len(trainable)} trainable parameters")
    key = capsule_dir(settings.step, settings.rank)
    try:
        store = open_store(location) if isinstance(location, str) else location
    except LineageError as exc:
        return CapsuleResult(False, f"{location}/{key}", 0, str(exc))
    where = store.uri(key)
    try:
        digests = [batch_digests(b) for b in batches]
    except (ValueError, TypeError) as exc:
        return CapsuleResult(False, where, 0, f"a micro-batch cannot be stored: {exc}")
    state = {k: v.detach() for k, v in module.state_dict().items()}
    stored = _compacted(batches)
    # Refused before serialising: a model far over the cap is never copied into memory.
    estimate = _storage_bytes(list(state.values())) + _storage_bytes([t for b in stored for t in _leaves(b)])
    if estimate > cap_bytes:
        return CapsuleResult(False, where, estimate, over_cap(estimate, cap_bytes))
    objects = {STATE_NAME: _serialise({k: v.cpu() for k, v in state.items()})}
    for i, batch in enumerate(stored):
        objects[batch_name(i)] = _serialise(batch)
    size = sum(len(data) for data in objects.values())
    if size > cap_bytes:
        return CapsuleResult(False, where, size, over_cap(size, cap_bytes))
    manifest = CapsuleManifest(
        created=datetime.now(UTC).isoformat(timespec="seconds"), factory=factory,
        factory_args=dict(factory_args or {}), settings=settings, signature=dict(signature), expected=expected,
        batches=digests, objects=[ObjectDigest(name=n, sha256=sha256_hex(d), size=len(d)) for n, d in objects.items()],
        origin=dict(origin or {}),
    )
    try:
        # Uncommit first: a reader must never pair an older manifest with these objects.
        store.delete(f"{key}/{MANIFEST_NAME}")
        for digest, data in zip(manifest.objects, objects.values(), strict=True):
            store.put_bytes(f"{key}/{digest.name}", data, sha256=digest.sha256)
        store.put_bytes(f"{key}/{MANIFEST_NAME}", _manifest_bytes(manifest))
    except Exception as exc:  # an S3 outage must not stop the alarm that called us
        log.warning("replay capsule not stored at %s: %s", where, exc)
        return CapsuleResult(False, where, size, f"storing it at {where} failed: {type(exc).__name__}: {exc}")
    return CapsuleResult(True, where, size, manifest=manifest)


def over_cap(size: int, cap: int) -> str:
    """Why a capsule of ``size`` bytes was not written (the sentence the alarm carries)."""
    return (f"it would be {size} bytes, above capsule_max_bytes ({cap}); nothing was written "
            f"(raise SDCGUARD_CAPSULE_MAX_BYTES to keep one)")


# -- loading ---------------------------------------------------------------------------------------------


@dataclass
class Capsule:
    """A capsule whose manifest and every object verified, loaded on the CPU."""

    location: str
    manifest: CapsuleManifest
    state: dict[str, torch.Tensor]
    batches: list[Any]
    size_bytes: int


def _corrupt(where: str, what: str) -> CapsuleCorrupt:
    return CapsuleCorrupt(f"{where}: {what}; a corrupt capsule is never replayed")


def parse_manifest(data: bytes, *, where: str) -> CapsuleManifest:
    """The manifest in ``data``, once its own sha256 matches its content.

    Raises :class:`CapsuleCorrupt` when it is not JSON, its digest is missing
    or differs (a changed byte), or it does not match the capsule format.
    """
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(where, f"{MANIFEST_NAME} is not JSON ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("manifest_sha256"), str):
        raise _corrupt(where, f"{MANIFEST_NAME} has no manifest_sha256")
    recorded = raw.pop("manifest_sha256")
    actual = sha256_hex(_canonical(raw))
    if actual != recorded:
        raise _corrupt(where, f"{MANIFEST_NAME}'s content has sha256 {actual}, it records {recorded}")
    try:
        return CapsuleManifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise _corrupt(where, f"{MANIFEST_NAME} is not a capsule manifest ({loc}: {first['msg']})") from None


def _load(data: bytes, name: str, where: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise _corrupt(where, f"{name}: torch.load(weights_only=True) refused it: {exc}") from exc


def capsule_store(location: str) -> ObjectStore:
    """The store of the capsule at ``location``: its folder (``s3://...`` or a path), or its ``CAPSULE.json``.
    Raises ``sdcguard.lineage.errors.InvalidStoreUri`` for a location that is neither."""
    location = location.strip().rstrip("/")
    if location.endswith(f"/{MANIFEST_NAME}") or location == MANIFEST_NAME:
        location = location[: -len(MANIFEST_NAME)].rstrip("/") or "."
    return open_store(location)


def load_capsule(location: str | ObjectStore, *,
                 admit: Callable[[CapsuleManifest], None] | None = None) -> Capsule:
    """The capsule at ``location`` (``s3://bucket/prefix/capsules/step-...-rank-...``, a folder, or its
    ``CAPSULE.json``), verified: the manifest's own digest, then every object's sha256 and size before it is
    loaded, then each micro-batch's tensor fingerprints.

    ``admit`` sees the verified manifest before any object is read and refuses it by raising (the replay's
    factory allow-list, :class:`sdcguard.agent.capsule_replay.FactoryAllowList`): what it raises propagates.
    Raises :class:`CapsuleNotFound` when there is no ``CAPSULE.json`` and
    :class:`CapsuleCorrupt` for a changed manifest, a missing or changed
    object, or a state that is not tensors by name.
    """
    store = capsule_store(location) if isinstance(location, str) else location
    where = store.uri()
    try:
        data, _ = store.get_bytes(MANIFEST_NAME)
    except ObjectNotFound:
        raise CapsuleNotFound(f"{where}: no {MANIFEST_NAME}: not a committed replay capsule") from None
    manifest = parse_manifest(data, where=store.uri(MANIFEST_NAME))
    if admit is not None:
        admit(manifest)
    names = [o.name for o in manifest.objects]
    wanted = [STATE_NAME] + [batch_name(i) for i in range(len(manifest.batches))]
    if sorted(names) != sorted(wanted):
        raise _corrupt(where, f"the manifest lists {names}, a capsule of {len(manifest.batches)} micro-batches "
                              f"holds {wanted}")
    loaded: dict[str, Any] = {}
    for expected in manifest.objects:
        try:
            blob, sha256 = store.get_with_sha256(expected.name)
        except ObjectNotFound:
            raise _corrupt(store.uri(expected.name), "listed in the manifest but missing") from None
        try:
            check_object(expected, sha256, len(blob), where=store.uri(expected.name))
        except CheckpointCorrupt as exc:
            raise _corrupt(store.uri(expected.name), str(exc).split(": ", 1)[-1]) from None
        loaded[expected.name] = _load(blob, expected.name, where)
    state = loaded[STATE_NAME]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise _corrupt(where, f"{STATE_NAME} is not a state_dict of tensors")
    batches = [loaded[batch_name(i)] for i in range(len(manifest.batches))]
    for i, (batch, recorded) in enumerate(zip(batches, manifest.batches, strict=True)):
        try:
            found = batch_digests(batch)
        except (ValueError, TypeError) as exc:
            raise _corrupt(where, f"{batch_name(i)}: {exc}") from None
        if found != recorded:
            raise _corrupt(where, f"{batch_name(i)}: its tensors' fingerprints are not the recorded ones")
    return Capsule(location=where, manifest=manifest, state=state, batches=batches,
                   size_bytes=sum(o.size for o in manifest.objects))
