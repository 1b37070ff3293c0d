"""The pieces every campaign rank is built from, without a process group.

The training loop is written once and stops where its caller stops; the
all-reduce wrapper lasts exactly as long as its block, an exception
included; the fault queue hands each fault to exactly one world; the records
keep the JSON layout the parent's judging reads (keys, their order, the
optional ones left out); the plan reads back as it was written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import pytest
import torch.distributed as dist

from sdcguard.agent.guard import SDCGuard, StepResult
from sdcguard.campaign.all_reduce_wrap import wrapped_all_reduce
from sdcguard.campaign.collectives import RankGroup
from sdcguard.campaign.detectors import configs
from sdcguard.campaign.fault_queue import FaultQueue
from sdcguard.campaign.faults import draw, row_id
from sdcguard.campaign.injectors import ModelShape
from sdcguard.campaign.rank_plan import RankPlan
from sdcguard.campaign.records import (
    BaselineRun,
    DetectorRun,
    EndState,
    FirstAlarm,
    ReferenceRecord,
    UnverifiedLoad,
)
from sdcguard.campaign.settings import QUICK
from sdcguard.campaign.training_run import TrainingRun


class _Steps:
    """A guard whose steps return a set loss and raise the ``overflow`` flag on even steps."""

    def __init__(self) -> None:
        self.stepped: list[int] = []

    def step(self, step: int) -> StepResult:
        self.stepped.append(step)
        return StepResult(step=step, loss=float(step) / 10, overflow=step % 2 == 0)


def test_the_loop_trains_until_its_caller_stops_and_counts_what_it_saw() -> None:
    guard = _Steps()
    run = TrainingRun(cast("SDCGuard", guard))
    before: list[int] = []
    for step, result in run.steps(range(3, 10), before=before.append):
        assert result.step == step
        if step == 6:
            break
    assert guard.stepped == before == [3, 4, 5, 6]
    assert run.losses == [0.3, 0.4, 0.5, 0.6]
    assert run.flags == {"overflow": 2}
    assert run.last_step == 6
    assert run.norms == []  # no probe: no norms


def test_the_all_reduce_wrapper_is_gone_after_its_block_even_after_an_error() -> None:
    original = dist.all_reduce
    calls: list[Any] = []

    def counting(inner: Any) -> Any:
        def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(tensor)
            return None

        return all_reduce

    def step() -> None:
        with wrapped_all_reduce(counting):
            dist.all_reduce("bucket")
            raise RuntimeError("in the step")

    with pytest.raises(RuntimeError, match="in the step"):
        step()
    assert calls == ["bucket"]
    assert dist.all_reduce is original


class _Rank0:
    """Rank 0 of a world of one: its own choice is the world's."""

    rank = 0

    @staticmethod
    def from_rank0(value: int) -> int:
        return value


def test_two_worlds_take_every_fault_once_in_plan_order(tmp_path: Path) -> None:
    faults = [draw(0, row_id("weight", "transient", i), world=3, first_step=12, span=10, horizon=8,
                   checkpoint_gap=5) for i in range(5)]
    first = FaultQueue(faults, tmp_path, cast("RankGroup", _Rank0())).claimed()
    second = FaultQueue(faults, tmp_path, cast("RankGroup", _Rank0())).claimed()
    taken = [next(first), next(second), next(second), next(first), next(first)]
    assert [place for place, _ in taken] == [0, 1, 2, 3, 4]
    assert [fault for _, fault in taken] == faults
    assert next(first, None) is None
    assert next(second, None) is None


def _end(**extra: Any) -> EndState:
    return EndState(end_step=30, exact_final=False, finite_final=True, weight_rel=math.inf, losses=[[1.0, 1.0]],
                    norms=[[2.0, 2.0]], series_start=29, **extra)


def test_a_run_record_keeps_the_layout_the_judging_reads() -> None:
    alarm = FirstAlarm(step=30, detector="ring_audit", suspects=[1], localized=True, trusted_through=19,
                       rollback_step=10, rollback_ok=True, fault_persistence=None)
    base = BaselineRun(alarm=None, last_step=29, fired=2, flags={}, end=_end(all_finite=True,
                                                                            reduced_identical=False),
                       benign_at=None)
    assert list(base.to_dict()) == ["alarm", "last_step", "fired", "flags", "end_step", "exact_final",
                                    "finite_final", "weight_rel", "losses", "norms", "series_start", "all_finite",
                                    "reduced_identical", "benign_at"]
    trained = DetectorRun(alarm=alarm, last_step=30, fired=1, flags={"audited": 1})
    assert trained.to_dict() == {"alarm": {"step": 30, "detector": "ring_audit", "suspects": [1],
                                           "localized": True, "trusted_through": 19, "rollback_step": 10,
                                           "rollback_ok": True, "fault_persistence": None},
                                 "last_step": 30, "fired": 1, "flags": {"audited": 1}}
    assert DetectorRun(alarm=None, last_step=29, fired=2, flags={}, derived="all_finite").to_dict()[
        "derived"] == "all_finite"
    loud = UnverifiedLoad(loud=True, problem="UnpicklingError: ...", wrong_step=False)
    assert loud.to_dict() == {"loud": True, "problem": "UnpicklingError: ...", "wrong_step": False}
    assert list(UnverifiedLoad(loud=False, problem=None, wrong_step=False, end=_end()).to_dict())[3:] == [
        "end_step", "exact_final", "finite_final", "weight_rel", "losses", "norms", "series_start"]
    shape = ModelShape(products={"fwd": 4, "bwd": 8}, allreduces=1, linears=["fc"], params=[("fc.weight", 6)])
    reference = ReferenceRecord(steps=1, seconds=0.5, shape=shape, model="m.M", trainable=6, losses=[[1.0]],
                                norms=[[2.0]])
    assert json.loads(json.dumps(reference.to_dict()))["shape"] == {
        "products": {"fwd": 4, "bwd": 8}, "allreduces": 1, "linears": ["fc"], "params": [["fc.weight", 6]]}


def test_the_plan_reads_back_as_written(tmp_path: Path) -> None:
    faults = [draw(0, row_id(model, "persistent", 0), world=3, first_step=12, span=10, horizon=8,
                   checkpoint_gap=5) for model in ("checkpoint", "matmul_fwd")]
    plan = RankPlan(settings=QUICK, configs=configs(10, 5), fault_configs=["nonfinite", "all"],
                    phases=["clean", "faults"], worlds=2, derive=True, faults=faults, out=str(tmp_path))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    assert RankPlan.read(path) == plan
    assert json.loads(path.read_text())["settings"]["last_step"] == QUICK.last_step
