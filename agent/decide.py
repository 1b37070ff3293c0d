"""Deciding a step that disagreed: the detectors' verdicts, the confirmation and the replays in, one Decision out.

Pure: no collective, no state, no logging; the guard gathers, confirms and
replays, calls :func:`decide`, and applies the :class:`Decision` it returns
(an alarm published under the policy, a skip, an update). Every rank calls it
with the same inputs and so decides alike.

What each detector says is its own (its blame rule, in
sdcguard.agent.detectors): :meth:`~sdcguard.agent.detectors.StepDetector.at_once` for a
verdict no recomputation could change,
:meth:`~sdcguard.agent.detectors.StepDetector.unconfirmed` when no other node can
recompute, :meth:`~sdcguard.agent.detectors.StepDetector.confirmed` when the
recomputations disagree with an owner, and
:meth:`~sdcguard.agent.detectors.StepDetector.reproduced` when they all reproduce
the owners' claims. This module holds only the order in which they are
asked:

1. The first detector (in the list's order) whose verdict is final decides at
   once.
2. No rank to confirm: the step updates.
3. No confirmation (``confirm`` off, or no other node): the first detector
   by ``unconfirmed_precedence`` that raises an alarm; else the step updates.
4. A confirmer rebuilt another micro-batch than the owner's: the loader's
   error (``unreplayable``). Recomputations that all differ, with nobody to
   blame: ``nonreproducible``.
5. A recomputation disagreed with an owner: a suspect whose replay matches
   nothing is ``nonreproducible``; else the first detector by
   ``precedence`` whose reason the mismatched owners carry raises the alarm.
6. Every recomputation reproduced the claims: the most severe of the
   detectors' sayings (an alarm, then a data fault, then an update), ties by
   ``precedence``; the notes of every update are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from sdcguard.agent import confirm
from sdcguard.contract import Detector, RingPair
from sdcguard.contract.alarm import FaultPersistence

if TYPE_CHECKING:
    from sdcguard.agent.detectors import StepDetector

Kind = Literal["update", "alarm", "overflow", "data_fault", "nonreproducible", "unreplayable"]
"""What the guard does with the step: update it, raise an alarm (the update skipped), let the GradScaler skip it
(its overflow), skip it on every rank (a data fault; non-reproducible work), or raise the loader's error."""

_SEVERITY: dict[Kind, int] = {"alarm": 0, "unreplayable": 0, "nonreproducible": 1, "data_fault": 2, "overflow": 3,
                              "update": 4}


@dataclass(frozen=True)
class Context:
    """What a decision may depend on besides the verdicts: the step, the world, the settings, the streak."""

    step: int
    world_size: int
    ring: confirm.Ring
    """Who confirms whom (its ``units`` say whether two confirmers can outvote one)."""
    max_scaler_overflow_steps: int = 0
    overflow_streak: int = 0
    """The GradScaler's consecutive overflows before this step."""
    param_label: Callable[[str], str] = str
    """A parameter's name as an alarm's evidence gives it (the parallelism's ``param_label``)."""
    digest_names: list[str] | None = None
    """The parameters of an audit step's digests, in claim order (None on other steps)."""


@dataclass(frozen=True)
class Confirmation:
    """The confirmations' verdict, and the gathered claims and records it was judged from."""

    verdict: confirm.ConfirmationVerdict
    claims: torch.Tensor
    records: torch.Tensor


@dataclass(frozen=True)
class AlarmDecision:
    """An alarm as the detector says it: the guard adds who, where and when (sdcguard.agent.alarms)."""

    detector: Detector
    suspects: list[int]
    localized: bool
    evidence: Any
    message: str
    persistence: FaultPersistence = "unknown"


