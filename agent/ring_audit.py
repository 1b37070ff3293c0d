"""Detector 2: the ring re-execution audit.

On an audit step every rank recomputes the micro-batch of the same local rank
on the next node, with the same pre-update weights, the same data and the same
random state, on the bare module (no all-reduce), and the guard gathers both
sides in its one per-step collective. The loss must match bit for bit and so
must the per-parameter fingerprints of the local gradients (recorded by the
communication hook on the owner's side).

A rank whose two audits both disagree (its own micro-batch recomputed by the
previous node, and its recomputation of the next node's) is the suspect: its
hardware got both wrong while its neighbours agree elsewhere. That needs at
least 3 nodes; with 2 nodes each pair audits the other both ways, so every
involved rank is reported and the alarm is not localised.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agent import fingerprint as fp
from agent.inject import Injector
from agent.nonfinite import GradientHook, gradients_fingerprint
from agent.topology import audited_by_ring


def loss_bits(loss: torch.Tensor) -> torch.Tensor:
    """The exact bits of a scalar loss as an int64 (fp32/bf16/fp16 widen to fp64 exactly)."""
    return loss.detach().reshape(()).to(torch.float64).view(torch.int64)


def bits_to_hex(bits: int) -> str:
    """A float's exact value from its fp64 bits, as ``float.hex`` (for the evidence)."""
    return struct.unpack("<d", struct.pack("<q", bits))[0].hex()


def owner_record(loss: torch.Tensor, hook: GradientHook, device: torch.device) -> torch.Tensor:
    """This rank's own claim: its loss bits, then the local-gradient fingerprint of each bucket in index order."""
    rows = [hook.bucket_fingerprints[i].to(device) for i in sorted(hook.bucket_fingerprints)]
    return torch.cat([loss_bits(loss).reshape(1).to(device), *rows])


