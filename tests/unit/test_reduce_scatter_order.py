"""FSDP2: the guard's checks of a reduce-scatter input run once the collective is issued, never before it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from sdcguard.agent.reduce_scatter_observer import ObservedReduceScatter, ReduceScatterObserver


def test_the_collective_is_issued_before_the_checks_and_the_injector_runs_before_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    observer = ReduceScatterObserver()
    observer.measure_norms = True
    seen = observer.begin(record=True)
    observer.before_reduce.append(lambda index, flat: order.append(f"inject {index}"))

    def issued(self: Any, output: torch.Tensor, input_tensor: torch.Tensor, *_: Any, **__: Any) -> str:
        order.append(f"reduce-scatter ({len(seen.flags)} checked)")
        output.copy_(input_tensor[: output.numel()])
        return "work"

    monkeypatch.setattr(DefaultReduceScatter, "__call__", issued)
    rs = ObservedReduceScatter("layers.0", observer)
    flat = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    out = torch.empty(2)

    assert rs(out, flat, None, None, async_op=True) == "work"  # type: ignore[arg-type]
    assert order == ["inject 0", "reduce-scatter (0 checked)"]
    # The checks saw the input the collective was given, unchanged.
    assert seen.names == ["layers.0"]
    assert [bool(f) for f in seen.flags] == [True]
    assert len(seen.norms) == len(seen.rows) == 1


def test_a_recomputation_answers_locally_and_is_still_checked() -> None:
    observer = ReduceScatterObserver()
    observer.communicate = False
    seen = observer.begin(record=False)
    out = torch.full((2,), 5.0)

    assert ObservedReduceScatter("root", observer)(out, torch.ones(4), None, None) is None  # type: ignore[arg-type]
    assert torch.equal(out, torch.zeros(2))
    assert [bool(f) for f in seen.flags] == [False]
