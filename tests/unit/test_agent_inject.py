"""Fault injection: parsed strictly, fires only where and when asked, corrupts exactly what it says."""

from __future__ import annotations

import pytest
import torch

from sdcguard.agent.testing.inject import Injection, Injector, corrupt_checkpoint_bytes, flip_bit, from_env


def test_parse_the_documented_example() -> None:
    inj = Injection.parse("kind=finite_activation,rank=3,step=120,factor=1e4,repeat=50")
    assert (inj.kind, inj.rank, inj.step, inj.factor, inj.repeat, inj.node) == (
        "finite_activation", 3, 120, 1e4, 50, None)
    assert inj.fires(120, 3, "any")
    assert inj.fires(169, 3, "any")
    assert not inj.fires(119, 3, "any")
    assert not inj.fires(170, 3, "any")
    assert not inj.fires(120, 2, "any")


def test_a_node_bound_fault_fires_on_every_rank_of_that_node() -> None:
    inj = Injection.parse("kind=grad_bitflip,node=hyperpod-i-0aaaaaaaaaaaaaaa0,step=4")
    assert inj.fires(4, 0, "hyperpod-i-0aaaaaaaaaaaaaaa0")
    assert inj.fires(4, 7, "hyperpod-i-0aaaaaaaaaaaaaaa0")
    assert not inj.fires(4, 0, "hyperpod-i-0bbbbbbbbbbbbbbb1")


@pytest.mark.parametrize(
    ("text", "field"),
    [("kind=cosmic_ray,rank=1,step=3", "kind"), ("rank=1,step=3", "kind"), ("kind=nan_activation,rank=1", "step"),
     ("kind=nan_activation,step=3", "rank"), ("kind=nan_activation,rank=1,step=x", "step"),
     ("kind=nan_activation,rank=1,step=3,repeat=0", "repeat"), ("kind=nan_activation,rank=1,step=3,bitt=4", "bitt"),
     ("kind=weight_bitflip,rank=1,step=3,bit=64", "bit")],
)
def test_a_malformed_injection_is_refused_naming_the_key(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        Injection.parse(text)


def test_off_by_default() -> None:
    assert from_env({}) is None
    assert from_env({"SDCGUARD_INJECT": "kind=nan_activation,rank=0,step=1"}) is not None


def test_turning_it_on_is_loud(capsys: pytest.CaptureFixture[str]) -> None:
    Injector(Injection.parse("kind=nan_activation,rank=0,step=1"), rank=2, node="n")
    assert "SDCGUARD FAULT INJECTION IS ON (rank 2)" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_flip_bit_changes_exactly_that_bit(dtype: torch.dtype) -> None:
    t = torch.linspace(-1, 1, 8, dtype=dtype)
    before = t.clone()
    flip_bit(t, 3, index=2)
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
    diff = t.view(ints) ^ before.view(ints)
    assert diff.tolist() == [0, 0, 1 << 3, 0, 0, 0, 0, 0]


def test_flip_the_sign_bit() -> None:
    t = torch.tensor([1.5])
    flip_bit(t, 31)
    assert t.item() == -1.5


def test_weight_bitflip_fires_only_at_its_step() -> None:
    injector = Injector(Injection.parse("kind=weight_bitflip,rank=1,step=5,bit=22"), rank=1, node="n")
    w = torch.ones(4)
    injector.begin_step(4)
    injector.weights([w])
    assert torch.equal(w, torch.ones(4))
    injector.begin_step(5)
    injector.weights([w])
    assert w[0].item() == 1.5
    assert torch.equal(w[1:], torch.ones(3))


def test_checkpoint_corruption_changes_one_byte_when_it_fires() -> None:
    inj = Injection.parse("kind=checkpoint_corrupt,rank=0,step=100")
    data = bytes(range(100))
    assert corrupt_checkpoint_bytes(data, step=99, rank=0, injection=inj) == data
    assert corrupt_checkpoint_bytes(data, step=100, rank=1, injection=inj) == data
    bad = corrupt_checkpoint_bytes(data, step=100, rank=0, injection=inj)
    assert len(bad) == len(data)
    assert sum(a != b for a, b in zip(bad, data, strict=True)) == 1


@pytest.mark.parametrize(("repeat", "recomputations_hit"), [(1, False), (3, True)])
def test_repeat_decides_whether_recomputations_on_the_same_hardware_are_hit(repeat: int,
                                                                          recomputations_hit: bool) -> None:
    # A forward hook counts computations; the rank's own pass is the first of its step.
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    injector = Injector(Injection.parse(f"kind=nan_activation,rank=0,step=2,repeat={repeat}"), rank=0, node="n")
    model.register_forward_pre_hook(injector._count)
    model[0].register_forward_hook(injector.activation_hook())
    injector.begin_step(2)
    own = model(torch.ones(1, 3))
    replay = model(torch.ones(1, 3))
    assert torch.isnan(own[0, -1])
    assert bool(torch.isnan(replay[0, -1])) is recomputations_hit
    injector.begin_step(5)
    assert not torch.isnan(model(torch.ones(1, 3))).any()
