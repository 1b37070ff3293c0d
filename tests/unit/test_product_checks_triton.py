"""The product checks' fused Triton pass over an operand (``sdcguard.agent.kernels.triton_products``), run on the CPU
by Triton's interpreter: ``a @ s`` and ``|a| @ t`` within fp32 rounding for every dtype and layout it reads, and the
checks give the same verdicts through it as through torch's operators, naming the same sites."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sdcguard.agent import native
from sdcguard.agent.product_checks import ProductChecks
from sdcguard.agent.testing.train import SyntheticData, loss_fn
from tests.unit.test_product_checks import BACKWARD, FORWARD, SHAPE, _flip_product, _model
from tests.unit.test_product_checks_native import probe_flags

# Triton decides when it is imported whether kernels run in its interpreter (see test_fingerprint_triton.py), so the
# setting precedes any import of it; it is taken away after this file's tests only if this file made it (another
# file collected earlier may have, and restores it itself).
_SET_HERE = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the dev extra has it)")


@pytest.fixture(scope="module", autouse=True)
def _restore_interpret_setting() -> Iterator[None]:
    yield
    if _SET_HERE:
        os.environ.pop("TRITON_INTERPRET", None)


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """SDCGUARD_FINGERPRINT_KERNEL=triton with Triton's interpreter on (for this test; restored after)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(native.KERNEL_ENV, "triton")


def _exact(a: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ad, sd, td = a.double(), s.double().unsqueeze(-1), t.double().unsqueeze(-1)
    return (ad @ sd).squeeze(-1), (ad.abs() @ td).squeeze(-1), (ad.abs() @ sd.abs()).squeeze(-1)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["rows", "columns", "batched rows", "batched columns", "every other column"])
def test_the_fused_pass_equals_its_definition_within_rounding(dtype: torch.dtype, layout: str) -> None:
    from sdcguard.agent.kernels import triton_products

    for r, p in [(1, 1), (33, 129), (70, 300)]:  # either side of a program's 32 rows and a step's 128 columns
        g = torch.Generator().manual_seed(r * 1000 + p)
        batch = 3 if "batched" in layout else 1
        a = (torch.randn(batch, r, 2 * p, generator=g) * torch.logspace(-2, 2, 2 * p)).to(dtype)
        a = a[..., ::2] if layout == "every other column" else a[..., :p]
        if "columns" in layout:
            a = a.mT.contiguous().mT  # the same values stored by columns
        if batch == 1:
            a = a[0]
        s = torch.randn(*([batch] if batch > 1 else []), p, generator=g)
        t = torch.rand(*([batch] if batch > 1 else []), p, generator=g)
        e, b = triton_products.dual_matvec(a, s, t)
        assert e.shape == b.shape == a.shape[:-1]
        assert e.dtype == b.dtype == torch.float32
        exact_e, exact_b, scale = _exact(a, s, t)
        # Any order of fp32 additions (the operand widened exactly): within gamma_p of the sum of magnitudes.
        allowed = (p + 1) * 2.0 ** -24 / (1 - (p + 1) * 2.0 ** -24)
        assert torch.all((e.double() - exact_e).abs() <= allowed * scale + 1e-30), (r, p)
        assert torch.all((b.double() - exact_b).abs() <= allowed * exact_b + 1e-30), (r, p)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["rows, bias row", "columns, one bias value", "batched, no bias",
                                  "batched columns, strided bias, alpha and beta"])
