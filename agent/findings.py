"""One rank's findings of one step, in one int64 layout: the step's agreement vector and, on disagreement, its row.

Every parallelism fills the same :class:`StepFindings`: the loss, detector 1's
summary (sdcguard.agent.nonfinite's layout: the any-flags and masks of non-finite local
and reduced gradients, the loss flag, the reduced-gradient fingerprint lanes),
the magnitude trigger's flag and whether this rank's audit pair disagreed.

- :func:`agreement_vector` packs what the step's one all-reduce (MAX) needs:
  the six flags, then one slot of reduced lanes per vote group (this rank's
  lanes in its own group's slot, the lowest int64 elsewhere), then their
  complements (a MAX of ~x is the complement of the MIN, with no overflow);
  :func:`agreed` reads the reduced vector: no flag anywhere, and within every
  group the highest lanes equal the lowest.
- :func:`pack_row` packs the row every rank contributes when something
  disagreed: the summary, the two flags, the product checks' summary, then the rank's claim
  (sdcguard.agent.confirm's layout); :meth:`GatheredFindings.unpack` reads the
  gathered ``[world, width]`` rows.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent.nonfinite import LOCAL_ANY, LOSS_NONFINITE, REDUCED_ANY, REDUCED_FP, SUMMARY_WIDTH

# The agreement vector: these flags, then the lanes of every vote group, then their complements.
FLAG_NAMES = ("local", "reduced", "loss", "trigger", "audit", "product")
FLAG_COUNT = len(FLAG_NAMES)

# A gathered row: the summary, then these, then the product checks' summary (first failing site, count), then
# the claim.
ROW_TRIGGER = SUMMARY_WIDTH
ROW_AUDIT_BAD = SUMMARY_WIDTH + 1
ROW_PRODUCTS = slice(SUMMARY_WIDTH + 2, SUMMARY_WIDTH + 4)
ROW_CLAIM = SUMMARY_WIDTH + 4

_LOWEST = torch.iinfo(torch.int64).min


@dataclass
class StepFindings:
    """What the rank's own forward and backward left for the verdict (every tensor on the rank's device)."""

    loss: torch.Tensor
    """The rank's loss, the mean over its micro-batches."""
    summary: torch.Tensor
    """int64 ``[SUMMARY_WIDTH]``, sdcguard.agent.nonfinite's layout."""
    own_record: torch.Tensor | None = None
    """Audit steps: the rank's loss bits and digests (what its auditor's recomputation must match)."""
    audit_record: torch.Tensor | None = None
    """Audit steps: this rank's recomputation of the rank it audits, laid out as that rank's own record."""
    audit_bad: torch.Tensor | None = None
    """Audit steps: 0-dim bool, the record this rank's auditor sent differs from its own."""
    trigger: torch.Tensor | None = None
    """0-dim bool, the magnitude trigger fired (None when the trigger is off)."""
    products: torch.Tensor | None = None
    """int64 ``[2]``: sdcguard.agent.product_checks' summary (first failing site or -1, how many failed); None when the
    product checks are off."""


