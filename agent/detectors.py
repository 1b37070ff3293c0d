"""The step's detectors as components with one interface: when each is due, what it observes, how it judges.

:class:`SDCGuard <sdcguard.agent.guard.SDCGuard>` holds the list
:func:`step_detectors` builds from the settings (a detector that is off is not
in it) and runs every step through it:

- :meth:`StepDetector.due`: whether the detector watches this step (its cadence);
- :meth:`StepDetector.watching`: around the rank's own forward and backward
  only (the product checks' hooks; nothing for the others);
- :meth:`StepDetector.observe`: after the rank's own forward and backward, it
  puts its flag into the step's :class:`~sdcguard.agent.findings.StepFindings`;
  its declared slots (``flag_width``, ``lane_width``, ``row_width``, filled by
  :meth:`StepDetector.flags`, ``lanes``, ``row``) are what
  :class:`sdcguard.agent.findings.Layout` packs into the step's one all-reduce
  and, on disagreement, into the gathered row. Detector 1 and the reduced-gradient comparison observe
  nothing here: the gradient observer (DDP's hook, FSDP2's reduce-scatter) has
  already filled their part of the summary;
- :meth:`StepDetector.judge`: only when something disagreed, its verdict from
  every rank's gathered row, through the pure verdict functions
  (sdcguard.agent.nonfinite, weights, ring_audit, product_checks); None when its
  flag is clear everywhere (it then gathers nothing);
- :meth:`StepDetector.asks`: the ranks whose micro-batch another node must
  recompute before that verdict blames anyone, or :meth:`StepDetector.final`
  when the verdict needs no recomputation (decided at once);
- its blame rule, read by the pure :func:`sdcguard.agent.decide.decide`: what
  it says at once (:meth:`StepDetector.at_once`), without a confirmation
  (:meth:`StepDetector.unconfirmed`), when other nodes' recomputations
  disagree (:meth:`StepDetector.confirmed`) or reproduce the claims
  (:meth:`StepDetector.reproduced`), and its ``precedence``.

The list's order is the order of observation and of judgement: the detectors
that may decide at once (the reduced gradients, then detector 1) come first,
so no later detector's collective (the audit's gather of its records) runs on
a step they settle; the audit observes before the trigger, whose norm is read
after the audit's recomputation, as it always was. Among the detectors that
ask, the order is immaterial: the confirmation sorts the ranks. Which alarm wins
when several fire is said by the detectors' ``precedence`` (sdcguard.agent.decide),
not the list's. Detector 3 (the weights) runs before the pass on a gather of its
own: :class:`WeightCheck` gives only its cadence.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.distributed as dist

from sdcguard.agent import confirm
from sdcguard.agent import fingerprint as fp
from sdcguard.agent.alarm import fingerprint_evidence, nonfinite_evidence, ring_evidence
from sdcguard.agent.decide import AlarmDecision, Context, Decision, Mismatch, Reproduced, Verdicts
from sdcguard.agent.findings import GatheredFindings, StepFindings, flag_of
from sdcguard.agent.nonfinite import (
    LOCAL_ANY,
    LOSS_NONFINITE,
    REDUCED_ANY,
    REDUCED_FP,
    NonFiniteVerdict,
    judge_nonfinite,
)
from sdcguard.agent.ring_audit import AuditVerdict
from sdcguard.agent.ring_audit import judge as judge_audit
from sdcguard.agent.trigger import MagnitudeTrigger, cross_rank_outliers
from sdcguard.agent.weights import GroupVerdict, vote_in_groups
from sdcguard.contract import Detector, NonFiniteEvidence, ProductCheckEvidence, ProductSite, RingPair

if TYPE_CHECKING:
    from sdcguard.agent.config import GuardConfig
    from sdcguard.agent.parallelism import Parallelism
    from sdcguard.agent.product_checks import ProductChecks

V = TypeVar("V")

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's ``[n]`` tensor as ``[world, n]`` on the CPU (a collective)."""


