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

Two kinds of disagreement are not hardware's, and blame nobody:

- The micro-batch itself differs. Every claim starts with the digest of the
  micro-batches its rank trained on (``sdcguard.agent.batches.batch_digest``); where a
  confirmer rebuilt a different micro-batch than the owner's, ``batch_for``
  did not replay, and that owner is ``unreplayable``, judged no further.
- All three results differ (the owner's and both confirmers'): two faults in
  one step is far less likely than a computation that is not bit-reproducible
  (a non-deterministic kernel, ``cudnn.benchmark``, different software); the
  owner is ``nonreproducible``.

After a confirmed mismatch each localised suspect replays, once, the
computation it got wrong: if it gets the majority's result now the fault was
``transient``; its own first result again, ``persistent``; a third result,
the suspect cannot reproduce its own computation: non-reproducible, not a
fault (``judge_replays``). In the same collective one rank of the majority
(the *witness*) replays its own result: healthy hardware gives the same bits
again, so a witness that does not is a computation with a few possible
results (a non-deterministic reduction), where two of three runs agree by
chance; that too is non-reproducible and blames nobody.

Every tensor made here lives on the device of the claims (the rank's GPU):
``torch.cat``/``torch.stack`` refuse a CPU tensor among CUDA ones. The
judgement is computed on that device and read back once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent.ddp_hook import GradientHook
from sdcguard.agent.nonfinite import MASK_BUCKETS, measure
from sdcguard.agent.ring_audit import Recomputation, bits_to_hex, layout_order, loss_bits
from sdcguard.contract.alarm import FaultPersistence

BATCH_LANES = fp.LANES
"""Width of the micro-batch digest at the head of every claim."""

# Claim layout: the micro-batch digest, loss bits, non-finite bucket mask, then one norm per bucket, then (audit
# steps) digests.
CLAIM_BATCH = 0
CLAIM_LOSS = BATCH_LANES
CLAIM_MASK = BATCH_LANES + 1
CLAIM_NORMS = BATCH_LANES + 2

# Why a rank's micro-batch is confirmed.
NONFINITE, AUDIT, MAGNITUDE = "nonfinite", "audit", "magnitude"
PRODUCT = "product"
"""A matrix product of the rank's own pass failed its checksums (sdcguard.agent.product_checks)."""


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """The exact bits of floats as int64 (widened to fp64, which is exact)."""
    return values.detach().to(torch.float64).view(torch.int64)


def batch_lanes(batch: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The head of a claim: ``batch`` (``sdcguard.agent.batches.batch_digest``) on ``device``, or zeros of its width.

    Raises ValueError unless ``batch`` is None or an int64 tensor of ``BATCH_LANES`` values."""
    if batch is None:
        return torch.zeros(BATCH_LANES, dtype=torch.int64, device=device)
    if batch.dtype != torch.int64 or batch.numel() != BATCH_LANES:
        raise ValueError(f"batch: expected {BATCH_LANES} int64 lanes (sdcguard.agent.batches.batch_digest), got "
                         f"{batch.dtype} with {batch.numel()} values")
    return batch.to(device).reshape(-1)


def claim_from_hook(loss: torch.Tensor, hook: GradientHook, device: torch.device, *, digests: bool,
                    batch: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's claim about its own pass this step (int64, on ``device``).

    ``batch`` is the digest of the micro-batches the pass trained on (None: zeros, nothing compared)."""
    parts = [batch_lanes(batch, device), loss_bits(loss).reshape(1).to(device), hook.local_mask(device).reshape(1),
             float_bits(hook.bucket_norms(device)).to(device)]
    if digests:
        parts += [hook.param_fingerprints[i].to(device).reshape(-1) for i in sorted(hook.param_fingerprints)]
    return torch.cat(parts)


def claim_from_recomputation(recomputation: Recomputation, layout: dict[int, list[str]], device: torch.device, *,
                             nonfinite: bool, norms: bool, digests: bool,
                             batch: torch.Tensor | None = None) -> torch.Tensor:
    """The claim the owner should have made, from a recomputation of its micro-batch (same layout, same bits).

    ``batch`` is the digest of the micro-batches this recomputation rebuilt (None: zeros). Every part is made
    on ``device`` and nothing is read back to the host."""
    mask = torch.zeros((), dtype=torch.int64, device=device)
    norm_values = []
    for index in sorted(layout):
        grads = [recomputation.grads[n].reshape(-1) for n in layout[index]]
        flat = torch.cat(grads) if grads else torch.zeros(0, dtype=torch.float32, device=device)
        # The owner's hook measured the bucket buffer, which is these gradients laid end to end.
        seen = measure(flat, flag=nonfinite and index < MASK_BUCKETS, norm=norms)
        if seen.nonfinite is not None:
            # Bits of distinct buckets: the sum is the bitwise or, and it stays on the device.
            mask = mask + seen.nonfinite.to(device, torch.int64) * (1 << index)
        norm_values.append(seen.norm.to(device, torch.float64) if seen.norm is not None
                           else torch.zeros((), dtype=torch.float64, device=device))
    parts = [batch_lanes(batch, device), loss_bits(recomputation.loss).reshape(1).to(device), mask.reshape(1)]
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
    nonreproducible: bool = False
    """All three results differ: the computation is not bit-reproducible; ``suspects`` is empty."""


@dataclass(frozen=True)
class ConfirmationVerdict:
    """Every owner's outcome and what they add up to."""

    outcomes: list[Outcome]
    unreplayable: list[tuple[int, int]] = field(default_factory=list)
    """(owner, confirmer) pairs whose micro-batch digests differ: ``batch_for`` did not replay; nobody is judged."""
    nonreproducible: list[int] = field(default_factory=list)
    """Owners whose recomputations differ from each other and from the owner: no rank is blamed."""

    @property
    def mismatched(self) -> list[Outcome]:
        """Owners whose micro-batch some recomputation did not reproduce, with someone to blame."""
        return [o for o in self.outcomes if not o.reproduced and not o.nonreproducible]

    @property
    def suspects(self) -> list[int]:
        """Every suspect of every mismatch, sorted."""
        return sorted({s for o in self.mismatched for s in o.suspects})

    @property
    def localized(self) -> bool:
        """Every mismatch was localised."""
        return bool(self.mismatched) and all(o.localized for o in self.mismatched)


_FP64_EXPONENT = 0x7FF0000000000000

# Columns of confirmation_flags.
_BATCH_1, _BATCH_2, _AGREE_1, _AGREE_2, _CONFIRMERS_AGREE, _FINITE_1 = range(6)


def confirmation_flags(claims: torch.Tensor, records: torch.Tensor, ranks: list[int], ring: Ring) -> torch.Tensor:
    """Per owner in ``ranks``: bool [n, 6] on the claims' device, every comparison the verdict needs.

    Columns: the first (then second) confirmer rebuilt the owner's micro-batch (equal digests); its record
    equals the owner's claim; the two confirmers' records are equal; the first confirmer's record is finite
    (finite loss, no non-finite bucket). With one confirmer the second's columns repeat the first's and the
    confirmers never agree. Made on the device, with no host synchronisation (the caller reads it once).
    """
    device = claims.device
    # narrow/select/index_select rather than Python indexing: the same ops on every device.
    t = torch.tensor(ranks, dtype=torch.int64, device=device)
    width = claims.shape[1]
    o = claims.index_select(0, t)
    x1 = records.select(1, 0).narrow(1, 1, width).index_select(0, (t - ring.stride) % ring.world)
    b1 = (x1.narrow(1, CLAIM_BATCH, BATCH_LANES) == o.narrow(1, CLAIM_BATCH, BATCH_LANES)).all(dim=1)
    m1 = (x1 == o).all(dim=1)
    if ring.units >= 3:
        x2 = records.select(1, 1).narrow(1, 1, width).index_select(0, (t + ring.stride) % ring.world)
        b2 = (x2.narrow(1, CLAIM_BATCH, BATCH_LANES) == o.narrow(1, CLAIM_BATCH, BATCH_LANES)).all(dim=1)
        m2 = (x2 == o).all(dim=1)
        m12 = (x1 == x2).all(dim=1)
    else:
        b2, m2, m12 = b1, m1, torch.zeros_like(m1)
    # An fp64 is finite unless its exponent bits are all ones: read from the bits, no reinterpretation.
    exponent = x1.select(1, CLAIM_LOSS) & _FP64_EXPONENT
    finite = (exponent != _FP64_EXPONENT) & (x1.select(1, CLAIM_MASK) == 0)
    return torch.stack([b1, b2, m1, m2, m12, finite], dim=1)


def judge_confirmations(claims: torch.Tensor, records: torch.Tensor, owners: dict[int, tuple[str, ...]],
                        ring: Ring) -> ConfirmationVerdict:
    """Compare each owner's claim with its confirmers' recomputations; a pure function of gathered data.

    ``claims`` is ``[world, C]`` (every rank's claim), ``records`` ``[world, 2, 1 + C]``
    (per rank, slot 0: its recomputation of the owner after it, slot 1: of the
    one before; column 0 says whether it was made). ``owners`` maps each
    confirmed owner to why. The comparisons run on the claims' device
    (``confirmation_flags``) and come back to the host in one copy.

    First the micro-batch digests: an owner whose confirmer rebuilt another
    micro-batch goes to ``unreplayable`` and is judged no further. Then the
    results: all three different is ``nonreproducible`` (nobody blamed).
    """
    ranks = sorted(owners)
    if not ranks:
        return ConfirmationVerdict([])
    table = confirmation_flags(claims, records, ranks, ring).tolist()
    outcomes: list[Outcome] = []
    unreplayable: list[tuple[int, int]] = []
    nonreproducible: list[int] = []
    for owner, row in zip(ranks, table, strict=True):
        confirmers = tuple(ring.confirmers(owner))
        two = len(confirmers) == 2
        rebuilt = (row[_BATCH_1], row[_BATCH_2]) if two else (row[_BATCH_1],)
        if not all(rebuilt):
            unreplayable += [(owner, c) for c, same in zip(confirmers, rebuilt, strict=True) if not same]
            continue
        a1, a2 = row[_AGREE_1], row[_AGREE_2]
        agrees = (a1, a2) if two else (a1,)
        reasons = owners[owner]
        if all(agrees):
            outcomes.append(Outcome(owner, reasons, confirmers, agrees, True, (), False, None))
            continue
        if not two:
            if NONFINITE in reasons and row[_FINITE_1]:
                # Two opinions, but not symmetric ones: the owner's pass made a NaN/Inf that another GPU,
                # computing the same thing, did not. A fault that makes a NaN is far likelier than one that
                # makes the right finite answer out of a NaN, so the owner is named (as detector 1 always did).
                outcomes.append(Outcome(owner, reasons, confirmers, agrees, False, (owner,), True, confirmers[0]))
            else:
                outcomes.append(Outcome(owner, reasons, confirmers, agrees, False,
                                        tuple(sorted({owner, confirmers[0]})), False, None))
            continue
        c1, c2 = confirmers
        if not a1 and not a2 and row[_CONFIRMERS_AGREE]:
            outcome = Outcome(owner, reasons, confirmers, agrees, False, (owner,), True, c1)
        elif a1 and not a2:
            outcome = Outcome(owner, reasons, confirmers, agrees, False, (c2,), True, owner)
        elif a2 and not a1:
            outcome = Outcome(owner, reasons, confirmers, agrees, False, (c1,), True, owner)
        else:
            # Three different results of one computation: not reproducible, whoever runs it.
            outcome = Outcome(owner, reasons, confirmers, agrees, False, (), False, None, nonreproducible=True)
            nonreproducible.append(owner)
        outcomes.append(outcome)
    return ConfirmationVerdict(outcomes, unreplayable, nonreproducible)


def record_of(rank: int, owner: int, claims: torch.Tensor, records: torch.Tensor, ring: Ring) -> torch.Tensor:
    """What ``rank`` computed for ``owner``'s micro-batch this step: its claim, or its confirmation record."""
    if rank == owner:
        return claims.select(0, owner)
    slot = 0 if (rank + ring.stride) % ring.world == owner else 1
    return records.select(0, rank).select(0, slot).narrow(0, 1, claims.shape[1])


def pair_rows(outcome: Outcome, claims: torch.Tensor, records: torch.Tensor, ring: Ring,
              names: list[str] | None) -> list[tuple[int, int, bool, str, str, list[str]]]:
    """(confirmer, owner, loss_match, expected hex, observed hex, differing parameters) per confirmation.

    For an alarm's evidence: the owner's and its confirmers' rows come back to the host in one copy."""
    rows = []
    involved = [outcome.owner, *outcome.confirmers]
    claims, records = _rows_on_host(claims, records, involved)
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


def _rows_on_host(claims: torch.Tensor, records: torch.Tensor, ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``claims`` and ``records`` on the CPU, only ``ranks``' rows filled (the rest zeros): one copy back."""
    index = torch.tensor(ranks, dtype=torch.int64, device=claims.device)
    picked = torch.cat([claims.index_select(0, index), records.index_select(0, index).reshape(len(ranks), -1)],
                       dim=1).cpu()
    host_claims = torch.zeros(claims.shape, dtype=claims.dtype, device="cpu")
    host_records = torch.zeros(records.shape, dtype=records.dtype, device="cpu")
    host_claims[ranks] = picked[:, :claims.shape[1]]
    host_records[ranks] = picked[:, claims.shape[1]:].reshape(len(ranks), *records.shape[1:])
    return host_claims, host_records


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


def witness_plan(plan: dict[int, Outcome]) -> dict[int, Outcome]:
    """Which micro-batch each witness replays: per outcome in ``plan``, its majority rank replays what it
    computed for the owner (the owner its own micro-batch, a confirmer its recomputation); a rank that is
    the majority of several outcomes replays the first."""
    witnesses: dict[int, Outcome] = {}
    for outcome in sorted({o.owner: o for o in plan.values()}.values(), key=lambda o: o.owner):
        if outcome.majority is not None:
            witnesses.setdefault(outcome.majority, outcome)
    return witnesses


REPLAY_SLOTS = 2
"""Per rank in a replay collective: slot 0 its replay as a suspect, slot 1 as a witness."""


@dataclass(frozen=True)
class ReplayVerdict:
    """What the localised suspects' replays say."""

    persistence: FaultPersistence
    """``transient``, ``persistent`` or ``unknown`` over the suspects that reproduced something."""
    nonreproducible: list[int] = field(default_factory=list)
    """Suspects whose replay matched neither the majority's result nor their own first one (they cannot
    reproduce their own computation), or whose majority's witness could not reproduce its own: work that is
    not bit-reproducible, not a hardware fault."""


def judge_replays(replays: torch.Tensor, plan: dict[int, Outcome], claims: torch.Tensor, records: torch.Tensor,
                  ring: Ring) -> ReplayVerdict:
    """The localised suspects' and the witnesses' replays, judged.

    ``replays`` is ``[world, REPLAY_SLOTS, 1 + C]``: per rank, slot 0 its
    replay as a suspect (``plan``), slot 1 as a witness (``witness_plan``);
    column 0 says whether it replayed. A witness that does not get its own
    first result again makes its outcome's suspects non-reproducible. Of the
    rest, a suspect that gets the majority's result now was hit by a
    transient fault; one that gets its own first result again, by a
    persistent one (any persistent wins); one that gets a third result is
    non-reproducible (counted as neither). ``unknown`` when a rank did not
    replay, there is no plan, or every suspect was non-reproducible. Reads
    the rows back once."""
    if not plan:
        return ReplayVerdict("unknown")
    if any(outcome.majority is None for outcome in plan.values()):
        return ReplayVerdict("unknown")
    width = claims.shape[1]
    suspects, witnesses = sorted(plan), witness_plan(plan)
    rows = []
    for s in suspects:  # (replayed, got the majority's result, got its own first result again)
        majority = plan[s].majority
        assert majority is not None  # checked above
        replayed = replays[s, 0, 1:1 + width]
        rows.append(torch.stack([replays[s, 0, 0] != 0,
                                 (replayed == record_of(majority, plan[s].owner, claims, records, ring)).all(),
                                 (replayed == record_of(s, plan[s].owner, claims, records, ring)).all()]))
    for w, o in sorted(witnesses.items()):  # (replayed, got its first result again) in the suspects' layout
        again = (replays[w, 1, 1:1 + width] == record_of(w, o.owner, claims, records, ring)).all()
        rows.append(torch.stack([replays[w, 1, 0] != 0, again, again]))
    table = torch.stack(rows).tolist()
    suspect_rows, witness_rows = table[:len(suspects)], table[len(suspects):]
    if not all(replayed for replayed, _, _ in table):
        return ReplayVerdict("unknown")
    unsettled = {o.owner for (w, o), (_, again, _) in zip(sorted(witnesses.items()), witness_rows, strict=True)
                 if not again}
    nonreproducible = [s for s, (_, right, again) in zip(suspects, suspect_rows, strict=True)
                       if plan[s].owner in unsettled or (not right and not again)]
    judged = [right for s, (_, right, _) in zip(suspects, suspect_rows, strict=True) if s not in nonreproducible]
    if not judged:
        return ReplayVerdict("unknown", nonreproducible)
    return ReplayVerdict("transient" if all(judged) else "persistent", nonreproducible)


def persistence(replays: torch.Tensor, plan: dict[int, Outcome], claims: torch.Tensor, records: torch.Tensor,
                ring: Ring) -> FaultPersistence:
    """``judge_replays(...).persistence``: ``persistent``, ``transient`` or ``unknown``."""
    return judge_replays(replays, plan, claims, records, ring).persistence
