"""The step's detectors as components: their cadence, the list the settings build, and what each judges.

Pure: no process group. The parallelism is a stand-in holding only what the
detectors read (its vote groups, its topology, the audit's partners).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.detectors import (
    MagnitudeCheck,
    NonFiniteCheck,
    ProductCheck,
    ReducedGradCheck,
    RingAuditCheck,
    StepDetector,
    WeightCheck,
    step_detectors,
)
from sdcguard.agent.findings import GatheredFindings, Layout, StepFindings
from sdcguard.agent.nonfinite import LOCAL_ANY, LOSS_NONFINITE, REDUCED_ANY, REDUCED_FP, SUMMARY_WIDTH
from sdcguard.agent.product_checks import ProductChecks
from sdcguard.agent.trigger import MagnitudeTrigger
from sdcguard.contract import Detector

WORLD = 4


def _parallel() -> Any:
    topology = types.SimpleNamespace(world_size=WORLD, rank=0)
    return types.SimpleNamespace(vote_groups=[list(range(WORLD))], vote_slot=0,
                                 job=types.SimpleNamespace(topology=topology), audit_stride=1, digest_names=lambda: [])


def _no_gather(local: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a detector whose flag is clear gathered")


def _every(*, config: GuardConfig | None = None, audit: bool = True, trigger: bool = True,
           products: bool = True, scaled: bool = False) -> list[StepDetector[Any]]:
    cpu = torch.device("cpu")
    return step_detectors(config or GuardConfig(), _parallel(), audit=audit, gather=_no_gather, group=None,
                          trigger=MagnitudeTrigger(4.0, 8, 4, cpu) if trigger else None,
                          products=ProductChecks(torch.nn.Linear(2, 2), device=cpu) if products else None,
                          unscaled=lambda norm: norm, scaled=scaled)


def _rows(summaries: torch.Tensor, *detectors: StepDetector[Any], triggered: tuple[int, ...] = (),
          audit_bad: tuple[int, ...] = ()) -> GatheredFindings:
    """Every rank's row as the disagreement path gathers them (laid out for ``detectors``, sdcguard.agent.findings)."""
    layout = Layout(detectors)
    rows = []
    for rank in range(WORLD):
        found = StepFindings(loss=torch.zeros(()), summary=summaries[rank],
                             trigger=torch.tensor(rank in triggered), audit_bad=torch.tensor(rank in audit_bad),
                             products=torch.tensor([-1, 0]))
        rows.append(layout.row(found, torch.zeros(3, dtype=torch.int64)))
    return layout.unpack(torch.stack(rows))


def _clean() -> torch.Tensor:
    return torch.zeros(WORLD, SUMMARY_WIDTH, dtype=torch.int64)


def test_the_settings_build_every_detector_in_the_order_they_observe_and_judge() -> None:
    names = [d.detector for d in _every()]
    # The detectors that may decide at once come first: no later detector's collective runs on a step they settle.
    assert names == [Detector.REDUCED_GRAD, Detector.NONFINITE_GRAD, Detector.PRODUCT_CHECK, Detector.RING_AUDIT,
                     Detector.MAGNITUDE_TRIGGER]


@pytest.mark.parametrize(("off", "kwargs"), [
    (Detector.REDUCED_GRAD, {"config": GuardConfig(reduced_grad=False)}),
    (Detector.NONFINITE_GRAD, {"config": GuardConfig(nonfinite=False)}),
    (Detector.RING_AUDIT, {"config": GuardConfig(audit_every=0)}),
    (Detector.RING_AUDIT, {"audit": False}),  # one node: nobody to audit
    (Detector.MAGNITUDE_TRIGGER, {"trigger": False}),
    (Detector.PRODUCT_CHECK, {"products": False}),
])
def test_a_detector_that_is_off_is_not_in_the_list(off: Detector, kwargs: dict[str, Any]) -> None:
    names = [d.detector for d in _every(**kwargs)]
    assert off not in names
    assert len(names) == 4


@pytest.mark.parametrize("every", [1, 3, 100])
def test_the_audit_and_the_weight_check_are_due_at_their_cadence_the_others_every_step(every: int) -> None:
    detectors = _every(config=GuardConfig(audit_every=every))
    for step in range(250):
        due = {d.detector for d in detectors if d.due(step)}
        assert (Detector.RING_AUDIT in due) == (step % every == 0), step
        assert due - {Detector.RING_AUDIT} == {Detector.REDUCED_GRAD, Detector.NONFINITE_GRAD,
                                               Detector.PRODUCT_CHECK, Detector.MAGNITUDE_TRIGGER}
        assert WeightCheck(every).due(step) == (step % every == 0)


def test_with_every_flag_clear_no_detector_judges_anything() -> None:
    # The rows of a step that disagreed for no detector's reason (as when another vote group's lanes differed).
    found = StepFindings(loss=torch.zeros(()), summary=torch.zeros(SUMMARY_WIDTH, dtype=torch.int64),
                         own_record=torch.zeros(4, dtype=torch.int64), audit_record=torch.zeros(4, dtype=torch.int64))
    detectors = _every()
    for detector in detectors:
        assert detector.judge(_rows(_clean(), *detectors), found) is None, detector.detector