class StepDetector(ABC, Generic[V]):
    """One detector of the step: its cadence, its flag in the step's findings, its verdict from the rows."""

    detector: Detector
    """Its name in alarms and in ``last_clean``."""
    reason: str = ""
    """Why its owners are confirmed (sdcguard.agent.confirm's NONFINITE, MAGNITUDE, PRODUCT, AUDIT)."""

    def due(self, step: int) -> bool:
        """Whether it watches ``step`` (every step unless it has a cadence of its own)."""
        return True

    def watching(self) -> contextlib.AbstractContextManager[None]:
        """Around the rank's own forward and backward only (never a recomputation): what watches the pass."""
        return contextlib.nullcontext()

    def observe(self, step: int, found: StepFindings) -> None:
        """After the own pass: put its flag into ``found`` (on the device; nothing comes back to the host)."""

    # -- its slots on the wire (sdcguard.agent.findings.Layout lays them out) ------------------------------

    flag_width: int = 0
    """Its flags in the step's agreement vector (any non-zero one anywhere: something disagreed). A detector
    of one flag sets 1 here and in ``row_width`` and puts the flag in ``found.marks[self.detector]``."""
    row_width: int = 0
    """Its slots of the row every rank contributes when something disagreed (read back with ``rows.of(self)``)."""

    def lane_width(self) -> int:
        """Its values that must be equal within every vote group, in the agreement vector (0: none)."""
        return 0

    def flags(self, found: StepFindings) -> torch.Tensor:
        """int64 ``[flag_width]`` on the findings' device (by default its one mark, 0 when it put none)."""
        return self._mark(found, self.flag_width)

    def lanes(self, found: StepFindings) -> torch.Tensor:
        """int64 ``[lane_width()]`` on the findings' device."""
        return torch.zeros(0, dtype=torch.int64, device=found.summary.device)

    def row(self, found: StepFindings) -> torch.Tensor:
        """int64 ``[row_width]`` on the findings' device (by default its one mark, 0 when it put none)."""
        return self._mark(found, self.row_width)

    def _mark(self, found: StepFindings, width: int) -> torch.Tensor:
        if width == 1:
            return flag_of(found.marks.get(self.detector), found.summary)
        if width == 0:
            return torch.zeros(0, dtype=torch.int64, device=found.summary.device)
        raise NotImplementedError(f"{type(self).__name__} declares {width} slots: it fills them itself")

    @abstractmethod
    def judge(self, rows: GatheredFindings, found: StepFindings) -> V | None:
        """Its verdict from every rank's gathered row (the same on every rank); None when its flag is clear
        everywhere. A detector whose verdict needs more data gathers it here, on every rank alike."""

    def final(self, verdict: V) -> bool:
        """Whether ``verdict`` needs no recomputation on another node (the guard decides at once)."""
        return False

    def asks(self, verdict: V) -> list[int]:
        """The ranks whose micro-batch another node must recompute before ``verdict`` blames anyone."""
        return []

    def passed(self, step: int) -> None:
        """``step`` passed every check and updates (the detector may learn from it)."""

    # -- its blame rule (read by sdcguard.agent.decide, pure) -----------------------------------------------

    precedence: int = 100
    """Which detector's alarm wins when the recomputations disagree with owners several detectors asked for,
    and which saying wins among equals when they all reproduced (the lowest first)."""
    unconfirmed_precedence: int = 100
    """Which detector's alarm wins when no other node recomputed (the lowest first)."""

    def at_once(self, verdict: V, context: Context) -> Decision:
        """The decision on a :meth:`final` verdict."""
        raise NotImplementedError(f"{type(self).__name__} gave a final verdict but says nothing of it (at_once)")

    def unconfirmed(self, verdict: V, verdicts: Verdicts, context: Context) -> AlarmDecision | None:
        """The alarm ``verdict`` raises when no other node can recompute (None: it raises none)."""
        return None

    def confirmed(self, verdict: V, mismatch: Mismatch, verdicts: Verdicts, context: Context) -> AlarmDecision | None:
        """The alarm when other nodes' recomputations disagree with an owner (None: not this detector's)."""
        return None

    def reproduced(self, verdict: V, reproduced: Reproduced, verdicts: Verdicts, context: Context) -> Decision | None:
        """What it says when every recomputation reproduced the owners' claims (None: nothing; the step updates)."""
        return None


_LOWEST = torch.iinfo(torch.int64).min


