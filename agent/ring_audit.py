"""Detector 2: the ring re-execution audit (the recomputation itself is sdcguard.agent.recompute).

On an audit step every rank recomputes the micro-batch of the same local rank
on the next node, with the same pre-update weights, the same data and the same
random state, on the bare module (no all-reduce). The loss must match bit for
bit and so must the fingerprint of every parameter's local gradient (recorded
by the communication hook on the owner's side: digests, never copies). The
auditor sends its record to the owner alone (point to point), the owner
compares, and one flag joins the step's all-reduce: the audit costs O(1) in
the world size while the ranks agree. Only when some pair disagreed are the
records gathered and judged here, vectorised.

A rank whose two audits both disagree (its own micro-batch recomputed by the
previous node, and its recomputation of the next node's) is the suspect: its
hardware got both wrong while its neighbours agree elsewhere. That needs at
least 3 nodes and a fault that hits every computation; the guard asks a third
opinion (sdcguard.agent.confirm) for every failed pair, which also localises a fault
that hit only the rank's own pass.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent.recompute import Recomputation

if TYPE_CHECKING:
    from sdcguard.agent.ddp_hook import GradientHook


def loss_bits(loss: torch.Tensor) -> torch.Tensor:
    """The exact bits of a scalar loss as an int64 (fp32/bf16/fp16 widen to fp64 exactly)."""
    return loss.detach().reshape(()).to(torch.float64).view(torch.int64)


def bits_to_hex(bits: int) -> str:
    """A float's exact value from its fp64 bits, as ``float.hex`` (for the evidence)."""
    return struct.unpack("<d", struct.pack("<q", bits))[0].hex()


def layout_order(layout: dict[int, list[str]]) -> list[str]:
    """Parameter names in bucket order (buckets by index), the order of every per-parameter record."""
    return [n for i in sorted(layout) for n in layout[i]]


def owner_record(loss: torch.Tensor, hook: GradientHook, device: torch.device) -> torch.Tensor:
    """This rank's own claim: its loss bits, then every parameter's local-gradient fingerprint in bucket order."""
    rows = [hook.param_fingerprints[i].to(device).reshape(-1) for i in sorted(hook.param_fingerprints)]
    return torch.cat([loss_bits(loss).reshape(1).to(device), *rows])


def audit_record(recomputation: Recomputation, layout: dict[int, list[str]], device: torch.device) -> torch.Tensor:
    """The auditor's record laid out as the owner's (DDP's layout is the same on all ranks)."""
    grads = [recomputation.grads[n] for n in layout_order(layout)]
    lanes = fp.fingerprint_many(grads).to(device).reshape(-1) if grads else torch.zeros(0, dtype=torch.int64,
                                                                                        device=device)
    return torch.cat([loss_bits(recomputation.loss).reshape(1).to(device), lanes])


@dataclass(frozen=True)
class PairResult:
    """One audit: ``auditor`` recomputed the micro-batch of ``audited``."""

    auditor: int
    audited: int
    loss_match: bool
    expected_loss: str
    observed_loss: str
    mismatched_buckets: list[int]
    """Indices of the digest rows that differed (per parameter, in bucket order)."""
    mismatched_params: list[str]

    @property
    def match(self) -> bool:
        """Loss and every gradient fingerprint agreed."""
        return self.loss_match and not self.mismatched_buckets


@dataclass(frozen=True)
class AuditVerdict:
    """The audit's outcome for one step: the pairs that disagreed, and whom they point at."""

    mismatched: list[PairResult]
    """The pairs that disagreed."""
    suspects: list[int]
    localized: bool
    matched: list[tuple[int, int, str]] = field(default_factory=list)
    """(auditor, audited, loss hex) of the pairs that agreed; built only for small worlds (``pairs``)."""

    @property
    def clean(self) -> bool:
        """Every pair matched."""
        return not self.mismatched

    @property
    def pairs(self) -> list[PairResult]:
        """Every pair, matched ones included, by auditor (small worlds: the evidence, the tests)."""
        agreed = [PairResult(a, t, True, h, h, [], []) for a, t, h in self.matched]
        return sorted([*agreed, *self.mismatched], key=lambda p: p.auditor)


def judge(owners: torch.Tensor, recomputed: torch.Tensor, ranks_per_node: int,
          names: Sequence[str] | None = None, keep_matched_below: int = 64) -> AuditVerdict:
    """Compare every rank's claim with its auditor's recomputation, vectorised over the world.

    ``owners[r]`` is rank r's own record, ``recomputed[a]`` is what auditor a
    computed for ``(a + ranks_per_node) mod world``; both ``[world, 1+3R]``
    int64 on the CPU (R digest rows). With ``names`` (one per row) the
    differing parameters are named. The verdict is a pure function of them,
    so every rank reaches the same one.
    """
    world = owners.shape[0]
    nodes = world // ranks_per_node
    audited = (torch.arange(world, device=owners.device) + ranks_per_node) % world  # audited_by_ring, for every auditor at once
    expected = owners[audited]
    loss_differs = expected[:, 0] != recomputed[:, 0]
    rows = (expected[:, 1:] != recomputed[:, 1:]).reshape(world, -1, 3).any(dim=2)
    bad = loss_differs | rows.any(dim=1)
    bad_auditors = torch.nonzero(bad).reshape(-1)
    mismatched = []
    for a in bad_auditors.tolist():
        t = int(audited[a])
        differs = torch.nonzero(rows[a]).reshape(-1).tolist()
        mismatched.append(PairResult(
            auditor=a, audited=t, loss_match=not bool(loss_differs[a]),
            expected_loss=bits_to_hex(int(expected[a, 0])), observed_loss=bits_to_hex(int(recomputed[a, 0])),
            mismatched_buckets=differs, mismatched_params=[names[i] for i in differs] if names is not None else [],
        ))
    matched = []
    if world <= keep_matched_below:
        matched = [(a, int(audited[a]), bits_to_hex(int(expected[a, 0]))) for a in range(world) if not bool(bad[a])]
    if not mismatched:
        return AuditVerdict(mismatched=[], suspects=[], localized=False, matched=matched)
    strikes = torch.bincount(torch.cat([bad_auditors, audited[bad_auditors]]), minlength=world)
    if nodes >= 3:
        both = torch.nonzero(strikes >= 2).reshape(-1).tolist()
        if both:
            return AuditVerdict(mismatched=mismatched, suspects=both, localized=True, matched=matched)
    involved = torch.nonzero(strikes).reshape(-1).tolist()
    return AuditVerdict(mismatched=mismatched, suspects=involved, localized=False, matched=matched)


def name_parameters(verdict: AuditVerdict, owners: torch.Tensor, recomputed: torch.Tensor,
                    names: list[str], ranks_per_node: int) -> AuditVerdict:
    """The verdict with each failed pair's differing parameters named.

    ``owners``/``recomputed`` are ``[world, P, 3]`` per-parameter fingerprints.
    """
    pairs = []
    for pair in verdict.mismatched:
        differs = (owners[pair.audited] != recomputed[pair.auditor]).any(dim=1).tolist()
        named = [n for n, d in zip(names, differs, strict=True) if d]
        pairs.append(PairResult(pair.auditor, pair.audited, pair.loss_match, pair.expected_loss,
                                pair.observed_loss, pair.mismatched_buckets, named))
    return AuditVerdict(mismatched=pairs, suspects=verdict.suspects, localized=verdict.localized,
                        matched=verdict.matched)