def test_the_fused_check_of_a_product_equals_its_definition_within_rounding(dtype: torch.dtype, case: str) -> None:
    from sdcguard.agent.kernels import triton_products

    g = torch.Generator().manual_seed(len(case))
    batch = 2 if "batched" in case else 1
    r, p, n = 45, 150, 140  # either side of a program's rows and a step's columns
    a = torch.randn(batch, r, p, generator=g).to(dtype)
    b = torch.randn(batch, p, n, generator=g).to(dtype)
    alpha, beta = (0.5, -2.0) if "alpha" in case else (1.0, 1.0)
    bias = None
    if "bias row" in case:
        bias = torch.randn(n, generator=g).to(dtype)
    elif "one bias value" in case:
        bias = torch.randn(1, generator=g).to(dtype)
    elif "strided bias" in case:
        bias = torch.randn(2 * n, generator=g).to(dtype)[::2]
    c = alpha * (a.double() @ b.double()) + (0 if bias is None else beta * bias.double())
    c = c.to(dtype)
    if "columns" in case:
        a, c = a.mT.contiguous().mT, c.mT.contiguous().mT
    if batch == 1:
        a, b, c = a[0], b[0], c[0]
    s, t = b.float().sum(-1), b.float().abs().sum(-1)
    rows = torch.full((2, 5 + batch * r + 3), -1.0)
    triton_products.row_check(a, s, t, c, bias, alpha, beta, rows, start=5)
    # Only its own span written.
    assert torch.equal(rows[:, :5], torch.full((2, 5), -1.0))
    assert torch.equal(rows[:, -3:], torch.full((2, 3), -1.0))
    difference, bound = rows[0, 5:-3].double(), rows[1, 5:-3].double()
    bias_sum = 0.0 if bias is None else float(bias.double().sum()) * (n if bias.numel() == 1 else 1)
    bias_abs = 0.0 if bias is None else float(bias.double().abs().sum()) * (n if bias.numel() == 1 else 1)
    exact_e = alpha * (a.double() @ s.double().unsqueeze(-1)).squeeze(-1) + beta * bias_sum
    exact_b = abs(alpha) * (a.double().abs() @ t.double().unsqueeze(-1)).squeeze(-1) + abs(beta) * bias_abs
    exact_d = (c.double().sum(-1) - exact_e).abs().reshape(-1)
    # fp32 sums of p and n terms: within gamma of the magnitudes they add (the bound's own terms).
    allowed = (p + n + 4) * 2.0 ** -24 / (1 - (p + n + 4) * 2.0 ** -24)
    magnitude = exact_b.reshape(-1) + c.double().abs().sum(-1).reshape(-1)
    assert torch.all((difference - exact_d).abs() <= allowed * magnitude + 1e-30)
    assert torch.all((bound - exact_b.reshape(-1)).abs() <= allowed * exact_b.reshape(-1) + 1e-30)
    with pytest.raises(ValueError, match=r"row_check: takes .* rows \[2, >= "):
        triton_products.row_check(a, s, t, c, bias, alpha, beta, rows[:, :4], start=5)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["dW: few rows, a long accumulation by columns, bias row", "batched rows"])