def _flag(value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return value.to(torch.int64).reshape(1) if value is not None else torch.zeros(1, dtype=torch.int64, device=like.device)


def agreement_vector(found: StepFindings, *, nonfinite: bool, reduced: bool, slot: int, slots: int) -> torch.Tensor:
    """The int64 vector of the step's one all-reduce (MAX), on the summary's device.

    ``slot`` is this rank's vote group among ``slots``; ``nonfinite`` and
    ``reduced`` say whether detector 1 and the reduced-gradient comparison
    are on (their parts are zeros otherwise)."""
    s = found.summary
    # Views, not an index tensor: nothing is copied from the host to the device.
    flags = (torch.cat([s.narrow(0, LOCAL_ANY, REDUCED_ANY + 1 - LOCAL_ANY), s.narrow(0, LOSS_NONFINITE, 1)])
             if nonfinite else torch.zeros(3, dtype=torch.int64, device=s.device))
    mine = s.narrow(0, REDUCED_FP.start, fp.LANES)
    if not reduced:
        lanes = torch.zeros(fp.LANES, dtype=torch.int64, device=s.device)
    elif slots == 1:
        lanes = mine
    else:
        lowest = torch.full((slots, fp.LANES), _LOWEST, dtype=torch.int64, device=s.device)
        here = (torch.arange(slots, device=s.device) == slot).unsqueeze(1)
        lanes = torch.where(here, mine.unsqueeze(0), lowest).reshape(-1)
    return torch.cat([flags, _flag(found.trigger, s), _flag(found.audit_bad, s), _flag(_product_hit(found), s),
                      lanes, torch.bitwise_not(lanes)])


def _product_hit(found: StepFindings) -> torch.Tensor | None:
    # A view and a clamp (the count is >= 0): 1 where some product failed, with no scalar from the host.
    return found.products.narrow(0, 1, 1).clamp(max=1) if found.products is not None else None


def _products(found: StepFindings) -> torch.Tensor:
    """The product checks' summary, or "none failed" ([-1, 0]) when they are off."""
    if found.products is not None:
        return found.products.to(torch.int64).reshape(2)
    # Filled on the device: no copy from the host.
    device = found.summary.device
    return torch.cat([torch.full((1,), -1, dtype=torch.int64, device=device),
                      torch.zeros(1, dtype=torch.int64, device=device)])


def agreed(vector: Sequence[int]) -> bool:
    """Whether every rank agrees, from the all-reduced :func:`agreement_vector` read back to the host."""
    width = (len(vector) - FLAG_COUNT) // 2
    if any(vector[:FLAG_COUNT]):
        return False
    high = vector[FLAG_COUNT:FLAG_COUNT + width]
    low = vector[FLAG_COUNT + width:FLAG_COUNT + 2 * width]
    # ~x on a Python int is the int64 complement for every int64 value.
    return all(h == ~complement for h, complement in zip(high, low, strict=True))


def float_of_bits(bits: int) -> float:
    """The float whose fp64 bits are the int64 ``bits`` (``sdcguard.agent.ring_audit.loss_bits`` read back)."""
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def pack_row(found: StepFindings, claim: torch.Tensor) -> torch.Tensor:
    """This rank's row for the gather on disagreement: summary, trigger flag, audit flag, the product checks'
    summary, claim (on its device)."""
    s = found.summary
    return torch.cat([s, _flag(found.trigger, s), _flag(found.audit_bad, s), _products(found), claim.to(s.device)])


@dataclass(frozen=True)
class GatheredFindings:
    """Every rank's row, read back (on the CPU)."""

    summaries: torch.Tensor
    """``[world, SUMMARY_WIDTH]``: what :func:`sdcguard.agent.nonfinite.judge_nonfinite` reads."""
    triggered: list[int]
    """Ranks whose magnitude trigger fired."""
    audit_failed: bool
    """Some audit pair disagreed."""
    claims: torch.Tensor
    """``[world, claim width]``: every rank's claim about its own pass."""
    products: torch.Tensor
    """``[world, 2]``: every rank's product-check summary (first failing site or -1, how many failed)."""

    @property
    def product_ranks(self) -> list[int]:
        """Ranks whose product checks fired."""
        return torch.nonzero(self.products[:, 1] > 0).reshape(-1).tolist()

    @property
    def reduced_nonfinite(self) -> bool:
        """Some rank's reduced gradients were non-finite (their fingerprints then carry no meaning)."""
        return bool(self.summaries[:, REDUCED_ANY].any())

    @property
    def reduced_lanes(self) -> torch.Tensor:
        """``[world, LANES]``: every rank's reduced-gradient fingerprint."""
        return self.summaries[:, REDUCED_FP]

    @classmethod
    def unpack(cls, rows: torch.Tensor) -> GatheredFindings:
        """Read the gathered ``[world, width]`` rows of :func:`pack_row`."""
        rows = rows.cpu()
        return cls(summaries=rows[:, :SUMMARY_WIDTH],
                   triggered=torch.nonzero(rows[:, ROW_TRIGGER]).reshape(-1).tolist(),
                   audit_failed=bool(rows[:, ROW_AUDIT_BAD].any()), claims=rows[:, ROW_CLAIM:],
                   products=rows[:, ROW_PRODUCTS])