class ReducedGradCheck(StepDetector[GroupVerdict]):
    """The reduced gradients, which every replica of a vote group must hold bit for bit: a majority vote of
    their fingerprints. Its verdict is final: no recomputation can say who received what."""

    detector = Detector.REDUCED_GRAD

    def __init__(self, vote_groups: list[list[int]], slot: int = 0) -> None:
        self.vote_groups = vote_groups
        self.slot = slot
        """This rank's vote group."""

    def lane_width(self) -> int:
        return len(self.vote_groups) * fp.LANES

    def lanes(self, found: StepFindings) -> torch.Tensor:
        """One slot of lanes per vote group: this rank's lanes in its own group's slot, the lowest int64
        elsewhere (so the MAX and MIN of every slot are its own group's)."""
        s = found.summary
        mine = s.narrow(0, REDUCED_FP.start, fp.LANES)
        slots = len(self.vote_groups)
        if slots == 1:
            return mine
        lowest = torch.full((slots, fp.LANES), _LOWEST, dtype=torch.int64, device=s.device)
        here = (torch.arange(slots, device=s.device) == self.slot).unsqueeze(1)
        return torch.where(here, mine.unsqueeze(0), lowest).reshape(-1)

    def judge(self, rows: GatheredFindings, found: StepFindings) -> GroupVerdict | None:
        # A step with non-finite sums belongs to detector 1 (their bits carry no meaning).
        if rows.reduced_nonfinite:
            return None
        verdict = vote_in_groups(rows.reduced_lanes, self.vote_groups)
        return None if verdict.unanimous else verdict

    def final(self, verdict: GroupVerdict) -> bool:
        return True

    def at_once(self, verdict: GroupVerdict, context: Context) -> Decision:
        suspects = verdict.dissenters
        return Decision.raise_alarm(AlarmDecision(
            Detector.REDUCED_GRAD, suspects, verdict.localized,
            fingerprint_evidence("reduced_grad", verdict.groups(), verdict.majority(), "reduced_gradients"),
            f"replicas received different reduced gradients; outside the strict majority: {suspects}"
            if verdict.localized else "replicas received different reduced gradients and no strict majority"))


