"""What a step that disagreed becomes, decided from the detectors' verdicts alone (sdcguard.agent.decide).

Pure: no process group, no guard. The verdicts, the confirmation and the
replays are given as the guard would gather them, for a world of 3 ranks on 3
nodes (every micro-batch has two confirmers).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import torch

from sdcguard.agent import confirm
from sdcguard.agent import fingerprint as fp
from sdcguard.agent.decide import Confirmation, Context, Decision, Verdicts, decide, replays_needed
from sdcguard.agent.detectors import (
    MagnitudeCheck,
    NonFiniteCheck,
    ProductCheck,
    ReducedGradCheck,
    RingAuditCheck,
)
from sdcguard.agent.nonfinite import NonFiniteVerdict
from sdcguard.agent.ring_audit import AuditVerdict, PairResult, bits_to_hex
from sdcguard.agent.weights import vote_in_groups
from sdcguard.contract import Detector, ProductSite

WORLD = 3
RING = confirm.Ring(WORLD, 1)
NONFINITE = NonFiniteCheck(WORLD, scaled=False)
SCALED = NonFiniteCheck(WORLD, scaled=True)
PRODUCTS = ProductCheck(types.SimpleNamespace())  # type: ignore[arg-type]  # its blame rule reads no checks
AUDIT = RingAuditCheck(1, types.SimpleNamespace(), lambda t: t, None)  # type: ignore[arg-type]
MAGNITUDE = MagnitudeCheck(types.SimpleNamespace(), types.SimpleNamespace(), lambda t: t, None)  # type: ignore[arg-type]


def _context(**kwargs: Any) -> Context:
    return Context(step=9, world_size=WORLD, ring=RING, **kwargs)


def _nonfinite(*, local: list[int] = [], reduced: list[int] = [], loss: list[int] = []) -> NonFiniteVerdict:  # noqa: B006
    return NonFiniteVerdict(local_ranks=local, reduced_ranks=reduced, loss_ranks=loss,
                            buckets=[(r, 0, "local") for r in local] + [(r, 0, "reduced") for r in reduced])


def _audit(auditor: int = 0, audited: int = 1) -> AuditVerdict:
    pair = PairResult(auditor, audited, False, bits_to_hex(1), bits_to_hex(2), [0], ["w"])
    return AuditVerdict(mismatched=[pair], suspects=[audited], localized=True)


def _outcome(owner: int, reason: str, *, reproduced: bool) -> confirm.Outcome:
    confirmers = tuple(RING.confirmers(owner))
    if reproduced:
        return confirm.Outcome(owner, (reason,), confirmers, (True, True), True, (), False, owner)
    return confirm.Outcome(owner, (reason,), confirmers, (False, False), False, (owner,), True, confirmers[0])


def _confirmation(*outcomes: confirm.Outcome) -> Confirmation:
    width = confirm.CLAIM_NORMS + 1
    return Confirmation(confirm.ConfirmationVerdict(list(outcomes)), torch.zeros(WORLD, width, dtype=torch.int64),
                        torch.zeros(WORLD, 2, 1 + width, dtype=torch.int64))


def test_a_step_nobody_asks_about_updates() -> None:
    assert decide(Verdicts([(NONFINITE, None), (AUDIT, None)]), None, None, context=_context()) == Decision("update")


def test_replicas_that_received_different_sums_are_decided_at_once_by_the_first_final_verdict() -> None:
    lanes = torch.zeros(WORLD, fp.LANES, dtype=torch.int64)
    lanes[2] = 5
    reduced = vote_in_groups(lanes, [list(range(WORLD))])
    decision = decide(Verdicts([(ReducedGradCheck([list(range(WORLD))]), reduced), (NONFINITE, _nonfinite(local=[1]))]),
                      None, None, context=_context())
    assert decision.kind == "alarm"
    assert decision.alarm is not None
    assert (decision.alarm.detector, decision.alarm.suspects, decision.alarm.localized) == (Detector.REDUCED_GRAD, [2], True)
    assert decision.confirmed == []  # nothing was recomputed


def test_a_reduction_that_delivered_nan_from_finite_inputs_blames_the_ranks_it_reached_when_not_all() -> None:
    decision = decide(Verdicts([(NONFINITE, _nonfinite(reduced=[1]))]), None, None, context=_context())
    assert decision.alarm is not None
    assert (decision.alarm.suspects, decision.alarm.localized) == ([1], True)
    everywhere = decide(Verdicts([(NONFINITE, _nonfinite(reduced=[0, 1, 2]))]), None, None, context=_context())
    assert everywhere.alarm is not None
    assert everywhere.alarm.suspects == []


def test_the_gradscalers_overflow_is_its_backoff_until_the_streak_passes_its_limit() -> None:
    every = Verdicts([(SCALED, _nonfinite(local=[0, 1, 2]))])
    backoff = decide(every, None, None, context=_context(max_scaler_overflow_steps=2, overflow_streak=1))
    assert backoff == Decision("overflow", scaler_overflow=True)
    past = decide(every, None, None, context=_context(max_scaler_overflow_steps=2, overflow_streak=2))
    assert past.kind == "alarm"
    assert past.scaler_overflow
    assert past.alarm is not None
    assert past.alarm.message.startswith("gradients non-finite on every rank for 3 consecutive steps")


def test_without_a_confirmation_the_detectors_own_verdicts_blame_and_the_trigger_alone_never_does() -> None:
    nan = decide(Verdicts([(NONFINITE, _nonfinite(local=[1])), (MAGNITUDE, [2])]), None, None, context=_context())
    assert nan.alarm is not None
    assert nan.confirmed == [1, 2]
    assert (nan.alarm.detector, nan.alarm.suspects) == (Detector.NONFINITE_GRAD, [1])
    # Without a recomputation a failed audit pair names first, before a product's checksums.
    sites = [ProductSite(rank=2, site="fc forward")]
    both = decide(Verdicts([(PRODUCTS, sites), (AUDIT, _audit())]), None, None, context=_context())
    assert both.alarm is not None
    assert both.alarm.detector is Detector.RING_AUDIT
    alone = decide(Verdicts([(PRODUCTS, sites)]), None, None, context=_context())
    assert alone.alarm is not None
    assert (alone.alarm.detector, alone.alarm.suspects) == (Detector.PRODUCT_CHECK, [2])
    assert decide(Verdicts([(MAGNITUDE, [2])]), None, None, context=_context()) == Decision("update", confirmed=[2])


def test_a_recomputation_that_disagrees_blames_with_the_detector_that_asked_and_the_replays_persistence() -> None:
    confirmation = _confirmation(_outcome(1, confirm.NONFINITE, reproduced=False))
    verdicts = Verdicts([(NONFINITE, _nonfinite(local=[1])), (MAGNITUDE, [1])])
    assert replays_needed(confirmation)
    with pytest.raises(ValueError, match="replays_needed"):
        decide(verdicts, confirmation, None, context=_context())
    decision = decide(verdicts, confirmation, confirm.ReplayVerdict("persistent"), context=_context())
    assert decision.alarm is not None
    assert (decision.alarm.detector, decision.alarm.suspects, decision.alarm.localized,
            decision.alarm.persistence) == (Detector.NONFINITE_GRAD, [1], True, "persistent")
    assert [(p.auditor, p.audited) for p in decision.alarm.evidence.confirmation] == [(0, 1), (2, 1)]


def test_a_jump_the_recomputations_contradict_is_the_triggers_alarm_in_the_audits_layout() -> None:
    confirmation = _confirmation(_outcome(2, confirm.MAGNITUDE, reproduced=False))
    decision = decide(Verdicts([(MAGNITUDE, [2])]), confirmation, confirm.ReplayVerdict("transient"),
                      context=_context())
    assert decision.alarm is not None
    assert decision.alarm.detector is Detector.MAGNITUDE_TRIGGER
    assert (decision.alarm.evidence.kind, decision.alarm.evidence.trigger) == ("magnitude_trigger", "magnitude")
    assert decision.alarm.message.startswith("rank(s) [2] jumped (magnitude trigger)")


def test_a_suspect_that_cannot_replay_its_own_computation_is_blamed_for_nothing() -> None:
    confirmation = _confirmation(_outcome(1, confirm.AUDIT, reproduced=False))
    decision = decide(Verdicts([(AUDIT, _audit())]), confirmation, confirm.ReplayVerdict("unknown", [1]),
                      context=_context())
    assert (decision.kind, decision.ranks, decision.alarm) == ("nonreproducible", [1], None)


def test_reproduced_claims_blame_a_failed_audits_auditor_before_calling_a_nan_the_datas() -> None:
    confirmation = _confirmation(_outcome(1, confirm.NONFINITE, reproduced=True),
                                 _outcome(2, confirm.AUDIT, reproduced=True))
    verdicts = Verdicts([(NONFINITE, _nonfinite(local=[1])), (AUDIT, _audit(auditor=1, audited=2))])
    assert not replays_needed(confirmation)
    decision = decide(verdicts, confirmation, None, context=_context())
    assert decision.alarm is not None
    assert (decision.alarm.detector, decision.alarm.suspects, decision.alarm.persistence) == (
        Detector.RING_AUDIT, [1], "transient")
    data = decide(Verdicts([(NONFINITE, _nonfinite(local=[1]))]),
                  _confirmation(_outcome(1, confirm.NONFINITE, reproduced=True)), None, context=_context())
    assert (data.kind, data.ranks, data.confirmed) == ("data_fault", [1], [1])


def test_reproduced_products_update_with_a_warning_that_names_the_sites() -> None:
    sites = [ProductSite(rank=1, site="fc backward dW")]
    decision = decide(Verdicts([(PRODUCTS, sites)]), _confirmation(_outcome(1, confirm.PRODUCT, reproduced=True)),
                      None, context=_context())
    assert decision.kind == "update"
    levels = [level for level, _ in decision.notes]
    assert levels == [logging.WARNING, logging.INFO]
    assert "product checks fired (rank 1: fc backward dW)" in decision.notes[0][1]
