"""What bit-exact recomputation depends on: every rank's environment, compared, and deterministic mode.

The ring audit, the confirmation and a suspect's replay recompute another
rank's work and compare bits. Two healthy GPUs give the same bits only when
they run the same kernels on the same kind of hardware: cuBLAS is
bit-reproducible for one toolkit, architecture and SM count; TF32 and the
SDPA backend choose other kernels; ``cudnn.benchmark`` may pick another
algorithm per run; deterministic mode with ``warn_only=True`` keeps the
non-deterministic kernels (SDPA flash attention's backward among them);
Dao's ``flash_attn`` has its own ``deterministic=`` flag. Where any of these
differs between ranks, a disagreement says nothing about the hardware.

:func:`environment_signature` is one rank's view of all that;
:func:`gather_signatures` collects every rank's (one small all-gather, the
full text only when something differs); :func:`signature_differences` says
what differs, in words. :func:`require_deterministic` turns on what a
recompute-based check needs, or raises :class:`DeterminismUnavailable`
saying why it cannot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

CUBLAS_WORKSPACE = ":4096:8"
"""The cuBLAS workspace setting that makes cuBLAS deterministic (the other one cuBLAS accepts: ``:16:8``)."""

CUBLAS_WORKSPACE_SETTINGS = (":4096:8", ":16:8")

_LANES = 3


FP32_PRECISIONS = ("cuda.matmul", "cuda.conv", "cpu.matmul", "cpu.conv")
"""The products whose fp32 operands a backend may round first: cuBLAS's matrix products, cuDNN's convolutions,
oneDNN's (the CPU's) matrix products and convolutions."""

Fp32Precision = Literal["ieee", "tf32", "bf16"]


def fp32_precisions() -> dict[str, Fp32Precision]:
    """How each backend of :data:`FP32_PRECISIONS` may round fp32 operands before it multiplies them: ``"ieee"``
    (it does not), ``"tf32"`` (to 10 mantissa bits) or ``"bf16"`` (to 7).

    Where torch has the per-backend settings (``torch.backends.cuda.matmul.fp32_precision`` and the like,
    torch 2.9 on; ``"none"`` inherits from the backend, then from ``torch.backends.fp32_precision``) they are
    read, and nothing else: once a script has used them, as torch's deprecation warning asks, the legacy
    ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.get_float32_matmul_precision()`` raise. An older
    torch's legacy settings are read as they are (``"medium"`` taken as bf16 operands everywhere, the
    conservative reading)."""
    b = torch.backends
    if has_fp32_precision_settings():
        top = b.fp32_precision  # type: ignore[attr-defined]
        return {"cuda.matmul": _inherited(b.cuda.matmul.fp32_precision, top),
                "cuda.conv": _inherited(b.cudnn.conv.fp32_precision, b.cudnn.fp32_precision, top),  # type: ignore[attr-defined]
                "cpu.matmul": _inherited(b.mkldnn.matmul.fp32_precision, b.mkldnn.fp32_precision, top),  # type: ignore[attr-defined]
                "cpu.conv": _inherited(b.mkldnn.conv.fp32_precision, b.mkldnn.fp32_precision, top)}  # type: ignore[attr-defined]
    precision = torch.get_float32_matmul_precision()
    legacy: Fp32Precision = "bf16" if precision == "medium" else "tf32" if precision == "high" else "ieee"
    return {"cuda.matmul": "tf32" if legacy == "ieee" and b.cuda.matmul.allow_tf32 else legacy,
            "cuda.conv": "tf32" if b.cudnn.allow_tf32 else "ieee", "cpu.matmul": legacy, "cpu.conv": legacy}


def has_fp32_precision_settings() -> bool:
    """Whether this torch has the per-backend ``fp32_precision`` settings (torch 2.9 on)."""
    return hasattr(torch.backends, "fp32_precision")


def set_fp32_precisions(precisions: Mapping[str, str]) -> None:
    """Set each backend's ``fp32_precision`` as :func:`fp32_precisions` reads it (torch 2.9 on)."""
    b = torch.backends
    b.cuda.matmul.fp32_precision = precisions["cuda.matmul"]
    b.cudnn.conv.fp32_precision = precisions["cuda.conv"]  # type: ignore[attr-defined]
    b.mkldnn.matmul.fp32_precision = precisions["cpu.matmul"]  # type: ignore[attr-defined]
    b.mkldnn.conv.fp32_precision = precisions["cpu.conv"]  # type: ignore[attr-defined]