def test_a_check_split_along_its_length_has_the_same_rows_on_every_run(dtype: torch.dtype, case: str) -> None:
    from sdcguard.agent.kernels import triton_products

    g = torch.Generator().manual_seed(7)
    batch = 2 if "batched" in case else 1
    r, p, n = 45, 1100, 700  # two row blocks; parts of several loop steps, a ragged last one, an empty one at 7
    a = torch.randn(batch, r, p, generator=g).to(dtype)
    b = torch.randn(batch, p, n, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if "bias" in case else None
    c = ((a.double() @ b.double()) + (0 if bias is None else bias.double())).to(dtype)
    if "columns" in case:  # dW = dYᵀ X: the transposed view of the gradient, as autograd hands it over
        a = a.mT.contiguous().mT
    if batch == 1:
        a, b, c = a[0], b[0], c[0]
    s, t = b.float().sum(-1), b.float().abs().sum(-1)

    def rows_of(split: int | None) -> torch.Tensor:
        rows = torch.full((2, 3 + batch * r + 2), -1.0)
        triton_products.row_check(a, s, t, c, bias, 1.0, 1.0, rows, 3, split=split)
        assert torch.equal(rows[:, :3], torch.full((2, 3), -1.0))
        assert torch.equal(rows[:, -2:], torch.full((2, 2), -1.0))
        return rows[:, 3:-2]

    whole = rows_of(1)
    exact_e = (a.double() @ s.double().unsqueeze(-1)).squeeze(-1) + (0 if bias is None else float(bias.double().sum()))
    exact_b = (a.double().abs() @ t.double().unsqueeze(-1)).squeeze(-1) + (
        0 if bias is None else float(bias.double().abs().sum()))
    exact_d = (c.double().sum(-1) - exact_e).abs().reshape(-1)
    allowed = (p + n + 4) * 2.0 ** -24 / (1 - (p + n + 4) * 2.0 ** -24)
    magnitude = exact_b.reshape(-1) + c.double().abs().sum(-1).reshape(-1)
    for split in (2, 3, 7):
        parts = rows_of(split)
        assert torch.equal(parts, rows_of(split)), "the parts are added in a fixed order"
        assert torch.all((parts[0].double() - exact_d).abs() <= allowed * magnitude + 1e-30)
        assert torch.all((parts[1].double() - exact_b.reshape(-1)).abs() <= allowed * exact_b.reshape(-1) + 1e-30)
        assert torch.allclose(parts[1], whole[1], rtol=1e-5)
    # One row (an integer argument of 1 is a compile-time constant on a GPU): split as any other.
    one = torch.empty(2, 1)
    triton_products.row_check(a.reshape(-1, p)[:1], s.reshape(-1, p)[0], t.reshape(-1, p)[0], c.reshape(-1, n)[:1],
                              bias, 1.0, 1.0, one, 0, split=3)
    assert abs(float(one[0, 0]) - float(exact_d[0])) <= allowed * float(magnitude[0]) + 1e-30
    assert torch.allclose(one[1, 0], whole[1, 0], rtol=1e-5)
    with pytest.raises(ValueError, match=r"row_check: split is 1 to 64 parts .* got 0"):
        triton_products.row_check(a, s, t, c, bias, 1.0, 1.0, torch.empty(2, batch * r), 0, split=0)


def test_a_check_is_split_only_where_its_row_blocks_leave_the_device_idle() -> None:
    from sdcguard.agent.kernels.triton_products import MAX_SPLIT, MIN_PART, split_for

    h100 = 4 * 132
    assert split_for(256, 4096, h100) == 3  # 8,192 tokens by rows: nearly full already, a little split
    assert split_for(128, 16384, h100) == 5  # dW of a 4,096-wide layer over 16,384 tokens
    assert split_for(32, 65536, h100) == 17
    assert split_for(1, 1 << 20, h100) == MAX_SPLIT
    assert split_for(4, 3 * MIN_PART, h100) == 3  # no part shorter than MIN_PART
    assert split_for(4, 2 * MIN_PART - 1, h100) == 1  # too short to share
    assert split_for(h100, 1 << 20, h100) == 1  # the row blocks fill the device
    assert split_for(10, 1 << 20, 1) == 1  # Triton's interpreter: one program at a time


@pytest.mark.usefixtures("interpreted")
def test_a_nan_carries_into_its_row_and_what_it_does_not_read_is_refused() -> None:
    from sdcguard.agent.kernels import triton_products

    a = torch.ones(4, 40, dtype=torch.bfloat16)
    a[2, 17] = math.nan
    e, b = triton_products.dual_matvec(a, torch.ones(40), torch.ones(40))
    assert torch.isnan(e[2])
    assert torch.isnan(b[2])
    assert not torch.isnan(e[[0, 1, 3]]).any()
    with pytest.raises(ValueError, match=r"dual_matvec: reads .* got torch.float64"):
        triton_products.dual_matvec(torch.ones(4, 4, dtype=torch.float64), torch.ones(4), torch.ones(4))
    with pytest.raises(ValueError, match="dual_matvec: reads"):
        triton_products.dual_matvec(torch.ones(4, 4), torch.ones(4, dtype=torch.float64), torch.ones(4))


def test_where_triton_cannot_run_the_call_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.agent.kernels import triton_products

    monkeypatch.setenv(native.KERNEL_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(native.TritonKernelError, match="TRITON_INTERPRET"):
        triton_products.dual_matvec(torch.ones(4, 4), torch.ones(4), torch.ones(4))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_the_checks_judge_alike_through_the_fused_pass_and_through_torch(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype | None) -> None:
    from sdcguard.agent.kernels import triton_products

    calls = {"row_check": 0, "dual_matvec": 0}

    def counting(name: str) -> Any:
        real = getattr(triton_products, name)

        def counted(*args: object) -> object:
            calls[name] += 1
            return real(*args)
        return counted

    for name in calls:
        monkeypatch.setattr(triton_products, name, counting(name))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    flags = {}
    for mode in ("triton", "torch"):
        monkeypatch.setenv(native.KERNEL_ENV, mode)
        model = _model()
        checks = ProductChecks(model)
        data = SyntheticData(SHAPE, torch.device("cpu"))
        torch.manual_seed(0)
        checks.begin_step()
        with checks.watching(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss_fn(model, data(0, 0)).backward()
        flags[mode] = [checks.flags.clone(), probe_flags(checks)]  # a clean pass, then a corrupted product
        if mode == "triton":
            # Every product (and the probe) checked whole in one launch; the row sums of an operand that is not
            # a weight (an activation, a gradient) in one read.
            assert calls["row_check"] == len(FORWARD) + len(BACKWARD) + 1
            assert calls["dual_matvec"] > 0
            calls.update(row_check=0, dual_matvec=0)
    assert calls == {"row_check": 0, "dual_matvec": 0}  # torch's form runs no fused kernel
    for fused_flags, torch_flags in zip(flags["triton"], flags["torch"], strict=True):
        assert torch.equal(fused_flags, torch_flags)
    assert int(flags["triton"][0].sum()) == 0
    assert int(flags["triton"][1].sum()) == 1


@pytest.mark.usefixtures("interpreted")
def test_a_flip_inside_a_backward_product_is_named_through_the_fused_pass() -> None:
    # blocks.1's attention dA: both of its operands are activations, so both passes run the fused kernel.
    target = BACKWARD.index("blocks.1 #1 backward dA")
    model = _model()
    checks = ProductChecks(model)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    with _flip_product("bwd", target, bit=30) as fired, checks.watching():
        loss_fn(model, data(0, 0)).backward()
    assert fired == [1]
    assert [s for _, s in checks.findings(checks.flags.reshape(1, -1))] == [BACKWARD[target]]