class NonFiniteCheck(StepDetector[NonFiniteVerdict]):
    """Detector 1: NaN/Inf in a rank's local gradients or loss, or in the reduced gradients.

    Final (no recomputation) when the reduction alone went non-finite, or when, under a GradScaler, every
    rank's scaled gradients overflowed with finite losses (the scaler's routine backoff)."""

    detector = Detector.NONFINITE_GRAD
    reason = confirm.NONFINITE

    def __init__(self, world_size: int, *, scaled: bool) -> None:
        self.world_size = world_size
        self.scaled = scaled

    flag_width = 3  # any local, any reduced, the loss: the gradient observer's, in the summary (no row of its own)

    def flags(self, found: StepFindings) -> torch.Tensor:
        s = found.summary
        # Views, not an index tensor: nothing is copied from the host to the device.
        return torch.cat([s.narrow(0, LOCAL_ANY, REDUCED_ANY + 1 - LOCAL_ANY), s.narrow(0, LOSS_NONFINITE, 1)])

    def judge(self, rows: GatheredFindings, found: StepFindings) -> NonFiniteVerdict | None:
        verdict = judge_nonfinite(rows.summaries)
        return verdict if verdict.local_ranks or verdict.loss_ranks or verdict.reduced_ranks else None

    def final(self, verdict: NonFiniteVerdict) -> bool:
        return not self.asks(verdict) or self.overflow(verdict)

    def overflow(self, verdict: NonFiniteVerdict) -> bool:
        """Every rank's scaled gradients overflowed and every loss is finite (only with a GradScaler)."""
        return self.scaled and len(verdict.local_ranks) == self.world_size and not verdict.loss_ranks

    def asks(self, verdict: NonFiniteVerdict) -> list[int]:
        return sorted(set(verdict.local_ranks) | set(verdict.loss_ranks))

    precedence = 10
    unconfirmed_precedence = 10

    def at_once(self, verdict: NonFiniteVerdict, context: Context) -> Decision:
        """The GradScaler's routine backoff (an alarm past ``max_scaler_overflow_steps`` in a row), or a
        reduction that delivered non-finite sums from finite inputs."""
        if self.overflow(verdict):
            streak = context.overflow_streak + 1
            if streak <= context.max_scaler_overflow_steps:
                return Decision("overflow", scaler_overflow=True)
            message = (f"gradients non-finite on every rank for {streak} consecutive steps, "
                       f"past the GradScaler's backoff ({context.max_scaler_overflow_steps} allowed)")
            return Decision.raise_alarm(AlarmDecision(Detector.NONFINITE_GRAD, [], False, evidence_of(verdict),
                                                      message), scaler_overflow=True)
        # Finite inputs everywhere, non-finite sums: the reduction itself.
        strict = 0 < len(verdict.reduced_ranks) < context.world_size
        suspects = verdict.reduced_ranks if strict else []
        return Decision.raise_alarm(AlarmDecision(
            Detector.NONFINITE_GRAD, suspects, bool(suspects), nonfinite_evidence([], True, verdict.buckets),
            f"the reduction delivered non-finite gradients to rank(s) {verdict.reduced_ranks}"))

    def unconfirmed(self, verdict: NonFiniteVerdict, verdicts: Verdicts, context: Context) -> AlarmDecision | None:
        if not (verdict.local_ranks or verdict.loss_ranks):
            return None
        # The ranks whose own pass went non-finite: their local gradients, or only their loss.
        named = sorted(set(verdict.local_ranks) | set(verdict.loss_ranks))
        suspects = [] if len(verdict.local_ranks) == context.world_size else named
        return AlarmDecision(Detector.NONFINITE_GRAD, suspects, bool(suspects), evidence_of(verdict),
                             f"non-finite local gradients on rank(s) {named}")

    def confirmed(self, verdict: NonFiniteVerdict, mismatch: Mismatch, verdicts: Verdicts,
                  context: Context) -> AlarmDecision | None:
        if confirm.NONFINITE not in mismatch.reasons:
            return None
        message = (f"non-finite gradients on rank(s) {verdict.local_ranks or verdict.loss_ranks} that another "
                   f"node's recomputation did not reproduce; suspects {mismatch.verdict.suspects} ({mismatch.where})")
        return AlarmDecision(Detector.NONFINITE_GRAD, mismatch.verdict.suspects, mismatch.verdict.localized,
                             evidence_of(verdict).model_copy(update={"confirmation": mismatch.pairs}), message,
                             mismatch.persistence)

    def reproduced(self, verdict: NonFiniteVerdict, reproduced: Reproduced, verdicts: Verdicts,
                   context: Context) -> Decision | None:
        """The recomputations reproduced the NaN/Inf: the data's (every rank skips the update)."""
        owners = sorted(o.owner for o in reproduced.verdict.outcomes if confirm.NONFINITE in o.reasons)
        return Decision("data_fault", ranks=owners) if owners else None


def evidence_of(verdict: NonFiniteVerdict) -> NonFiniteEvidence:
    """Detector 1's evidence from its reading of the gathered rows (per DDP bucket, or per FSDP group)."""
    return nonfinite_evidence(verdict.local_ranks, bool(verdict.reduced_ranks), verdict.buckets)


