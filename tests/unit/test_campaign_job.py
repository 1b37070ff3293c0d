"""The campaign's job (``--job MODULE:FUNCTION``): resolving a factory, checking what it builds, and the
injectors on a model that is not the reference TinyGPT. No rank is started here."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from sdcguard.agent.testing.train import JobShape, SyntheticData, TinyGPT, loss_fn
from sdcguard.campaign import campaign as driver
from sdcguard.campaign.faults import FaultSpec
from sdcguard.campaign.injectors import ModelShape, install
from sdcguard.campaign.job import (
    REFERENCE_JOB,
    CampaignJob,
    JobProblem,
    built,
    measured_problems,
    reference_job,
    resolve,
)

CPU = torch.device("cpu")


def _tiny_job(seed: int) -> CampaignJob:
    def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Linear(2, 2).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    return CampaignJob(build=build, batch_for=lambda step, rank: torch.ones(1, 2),
                       loss_fn=lambda module, batch: module(batch).sum())


def _raises(seed: int) -> CampaignJob:
    raise RuntimeError("no dataset here")


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> str:
    """A module ``team_jobs`` with a good factory and every way of a bad one."""
    module = types.ModuleType("team_jobs")
    module.__dict__.update(good=_tiny_job, not_callable=42, not_a_job=lambda seed: (nn.Linear(2, 2), None),
                           raises=_raises)
    monkeypatch.setitem(sys.modules, "team_jobs", module)
    return "team_jobs"


def test_a_good_factory_resolves_to_its_job(jobs: str) -> None:
    job = resolve(f"{jobs}:good", 0)
    assert isinstance(job, CampaignJob)
    model, _ = job.build(CPU)
    assert isinstance(model, nn.Linear)


@pytest.mark.parametrize(("spec", "says"), [
    ("team_jobs.good", "expected MODULE:FUNCTION"),
    ("team_jobs:", "expected MODULE:FUNCTION"),
    (":good", "expected MODULE:FUNCTION"),
    ("sdcguard_no_such_module:job", "module 'sdcguard_no_such_module' cannot be imported (ModuleNotFoundError"),
    ("team_jobs:missing", "module 'team_jobs' has no attribute 'missing'"),
    ("team_jobs:not_callable", "'not_callable' is a int, not a function"),
    ("team_jobs:raises", "raises(0) raised RuntimeError: no dataset here"),
    ("team_jobs:not_a_job", "not_a_job(0) returned a tuple, not a sdcguard.campaign.job.CampaignJob"),
])
def test_a_bad_spec_says_what_is_wrong_and_names_the_option(jobs: str, spec: str, says: str) -> None:
    with pytest.raises(JobProblem) as info:
        resolve(spec, 0)
    assert str(info.value).startswith(f"--job {spec!r}: ")
    assert says in str(info.value)


def test_a_bad_spec_fails_before_any_rank_starts(
        jobs: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def launch(*_: object, **__: object) -> list[int | None]:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(driver, "launch", launch)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        driver.run_campaign(driver.dataclasses.replace(driver.QUICK, job=f"{jobs}:missing"), out)
    assert not out.exists()
    # The form alone is checked with the other settings.
    with pytest.raises(ValueError, match="expected MODULE:FUNCTION"):
        driver.Settings(job="team_jobs.good")


def test_the_reference_job_is_the_reference_trainings() -> None:
    # The default campaign's results stay what they were: the same model, weights, data and optimizer.
    shape = JobShape()
    job = resolve(REFERENCE_JOB, shape.seed)
    model, optimizer = job.build(CPU)
    torch.manual_seed(shape.seed)
    expected = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout)
    assert type(model) is TinyGPT
    for (name, p), (other, q) in zip(model.state_dict().items(), expected.state_dict().items(), strict=True):
        assert name == other
        assert torch.equal(p, q), name
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["lr"] == shape.lr
    data = SyntheticData(shape, CPU)
    for step, rank in ((0, 0), (7, 2)):
        for got, want in zip(job.batch_for(step, rank), data(step, rank), strict=True):
            assert torch.equal(got, want)
    assert job.loss_fn is loss_fn
    # Another seed is another model.
    reseeded, _ = reference_job(1).build(CPU)
    assert not torch.equal(reseeded.state_dict()["head.weight"], model.state_dict()["head.weight"])


def test_what_build_returns_is_checked() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert built("j:f", (model, optimizer), CPU) == (model, optimizer)
    with pytest.raises(JobProblem, match=r"--job 'j:f': build\(cpu\) must return \(nn.Module, torch.optim.Optimizer\)"):
        built("j:f", model, CPU)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(JobProblem, match="--job 'j:f': the model has no parameter that requires grad"):
        built("j:f", (frozen, torch.optim.SGD(frozen.parameters(), lr=0.1)), CPU)


def test_what_the_fault_models_need_is_checked_on_the_measured_model() -> None:
    fine = measured_problems("j:f", {"matmul_fwd", "matmul_bwd", "activation", "weight"},
                             {"fwd": 2, "bwd": 3}, ["fc"], {torch.float32})
    assert fine == []
    no_products = measured_problems("j:f", {"matmul_fwd", "mercurial", "gradient"}, {"fwd": 0, "bwd": 4}, ["fc"],
                                    {torch.float32})
    assert no_products == ["--job 'j:f': fault model matmul_fwd: no float32 matrix product (mm, addmm, bmm, "
                           "baddbmm, convolution) was counted in the fwd pass of a step; leave it out of --models"]
    no_linear = measured_problems("j:f", {"activation"}, {"fwd": 1, "bwd": 1}, [], {torch.float32})
    assert no_linear == ["--job 'j:f': fault model activation: the model has no nn.Linear module; "
                         "leave it out of --models"]
    half = measured_problems("j:f", {"weight", "matmul_fwd"}, {"fwd": 1, "bwd": 1}, ["fc"],
                             {torch.float32, torch.bfloat16})
    assert half == ["--job 'j:f': fault model weight: the bit flips are float32's, and trainable parameters are "
                    "bfloat16; leave it out of --models"]


def _optimizer_fault(target: int) -> FaultSpec:
    return FaultSpec(row_id="optimizer/transient/000", model="optimizer", persistence="transient", seed=0, rank=0,
                     step=1, steps=(1,), bit=30, bit_class="exponent", direction="fwd", product=0, element=3,
                     target=target, factor=1.0, period=0)


def _stepped(optimizer_for: Callable[..., torch.optim.Optimizer], **kwargs: float,
             ) -> tuple[nn.Module, torch.optim.Optimizer, ModelShape]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = optimizer_for(model.parameters(), **kwargs)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # the optimizer's state exists from here on, as at any fault's step
    shape = ModelShape(products={"fwd": 2, "bwd": 3}, allreduces=1, linears=["0", "2"],
                       params=[(n, p.numel()) for n, p in model.named_parameters()])
    return model, optimizer, shape


@pytest.mark.parametrize(("optimizer_for", "kwargs", "target", "slot"), [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 1, "momentum_buffer"),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 2, "param"),
    (torch.optim.AdamW, {"lr": 0.01}, 1, "exp_avg"),  # the reference job's order, as before
    (torch.optim.AdamW, {"lr": 0.01}, 2, "exp_avg_sq"),
])
def test_an_optimizer_fault_corrupts_the_state_this_optimizer_has(
        optimizer_for: Callable[..., torch.optim.Optimizer], kwargs: dict[str, float], target: int,
        slot: str) -> None:
    clean_model, clean_opt, _ = _stepped(optimizer_for, **kwargs)
    model, optimizer, shape = _stepped(optimizer_for, **kwargs)
    inst = install(_optimizer_fault(target), rank=0, module=model, optimizer=optimizer, shape=shape)
    for m, opt in ((clean_model, clean_opt), (model, optimizer)):
        inst.begin_step(1)
        opt.zero_grad()
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    inst.remove()
    assert inst.fired == 1
    which = shape.params[0][0]  # element 3 of 4 * 3 + 3 + 3 * 2 + 2 falls in the first weight

    def tensor(m: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
        p = dict(m.named_parameters())[which]
        return p.detach() if slot == "param" else opt.state[p][slot]

    corrupted, clean = tensor(model, optimizer).view(-1), tensor(clean_model, clean_opt).view(-1)
    assert not torch.equal(corrupted[3], clean[3])
    assert torch.equal(torch.cat([corrupted[:3], corrupted[4:]]), torch.cat([clean[:3], clean[4:]]))