def _inherited(*levels: str) -> Fp32Precision:
    for value in levels:
        if value != "none":
            if value not in ("ieee", "tf32", "bf16"):
                return "bf16"  # a precision this reader does not know: the coarsest it does
            return value  # type: ignore[return-value]
    return "ieee"


class DeterminismUnavailable(RuntimeError):
    """Deterministic recomputation cannot be guaranteed in this process; the message says why and what to set."""


def environment_signature(device: torch.device) -> dict[str, str]:
    """What bit-exactness depends on, as seen by this process for ``device``: text keys and values.

    GPU name, SM count and compute capability; torch, CUDA, cuDNN and NCCL
    versions; the TF32 flags (matmul and cuDNN) and every backend's fp32
    precision (:func:`fp32_precisions`); ``cudnn.benchmark`` and ``cudnn.deterministic``; deterministic
    mode and its ``warn_only``; the SDPA backends enabled (flash,
    memory-efficient, math, cuDNN); ``flash_attn``'s version if it is already
    imported; on the CPU the intra-op thread count; on CUDA
    ``CUBLAS_WORKSPACE_CONFIG``. Reads settings only; makes no tensor."""
    cuda = device.type == "cuda"
    sdp = torch.backends.cuda
    precisions = fp32_precisions()
    signature = {
        "device": device.type,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "cudnn": str(torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None),
        "tf32.matmul": str(precisions["cuda.matmul"] == "tf32"),
        "tf32.cudnn": str(precisions["cuda.conv"] == "tf32"),
        **{f"fp32_precision.{name}": value for name, value in precisions.items()},
        "cudnn.benchmark": str(torch.backends.cudnn.benchmark),
        "cudnn.deterministic": str(torch.backends.cudnn.deterministic),
        "deterministic": str(torch.are_deterministic_algorithms_enabled()),
        "deterministic.warn_only": str(torch.is_deterministic_algorithms_warn_only_enabled()),
        "sdpa.flash": str(sdp.flash_sdp_enabled()),
        "sdpa.mem_efficient": str(sdp.mem_efficient_sdp_enabled()),
        "sdpa.math": str(sdp.math_sdp_enabled()),
        "sdpa.cudnn": str(sdp.cudnn_sdp_enabled()),
        "flash_attn": _imported_version("flash_attn"),
    }
    if cuda:
        properties = torch.cuda.get_device_properties(device)
        signature.update({
            "gpu": properties.name,
            "gpu.sm_count": str(properties.multi_processor_count),
            "gpu.capability": f"{properties.major}.{properties.minor}",
            "nccl": _nccl_version(),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG") or "(unset)",
        })
    else:
        signature["threads"] = str(torch.get_num_threads())
    return signature


def _nccl_version() -> str:
    if not dist.is_nccl_available():
        return "None"
    version = torch.cuda.nccl.version()
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def _imported_version(name: str) -> str:
    """A module's ``__version__`` if the job has imported it (importing it here would change nothing we check)."""
    module = sys.modules.get(name)
    if module is None:
        return "not imported"
    return str(getattr(module, "__version__", "unknown version"))


def canonical(signature: dict[str, str]) -> bytes:
    """The signature as canonical JSON bytes (sorted keys, no spaces): equal signatures, equal bytes."""
    return json.dumps(signature, sort_keys=True, separators=(",", ":")).encode()


def signature_lanes(signature: dict[str, str], device: torch.device) -> torch.Tensor:
    """int64 [3] on ``device``: a hash of the canonical JSON."""
    digest = hashlib.blake2b(canonical(signature), digest_size=8 * _LANES).digest()
    lanes = [int.from_bytes(digest[8 * i:8 * i + 8], "little", signed=True) for i in range(_LANES)]
    return torch.tensor(lanes, dtype=torch.int64, device=device)