class ProductCheck(StepDetector[list[ProductSite]]):
    """Every matrix product of the rank's own pass checked by checksums (sdcguard.agent.product_checks)."""

    detector = Detector.PRODUCT_CHECK
    reason = confirm.PRODUCT

    def __init__(self, checks: ProductChecks) -> None:
        self.checks = checks

    def watching(self) -> contextlib.AbstractContextManager[None]:
        """Every product of the own pass (recomputations run outside: a flag is always this rank's own)."""
        return self._watching()

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        self.checks.begin_step()
        with self.checks.watching():
            yield

    def observe(self, step: int, found: StepFindings) -> None:
        found.products = self.checks.summary()

    flag_width = 1
    row_width = 2  # the first failing site (or -1), how many failed

    def flags(self, found: StepFindings) -> torch.Tensor:
        # A view and a clamp (the count is >= 0): 1 where some product failed, with no scalar from the host.
        hit = found.products.narrow(0, 1, 1).clamp(max=1) if found.products is not None else None
        return flag_of(hit, found.summary)

    def row(self, found: StepFindings) -> torch.Tensor:
        if found.products is not None:
            return found.products.to(torch.int64).reshape(2)
        # "None failed", filled on the device: no copy from the host.
        device = found.summary.device
        return torch.cat([torch.full((1,), -1, dtype=torch.int64, device=device),
                          torch.zeros(1, dtype=torch.int64, device=device)])

    def judge(self, rows: GatheredFindings, found: StepFindings) -> list[ProductSite] | None:
        """The first failing product of each rank whose checks fired (named from this rank's sites: every rank
        runs the same model, so the same sites in the same order)."""
        sites = [ProductSite(rank=rank, site=site[:256]) for rank, site in self.checks.findings(rows.of(self))]
        return sites[:4096] or None

    def asks(self, verdict: list[ProductSite]) -> list[int]:
        return [site.rank for site in verdict]

    precedence = 20
    unconfirmed_precedence = 35  # after the audit's: without a recomputation, a failed audit pair names first

    def unconfirmed(self, verdict: list[ProductSite], verdicts: Verdicts, context: Context) -> AlarmDecision | None:
        """The checksums' bound is rigorous: a mismatch alone is an alarm, localised to the rank that made it."""
        ranks = sorted({s.rank for s in verdict})
        sites = ", ".join(f"rank {s.rank}: {s.site}" for s in verdict[:8])
        return AlarmDecision(Detector.PRODUCT_CHECK, ranks, True, ProductCheckEvidence(sites=verdict),
                             f"a matrix product failed its checksums ({sites}); no other node recomputed it")

    def confirmed(self, verdict: list[ProductSite], mismatch: Mismatch, verdicts: Verdicts,
                  context: Context) -> AlarmDecision | None:
        mismatched = mismatch.owners
        sites = [s for s in verdict if s.rank in mismatched]
        if confirm.PRODUCT not in mismatch.reasons or not sites:
            return None
        named = ", ".join(f"rank {s.rank}: {s.site}" for s in sites[:8])
        message = (f"a matrix product failed its checksums ({named}) and other nodes' recomputations "
                   f"disagree with rank(s) {mismatched}; suspects {mismatch.verdict.suspects} ({mismatch.where})")
        return AlarmDecision(Detector.PRODUCT_CHECK, mismatch.verdict.suspects, mismatch.verdict.localized,
                             ProductCheckEvidence(sites=sites, confirmation=mismatch.pairs), message,
                             mismatch.persistence)

    def reproduced(self, verdict: list[ProductSite], reproduced: Reproduced, verdicts: Verdicts,
                   context: Context) -> Decision | None:
        return Decision("update", notes=((logging.WARNING, (
            f"step {context.step}: product checks fired ({', '.join(f'rank {s.rank}: {s.site}' for s in verdict[:8])}); "
            f"the recomputations on other nodes reproduced the micro-batch's loss and gradients, so the fault did "
            f"not reach them: the update goes ahead")),))


