"""The product checks' compiled pass over an operand (``sdc_dual_matvec``): ``a @ s`` and ``|a| @ t`` in one read,
equal to torch's within fp32 rounding at every instruction set, by rows and by columns, batched; and the checks
give the same verdicts through it as through torch's operators."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from sdcguard.agent import native
from sdcguard.agent.product_checks import ProductChecks
from sdcguard.agent.testing.train import JobShape, SyntheticData, TinyGPT, loss_fn
from tests.unit.test_fingerprint_native import isas, kernel  # noqa: F401 (a fixture)


def _dual(k: native.Kernel, a: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch = a.shape[0] if a.dim() == 3 else 1
    e = torch.empty(a.shape[:-1])
    b = torch.empty(a.shape[:-1])
    k.dual_matvec(a.data_ptr(), (batch, a.shape[-2], a.shape[-1]),
                  (a.stride(0) if a.dim() == 3 else 0, a.stride(-2), a.stride(-1)), s.data_ptr(), t.data_ptr(),
                  a.shape[-1] if s.dim() == 2 else 0, e.data_ptr(), b.data_ptr())
    return e, b


@pytest.mark.parametrize("layout", ["rows", "columns", "batched rows", "batched columns"])
@pytest.mark.parametrize(("r", "p"), [(1, 1), (7, 15), (33, 16), (64, 200), (5, 1031)])
def test_the_compiled_pass_equals_torch_within_rounding(kernel: native.Kernel, layout: str, r: int, p: int) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(r * 1000 + p)
    batch = 3 if "batched" in layout else 1
    a = torch.randn(batch, r, p, generator=g) * torch.logspace(-3, 3, p)
    if "columns" in layout:
        a = a.mT.contiguous().mT  # the same values stored by columns
    if batch == 1:
        a = a[0]
    s = torch.randn(*([batch] if batch > 1 else []), p, generator=g)
    t = torch.rand(*([batch] if batch > 1 else []), p, generator=g)
    exact_e = (a.double() @ s.double().unsqueeze(-1)).squeeze(-1)
    exact_b = (a.double().abs() @ t.double().unsqueeze(-1)).squeeze(-1)
    scale = (a.double().abs() @ s.double().abs().unsqueeze(-1)).squeeze(-1)
    for each in isas(kernel):
        e, b = _dual(each, a, s, t)
        # Any order of fp32 additions: within gamma_p of the sum of magnitudes (FMA or not).
        allowed = (p + 1) * 2.0 ** -24 / (1 - (p + 1) * 2.0 ** -24)
        assert torch.all((e.double() - exact_e).abs() <= allowed * scale + 1e-30), each.isa_name
        assert torch.all((b.double() - exact_b).abs() <= allowed * exact_b + 1e-30), each.isa_name


def test_a_nan_carries_into_its_sums_and_bad_strides_are_refused(kernel: native.Kernel) -> None:  # noqa: F811
    a = torch.ones(4, 40)
    a[2, 17] = math.nan
    e, b = _dual(kernel, a, torch.ones(40), torch.ones(40))
    assert torch.isnan(e[2])
    assert torch.isnan(b[2])
    assert not torch.isnan(e[[0, 1, 3]]).any()
    strided = torch.ones(8, 8)[::2, ::2]
    with pytest.raises(native.NativeKernelError, match="unit row or column stride"):
        _dual(kernel, strided, torch.ones(4), torch.ones(4))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_the_checks_judge_alike_through_the_compiled_pass_and_through_torch(
        kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype | None) -> None:  # noqa: F811
    shape = JobShape(vocab=64, dim=32, heads=2, layers=2, seq=16, batch=8, dropout=0.1)
    flags = {}
    for mode in ("native", "torch"):
        monkeypatch.setenv(native.KERNEL_ENV, mode)
        torch.manual_seed(0)
        model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout)
        checks = ProductChecks(model)
        data = SyntheticData(shape, torch.device("cpu"))
        seen = []
        for step in range(3):
            torch.manual_seed(step)
            checks.begin_step()
            with checks.watching(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss_fn(model, data(step, 0)).backward()
            seen.append(checks.flags.clone())
        # A flip well above the bound, through the same path.
        layer = nn.Linear(48, 48, bias=False)
        x = torch.randn(32, 48)
        corrupted = nn.functional.linear(x, layer.weight.detach())
        corrupted[3, 5] *= 2.0 ** 16
        checks.begin_step()
        checks._verify_product(x, layer.weight.detach().t(), corrupted, None, 1.0, 1.0, "probe")
        seen.append(checks.flags.clone())
        flags[mode] = seen
    for native_flags, torch_flags in zip(flags["native"], flags["torch"], strict=True):
        assert torch.equal(native_flags, torch_flags)
    assert all(int(f.sum()) == 0 for f in flags["native"][:3])
    assert int(flags["native"][3].sum()) == 1


def test_the_load_time_self_check_covers_the_pass(kernel: native.Kernel) -> None:  # noqa: F811
    # The loaded kernel passes it at every instruction set; a pass that computes nothing is refused by name (the
    # loader then falls back to torch in auto mode, as for a wrong fingerprint).
    import random

    for each in isas(kernel):
        assert native.self_check(each) is None, each.isa_name

    class Broken:
        def dual_matvec(self, *args: object) -> None:
            pass

    problem = native._check_dual(Broken(), random.Random(0))  # type: ignore[arg-type]
    assert problem is not None
    assert "product checks' pass by rows" in problem