def gather_signatures(device: torch.device, group: dist.ProcessGroup | None = None) -> list[dict[str, str]]:
    """Every rank's :func:`environment_signature`, in rank order (a collective of ``group``: call on every rank).

    Gathers a 3-lane hash of each signature on ``device`` (tensors, not
    ``all_gather_object``); only when the hashes differ, the signatures
    themselves as padded bytes. Without an initialised process group, or in a
    world of one, returns this rank's alone."""
    mine = environment_signature(device)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [mine]
    world = dist.get_world_size(group)
    lanes = signature_lanes(mine, device)
    gathered = [torch.empty_like(lanes) for _ in range(world)]
    dist.all_gather(gathered, lanes, group=group)
    if bool((torch.stack(gathered) == lanes).all()):
        return [dict(mine) for _ in range(world)]
    text = canonical(mine)
    length = torch.tensor([len(text)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in torch.cat(lengths).tolist()]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device="cpu")
    padded[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    padded = padded.to(device)
    rows = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(rows, padded, group=group)
    return [json.loads(bytes(row.cpu().tolist()[:size]).decode()) for row, size in zip(rows, sizes, strict=True)]


def signature_differences(rows: Sequence[dict[str, str]]) -> list[str]:
    """What differs between the ranks' signatures, one line per key, in key order; empty when all are equal.

    Each line names the key and which ranks hold which value, e.g.
    ``"gpu.sm_count: '132' on ranks [0, 1]; '114' on rank [2]"``; a key a rank
    lacks shows as ``(absent)``."""
    lines = []
    for key in sorted({k for row in rows for k in row}):
        holders: dict[str, list[int]] = {}
        for rank, row in enumerate(rows):
            holders.setdefault(row.get(key, "(absent)"), []).append(rank)
        if len(holders) > 1:
            parts = [f"{value!r} on rank{'s' if len(ranks) > 1 else ''} {ranks}"
                     for value, ranks in sorted(holders.items(), key=lambda item: item[1][0])]
            lines.append(f"{key}: " + "; ".join(parts))
    return lines


def require_deterministic(device: torch.device) -> None:
    """Turn on what bit-exact recomputation needs on ``device``, or raise DeterminismUnavailable saying why.

    - ``torch.use_deterministic_algorithms(True)``, not ``warn_only``: with
      ``warn_only`` the ops that have no deterministic kernel (SDPA flash
      attention's backward, for one) keep their non-deterministic one, and a
      recomputation would accuse healthy hardware. A job that set
      ``warn_only=True`` has it turned off, with a warning; an op with no
      deterministic kernel then raises torch's RuntimeError naming the op.
    - ``cudnn.deterministic = True`` and ``cudnn.benchmark = False`` (a warning
      when benchmark was on).
    - On CUDA, ``CUBLAS_WORKSPACE_CONFIG`` must be ``:4096:8`` or ``:16:8``
      before cuBLAS is first used (PyTorch chooses the workspace at first use
      and keeps it). Unset (or another value) and CUDA not yet initialised in
      this process: set to ``:4096:8``. Unset and CUDA already initialised:
      nothing here can tell whether cuBLAS has already run, so this raises
      DeterminismUnavailable: set it in the job's environment.
    """
    if device.type == "cuda":
        setting = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
        if setting not in CUBLAS_WORKSPACE_SETTINGS:
            if torch.cuda.is_initialized():
                raise DeterminismUnavailable(
                    f"CUBLAS_WORKSPACE_CONFIG is {setting or '(unset)'!s} and CUDA is already initialised in this "
                    f"process, so cuBLAS may already have chosen a non-deterministic workspace (PyTorch keeps the "
                    f"one chosen at first use): set CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} in the job's "
                    f"environment, or set GuardConfig.deterministic=False and see to determinism yourself")
            if setting:
                log.warning("CUBLAS_WORKSPACE_CONFIG=%s is not one cuBLAS is deterministic with; using %s", setting,
                            CUBLAS_WORKSPACE)
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    if torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled():
        log.warning("deterministic algorithms: warn_only turned off; with it, ops without a deterministic kernel "
                    "(SDPA flash attention's backward, for one) run their non-deterministic one, and the guard's "
                    "recomputations would accuse healthy hardware")
    if not torch.are_deterministic_algorithms_enabled() or torch.is_deterministic_algorithms_warn_only_enabled():
        torch.use_deterministic_algorithms(True)
        log.info("deterministic algorithms on, for the guard's recomputations")
    if torch.backends.cudnn.benchmark:
        log.warning("cudnn.benchmark turned off: it may choose another algorithm on each run")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


__all__ = ["CUBLAS_WORKSPACE", "CUBLAS_WORKSPACE_SETTINGS", "DeterminismUnavailable", "canonical",
           "environment_signature", "gather_signatures", "require_deterministic", "signature_differences",
           "signature_lanes"]