def test_a_raised_flag_is_judged_by_its_detector_alone() -> None:
    # Given rank 2's local gradients went non-finite and rank 1's trigger fired
    summaries = _clean()
    summaries[2, LOCAL_ANY] = 1
    listed = _every()
    rows = _rows(summaries, *listed, triggered=(1,))
    found = StepFindings(loss=torch.zeros(()), summary=summaries[0])
    detectors = {d.detector: d for d in listed}
    # Then detector 1 asks for a confirmation of rank 2, the trigger of rank 1, and the rest say nothing
    nonfinite = detectors[Detector.NONFINITE_GRAD].judge(rows, found)
    assert nonfinite is not None
    assert nonfinite.local_ranks == [2]
    assert not detectors[Detector.NONFINITE_GRAD].final(nonfinite)
    assert detectors[Detector.NONFINITE_GRAD].asks(nonfinite) == [2]
    magnitude = detectors[Detector.MAGNITUDE_TRIGGER]
    assert magnitude.asks(magnitude.judge(rows, found)) == [1]
    for name in (Detector.REDUCED_GRAD, Detector.PRODUCT_CHECK, Detector.RING_AUDIT):
        assert detectors[name].judge(rows, found) is None, name


def test_the_verdicts_no_recomputation_could_change_are_final() -> None:
    found = StepFindings(loss=torch.zeros(()), summary=torch.zeros(SUMMARY_WIDTH, dtype=torch.int64))
    # Replicas that received different reduced gradients: rank 3 outside the majority.
    lanes = _clean()
    lanes[3, REDUCED_FP] = 7
    reduced = ReducedGradCheck([list(range(WORLD))])
    verdict = reduced.judge(_rows(lanes, reduced), found)
    assert verdict is not None
    assert reduced.final(verdict)
    assert verdict.dissenters == [3]
    # A reduction that delivered NaN from finite inputs, and (with a GradScaler) every rank's overflow.
    nonfinite = _clean()
    nonfinite[:, REDUCED_ANY] = 1
    assert _final(NonFiniteCheck(WORLD, scaled=False), nonfinite)
    nonfinite[:, LOCAL_ANY] = 1
    assert _final(NonFiniteCheck(WORLD, scaled=True), nonfinite)
    assert not _final(NonFiniteCheck(WORLD, scaled=False), nonfinite)
    # A non-finite loss is never the GradScaler's.
    nonfinite[1, LOSS_NONFINITE] = 1
    assert not _final(NonFiniteCheck(WORLD, scaled=True), nonfinite)


def _final(check: NonFiniteCheck, summaries: torch.Tensor) -> bool:
    found = StepFindings(loss=torch.zeros(()), summary=summaries[0])
    verdict = check.judge(_rows(summaries, check), found)
    assert verdict is not None
    return check.final(verdict)


def test_a_failed_audit_gathers_both_records_and_judges_them() -> None:
    gathered: list[torch.Tensor] = []

    def gather(local: torch.Tensor) -> torch.Tensor:
        gathered.append(local)
        # Rank 1's recomputation of rank 2 differs from rank 2's own record in its loss bits.
        both = torch.stack([local] * WORLD)
        both[1, 4] = 9
        return both

    audit = RingAuditCheck(5, _parallel(), gather, None)
    found = StepFindings(loss=torch.zeros(()), summary=torch.zeros(SUMMARY_WIDTH, dtype=torch.int64),
                         own_record=torch.zeros(4, dtype=torch.int64), audit_record=torch.zeros(4, dtype=torch.int64))
    assert audit.judge(_rows(_clean(), audit), found) is None
    assert gathered == []
    verdict = audit.judge(_rows(_clean(), audit, audit_bad=(2,)), found)
    assert len(gathered) == 1
    assert verdict is not None
    assert audit.asks(verdict) == [2]


def test_the_trigger_puts_its_flag_in_the_findings_and_learns_only_from_a_step_that_passed() -> None:
    trigger = MagnitudeTrigger(4.0, 8, 1, torch.device("cpu"))
    parallel = _parallel()
    parallel.job.topology.world_size = 1  # no other rank to compare with while it warms up
    parallel.local_norm = lambda found: torch.ones((), dtype=torch.float64)
    check = MagnitudeCheck(trigger, parallel, lambda norm: norm, None)
    found = StepFindings(loss=torch.ones(()), summary=torch.zeros(SUMMARY_WIDTH, dtype=torch.int64))
    check.observe(0, found)
    assert found.trigger is not None
    assert not bool(found.trigger)
    assert trigger.seen == 0
    check.passed(0)
    assert trigger.seen == 1


def test_the_product_check_watches_the_pass_and_flags_nothing_on_a_clean_one() -> None:
    model = torch.nn.Linear(4, 4)
    check = ProductCheck(ProductChecks(model, device=torch.device("cpu")))
    found = StepFindings(loss=torch.zeros(()), summary=torch.zeros(SUMMARY_WIDTH, dtype=torch.int64))
    with check.watching():
        model(torch.randn(2, 4)).sum().backward()
    check.observe(0, found)
    assert found.products is not None
    assert found.products.tolist() == [-1, 0]
    assert check.checks.checked > 0
