"""Confirmation before blame: recompute a suspicious rank's micro-batch on other nodes inside the step.

When a per-step check fires on some ranks (non-finite local gradients or
loss, a GradScaler overflow on some ranks only), the magnitude trigger fires,
or an audit pair disagrees, the guard does not yet know whether the hardware
or the data is at fault: a bad sample gives the same NaN on any GPU. So,
before any update, the rank's micro-batch is recomputed bit for bit (as the
ring audit does) by the same local rank on the previous node and, with 3 or
more nodes, on the next node too: a third opinion where two disagree.

- Every recomputation reproduces the owner's claim: the data did it (a data
  fault when something was non-finite; a real jump when only the magnitude
  trigger fired). No node is named.
- The two confirmers agree with each other and not with the owner: the
  owner's hardware (localised). One confirmer disagrees with both others:
  that confirmer's hardware (localised). All three differ, or with 2 nodes any
  disagreement: every rank involved is named, not localised.

A claim is what a rank can state about its own pass without keeping any copy
of its gradients: the bits of its loss, which buckets were non-finite, the
bits of each bucket's local-gradient norm, and on audit steps every
parameter's local-gradient fingerprint. A recomputation produces the same
record from its gradients, laid out as DDP's buckets.

After a confirmed mismatch each localised suspect replays, once, the
computation it got wrong: if it gets the majority's result now the fault was
``transient``, otherwise ``persistent``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent import fingerprint as fp
from agent.nonfinite import MASK_BUCKETS, GradientHook, measure
from agent.ring_audit import Recomputation, bits_to_hex, layout_order, loss_bits
from contract.alarm import FaultPersistence

# Claim layout: loss bits, non-finite bucket mask, then one norm per bucket, then (audit steps) digests.
CLAIM_LOSS, CLAIM_MASK = range(2)
CLAIM_NORMS = 2

# Why a rank's micro-batch is confirmed.
NONFINITE, AUDIT, MAGNITUDE = "nonfinite", "audit", "magnitude"


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """The exact bits of floats as int64 (widened to fp64, which is exact)."""
    return values.detach().to(torch.float64).view(torch.int64)


def claim_from_hook(loss: torch.Tensor, hook: GradientHook, device: torch.device, *, digests: bool) -> torch.Tensor:
    """This rank's claim about its own pass this step (int64, on ``device``)."""
    parts = [loss_bits(loss).reshape(1).to(device), hook.local_mask(device).reshape(1),
             float_bits(hook.bucket_norms(device))]
    if digests:
        parts += [hook.param_fingerprints[i].to(device).reshape(-1) for i in sorted(hook.param_fingerprints)]
    return torch.cat(parts)


def claim_from_recomputation(recomputation: Recomputation, layout: dict[int, list[str]], device: torch.device, *,
                             nonfinite: bool, norms: bool, digests: bool) -> torch.Tensor:
    """The claim the owner should have made, from a recomputation of its micro-batch (same layout, same bits)."""
    mask = 0
    norm_values = []
    for index in sorted(layout):
        grads = [recomputation.grads[n].reshape(-1) for n in layout[index]]
        flat = torch.cat(grads) if grads else torch.zeros(0)
        # The owner's hook measured the bucket buffer, which is these gradients laid end to end.
        seen = measure(flat, flag=nonfinite and index < MASK_BUCKETS, norm=norms)
        if seen.nonfinite is not None and bool(seen.nonfinite):
            mask |= 1 << index
        norm_values.append(seen.norm.to(torch.float64) if seen.norm is not None
                           else torch.zeros((), dtype=torch.float64))
    parts = [loss_bits(recomputation.loss).reshape(1).to(device), torch.tensor([mask], dtype=torch.int64, device=device)]
    if norm_values:
        parts.append(float_bits(torch.stack(norm_values)).to(device))
    if digests:
        grads = [recomputation.grads[n] for n in layout_order(layout)]
        parts.append(fp.fingerprint_many(grads).to(device).reshape(-1))
    return torch.cat(parts)