@dataclass(frozen=True)
class Decision:
    """What the guard applies to a step that disagreed."""

    kind: Kind
    alarm: AlarmDecision | None = None
    """``kind == "alarm"``: the alarm."""
    ranks: list[int] = field(default_factory=list)
    """``data_fault``: the owners of the reproduced NaN/Inf; ``nonreproducible``: the owners of that work;
    ``unreplayable``: (owner, confirmer)."""
    confirmed: list[int] = field(default_factory=list)
    """Ranks whose micro-batch was (to be) recomputed on other nodes this step."""
    scaler_overflow: bool = False
    """Every rank's scaled gradients overflowed: the GradScaler's streak grows (also when it became an alarm)."""
    notes: tuple[tuple[int, str], ...] = ()
    """(logging level, text) the guard logs when it applies the decision."""

    @classmethod
    def raise_alarm(cls, alarm: AlarmDecision, **kwargs: Any) -> Decision:
        """An alarm."""
        return cls("alarm", alarm=alarm, **kwargs)


@dataclass(frozen=True)
class Verdicts:
    """The detectors that judged the step, each with its verdict (None: its flag was clear everywhere), in the
    list's order. The guard stops judging at the first final verdict, so later detectors may be missing."""

    judged: list[tuple[StepDetector[Any], Any]]

    def get(self, detector: Detector) -> Any:
        """The verdict of the detector named ``detector`` (None when it did not judge or saw nothing)."""
        return next((v for d, v in self.judged if d.detector is detector and v is not None), None)

    @property
    def present(self) -> list[tuple[StepDetector[Any], Any]]:
        """The detectors that saw something, with their verdicts."""
        return [(d, v) for d, v in self.judged if v is not None]

    def final(self) -> tuple[StepDetector[Any], Any] | None:
        """The first detector whose verdict needs no recomputation, with it."""
        return next(((d, v) for d, v in self.present if d.final(v)), None)

    def owners(self) -> dict[int, tuple[str, ...]]:
        """Each rank whose micro-batch another node must recompute, with why (the asking detectors' reasons)."""
        owners: dict[int, list[str]] = {}
        for detector, verdict in self.present:
            for rank in detector.asks(verdict):
                owners.setdefault(rank, []).append(detector.reason)
        return {rank: tuple(reasons) for rank, reasons in owners.items()}


@dataclass(frozen=True)
class Mismatch:
    """A confirmation in which some recomputation disagreed with an owner: what every blame rule reads."""

    verdict: confirm.ConfirmationVerdict
    pairs: list[RingPair]
    """Every confirmation recomputation of the step (the evidence's ``confirmation``)."""
    persistence: FaultPersistence

    @property
    def reasons(self) -> set[str]:
        """Why the mismatched owners were confirmed (sdcguard.agent.confirm's reasons)."""
        return {r for o in self.verdict.mismatched for r in o.reasons}

    @property
    def owners(self) -> list[int]:
        """The mismatched owners, sorted."""
        return sorted(o.owner for o in self.verdict.mismatched)

    @property
    def where(self) -> str:
        return "localised by the recomputations on other nodes" if self.verdict.localized else "not localised"

    def disagreed(self) -> list[RingPair]:
        """The recomputations of the mismatched owners that disagreed with the owner's claim."""
        owners = set(self.owners)
        return [p for p in self.pairs if p.audited in owners and not _pair_agrees(p, self.verdict)]


@dataclass(frozen=True)
class Reproduced:
    """A confirmation in which every recomputation reproduced the owners' claims."""

    verdict: confirm.ConfirmationVerdict
    pairs: list[RingPair]


def replays_needed(confirmation: Confirmation) -> bool:
    """Whether :func:`decide` needs the suspects' replays: some recomputation disagreed with an owner (and no
    micro-batch failed to replay)."""
    return not confirmation.verdict.unreplayable and bool(confirmation.verdict.mismatched)