class RingAuditCheck(StepDetector[AuditVerdict]):
    """Detector 2: every ``every`` steps, each rank recomputes another's whole step and sends the record to
    its owner, who compares it with its own."""

    detector = Detector.RING_AUDIT
    reason = confirm.AUDIT

    def __init__(self, every: int, parallel: Parallelism, gather: Gather, group: dist.ProcessGroup | None) -> None:
        self.every = every
        self.parallel = parallel
        self.gather = gather
        self.group = group

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def observe(self, step: int, found: StepFindings) -> None:
        parallel = self.parallel
        found.own_record, found.audit_record = parallel.audit_records(step, found)
        received = torch.empty_like(found.own_record)
        if parallel.job.topology.world_size > 1:
            ops = [dist.P2POp(dist.isend, found.audit_record, global_rank(self.group, parallel.audits), self.group),
                   dist.P2POp(dist.irecv, received, global_rank(self.group, parallel.audited_by), self.group)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        else:
            received = found.audit_record
        found.audit_bad = (received != found.own_record).any()

    flag_width = row_width = 1  # this rank's pair disagreed (0 on the steps it is not due)

    def flags(self, found: StepFindings) -> torch.Tensor:
        return flag_of(found.audit_bad, found.summary)

    row = flags

    def judge(self, rows: GatheredFindings, found: StepFindings) -> AuditVerdict | None:
        """A pair disagreed: gather both sides' records (O(world), only now) and judge them."""
        if found.own_record is None or found.audit_record is None or not bool(rows.of(self).any()):
            return None
        both = self.gather(torch.cat([found.own_record, found.audit_record]))
        width = both.shape[1] // 2
        return judge_audit(both[:, :width], both[:, width:], self.parallel.audit_stride,
                           names=self.parallel.digest_names())

    def asks(self, verdict: AuditVerdict) -> list[int]:
        return [pair.audited for pair in verdict.mismatched]

    precedence = 30
    unconfirmed_precedence = 30

    def unconfirmed(self, verdict: AuditVerdict, verdicts: Verdicts, context: Context) -> AlarmDecision | None:
        if verdict.clean:
            return None
        where = "disagrees with both ring neighbours" if verdict.localized else "involved in a failed audit"
        return AlarmDecision(Detector.RING_AUDIT, verdict.suspects, verdict.localized,
                             ring_evidence(ring_pairs(verdict, context)), f"rank(s) {verdict.suspects} {where}")

    def confirmed(self, verdict: AuditVerdict, mismatch: Mismatch, verdicts: Verdicts,
                  context: Context) -> AlarmDecision | None:
        if confirm.AUDIT not in mismatch.reasons:
            return None
        return recomputed_alarm(Detector.RING_AUDIT, mismatch, verdicts, context)

    def reproduced(self, verdict: AuditVerdict, reproduced: Reproduced, verdicts: Verdicts,
                   context: Context) -> Decision | None:
        """Every recomputation reproduces the audited ranks' claims: the auditor got it wrong once."""
        if verdict.clean:
            return None
        auditors = sorted({p.auditor for p in verdict.mismatched})
        evidence = ring_evidence(ring_pairs(verdict, context)).model_copy(update={"confirmation": reproduced.pairs})
        return Decision.raise_alarm(AlarmDecision(
            Detector.RING_AUDIT, auditors, context.ring.units >= 3, evidence,
            f"the audit by rank(s) {auditors} disagreed, but two other recomputations reproduced the audited "
            f"claims: the auditors' hardware", "transient"))


def ring_pairs(verdict: AuditVerdict, context: Context) -> list[RingPair]:
    """The audit's disagreeing pairs as the evidence gives them (at most 4096, 64 parameters each)."""
    return [RingPair(auditor=p.auditor, audited=p.audited, loss_match=p.loss_match,
                     expected_loss=p.expected_loss, observed_loss=p.observed_loss,
                     mismatched_params=[context.param_label(n) for n in p.mismatched_params[:64]])
            for p in verdict.mismatched][:4096]


def recomputed_alarm(detector: Detector, mismatch: Mismatch, verdicts: Verdicts, context: Context) -> AlarmDecision:
    """The alarm of a recomputation that disagreed with an owner the audit (``ring_audit``) or the magnitude
    trigger (``magnitude_trigger``) asked for, with the ring audit's evidence layout: the audit's own failed
    pairs where it has any, else the confirmations that disagreed, else every confirmation."""
    audit = verdicts.get(Detector.RING_AUDIT)
    audit_pairs = ring_pairs(audit, context) if audit is not None and not audit.clean else []
    trigger = "audit" if detector is Detector.RING_AUDIT else "magnitude"
    evidence = ring_evidence(audit_pairs or mismatch.disagreed() or mismatch.pairs).model_copy(
        update={"kind": detector.value, "trigger": trigger, "confirmation": mismatch.pairs})
    what = "failed the ring audit" if trigger == "audit" else "jumped (magnitude trigger)"
    message = (f"rank(s) {mismatch.owners} {what} and other nodes' "
               f"recomputations disagree; suspects {mismatch.verdict.suspects} ({mismatch.where})")
    return AlarmDecision(detector, mismatch.verdict.suspects, mismatch.verdict.localized, evidence, message, mismatch.persistence)


class MagnitudeCheck(StepDetector[list[int]]):
    """The magnitude trigger: a loss or gradient norm far from the rank's own history. It never blames by
    itself; it asks for a confirmation of the ranks it fired on."""

    detector = Detector.MAGNITUDE_TRIGGER
    reason = confirm.MAGNITUDE

    def __init__(self, trigger: MagnitudeTrigger, parallel: Parallelism,
                 unscaled: Callable[[torch.Tensor], torch.Tensor], group: dist.ProcessGroup | None) -> None:
        self.trigger = trigger
        self.parallel = parallel
        self.unscaled = unscaled
        self.group = group

    def observe(self, step: int, found: StepFindings) -> None:
        """While it has too little history of its own (a fresh job's first ``trigger_warmup`` steps, or a
        resume from a checkpoint without its state), also the cross-rank test: a loss or local-gradient norm
        orders of magnitude away from the other ranks' (an all-gather of two numbers per rank on those steps
        only; nothing is read back)."""
        norm = self.unscaled(self.parallel.local_norm(found))
        fired = self.trigger.fires(found.loss, norm)
        topology = self.parallel.job.topology
        if self.trigger.warming_up and topology.world_size >= 2:
            mine = torch.stack([found.loss.detach().reshape(()).to(torch.float64),
                                norm.detach().reshape(()).to(torch.float64)])
            rows = [torch.empty_like(mine) for _ in range(topology.world_size)]
            dist.all_gather(rows, mine, group=self.group)
            fired = fired | cross_rank_outliers(torch.stack(rows))[topology.rank]
        found.trigger = fired

    flag_width = row_width = 1  # this rank's trigger fired

    def flags(self, found: StepFindings) -> torch.Tensor:
        return flag_of(found.trigger, found.summary)

    row = flags

    def judge(self, rows: GatheredFindings, found: StepFindings) -> list[int] | None:
        return torch.nonzero(rows.of(self)[:, 0]).reshape(-1).tolist() or None

    def asks(self, verdict: list[int]) -> list[int]:
        return verdict

    precedence = 40  # alone never an alarm; after the audit, which claims a step both asked for

    def confirmed(self, verdict: list[int], mismatch: Mismatch, verdicts: Verdicts,
                  context: Context) -> AlarmDecision | None:
        if confirm.MAGNITUDE not in mismatch.reasons:
            return None
        # Its own detector, with ring_audit's evidence layout.
        return recomputed_alarm(Detector.MAGNITUDE_TRIGGER, mismatch, verdicts, context)

    def passed(self, step: int) -> None:
        self.trigger.observe()


@dataclass(frozen=True)
class WeightCheck:
    """Detector 3's cadence: the weights, optimizer state and checked buffers are compared before the pass of
    every ``every``-th step (on a gather of their own, not from the step's rows)."""

    every: int
    detector: Detector = Detector.WEIGHT_FINGERPRINT

    def due(self, step: int) -> bool:
        """Whether ``step`` starts with the weight check."""
        return step % self.every == 0

    @staticmethod
    def alarm(verdict: GroupVerdict) -> AlarmDecision:
        """Its blame rule: replicas that disagree, outside the strict majority (all of them without one); final."""
        suspects = verdict.dissenters
        return AlarmDecision(
            Detector.WEIGHT_FINGERPRINT, suspects, verdict.localized,
            fingerprint_evidence("weight_fingerprint", verdict.groups(), verdict.majority(), "weights+optimizer"),
            f"replicas hold different weights; outside the strict majority: {suspects}"
            if verdict.localized else "replicas hold different weights and no strict majority")


def step_detectors(config: GuardConfig, parallel: Parallelism, *, audit: bool, gather: Gather,
                   group: dist.ProcessGroup | None, trigger: MagnitudeTrigger | None,
                   products: ProductChecks | None, unscaled: Callable[[torch.Tensor], torch.Tensor],
                   scaled: bool) -> list[StepDetector[Any]]:
    """The detectors ``config`` turns on, in the order they observe and judge (see the module's docstring).

    ``audit`` says whether the ring audit can run (it needs another node); ``trigger`` and ``products`` are
    the magnitude trigger's and the product checks' state (None when off)."""
    detectors: list[StepDetector[Any]] = []
    if config.reduced_grad:
        detectors.append(ReducedGradCheck(parallel.vote_groups, parallel.vote_slot))
    if config.nonfinite:
        detectors.append(NonFiniteCheck(parallel.job.topology.world_size, scaled=scaled))
    if products is not None:
        detectors.append(ProductCheck(products))
    if audit and config.audit_every > 0:
        detectors.append(RingAuditCheck(config.audit_every, parallel, gather, group))
    if trigger is not None:
        detectors.append(MagnitudeCheck(trigger, parallel, unscaled, group))
    return detectors


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """``rank`` of ``group`` as a rank of the default group (what point-to-point calls take)."""
    return dist.get_global_rank(group, rank) if group is not None else rank