@dataclass(frozen=True)
class Ring:
    """Who confirms whom: the same local rank ``stride`` ranks back (and forward, with 3 or more units)."""

    world: int
    stride: int
    """Ranks per node with 2 or more nodes; 1 on a single node (another GPU of the same node)."""

    @classmethod
    def of(cls, world: int, ranks_per_node: int) -> Ring:
        """The confirmation ring of a world."""
        return cls(world, ranks_per_node if world // ranks_per_node >= 2 else 1)

    @property
    def units(self) -> int:
        """How many distinct opinions the ring can give on one micro-batch (owner included)."""
        return self.world // self.stride

    @property
    def possible(self) -> bool:
        """Whether any other rank can recompute a micro-batch."""
        return self.units >= 2

    def confirmers(self, owner: int) -> list[int]:
        """The ranks that recompute ``owner``'s micro-batch: previous unit, then (3+ units) the next."""
        back = (owner - self.stride) % self.world
        if self.units >= 3:
            return [back, (owner + self.stride) % self.world]
        return [back]

    def assignments(self, rank: int, owners: set[int]) -> list[tuple[int, int]]:
        """(slot, owner) pairs ``rank`` must recompute: slot 0 for the owner after it, slot 1 the one before."""
        out = []
        ahead = (rank + self.stride) % self.world
        if ahead in owners:
            out.append((0, ahead))
        behind = (rank - self.stride) % self.world
        if self.units >= 3 and behind in owners:
            out.append((1, behind))
        return out


@dataclass(frozen=True)
class Outcome:
    """The confirmation of one owner's micro-batch."""

    owner: int
    reasons: tuple[str, ...]
    confirmers: tuple[int, ...]
    agrees: tuple[bool, ...]
    """Per confirmer: did its recomputation give the owner's claim?"""
    reproduced: bool
    suspects: tuple[int, ...]
    localized: bool
    majority: int | None
    """The rank whose record is the majority's: the owner (its claim) or a confirmer, or None."""


@dataclass(frozen=True)
class ConfirmationVerdict:
    """Every owner's outcome and what they add up to."""

    outcomes: list[Outcome]

    @property
    def mismatched(self) -> list[Outcome]:
        """Owners whose micro-batch some recomputation did not reproduce."""
        return [o for o in self.outcomes if not o.reproduced]

    @property
    def suspects(self) -> list[int]:
        """Every suspect of every mismatch, sorted."""
        return sorted({s for o in self.mismatched for s in o.suspects})

    @property
    def localized(self) -> bool:
        """Every mismatch was localised."""
        return bool(self.mismatched) and all(o.localized for o in self.mismatched)


def judge_confirmations(claims: torch.Tensor, records: torch.Tensor, owners: dict[int, tuple[str, ...]],
                        ring: Ring) -> ConfirmationVerdict:
    """Compare each owner's claim with its confirmers' recomputations; a pure function of gathered data.

    ``claims`` is ``[world, C]`` (every rank's claim), ``records`` ``[world, 2, 1 + C]``
    (per rank, slot 0: its recomputation of the owner after it, slot 1: of the
    one before; column 0 says whether it was made). ``owners`` maps each
    confirmed owner to why. Vectorised over the owners.
    """
    ranks = sorted(owners)
    if not ranks:
        return ConfirmationVerdict([])
    t = torch.tensor(ranks)
    o = claims[t]
    back = (t - ring.stride) % ring.world
    x1 = records[back, 0, 1:]
    m1 = (x1 == o).all(dim=1)
    if ring.units >= 3:
        ahead = (t + ring.stride) % ring.world
        x2 = records[ahead, 1, 1:]
        m2 = (x2 == o).all(dim=1)
        m12 = (x1 == x2).all(dim=1)
    else:
        m2 = m1
        m12 = torch.zeros_like(m1)
    outcomes = []
    for i, owner in enumerate(ranks):
        confirmers = tuple(ring.confirmers(owner))
        a1, a2 = bool(m1[i]), bool(m2[i])
        agrees = (a1, a2) if len(confirmers) == 2 else (a1,)
        if all(agrees):
            outcomes.append(Outcome(owner, owners[owner], confirmers, agrees, True, (), False, None))
            continue
        if len(confirmers) == 1:
            if NONFINITE in owners[owner] and _finite(x1[i]):
                # Two opinions, but not symmetric ones: the owner's pass made a NaN/Inf that another GPU,
                # computing the same thing, did not. A fault that makes a NaN is far likelier than one that
                # makes the right finite answer out of a NaN, so the owner is named (as detector 1 always did).
                outcomes.append(Outcome(owner, owners[owner], confirmers, agrees, False, (owner,), True,
                                        confirmers[0]))
            else:
                outcomes.append(Outcome(owner, owners[owner], confirmers, agrees, False,
                                        tuple(sorted({owner, confirmers[0]})), False, None))
            continue
        c1, c2 = confirmers
        if not a1 and not a2 and bool(m12[i]):
            outcome = Outcome(owner, owners[owner], confirmers, agrees, False, (owner,), True, c1)
        elif a1 and not a2:
            outcome = Outcome(owner, owners[owner], confirmers, agrees, False, (c2,), True, owner)
        elif a2 and not a1:
            outcome = Outcome(owner, owners[owner], confirmers, agrees, False, (c1,), True, owner)
        else:
            outcome = Outcome(owner, owners[owner], confirmers, agrees, False,
                              tuple(sorted({owner, c1, c2})), False, None)
        outcomes.append(outcome)
    return ConfirmationVerdict(outcomes)


def _finite(record: torch.Tensor) -> bool:
    """Whether a claim record says: finite loss, no non-finite bucket."""
    loss = record[CLAIM_LOSS].reshape(1).view(torch.float64)
    return bool(torch.isfinite(loss).all()) and int(record[CLAIM_MASK]) == 0


def record_of(rank: int, owner: int, claims: torch.Tensor, records: torch.Tensor, ring: Ring) -> torch.Tensor:
    """What ``rank`` computed for ``owner``'s micro-batch this step: its claim, or its confirmation record."""
    if rank == owner:
        return claims[owner]
    slot = 0 if (rank + ring.stride) % ring.world == owner else 1
    return records[rank, slot, 1:]


def pair_rows(outcome: Outcome, claims: torch.Tensor, records: torch.Tensor, ring: Ring,
              names: list[str] | None) -> list[tuple[int, int, bool, str, str, list[str]]]:
    """(confirmer, owner, loss_match, expected hex, observed hex, differing parameters) per confirmation."""
    rows = []
    expected = claims[outcome.owner]
    for c in outcome.confirmers:
        observed = record_of(c, outcome.owner, claims, records, ring)
        params: list[str] = []
        width = expected.shape[0]
        if names:
            start = width - 3 * len(names)
            if start >= CLAIM_NORMS:
                differs = (expected[start:] != observed[start:]).reshape(-1, 3).any(dim=1).tolist()
                params = [n for n, d in zip(names, differs, strict=True) if d]
        rows.append((c, outcome.owner, bool(expected[CLAIM_LOSS] == observed[CLAIM_LOSS]),
                     bits_to_hex(int(expected[CLAIM_LOSS])), bits_to_hex(int(observed[CLAIM_LOSS])), params))
    return rows


def replay_plan(verdict: ConfirmationVerdict) -> dict[int, Outcome]:
    """Which micro-batch each suspect replays: the owner's of the first localised mismatch naming it.

    Empty when some mismatch is not localised (then no majority says what is right)."""
    if not verdict.localized:
        return {}
    plan: dict[int, Outcome] = {}
    for outcome in verdict.mismatched:
        for suspect in outcome.suspects:
            plan.setdefault(suspect, outcome)
    return plan


def persistence(replays: torch.Tensor, plan: dict[int, Outcome], claims: torch.Tensor, records: torch.Tensor,
                ring: Ring) -> FaultPersistence:
    """``persistent``, ``transient`` or ``unknown`` from the localised suspects' replays.

    ``replays`` is ``[world, 1 + C]``: column 0 says whether the rank replayed.
    A suspect that gets the majority's result now was hit by a transient
    fault; one that does not, by a persistent one (any persistent wins)."""
    if not plan:
        return "unknown"
    agreed = []
    for suspect, outcome in plan.items():
        if outcome.majority is None or not bool(replays[suspect, 0]):
            return "unknown"
        right = record_of(outcome.majority, outcome.owner, claims, records, ring)
        agreed.append(bool((replays[suspect, 1:] == right).all()))
    return "transient" if all(agreed) else "persistent"
