"""The magnitude trigger's blind window: its state survives a checkpoint, and the warm-up's cross-rank test."""

from __future__ import annotations

import io
import math

import pytest
import torch

from sdcguard.agent.testing.train import JobShape, SyntheticData, TinyGPT, loss_fn
from sdcguard.agent.trigger import GRAD_NORM, LOSS, MagnitudeTrigger, cross_rank_outliers

CPU = torch.device("cpu")


def _watched(steps: int, window: int = 8, warmup: int = 4) -> MagnitudeTrigger:
    trigger = MagnitudeTrigger(4.0, window=window, warmup=warmup, device=CPU)
    for i in range(steps):
        trigger.fires(torch.tensor(2.0 + 0.01 * i), torch.tensor(1.0 + 0.01 * i))
        trigger.observe()
    return trigger


def test_a_resumed_trigger_watches_from_its_first_step() -> None:
    # Given a trigger past its warm-up, saved as a checkpoint would (torch.save of its state_dict)
    saved = io.BytesIO()
    torch.save(_watched(11).state_dict(), saved)
    saved.seek(0)
    # When a new process builds a fresh trigger and loads it
    resumed = MagnitudeTrigger(4.0, window=8, warmup=4, device=CPU)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    fresh = MagnitudeTrigger(4.0, window=8, warmup=4, device=CPU)
    # Then the resumed one fires on a jump at its very first step; a fresh one is blind there
    jump = (torch.tensor(1e35), torch.tensor(1.0))
    assert not resumed.warming_up
    assert bool(resumed.fires(*jump))
    assert fresh.warming_up
    assert not bool(fresh.fires(*jump))
    # and it goes on as the original would: the same verdicts on the next steps
    original = _watched(11)
    resumed = MagnitudeTrigger(4.0, window=8, warmup=4, device=CPU)
    resumed.load_state_dict(original.state_dict())
    for value in (2.5, 9.0, 2.2, 0.3):
        pair = (torch.tensor(value), torch.tensor(value / 2))
        assert bool(original.fires(*pair)) == bool(resumed.fires(*pair))
        original.observe()
        resumed.observe()
    assert torch.equal(torch.nanmedian(original.history, 0).values, torch.nanmedian(resumed.history, 0).values)


def test_a_state_from_another_window_keeps_the_most_recent_steps() -> None:
    small = MagnitudeTrigger(4.0, window=4, warmup=2, device=CPU)
    small.load_state_dict(_watched(11, window=8).state_dict())
    assert small.seen == 4
    assert not small.warming_up
    # The four most recent losses (steps 7-10), oldest first.
    expected = torch.log(torch.tensor([2.07, 2.08, 2.09, 2.10], dtype=torch.float64))
    assert torch.allclose(small.history[:, LOSS], expected)


def test_a_malformed_state_is_refused_and_changes_nothing() -> None:
    trigger = _watched(5)
    before = trigger.history.clone(), trigger.seen
    for bad, match in (({"seen": 3}, "history"), ({"history": torch.zeros(8, 3), "seen": 3}, "history"),
                       ({"history": torch.zeros(8, 2), "seen": -1}, "seen")):
        with pytest.raises(ValueError, match=match):
            trigger.load_state_dict(bad)
    assert torch.allclose(trigger.history, before[0], equal_nan=True)
    assert trigger.seen == before[1]


def _healthy_values(ranks: int, steps: int) -> list[torch.Tensor]:
    """Each rank's loss and local gradient norm on its own micro-batch, over the first steps of a real run
    (a fresh TinyGPT with dropout, trained on the ranks' mean gradient, as DDP would)."""
    shape = JobShape()
    data = SyntheticData(shape, CPU)
    torch.manual_seed(0)
    model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr)
    params = list(model.parameters())
    values = []
    for step in range(steps):
        rows, grads = [], [torch.zeros_like(p) for p in params]
        for rank in range(ranks):
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, data(step, rank))
            loss.backward()
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            rows.append(torch.stack([loss.detach(), norm]))
            for g, p in zip(grads, params, strict=True):
                assert p.grad is not None
                g += p.grad / ranks
        for g, p in zip(grads, params, strict=True):
            p.grad = g
        optimizer.step()
        values.append(torch.stack(rows).to(torch.float64))
    return values


def test_healthy_variation_between_ranks_never_flags_and_a_catastrophic_loss_does() -> None:
    values = _healthy_values(ranks=6, steps=12)
    widest = max(float((v.max(0).values / v.min(0).values).max()) for v in values)
    print(f"largest ratio between two ranks' values in the first 12 steps: {widest:.2f}")
    assert widest < 1e2  # an order of magnitude of headroom under the factor
    for v in values:
        assert not bool(cross_rank_outliers(v).any())
    # The reviewer's catastrophic fault: one rank's loss about 1e35, finite.
    bad = values[3].clone()
    bad[4, LOSS] = 1e35
    assert cross_rank_outliers(bad).tolist() == [False, False, False, False, True, False]
    bad = values[3].clone()
    bad[1, GRAD_NORM] = 1e-12  # gradients that vanished on one rank only
    assert cross_rank_outliers(bad).tolist() == [False, True, False, False, False, False]


def test_the_cross_rank_test_is_nan_safe_and_handles_small_worlds() -> None:
    nan = math.nan
    # NaN, infinite, zero: never an outlier, and left out of the reference.
    assert cross_rank_outliers(torch.tensor([[3.0, 1.0], [nan, nan], [3.1, 1.1], [math.inf, 0.0]])).tolist() == \
        [False, False, False, False]
    assert cross_rank_outliers(torch.tensor([[3.0, 1.0], [nan, 1.0], [1e35, 1.0]])).tolist() == [False, False, True]
    # Three ranks, one outlier: the median of all is a healthy one's (the median of the others would not be).
    assert cross_rank_outliers(torch.tensor([[3.0, 1.0], [3.1, 1.1], [3.0, 1e30]])).tolist() == [False, False, True]
    # Two ranks: compared with each other; a loss only upwards, a norm either way (both named then).
    assert cross_rank_outliers(torch.tensor([[3.0, 1.0], [1e35, 1.0]])).tolist() == [False, True]
    assert cross_rank_outliers(torch.tensor([[3.0, 1.0], [3.0, 1e9]])).tolist() == [True, True]
    assert cross_rank_outliers(torch.tensor([[3.0, 1.0]])).tolist() == [False]
    # The factor is the user's.
    assert cross_rank_outliers(torch.tensor([[3.0, 1.0], [3.0, 1.1], [40.0, 1.0]]), factor=10).tolist() == \
        [False, False, True]
    with pytest.raises(ValueError, match="values"):
        cross_rank_outliers(torch.zeros(3))
    with pytest.raises(ValueError, match="factor"):
        cross_rank_outliers(torch.ones(3, 2), factor=1.0)
