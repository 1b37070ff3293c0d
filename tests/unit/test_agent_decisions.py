"""The guard's decisions that must never blame hardware: a loader that does not replay, work that is not
reproducible, and ranks whose environments differ. Decided by sdcguard.agent.decide from the verdicts given and
applied by the guard's own method (the verdicts themselves are sdcguard.agent.confirm's and
sdcguard.agent.determinism's, tested there)."""

from __future__ import annotations

import logging
import math
import types
from typing import Any

import pytest
import torch

from sdcguard.agent import confirm, guard
from sdcguard.agent.batches import BatchNotReplayable
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.decide import Confirmation, Context, Verdicts, decide
from sdcguard.agent.detectors import StepDetector
from sdcguard.agent.determinism import DeterminismUnavailable
from sdcguard.agent.guard import NonReproducible, SDCGuard, StepResult


def _stub(**config: Any) -> Any:
    cfg = GuardConfig(**config)
    optimizer = types.SimpleNamespace(zero_grad=lambda set_to_none=True: None)
    stub: Any = types.SimpleNamespace(config=cfg, optimizer=optimizer, nonreproducible_steps=0, device=torch.device("cpu"),
                                 topology=types.SimpleNamespace(rank=0, world_size=3),
                                 ring=confirm.Ring(3, 1),
                                 parallel=types.SimpleNamespace(audit_possible=True, job=types.SimpleNamespace(config=cfg)))
    stub._nonreproducible = lambda step, result, ranks: SDCGuard._nonreproducible(stub, step, result, ranks)
    stub.overflow_streak = 0
    return stub


def _confirmation(verdict: confirm.ConfirmationVerdict) -> Confirmation:
    return Confirmation(verdict, torch.zeros(3, 8, dtype=torch.int64), torch.zeros(3, 2, 9, dtype=torch.int64))


class _Asks(StepDetector[list[int]]):
    """A detector that asked for the confirmation of the ranks of its verdict (what it is does not matter here)."""

    reason = confirm.AUDIT

    def judge(self, rows: Any, found: Any) -> list[int] | None:
        raise AssertionError("the verdict is given")

    def asks(self, verdict: list[int]) -> list[int]:
        return verdict


def _decide(stub: Any, step: int, result: StepResult, confirmation: Confirmation) -> Any:
    """Decide with rank 1 confirmed, then apply as the guard does."""
    decision = decide(Verdicts([(_Asks(), [1, 2])]), confirmation, None,
                      context=Context(step=step, world_size=3, ring=stub.ring))
    return SDCGuard._apply(stub, step, decision, result)


def test_a_recomputation_of_another_batch_is_the_loaders_error_not_an_alarm() -> None:
    verdict = confirm.ConfirmationVerdict([], unreplayable=[(2, 1)])
    with pytest.raises(BatchNotReplayable, match=r"batch_for\(7, 2\) is not replayable: rank 1 rebuilt"):
        _decide(_stub(), 7, StepResult(step=7, loss=math.nan), _confirmation(verdict))


def _nonreproducible_verdict() -> confirm.ConfirmationVerdict:
    outcome = confirm.Outcome(1, (confirm.AUDIT,), (0, 2), (False, False), False, (), False, None,
                              nonreproducible=True)
    return confirm.ConfirmationVerdict([outcome], nonreproducible=[1])


def test_work_that_is_not_reproducible_blames_no_rank_and_goes_on_when_asked(
        caplog: pytest.LogCaptureFixture) -> None:
    result = StepResult(step=5, loss=math.nan)
    stub = _stub(on_nonreproducible="continue")
    with caplog.at_level(logging.WARNING, logger="sdcguard.agent.guard"):
        alarm = _decide(stub, 5, result, _confirmation(_nonreproducible_verdict()))
    assert alarm is None
    assert result.nonreproducible
    assert stub.nonreproducible_steps == 1
    assert "not bit-reproducible, no rank is blamed" in caplog.text


def test_work_that_is_not_reproducible_stops_the_job_without_an_alarm_by_default() -> None:
    with pytest.raises(NonReproducible, match=r"step 5: the recomputations of rank\(s\) \[1\]"):
        _decide(_stub(), 5, StepResult(step=5, loss=math.nan), _confirmation(_nonreproducible_verdict()))


def _differing(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"gpu.name": "H100", "torch": "2.5"}, {"gpu.name": "H100", "torch": "2.5"},
            {"gpu.name": "A100", "torch": "2.5"}]
    monkeypatch.setattr(guard, "gather_signatures", lambda device, group=None: rows)


def test_ranks_in_different_environments_are_refused_naming_what_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    _differing(monkeypatch)
    stub = _stub()
    with pytest.raises(DeterminismUnavailable, match=r"gpu.name: 'H100' on ranks \[0, 1\]; 'A100' on rank \[2\]"):
        SDCGuard._preflight(stub, stub.config, None)


def test_ranks_in_different_environments_train_without_the_recomputations_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _differing(monkeypatch)
    stub = _stub(on_environment_mismatch="degrade")
    cfg = SDCGuard._preflight(stub, stub.config, None)
    assert (cfg.audit_every, cfg.confirm) == (0, False)
    assert stub.parallel.job.config is cfg


def test_ranks_in_one_environment_keep_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard, "gather_signatures", lambda device, group=None: [{"torch": "2.5"}] * 3)
    stub = _stub()
    assert SDCGuard._preflight(stub, stub.config, None) is stub.config