def decide(verdicts: Verdicts, confirmation: Confirmation | None, replays: confirm.ReplayVerdict | None, *,
           context: Context) -> Decision:
    """The step's decision (see the module's docstring for the order).

    ``confirmation`` is None when no other node recomputed (or nobody was asked to); ``replays`` must be
    given when :func:`replays_needed` says so (``ValueError`` otherwise)."""
    final = verdicts.final()
    if final is not None:
        detector, verdict = final
        return detector.at_once(verdict, context)
    owners = verdicts.owners()
    if not owners:
        return Decision("update")
    confirmed = sorted(owners)
    if confirmation is None:
        for detector, verdict in _by(verdicts, "unconfirmed_precedence"):
            alarm = detector.unconfirmed(verdict, verdicts, context)
            if alarm is not None:
                return Decision.raise_alarm(alarm, confirmed=confirmed)
        return Decision("update", confirmed=confirmed)
    verdict = confirmation.verdict
    if verdict.unreplayable:
        return Decision("unreplayable", ranks=list(verdict.unreplayable[0]), confirmed=confirmed)
    if verdict.nonreproducible and not verdict.mismatched:
        return Decision("nonreproducible", ranks=list(verdict.nonreproducible), confirmed=confirmed)
    pairs = confirmation_pairs(confirmation, context)
    if verdict.mismatched:
        if replays is None:
            raise ValueError("decide: a confirmation that disagreed with an owner is decided with the suspects' "
                             "replays (see replays_needed)")
        if replays.nonreproducible:
            # A suspect cannot reproduce its own computation: not a fault of its hardware.
            return Decision("nonreproducible", ranks=list(replays.nonreproducible), confirmed=confirmed)
        mismatch = Mismatch(verdict, pairs, replays.persistence)
        for detector, judged in _by(verdicts, "precedence"):
            alarm = detector.confirmed(judged, mismatch, verdicts, context)
            if alarm is not None:
                return Decision.raise_alarm(alarm, confirmed=confirmed)
        raise AssertionError(f"no detector claimed the confirmed mismatch of rank(s) {mismatch.owners}")
    reproduced = Reproduced(verdict, pairs)
    said = (d.reproduced(v, reproduced, verdicts, context) for d, v in _by(verdicts, "precedence"))
    sayings = [s for s in said if s is not None]
    worst = min((_SEVERITY[s.kind] for s in sayings), default=_SEVERITY["update"])
    if worst < _SEVERITY["update"]:
        chosen = next(s for s in sayings if _SEVERITY[s.kind] == worst)
        return Decision(chosen.kind, alarm=chosen.alarm, ranks=chosen.ranks, confirmed=confirmed,
                        notes=chosen.notes)
    notes = [n for s in sayings for n in s.notes]
    notes.append((logging.INFO, f"step {context.step}: the check(s) of rank(s) {[o.owner for o in verdict.outcomes]} "
                                f"fired; the recomputations reproduced it"))
    return Decision("update", confirmed=confirmed, notes=tuple(notes))


def confirmation_pairs(confirmation: Confirmation, context: Context) -> list[RingPair]:
    """Every confirmation recomputation of the step as the evidence gives it (at most 4096)."""
    label = context.param_label
    return [RingPair(auditor=a, audited=t, loss_match=m, expected_loss=e, observed_loss=o,
                     mismatched_params=[label(n) for n in p[:64]])
            for outcome in confirmation.verdict.outcomes
            for a, t, m, e, o, p in confirm.pair_rows(outcome, confirmation.claims, confirmation.records,
                                                      context.ring, context.digest_names)][:4096]


def _by(verdicts: Verdicts, order: str) -> Sequence[tuple[StepDetector[Any], Any]]:
    # sorted() is stable: detectors of equal precedence keep the list's order.
    return sorted(verdicts.present, key=lambda dv: getattr(dv[0], order))


def _pair_agrees(pair: RingPair, verdict: confirm.ConfirmationVerdict) -> bool:
    for outcome in verdict.outcomes:
        if outcome.owner == pair.audited and pair.auditor in outcome.confirmers:
            return outcome.agrees[outcome.confirmers.index(pair.auditor)]
    return True
