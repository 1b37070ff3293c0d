"""Detector 3: weight and optimizer-state fingerprints compared across replicas by strict majority.

DDP keeps every replica's weights identical; a replica that differs computed
or stored something wrong. Every rank fingerprints its parameters and its
optimizer state, one all-gather brings all fingerprints to every rank, and
each rank reaches the same verdict from the same data. The same vote serves
the reduced-gradient comparison.

What must agree: every parameter, trainable or frozen (a LoRA base, a frozen
embedding: DDP broadcasts them once at construction and nothing reduces them
afterwards, so a flipped bit there would live on), the optimizer state, and
the buffers DDP keeps equal (``broadcast_buffers=True``, not in DDP's ignore
list, not marked by the user, and not changed by a training forward).
Batch-norm running statistics are left out: each rank updates its own from its
micro-batch after DDP's broadcast, so at the check they differ by design, and
DDP overwrites them from rank 0 at the next forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sdcguard.agent import fingerprint as fp


def state_tensors(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                  extra: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """The tensors that must agree across replicas: the parameters, each one's optimizer state, then ``extra``.

    ``extra`` holds what the guard adds (frozen parameters, checked buffers).
    The order is fixed (parameter order, then state keys sorted, then
    ``extra``), because the combined fingerprint is order-sensitive.
    """
    tensors = [p.detach() for p in params]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                tensors += [v.detach() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return tensors + [t.detach() for t in extra]


# Tensors below this many elements are fingerprinted packed together (per
# dtype and device): a fingerprint call has a fixed cost that dominated a
# model of many small tensors, while a copy of small tensors is cheap.
PACK_BELOW = 1 << 20


def packed_fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Fingerprint rows (int64 [n, 3]) covering every bit of ``tensors``, in a fixed order.

    Large tensors get a row each, in order; small ones are flattened and
    concatenated per (dtype, device) in order of first appearance, one row per
    group. Any change of any element changes some row; equal inputs in the same
    order give equal rows.
    """
    if not tensors:
        return torch.zeros(0, 3, dtype=torch.int64, device=torch.device("cpu"))
    device = tensors[0].device
    packed = fp.packed_rows(tensors, PACK_BELOW)
    fused = fp.triton_kernels_for(device)
    if fused is not None and all(t.device == device for t in tensors):
        # SDCGUARD_FINGERPRINT_KERNEL=triton: every row in one launch per element width (its metadata kept on
        # the device per layout), the same rows in the same order.
        out = torch.empty(len(packed), fp.LANES, dtype=torch.int64, device=device)
        result: torch.Tensor = fused.layout_for(packed)(out)
        return result
    rows = [fp.fingerprint(row[0]) if len(row) == 1 and row[0].numel() >= PACK_BELOW else fp.fingerprint_concat(row)
            for row in packed]
    return torch.stack([r.to(device) for r in rows])


