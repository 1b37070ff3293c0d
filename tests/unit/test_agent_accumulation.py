"""Gradient accumulation, clipping and autocast settings, and the recomputation of a whole accumulated step."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sdcguard.agent import fingerprint as fp
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.publisher import Publisher, PublishOutcome
from sdcguard.agent.recompute import recompute_step
from sdcguard.agent.testing.train import JobShape, SyntheticData, build, loss_fn
from sdcguard.contract import Alarm


class Rare(nn.Module):
    """``rare`` takes part only when a micro-batch says so, and then the first two elements of its gradient
    are -0.0; ``never`` takes no part."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 1)
        self.rare = nn.Parameter(torch.ones(3))
        self.never = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, rare: bool) -> torch.Tensor:
        out = self.body(x).sum()
        if rare:
            out = out + (self.rare * torch.tensor([-0.0, -0.0, 0.5])).sum()
        return out


def _loss(module: nn.Module, batch: tuple[torch.Tensor, bool]) -> torch.Tensor:
    return module(*batch)


def _batches() -> list[tuple[torch.Tensor, bool]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 4, generator=g), i == 1) for i in range(3)]


def _owner_grads(model: Rare, batches: list[tuple[torch.Tensor, bool]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What a plain accumulating loop leaves in ``.grad`` (None as zeros, as DDP hands an unused slot)."""
    model.zero_grad(set_to_none=True)
    total = None
    for batch in batches:
        loss = _loss(model, batch) / len(batches)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None
    return total, [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def test_the_recomputation_of_an_accumulated_step_has_the_owners_bits() -> None:
    torch.manual_seed(0)
    model = Rare()
    batches = _batches()
    loss, owner = _owner_grads(model, batches)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())

    again = recompute_step(model, _loss, batches, names, params, seed=lambda: None)

    assert torch.equal(again.loss.reshape(1).view(torch.int32), loss.reshape(1).view(torch.int32))
    assert torch.equal(fp.fingerprint_many([again.grads[n] for n in names]), fp.fingerprint_many(owner))
    # The -0.0 of the one micro-batch that used ``rare`` survives: a sum started from zeros would lose it.
    assert torch.signbit(again.grads["rare"][0])
    assert not torch.signbit(torch.zeros(1) + again.grads["rare"][0])
    assert torch.equal(again.grads["never"], torch.zeros(2))
    # The .grad fields are left alone.
    assert all(torch.equal(p.grad if p.grad is not None else torch.zeros_like(p), o)
               for p, o in zip(params, owner, strict=True))


def test_a_recomputation_of_fewer_micro_batches_differs() -> None:
    torch.manual_seed(0)
    model = Rare()
    batches = _batches()
    loss, _ = _owner_grads(model, batches)
    names = [n for n, _ in model.named_parameters()]
    partial = recompute_step(model, _loss, batches[:2], names, list(model.parameters()), seed=lambda: None)
    assert not torch.equal(partial.loss.reshape(1).view(torch.int32), loss.reshape(1).view(torch.int32))


def test_under_autocast_the_recomputation_runs_every_forward_under_it() -> None:
    seen: list[bool] = []

    def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, bool]) -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        return _loss(module, batch).float()

    model = Rare()
    recompute_step(model, loss_fn, _batches(), [n for n, _ in model.named_parameters()], list(model.parameters()),
                   seed=lambda: None, forward_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert seen == [True, True, True]


@pytest.mark.parametrize(("overrides", "field"), [
    ({"grad_accum_steps": 0}, "grad_accum_steps"),
    ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"max_grad_norm": float("inf")}, "max_grad_norm"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm"),
    ({"autocast_dtype": "float64"}, "autocast_dtype"),
])
def test_bad_loop_settings_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GuardConfig(**overrides)  # type: ignore[arg-type]


def test_loop_settings_come_from_the_environment() -> None:
    config = GuardConfig.from_env({"SDCGUARD_GRAD_ACCUM_STEPS": "4", "SDCGUARD_MAX_GRAD_NORM": "1.5",
                                   "SDCGUARD_AUTOCAST_DTYPE": "bfloat16"})
    assert (config.grad_accum_steps, config.max_grad_norm, config.autocast_dtype) == (4, 1.5, "bfloat16")
    assert GuardConfig.from_env({"SDCGUARD_MAX_GRAD_NORM": "none"}).max_grad_norm is None
    assert GuardConfig().grad_accum_steps == 1
    with pytest.raises(ValueError, match="autocast_dtype"):
        GuardConfig.from_env({"SDCGUARD_AUTOCAST_DTYPE": "half"})


# -- the guard in a one-rank world -------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_world() -> Iterator[None]:
    threads = torch.get_num_threads()  # the guard pins 1; give the rest of the session its own back
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


def _guard(tmp_path: Path, *, poison: frozenset[int] = frozenset(), k: int = 3, **overrides: Any,
           ) -> tuple[SDCGuard, torch.optim.lr_scheduler.LambdaLR]:
    shape = JobShape()
    ddp, optimizer = build(shape, torch.device("cpu"))
    data = SyntheticData(shape, torch.device("cpu"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))

    def batch_for(step: int, rank: int) -> list[tuple[Any, ...]]:
        return [(*data(step * k + i, rank), math.inf if step in poison else 1.0) for i in range(k)]

    def loss(module: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
        return loss_fn(module, batch[:2]) * batch[2]

    config = GuardConfig(on_alarm="continue", grad_accum_steps=k, spool_dir=str(tmp_path / "spool"),
                         checkpoint_prefix=str(tmp_path / "ckpt"), **overrides)
    guard = SDCGuard(ddp, optimizer, loss_fn=loss, batch_for=batch_for, config=config, scheduler=scheduler,
                     injection=None, publisher=_Quiet(config))
    return guard, scheduler


class _Quiet(Publisher):
    def publish(self, alarm: Alarm) -> PublishOutcome:
        return PublishOutcome(delivered=True, event_id="kept")


@pytest.mark.usefixtures("one_rank_world")
def test_the_schedule_steps_after_each_applied_update_and_never_on_a_skipped_one(tmp_path: Path) -> None:
    guard, scheduler = _guard(tmp_path, poison=frozenset({1}))
    results = [guard.step(step) for step in range(3)]
    assert [r.updated for r in results] == [True, False, True]
    assert results[1].alarm is not None  # one rank cannot confirm: the detector's own verdict
    assert scheduler.last_epoch == 2
    assert guard.optimizer.param_groups[0]["lr"] == pytest.approx(JobShape().lr / 3)


@pytest.mark.usefixtures("one_rank_world")
def test_grad_norm_is_reported_with_and_without_clipping(tmp_path: Path) -> None:
    free, _ = _guard(tmp_path / "free")
    clipped, _ = _guard(tmp_path / "clipped", max_grad_norm=1e-4)
    first_free, first_clipped = free.step(0), clipped.step(0)
    assert first_free.grad_norm == pytest.approx(first_clipped.grad_norm, rel=1e-5)
    assert first_clipped.grad_norm > 1e-4
    grads = torch.cat([p.grad.reshape(-1) for p in clipped.params if p.grad is not None])
    assert float(torch.linalg.vector_norm(grads)) <= 1e-4 * (1 + 1e-5)


@pytest.mark.usefixtures("one_rank_world")
def test_batch_for_must_return_k_micro_batches(tmp_path: Path) -> None:
    guard, _ = _guard(tmp_path)
    three = guard.batch_for
    guard.batch_for = lambda step, rank: three(step, rank)[:2]
    with pytest.raises(ValueError, match="batch_for: returned 2 micro-batches for step 0, rank 0; grad_accum_steps is 3"):
        guard.step(0)


@pytest.mark.usefixtures("one_rank_world")
def test_a_disabled_gradscaler_counts_as_none(tmp_path: Path) -> None:
    shape = JobShape()
    ddp, optimizer = build(shape, torch.device("cpu"))
    data = SyntheticData(shape, torch.device("cpu"))
    config = GuardConfig(on_alarm="continue", spool_dir=str(tmp_path / "spool"))
    guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=data, config=config, injection=None,
                     scaler=torch.amp.GradScaler("cpu", enabled=False), publisher=_Quiet(config))
    assert guard.scaler is None
    assert guard.step(0).updated
