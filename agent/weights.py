"""Detector 3: weight and optimizer-state fingerprints compared across replicas by strict majority.

DDP keeps every replica's weights identical; a replica that differs computed
or stored something wrong. Every rank fingerprints its parameters and its
optimizer state, one all-gather brings all fingerprints to every rank, and
each rank reaches the same verdict from the same data. The same vote serves
the reduced-gradient comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agent import fingerprint as fp


def state_tensors(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors that must agree across replicas: the parameters, then each one's optimizer state.

    The order is fixed (parameter order, then state keys sorted), because the
    combined fingerprint is order-sensitive.
    """
    tensors = [p.detach() for p in params]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                tensors += [v.detach() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return tensors


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
    rows: list[torch.Tensor] = []
    small: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    device = tensors[0].device if tensors else torch.device("cpu")
    for t in tensors:
        if t.numel() >= PACK_BELOW:
            rows.append(fp.fingerprint(t).to(device))
        else:
            small.setdefault((t.dtype, t.device), []).append(t)
    for group in small.values():
        rows.append(fp.fingerprint_concat(group).to(device))
    if not rows:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    return torch.stack(rows)


def state_fingerprint(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> torch.Tensor:
    """One fingerprint (int64 lanes, on the parameters' device) of the weights and optimizer state."""
    return fp.combine(packed_fingerprints(state_tensors(params, optimizer)))


def state_fingerprint_hex(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> str:
    """``state_fingerprint`` as the contract's hex Fingerprint (what a checkpoint manifest records)."""
    return fp.to_hex(state_fingerprint(params, optimizer))


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
    differ, or any even split, there is no strict majority.
    """
    by_hex: dict[str, list[int]] = {}
    for rank, lanes in enumerate(lanes_by_rank):
        by_hex.setdefault(fp.to_hex(lanes), []).append(rank)
    groups = sorted(by_hex.items(), key=lambda item: (-len(item[1]), item[1][0]))
    world = sum(len(ranks) for _, ranks in groups)
    majority = groups[0][0] if len(groups[0][1]) * 2 > world else None
    return Vote(groups=groups, majority=majority)
