"""Every tensor the step's packing and resolve paths make lives on the rank's device.

This machine has no GPU, so the paths run under ``FakeTensorMode`` with fake
``cuda`` tensors: an op that mixes a CPU tensor with them raises
``FakeTensorDeviceMismatchError`` (or refuses to stack), as CUDA itself would.
Collectives and reads back to the host do not run under it; each test stops
where the data would leave the device.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from sdcguard.agent import confirm, sharded
from sdcguard.agent import fingerprint as fp
from sdcguard.agent.ddp_hook import GradientHook, _flag_weights
from sdcguard.agent.detectors import (
    MagnitudeCheck,
    NonFiniteCheck,
    ProductCheck,
    ReducedGradCheck,
    RingAuditCheck,
)
from sdcguard.agent.findings import Layout, StepFindings
from sdcguard.agent.guard import SDCGuard, StepResult
from sdcguard.agent.nonfinite import SUMMARY_WIDTH
from sdcguard.agent.recomputations import Recomputations
from sdcguard.agent.reduce_scatter_observer import GroupFindings
from sdcguard.agent.sharded import ShardedDataParallel

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake() -> Iterator[None]:
    with FakeTensorMode():
        yield


def _findings(*, trigger: bool, audit: bool, products: bool = False) -> StepFindings:
    return StepFindings(loss=torch.zeros((), device=CUDA),
                        summary=torch.zeros(SUMMARY_WIDTH, dtype=torch.int64, device=CUDA),
                        trigger=torch.zeros((), dtype=torch.bool, device=CUDA) if trigger else None,
                        audit_bad=torch.zeros((), dtype=torch.bool, device=CUDA) if audit else None,
                        products=torch.zeros(2, dtype=torch.int64, device=CUDA) if products else None)


def test_the_harness_refuses_a_cpu_tensor_among_cuda_ones(fake: None) -> None:
    # What the guard's resolve once did: a CPU zero for an absent flag, joined to the device's findings.
    with pytest.raises(RuntimeError, match="device"):
        torch.cat([torch.zeros(1, dtype=torch.int64, device=CUDA), torch.zeros(1, dtype=torch.int64)])


@pytest.mark.parametrize(("trigger", "audit"), [(True, False), (False, True), (False, False), (True, True)])
@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("products", [False, True], ids=["products-off", "products-on"])
def test_the_agreement_vector_and_the_gathered_row_stay_on_the_device(fake: None, trigger: bool, audit: bool,
                                                                       slots: int, products: bool) -> None:
    found = _findings(trigger=trigger, audit=audit, products=products)
    layout = Layout(_every_detector(slots))
    vector = layout.agreement(found)
    assert vector.device == CUDA
    assert vector.numel() == 6 + 2 * slots * fp.LANES  # the six flags, then each vote group's lanes twice
    row = layout.row(found, torch.zeros(7, dtype=torch.int64, device=CUDA))
    assert row.device == CUDA
    assert row.numel() == SUMMARY_WIDTH + 4 + 7  # the summary, trigger, audit, the products' two, the claim


def _every_detector(slots: int) -> list[Any]:
    """Every detector of the step as it lays out its slots (this rank in the last of ``slots`` vote groups)."""
    stub: Any = types.SimpleNamespace()
    return [ReducedGradCheck([[r] for r in range(slots)], slot=slots - 1), NonFiniteCheck(slots, scaled=False),
            ProductCheck(stub), RingAuditCheck(1, stub, lambda t: t, None), MagnitudeCheck(stub, stub, lambda t: t, None)]


def _guard_stub(parallel: Any) -> Any:
    stub = types.SimpleNamespace(config=types.SimpleNamespace(nonfinite=True, reduced_grad=True),
                                 parallel=parallel, topology=types.SimpleNamespace(world_size=1, rank=0),
                                 device=CUDA, scaler=None, layout=Layout(_every_detector(1)[:2]))
    stub._unscaled = lambda norm: norm
    return stub


def test_the_step_packs_its_one_copy_to_the_host_on_the_device(fake: None) -> None:
    parallel = types.SimpleNamespace(vote_slot=0, vote_groups=[[0]],
                                     reduced_norm=lambda: torch.zeros((), dtype=torch.float64, device=CUDA))
    found = _findings(trigger=True, audit=False)
    # Reaching the read back (data-dependent under fake tensors) means every op before it was on one device.
    with pytest.raises(DataDependentOutputException):
        SDCGuard._agree(_guard_stub(parallel), found, StepResult(step=0, loss=math.nan))


def test_recomputed_claims_are_laid_out_on_the_device(fake: None) -> None:
    parallel: Any = types.SimpleNamespace(
        collective_recompute=True, device=CUDA,
        recompute_claim=lambda step, owner, digests: torch.zeros(5, dtype=torch.int64, device=CUDA))
    claims = Recomputations(parallel, confirm.Ring(1, 1), 0, lambda t: t).claims(3, {1: 0}, 5, 2, digests=False)
    assert claims.device == CUDA
    assert tuple(claims.shape) == (2, 6)


def test_an_fsdp_claim_is_made_on_the_device(fake: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The micro-batch digest is sdcguard.agent.batches' (tested there); here only where the claim is laid out.
    monkeypatch.setattr(sharded, "batch_digest", lambda batches, device: torch.zeros(fp.LANES, dtype=torch.int64,
                                                                                     device=device))
    seen = GroupFindings(record=True)
    seen.flags = [torch.zeros((), dtype=torch.bool, device=CUDA) for _ in range(2)]
    seen.norms = [torch.zeros((), dtype=torch.float64, device=CUDA) for _ in range(2)]
    seen.rows = [torch.zeros(fp.LANES, dtype=torch.int64, device=CUDA) for _ in range(2)]
    stub = types.SimpleNamespace(device=CUDA)
    claim = ShardedDataParallel._claim(stub, torch.zeros((), device=CUDA), seen, [], digests=True)  # type: ignore[arg-type]
    assert claim.device == CUDA


def test_the_ddp_hooks_summary_and_norms_are_made_on_the_device(fake: None) -> None:
    hook = GradientHook({}, world_size=2)
    hook._local = {0: torch.zeros((), dtype=torch.bool, device=CUDA)}
    hook._reduced = {0: torch.zeros((), dtype=torch.bool, device=CUDA)}
    hook._norms = {0: torch.zeros((), dtype=torch.float64, device=CUDA)}
    try:
        assert hook.summary(torch.zeros((), device=CUDA), CUDA).device == CUDA
    finally:
        _flag_weights.cache_clear()  # it caches per device: no fake tensor may outlive this test
    assert hook.local_mask(CUDA).device == CUDA
    assert hook.bucket_norms(CUDA).device == CUDA
    assert hook.reduced_norm(CUDA).device == CUDA


def test_the_product_checks_judge_on_the_device(fake: None) -> None:
    # A linear product and a batched bf16 one, checked and judged: every checksum, bound and judging vector is
    # made on the rank's device (the compiled CPU pass and the CPU scratch buffers stay out of a CUDA job).
    import warnings

    from torch import nn

    from sdcguard.agent.product_checks import ProductChecks

    layer = nn.Module()
    layer.weight = nn.Parameter(torch.zeros(8, 16, device=CUDA))
    layer.bias = nn.Parameter(torch.zeros(8, device=CUDA))
    checks = ProductChecks(layer, device=CUDA)
    assert checks._kernel is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fake tensors' storage pointers (the weights' keys)
        checks.begin_step()
        x = torch.zeros(4, 16, device=CUDA)
        weight, bias = layer.weight.detach(), layer.bias.detach()
        checks._verify_product(x, weight.t(), torch.addmm(bias, x, weight.t()), bias, 1.0, 1.0, "linear")
        a = torch.zeros(2, 4, 16, device=CUDA, dtype=torch.bfloat16)
        b = torch.zeros(2, 16, 5, device=CUDA, dtype=torch.bfloat16)
        checks._verify_product(a, b, torch.bmm(a, b), None, 1.0, 1.0, "bmm")
        assert checks.checked == 2
        assert checks.flags.device == CUDA
        assert checks.summary().device == CUDA
    assert not checks._scratch
