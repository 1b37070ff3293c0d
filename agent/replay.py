"""Deterministic replay: the random state and thread count that make a micro-batch recomputable.

The ring audit recomputes another rank's micro-batch and compares bits. That
holds only if the recomputation draws the same random numbers (dropout) and
runs the same kernels (the same intra-op thread count: measured, a different
count changed the bits; compiled code run the same way, compiled or eagerly:
``autocast_and_stance``). The guard seeds every forward from (seed, step, rank)
and pins the thread count, so the owner and the auditor agree; with the audit
on it also turns on torch's deterministic algorithms (``sdcguard.agent.determinism``),
without which a GPU's atomic-add reductions (an embedding's backward, for
one) may round differently on every run and the audit would accuse healthy
hardware.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

from sdcguard.agent.determinism import CUBLAS_WORKSPACE, require_deterministic

__all__ = ["CUBLAS_WORKSPACE", "autocast_and_stance", "pin_threads", "seed_for", "seed_micro_batch",
           "use_deterministic_algorithms"]


def seed_for(base: int, step: int, rank: int) -> int:
    """The seed of ``rank``'s micro-batch at ``step``: a hash, so nearby (step, rank) pairs do not collide."""
    digest = hashlib.blake2b(f"{base}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_micro_batch(base: int, step: int, rank: int, device: torch.device | None = None) -> None:
    """Seed torch's random generators for ``rank``'s micro-batch at ``step``: the CPU's and ``device``'s.

    On CUDA, ``device``'s own generator (``torch.cuda.manual_seed`` alone
    seeds the *current* device, which need not be the rank's). ``device=None``
    seeds the current CUDA device when CUDA is initialised (the old behaviour)."""
    seed = seed_for(base, step, rank)
    # Not torch.manual_seed: it visits every backend and measured ~6 ms a call.
    torch.default_generator.manual_seed(seed)
    if device is not None:
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)


def pin_threads(threads: int, device: torch.device | None = None) -> None:
    """Use exactly ``threads`` intra-op threads (0 keeps torch's choice) where the rank computes on ``device``.
    ValueError if negative.

    Only a CPU rank's (``device`` None or the CPU): its recomputation is bit-identical only with equal
    counts. A GPU rank's recomputation runs on the GPU, so its thread count stays the job's (the torch ops of
    its data loader keep the threads the job gave them)."""
    if threads < 0:
        raise ValueError(f"threads: must be >= 0, got {threads}")
    if device is not None and device.type != "cpu":
        return
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def use_deterministic_algorithms(device: torch.device) -> None:
    """``sdcguard.agent.determinism.require_deterministic(device)``: the name the guard calls (kept for it).

    Raises DeterminismUnavailable where deterministic recomputation cannot be set up (see there)."""
    require_deterministic(device)


@contextlib.contextmanager
def autocast_and_stance(device: torch.device, autocast_dtype: str | None, *, eager: bool) -> Iterator[None]:
    """``torch.autocast`` to ``autocast_dtype`` on ``device``'s type (none when None), and, where ``eager``,
    compiled code run eagerly (torch.compile's ``"force_eager"`` stance).

    The product checks see only operators that run eagerly, so the rank's own pass runs compiled code eagerly
    under them (:meth:`sdcguard.agent.product_checks.ProductChecks.watching`); a recomputation compared with
    that pass bit for bit (the ring audit's, a confirmation's, a capsule's replay) must run the same code, or
    every rank would differ from its auditor (fused compiled kernels round otherwise) and be blamed."""
    with contextlib.ExitStack() as stack:
        if autocast_dtype is not None:
            stack.enter_context(torch.autocast(device.type, dtype=getattr(torch, autocast_dtype)))
        if eager:
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        yield
