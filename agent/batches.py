"""The micro-batches a rank trains on: what ``batch_for`` must return, their digest, and whether it replays.

Every recomputation (the ring audit, the confirmation, a suspect's replay)
asks ``batch_for(step, rank)`` again for another rank's micro-batches and
compares bits. That holds only if ``batch_for`` returns the same micro-batches
every time it is called: a loader that draws from the global random state
(nanoGPT's ``get_batch``, for one) rebuilds different data, and every rank
would look faulty. So the guard calls it twice at start
(:func:`check_replayable`), every claim carries the digest of its rank's
micro-batches (:func:`batch_digest`), and a recomputation whose digest is not
the owner's is an error about the loader (:class:`BatchNotReplayable`),
never a hardware alarm.

A micro-batch is whatever ``loss_fn`` takes: a tensor, or tuples, lists and
dicts of them (and of plain values). Only the inputs are digested, once per
pass: one fingerprint per tensor, on the device, nothing read back.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sdcguard.agent import fingerprint as fp

BatchFor = Callable[[int, int], Any]

_STRUCTURE = "<structure>"
"""The label of the digest row that holds the nesting and every non-tensor leaf."""


class BatchNotReplayable(RuntimeError):
    """``batch_for(step, rank)`` returned different micro-batches for the same (step, rank).

    An error in the job's data loader, not in the hardware: no rank is blamed."""

    def __init__(self, step: int, rank: int, where: str) -> None:
        self.step, self.rank, self.where = step, rank, where
        super().__init__(
            f"batch_for({step}, {rank}) is not replayable: {where}; it must return the same micro-batch every time "
            f"it is called (e.g. a seeded torch.Generator per (step, rank), not the global RNG)")


def micro_batches(batch_for: BatchFor, step: int, rank: int, k: int) -> list[Any]:
    """``batch_for(step, rank)`` as a list of ``k`` micro-batches (``k`` is ``grad_accum_steps``).

    With ``k == 1`` ``batch_for`` returns the bare micro-batch; with ``k > 1`` a
    sequence (list or tuple) of ``k`` micro-batches. Raises ValueError naming
    ``batch_for`` and what it must return when the result cannot be that: not a
    sequence, a sequence of another length, a one-element list for ``k == 1``,
    or ``k`` tensors that differ in dtype or dimensions (one micro-batch such as
    ``(inputs, targets)`` returned where ``k`` were due)."""
    if k < 1:
        raise ValueError(f"k: must be >= 1 (grad_accum_steps), got {k}")
    batch = batch_for(step, rank)
    if k == 1:
        if isinstance(batch, list) and len(batch) == 1 and isinstance(batch[0], (tuple, list, Mapping)):
            raise ValueError(
                f"batch_for: returned a list of 1 micro-batch for step {step}, rank {rank}; with grad_accum_steps 1 "
                f"it must return the bare micro-batch (what loss_fn takes), not a list of one")
        return [batch]
    must = (f"with grad_accum_steps {k} it must return a sequence (list or tuple) of {k} micro-batches, "
            f"each what loss_fn takes")
    if batch is None or isinstance(batch, (torch.Tensor, Mapping, str, bytes)) or not isinstance(batch, Sequence):
        raise ValueError(f"batch_for: returned {_kind(batch)} for step {step}, rank {rank}; {must}")
    batches = list(batch)
    if len(batches) != k:
        hint = ""
        if batches and all(isinstance(b, torch.Tensor) for b in batches):
            hint = f" (it looks like one micro-batch of {len(batches)} tensors)"
        raise ValueError(f"batch_for: returned {len(batches)} micro-batches for step {step}, rank {rank}; "
                         f"grad_accum_steps is {k}{hint}; {must}")
    if all(isinstance(b, torch.Tensor) for b in batches):
        kinds = {(b.dtype, b.dim()) for b in batches}
        if len(kinds) > 1:
            raise ValueError(
                f"batch_for: returned {k} tensors of different dtypes or dimensions for step {step}, rank {rank}: "
                f"it looks like one micro-batch (such as (inputs, targets)), not {k}; {must}")
    return batches


