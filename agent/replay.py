"""Deterministic replay: the random state and thread count that make a micro-batch recomputable.

The ring audit recomputes another rank's micro-batch and compares bits. That
holds only if the recomputation draws the same random numbers (dropout) and
runs the same kernels (the same intra-op thread count: measured, a different
count changed the bits). The guard seeds every forward from (seed, step, rank)
and pins the thread count, so the owner and the auditor agree; with the audit
on it also turns on torch's deterministic algorithms, without which a GPU's
atomic-add reductions (an embedding's backward, for one) may round
differently on every run and the audit would accuse healthy hardware.
"""

from __future__ import annotations

import hashlib
import logging
import os

import torch

log = logging.getLogger(__name__)

CUBLAS_WORKSPACE = ":4096:8"
"""The cuBLAS workspace setting torch requires for deterministic matrix products on CUDA."""


def seed_for(base: int, step: int, rank: int) -> int:
    """The seed of ``rank``'s micro-batch at ``step``: a hash, so nearby (step, rank) pairs do not collide."""
    digest = hashlib.blake2b(f"{base}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_micro_batch(base: int, step: int, rank: int) -> None:
    """Seed torch's random generators (CPU and the current accelerator) for ``rank``'s micro-batch at ``step``."""
    seed = seed_for(base, step, rank)
    # Not torch.manual_seed: it visits every backend and measured ~6 ms a call.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)


def pin_threads(threads: int) -> None:
    """Use exactly ``threads`` intra-op threads (0 keeps torch's choice). ValueError if negative."""
    if threads < 0:
        raise ValueError(f"threads: must be >= 0, got {threads}")
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def use_deterministic_algorithms(device: torch.device) -> None:
    """Turn on torch's deterministic algorithms for the ring audit, if the job has not already.

    On CUDA, also sets ``CUBLAS_WORKSPACE_CONFIG`` when unset (it takes effect
    for cuBLAS handles made afterwards, so build the guard before the first
    matrix product, as the reference job does). An op with no deterministic
    implementation then raises torch's RuntimeError on its first use, naming
    the op: replace the op, or set ``deterministic=False`` and see to the
    determinism of the job yourself (else the audit may accuse healthy ranks).
    """
    if device.type == "cuda" and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    if not torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(True)
        log.info("deterministic algorithms on, for the ring audit's recomputation")
