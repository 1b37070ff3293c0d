"""One rank's findings of one step, in one int64 layout computed from the detectors present: the step's agreement
vector and, on disagreement, its row.

Every parallelism fills the same :class:`StepFindings`: the loss and the
gradient observer's summary (sdcguard.agent.nonfinite's layout: the any-flags and
masks of non-finite local and reduced gradients, the loss flag, the
reduced-gradient fingerprint lanes); each detector then puts its own flag in.

The wire belongs to the detectors: each declares its slots
(:class:`WireSlots`: ``flag_width`` slots of flags that must be zero on every
rank, ``lane_width`` slots that must be equal within every vote group,
``row_width`` slots of its row) and fills them from the findings.
:class:`Layout` lays out what the detectors present declare, in their order:

- :meth:`Layout.agreement` packs what the step's one all-reduce (MAX) needs:
  every detector's flags, then every detector's lanes, then their complements
  (a MAX of ~x is the complement of the MIN, with no overflow);
  :meth:`Layout.agreed` reads the reduced vector: no flag anywhere, and the
  highest lanes equal the lowest.
- :meth:`Layout.row` packs the row every rank contributes when something
  disagreed: the summary, every detector's row slots, then the rank's claim
  (sdcguard.agent.confirm's layout); :meth:`Layout.unpack` reads the gathered
  ``[world, width]`` rows, and :meth:`GatheredFindings.of` hands each detector
  its own columns.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sdcguard.agent.nonfinite import REDUCED_ANY, REDUCED_FP, SUMMARY_WIDTH
from sdcguard.contract import Detector


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
    marks: dict[Detector, torch.Tensor] = field(default_factory=dict)
    """What a detector without a field of its own put in (its flag, on the device), by its name."""


def flag_of(value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``value`` as one int64 slot, or 0 when it is absent (filled on ``like``'s device: no copy from the host)."""
    return value.to(torch.int64).reshape(1) if value is not None else torch.zeros(1, dtype=torch.int64, device=like.device)


class WireSlots(Protocol):
    """What a detector puts on the wire (sdcguard.agent.detectors.StepDetector declares it)."""

    flag_width: int
    """Slots of its flags in the agreement vector: any non-zero one on any rank is a disagreement."""
    row_width: int
    """Slots of its part of the gathered row."""

    def lane_width(self) -> int:
        """Slots of values that must be equal within every vote group, in the agreement vector (0: none)."""
        ...

    def flags(self, found: StepFindings) -> torch.Tensor:
        """int64 ``[flag_width]`` on the findings' device."""
        ...

    def lanes(self, found: StepFindings) -> torch.Tensor:
        """int64 ``[lane_width()]`` on the findings' device."""
        ...

    def row(self, found: StepFindings) -> torch.Tensor:
        """int64 ``[row_width]`` on the findings' device."""
        ...


class Layout:
    """The step's wire, laid out from the detectors present (in their order)."""

    def __init__(self, parts: Sequence[WireSlots]) -> None:
        self.parts = tuple(parts)
        self.flag_count = sum(p.flag_width for p in self.parts)
        self.lane_count = sum(p.lane_width() for p in self.parts)
        offsets, at = [], SUMMARY_WIDTH
        for part in self.parts:
            offsets.append(slice(at, at + part.row_width))
            at += part.row_width
        self._columns = offsets
        self.claim_at = at
        """The first column of the claim in a gathered row."""

    def agreement(self, found: StepFindings) -> torch.Tensor:
        """The int64 vector of the step's one all-reduce (MAX), on the summary's device: flags, lanes, ~lanes."""
        s = found.summary
        flags = [p.flags(found) for p in self.parts if p.flag_width]
        lanes = [p.lanes(found) for p in self.parts if p.lane_width()]
        lane = torch.cat(lanes) if lanes else torch.zeros(0, dtype=torch.int64, device=s.device)
        return torch.cat([*flags, lane, torch.bitwise_not(lane)])

    def agreed(self, vector: Sequence[int]) -> bool:
        """Whether every rank agrees, from the all-reduced :meth:`agreement` vector read back to the host."""
        if len(vector) != self.flag_count + 2 * self.lane_count:
            raise ValueError(f"agreed: {len(vector)} values, the layout has {self.flag_count} flags and "
                             f"{self.lane_count} lanes (twice)")
        if any(vector[:self.flag_count]):
            return False
        high = vector[self.flag_count:self.flag_count + self.lane_count]
        low = vector[self.flag_count + self.lane_count:]
        # ~x on a Python int is the int64 complement for every int64 value.
        return all(h == ~complement for h, complement in zip(high, low, strict=True))

    def row(self, found: StepFindings, claim: torch.Tensor) -> torch.Tensor:
        """This rank's row for the gather on disagreement: the summary, every detector's slots, the claim (on its
        device)."""
        s = found.summary
        return torch.cat([s, *(p.row(found) for p in self.parts if p.row_width), claim.to(s.device)])

    def unpack(self, rows: torch.Tensor) -> GatheredFindings:
        """Read the gathered ``[world, width]`` rows of :meth:`row`."""
        rows = rows.cpu()
        return GatheredFindings(summaries=rows[:, :SUMMARY_WIDTH], claims=rows[:, self.claim_at:],
                                parts=tuple(rows[:, columns] for columns in self._columns), layout=self)


def float_of_bits(bits: int) -> float:
    """The float whose fp64 bits are the int64 ``bits`` (``sdcguard.agent.ring_audit.loss_bits`` read back)."""
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


@dataclass(frozen=True)
class GatheredFindings:
    """Every rank's row, read back (on the CPU)."""

    summaries: torch.Tensor
    """``[world, SUMMARY_WIDTH]``: what :func:`sdcguard.agent.nonfinite.judge_nonfinite` reads."""
    claims: torch.Tensor
    """``[world, claim width]``: every rank's claim about its own pass."""
    parts: tuple[torch.Tensor, ...]
    """Per detector of the layout, ``[world, row_width]``: its columns."""
    layout: Layout

    def of(self, detector: WireSlots) -> torch.Tensor:
        """``[world, row_width]``: every rank's row slots of ``detector`` (ValueError when it is not laid out)."""
        for part, columns in zip(self.layout.parts, self.parts, strict=True):
            if part is detector:
                return columns
        raise ValueError(f"{type(detector).__name__} is not among the detectors the findings were laid out for")

    @property
    def reduced_nonfinite(self) -> bool:
        """Some rank's reduced gradients were non-finite (their fingerprints then carry no meaning)."""
        return bool(self.summaries[:, REDUCED_ANY].any())

    @property
    def reduced_lanes(self) -> torch.Tensor:
        """``[world, LANES]``: every rank's reduced-gradient fingerprint."""
        return self.summaries[:, REDUCED_FP]