def _kind(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def leaves(batches: Sequence[Any]) -> list[tuple[str, Any]]:
    """Every leaf of ``batches`` with its path (``"micro-batch 0, [1]"``, ``"micro-batch 1, ['ids']"``), in order.

    Tuples and lists are walked by position, dicts by key (in sorted order of
    their keys' text: a dict built in another order is the same batch)."""
    out: list[tuple[str, Any]] = []
    for i, batch in enumerate(batches):
        _walk(batch, f"micro-batch {i}", out)
    return out


def _walk(value: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, (tuple, list)):
        if not value:
            out.append((path, value))
        for j, item in enumerate(value):
            _walk(item, f"{path}, [{j}]", out)
    elif isinstance(value, Mapping):
        if not value:
            out.append((path, {}))
        for key in sorted(value, key=repr):
            _walk(value[key], f"{path}, [{key!r}]", out)
    else:
        out.append((path, value))


def batch_digest(batches: Sequence[Any], device: torch.device) -> torch.Tensor:
    """The digest of a rank's micro-batches: int64 [``fingerprint.LANES``] on ``device``.

    One fingerprint per tensor leaf (its bits, dtype and shape) and one row for
    the nesting and every non-tensor leaf (hashed from its type and ``repr``),
    combined in order: any change of a value, a shape, a dtype or the nesting
    changes the digest. No host synchronisation; a tensor on another device is
    fingerprinted where it is and its lanes moved. Raises TypeError for a
    tensor whose dtype cannot be fingerprinted (complex)."""
    found = leaves(batches)
    tensors = [value for _, value in found if isinstance(value, torch.Tensor)]
    structure = tuple((path, _plain(value)) for path, value in found)
    rows = [_structure_lanes(structure, device)]
    by_device: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(k)
    per_tensor: list[torch.Tensor | None] = [None] * len(tensors)
    for members in by_device.values():
        lanes = fp.fingerprint_many([tensors[k] for k in members]).to(device)
        for k, row in zip(members, lanes.unbind(0), strict=True):
            per_tensor[k] = row
    rows += [row for row in per_tensor if row is not None]
    return fp.combine(torch.stack(rows))


def _plain(value: Any) -> str:
    """How a leaf enters the structure row: a tensor by its kind (its bits have their own row), else its value."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    return f"{type(value).__qualname__}:{value!r}"


@functools.lru_cache(maxsize=64)
def _structure_lanes(structure: tuple[tuple[str, str], ...], device: torch.device) -> torch.Tensor:
    # A batch's structure repeats every step: one small host-to-device copy per structure, not per step.
    # Shared and only ever read (torch.stack copies it).
    digest = hashlib.blake2b(repr(structure).encode(), digest_size=8 * fp.LANES).digest()
    lanes = [int.from_bytes(digest[8 * i:8 * i + 8], "little", signed=True) for i in range(fp.LANES)]
    return torch.tensor(lanes, dtype=torch.int64, device=device)


def difference(a_batches: Sequence[Any], b_batches: Sequence[Any]) -> str | None:
    """Where two sets of micro-batches first differ, in words, or None when they are the same bits.

    Names the path and what differs: ``"micro-batch 0, [1] (shape (32, 1)) differs in its values"``.
    Reads the tensors back to the host: for the start-up check and an error
    message, not for every step."""
    a, b = leaves(a_batches), leaves(b_batches)
    if len(a_batches) != len(b_batches):
        return f"{len(a_batches)} micro-batches, then {len(b_batches)}"
    for (path_a, x), (path_b, y) in zip(a, b, strict=False):
        if path_a != path_b:
            return f"{path_a} is not {path_b} (the nesting differs)"
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"{path_a} is {_kind(x)}, then {_kind(y)}"
        if isinstance(x, torch.Tensor):
            where = f"{path_a} (shape {tuple(x.shape)})"
            if x.shape != y.shape:
                return f"{path_a} has shape {tuple(x.shape)}, then {tuple(y.shape)}"
            if x.dtype != y.dtype:
                return f"{where} is {x.dtype}, then {y.dtype}"
            if not torch.equal(fp.bit_view(x.detach()).cpu(), fp.bit_view(y.detach()).cpu()):
                return f"{where} differs in its values"
        elif _plain(x) != _plain(y):
            return f"{path_a} is {x!r}, then {y!r}"
    if len(a) != len(b):
        longer = a if len(a) > len(b) else b
        return f"{longer[min(len(a), len(b))][0]} is present only once (the nesting differs)"
    return None


def check_replayable(batch_for: BatchFor, step: int, rank: int, k: int, device: torch.device) -> list[Any]:
    """Call ``batch_for(step, rank)`` twice and require the same micro-batches, bit for bit; return them.

    For the guard's start, before any alarm could blame a rank for the
    loader. The random state of the CPU and of ``device`` is put back after
    both calls. Raises ValueError (from :func:`micro_batches`) for the wrong
    shape of result and :class:`BatchNotReplayable` naming the first tensor
    that differs."""
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        first = micro_batches(batch_for, step, rank, k)
        second = micro_batches(batch_for, step, rank, k)
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
    where = difference(first, second)
    if where is None and not torch.equal(batch_digest(first, device), batch_digest(second, device)):
        where = "their digests differ"
    if where is not None:
        raise BatchNotReplayable(step, rank, where)
    return first


__all__ = ["BatchFor", "BatchNotReplayable", "batch_digest", "check_replayable", "difference", "leaves",
           "micro_batches"]