@dataclass
class Recomputation:
    """The auditor's side: the recomputed loss and local gradients of the audited rank's micro-batch."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    """Recomputed local gradient by parameter name."""

    def record(self, hook: GradientHook, device: torch.device) -> torch.Tensor:
        """Loss bits and per-bucket fingerprints laid out as the owner's bucket (DDP's layout is the same on all ranks)."""
        rows = []
        for i in sorted(hook.bucket_names):
            grads = [self.grads[n] for n in hook.bucket_names[i]]
            rows.append(gradients_fingerprint(grads).to(device))
        return torch.cat([loss_bits(self.loss).reshape(1).to(device), *rows])


def recompute(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    names: list[str],
    params: list[torch.nn.Parameter],
    injector: Injector,
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Recomputation:
    """Recompute a micro-batch on the bare module (no all-reduce).

    The caller has seeded the random state for the audited rank. Gradients
    come from ``torch.autograd.grad``, so the ``.grad`` fields (which hold this
    step's reduced gradients) are left alone. ``scale`` is the GradScaler's
    scaling when one is in use: the owner's recorded gradients are scaled.
    """
    loss = loss_fn(module, batch)
    grads = torch.autograd.grad(scale(loss) if scale is not None else loss, params, allow_unused=True)
    out: dict[str, torch.Tensor] = {}
    for name, p, g in zip(names, params, grads, strict=True):
        # DDP hands an unused parameter's bucket slot as zeros.
        out[name] = g if g is not None else torch.zeros_like(p)
        injector.recomputed_gradient(name, out[name])
    return Recomputation(loss=loss.detach(), grads=out)


def param_fingerprints(grads_by_name: dict[str, torch.Tensor], names: list[str], device: torch.device) -> torch.Tensor:
    """Per-parameter fingerprints ``[P, 3]`` in ``names`` order (zeros for a missing one); used only after a failure."""
    present = [n for n in names if n in grads_by_name]
    out = torch.zeros(len(names), 3, dtype=torch.int64, device=device)
    if present:
        lanes = fp.fingerprint_many([grads_by_name[n] for n in present]).to(device)
        index = {n: i for i, n in enumerate(names)}
        for row, n in enumerate(present):
            out[index[n]] = lanes[row]
    return out


def owner_gradients(hook: GradientHook) -> dict[str, torch.Tensor]:
    """The copies of the local gradients the hook kept this audit step, by parameter name."""
    return {n: g for i in hook.bucket_names for n, g in zip(hook.bucket_names[i], hook.bucket_copies[i], strict=True)}


@dataclass(frozen=True)
class PairResult:
    """One audit: ``auditor`` recomputed the micro-batch of ``audited``."""

    auditor: int
    audited: int
    loss_match: bool
    expected_loss: str
    observed_loss: str
    mismatched_buckets: list[int]
    mismatched_params: list[str]

    @property
    def match(self) -> bool:
        """Loss and every gradient fingerprint agreed."""
        return self.loss_match and not self.mismatched_buckets


@dataclass(frozen=True)
class AuditVerdict:
    """The audit's outcome for one step."""

    pairs: list[PairResult]
    suspects: list[int]
    localized: bool

    @property
    def clean(self) -> bool:
        """Every pair matched."""
        return all(p.match for p in self.pairs)

    @property
    def mismatched(self) -> list[PairResult]:
        """The pairs that disagreed."""
        return [p for p in self.pairs if not p.match]


def judge(owners: torch.Tensor, recomputed: torch.Tensor, ranks_per_node: int) -> AuditVerdict:
    """Compare every rank's claim with its auditor's recomputation.

    ``owners[r]`` is rank r's own record, ``recomputed[a]`` is what auditor a
    computed for ``(a + ranks_per_node) mod world``; both ``[world, 1+3B]``
    int64 on the CPU (B buckets). The verdict is a pure function of them, so
    every rank reaches the same one.
    """
    world = owners.shape[0]
    nodes = world // ranks_per_node
    pairs = []
    strikes = [0] * world
    for auditor in range(world):
        audited = audited_by_ring(auditor, world, ranks_per_node)
        expected, observed = owners[audited], recomputed[auditor]
        differs = (expected[1:].view(-1, 3) != observed[1:].view(-1, 3)).any(dim=1).tolist()
        pair = PairResult(
            auditor=auditor,
            audited=audited,
            loss_match=bool(expected[0] == observed[0]),
            expected_loss=bits_to_hex(int(expected[0])),
            observed_loss=bits_to_hex(int(observed[0])),
            mismatched_buckets=[b for b, d in enumerate(differs) if d],
            mismatched_params=[],
        )
        pairs.append(pair)
        if not pair.match:
            strikes[auditor] += 1
            strikes[audited] += 1
    if all(p.match for p in pairs):
        return AuditVerdict(pairs=pairs, suspects=[], localized=False)
    if nodes >= 3:
        both = [r for r in range(world) if strikes[r] >= 2]
        if both:
            return AuditVerdict(pairs=pairs, suspects=both, localized=True)
    involved = [r for r in range(world) if strikes[r]]
    return AuditVerdict(pairs=pairs, suspects=involved, localized=False)


def name_parameters(verdict: AuditVerdict, owners: torch.Tensor, recomputed: torch.Tensor,
                    names: list[str], ranks_per_node: int) -> AuditVerdict:
    """The verdict with each failed pair's differing parameters named.

    ``owners``/``recomputed`` are ``[world, P, 3]`` per-parameter fingerprints
    gathered after a failed audit.
    """
    pairs = []
    for pair in verdict.pairs:
        if pair.match:
            pairs.append(pair)
            continue
        differs = (owners[pair.audited] != recomputed[pair.auditor]).any(dim=1).tolist()
        named = [n for n, d in zip(names, differs, strict=True) if d]
        pairs.append(PairResult(pair.auditor, pair.audited, pair.loss_match, pair.expected_loss,
                                pair.observed_loss, pair.mismatched_buckets, named))
    return AuditVerdict(pairs=pairs, suspects=verdict.suspects, localized=verdict.localized)