def state_fingerprint(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                      extra: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """One fingerprint (int64 lanes, on the parameters' device) of the weights, optimizer state and ``extra``."""
    return fp.combine(packed_fingerprints(state_tensors(params, optimizer, extra)))


def state_fingerprint_hex(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                          extra: Sequence[torch.Tensor] = ()) -> str:
    """``state_fingerprint`` as the contract's hex Fingerprint (what a checkpoint manifest records)."""
    return fp.to_hex(state_fingerprint(params, optimizer, extra))


def checked_buffers(ddp: torch.nn.parallel.DistributedDataParallel, changed_by_forward: set[str],
                    unchecked: set[str]) -> list[str]:
    """Names of the buffers the weight fingerprint covers (see the module docstring), in module order."""
    if not ddp.broadcast_buffers:
        return []
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    return [n for n, _ in ddp.module.named_buffers()
            if n not in ignored and n not in changed_by_forward and n not in unchecked]


@dataclass(frozen=True)
class Vote:
    """Ranks grouped by the fingerprint they hold, and the strict majority if there is one."""

    groups: list[tuple[str, list[int]]]
    """(fingerprint hex, ranks), the largest group first."""
    majority: str | None
    """The fingerprint more than half the ranks hold, or None."""

    @property
    def unanimous(self) -> bool:
        """Every rank holds the same fingerprint."""
        return len(self.groups) == 1

    @property
    def dissenters(self) -> list[int]:
        """Ranks outside the strict majority (empty when there is none: not localised)."""
        if self.majority is None:
            return []
        return sorted(r for h, ranks in self.groups if h != self.majority for r in ranks)


def vote(lanes_by_rank: list[torch.Tensor] | torch.Tensor) -> Vote:
    """Group ranks by fingerprint; a group holding more than half of the world is the majority.

    ``lanes_by_rank[r]`` is rank r's fingerprint lanes. With two ranks that
    differ, or any even split, there is no strict majority. Vectorised: the
    Python work is proportional to the number of distinct fingerprints.
    """
    rows = torch.stack(list(lanes_by_rank)) if not isinstance(lanes_by_rank, torch.Tensor) else lanes_by_rank
    rows = rows.reshape(rows.shape[0], -1).cpu()
    world = rows.shape[0]
    # One int64 key per rank (wrapping arithmetic: a sort of keys is far faster than a row-wise unique);
    # each group is then checked against its first member's full row, so a key collision cannot merge two.
    weights = torch.tensor(_KEY_WEIGHTS[: rows.shape[1]], dtype=torch.int64, device="cpu")
    keys = (rows * weights).sum(dim=1)
    _, inverse = torch.unique(keys, return_inverse=True)
    groups = []
    for g in range(int(inverse.max()) + 1 if world else 0):
        ranks = torch.nonzero(inverse == g).reshape(-1)
        first = rows[ranks[0]]
        same = (rows[ranks] == first).all(dim=1)
        if not bool(same.all()):
            return _vote_by_rows(rows)
        groups.append((fp.to_hex(first), ranks.tolist()))
    groups.sort(key=lambda item: (-len(item[1]), item[1][0]))
    majority = groups[0][0] if len(groups[0][1]) * 2 > world else None
    return Vote(groups=groups, majority=majority)


# Odd multipliers, one per lane (fingerprints have three; any width up to eight works).
_KEY_WEIGHTS = [0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019, 0x2545F4914F6CDD1D, 0x5851F42D4C957F2D,
                0x14057B7EF767814F, 0x27BB2EE687B0B0FD, 0x2127599BF4325C37, 0x1B873593CC9E2D51]


def _vote_by_rows(rows: torch.Tensor) -> Vote:
    """The same vote by a row-wise unique (only if two different fingerprints ever share a key)."""
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    groups = sorted(((fp.to_hex(unique[g]), torch.nonzero(inverse == g).reshape(-1).tolist())
                     for g in range(unique.shape[0])), key=lambda item: (-len(item[1]), item[1][0]))
    majority = groups[0][0] if len(groups[0][1]) * 2 > rows.shape[0] else None
    return Vote(groups=groups, majority=majority)


@dataclass(frozen=True)
class GroupVerdict:
    """A strict-majority vote within each vote group (ranks that must hold the same bits): under DDP one group
    of every replica, under HSDP one group per shard position of that shard's replicas."""

    votes: list[Vote]
    """One per vote group, over global ranks."""

    @property
    def unanimous(self) -> bool:
        """Every group agrees within itself."""
        return all(v.unanimous for v in self.votes)

    @property
    def dissenters(self) -> list[int]:
        """Ranks outside their group's strict majority."""
        return sorted(r for v in self.votes for r in v.dissenters)

    @property
    def localized(self) -> bool:
        """Every group that disagrees has a strict majority."""
        return all(v.majority is not None for v in self.votes if not v.unanimous)

    def groups(self) -> list[tuple[str, list[int]]]:
        """(fingerprint, ranks) of every group that disagreed, the largest first within each (at most 64)."""
        return [g for v in self.votes if not v.unanimous for g in v.groups][:64]

    def majority(self) -> str | None:
        """The majority fingerprint of the first group that disagreed."""
        return next((v.majority for v in self.votes if not v.unanimous), None)

    def agreed(self) -> list[str]:
        """The fingerprint each group holds (meaningful when unanimous), in group order."""
        return [v.groups[0][0] for v in self.votes]


def vote_in_groups(rows: torch.Tensor, groups: Sequence[Sequence[int]]) -> GroupVerdict:
    """:func:`vote` within each group of ranks; ``rows`` is ``[world, lanes]`` (every rank's lanes)."""
    rows = rows.cpu()
    votes = []
    for ranks in groups:
        ballot = vote(rows[list(ranks)])
        votes.append(Vote(groups=[(h, [ranks[i] for i in members]) for h, members in ballot.groups],
                          majority=ballot.majority))
    return GroupVerdict(votes=votes)
