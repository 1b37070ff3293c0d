"""The product checks' compiled pass over an operand (``sdc_dual_matvec``): ``a @ s`` and ``|a| @ t`` in one read,
equal to torch's within fp32 rounding at every instruction set, by rows and by columns, batched; the whole check
(``sdc_row_check``) and the check judged in the same call (``sdc_row_verdict``); and the checks give the same
verdicts through them as through torch's operators."""

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


def probe_flags(checks: ProductChecks) -> torch.Tensor:
    """The flags of one step in which ``checks`` saw only a product with one element far above its bound."""
    layer = nn.Linear(48, 48, bias=False)
    x = torch.randn(32, 48)
    corrupted = nn.functional.linear(x, layer.weight.detach())
    corrupted[3, 5] *= 2.0 ** 16
    checks.begin_step()
    checks._verify_product(x, layer.weight.detach().t(), corrupted, None, 1.0, 1.0, "probe")
    return checks.flags.clone()


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
        seen.append(probe_flags(checks))
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


def _row_check(k: native.Kernel, a: torch.Tensor, s: torch.Tensor, t: torch.Tensor, c: torch.Tensor, alpha: float,
               bias: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    batched = a.dim() == 3
    difference, bound = torch.empty(a.shape[:-1]), torch.empty(a.shape[:-1])
    work = torch.empty(a.shape[-2])
    k.row_check(a.data_ptr(), (a.shape[0] if batched else 1, a.shape[-2], a.shape[-1]),
                (a.stride(0) if batched else 0, a.stride(-2), a.stride(-1)), s.data_ptr(), t.data_ptr(),
                a.shape[-1] if s.dim() == 2 else 0, c.data_ptr(), c.shape[-1],
                (c.stride(0) if batched else 0, c.stride(-2), c.stride(-1)), alpha, bias.data_ptr(),
                bias.stride(0) if bias.numel() > 1 else 0, beta, work.data_ptr(), difference.data_ptr(),
                bound.data_ptr())
    return difference, bound


@pytest.mark.parametrize("layout", ["rows", "columns", "batched rows", "batched columns"])
@pytest.mark.parametrize(("r", "p", "n"), [(1, 1, 1), (7, 15, 33), (64, 200, 17), (5, 1031, 40)])
def test_the_compiled_check_of_a_product_equals_its_definition_within_rounding(
        kernel: native.Kernel, layout: str, r: int, p: int, n: int) -> None:  # noqa: F811
    # difference = |C 1 - (alpha A s + beta Σ bias)|, bound = |alpha| |A| t + |beta| Σ |bias|, with C stored either
    # way, the bias a row of n (strided) or one value broadcast.
    g = torch.Generator().manual_seed(r * 7 + p * 3 + n)
    batch = 2 if "batched" in layout else 1
    a = torch.randn(batch, r, p, generator=g)
    b = torch.randn(batch, p, n, generator=g)
    bias = torch.randn(2 * n, generator=g)[::2] if n % 2 else torch.full((1,), 0.75).expand(n)
    c = (a @ b) * -1.5 - 2.0 * bias
    c[..., 0, 0] += 100.0  # one row off, by far more than rounding
    if "columns" in layout:
        c = c.mT.contiguous().mT
    if batch == 1:
        a, b, c = a[0], b[0], c[0]
    s, t = b.sum(-1), b.abs().sum(-1)
    exact_c = c.double().sum(-1)
    bias_sum, bias_abs = bias.double().sum(), bias.double().abs().sum()
    exact_e = -1.5 * (a.double() @ s.double().unsqueeze(-1)).squeeze(-1) - 2.0 * bias_sum
    exact_b = 1.5 * (a.double().abs() @ t.double().unsqueeze(-1)).squeeze(-1) + 2.0 * bias_abs
    scale = (c.double().abs().sum(-1) + 1.5 * (a.double().abs() @ s.double().abs().unsqueeze(-1)).squeeze(-1) +
             2.0 * bias_abs)
    allowed = (p + 2 * n + 4) * 2.0 ** -24 / (1 - (p + 2 * n + 4) * 2.0 ** -24)
    for each in isas(kernel):
        difference, bound = _row_check(each, a, s, t, c, -1.5, bias, -2.0)
        assert torch.all((difference.double() - (exact_c - exact_e).abs()).abs() <= allowed * scale), each.isa_name
        assert torch.all((bound.double() - exact_b).abs() <= allowed * exact_b), each.isa_name
        assert float(difference.reshape(-1)[0]) > 99.0


def test_a_pass_mixing_compiled_and_torch_checks_charges_each_product_to_its_own_site(
        kernel: native.Kernel) -> None:  # noqa: F811
    # Compiled checks judge their products in the call; a product only torch checks (fp64 here) is queued between
    # them and judged at the pass's end, past a growth of the scratch: a fault is charged to its own site only.
    model = nn.Linear(8, 8)
    checks = ProductChecks(model)
    checks.begin_step()
    g = torch.Generator().manual_seed(3)
    w = model.weight.detach()

    def product(rows: int, dtype: torch.dtype, fault: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, 8, generator=g, dtype=dtype)
        y = x @ w.t().to(dtype)
        if fault:
            y[rows // 2, 3] += 1000.0
        return x, w.t().to(dtype), y

    for name, rows, dtype, fault in (("first", 100, torch.float32, False), ("wide", 50, torch.float64, True),
                                     ("large", 6000, torch.float32, False), ("last", 30, torch.float32, True)):
        checks._verify_product(*product(rows, dtype, fault), None, 1.0, 1.0, name)
    assert len(checks._pending) == 1, "the fp32 products did not go through the compiled verdict"
    assert checks.checked == 4
    failing = {checks.sites[i] for i in torch.nonzero(checks.flags).flatten().tolist()}
    assert failing == {"wide", "last"}
    checks.begin_step()
    checks._verify_product(*product(6000, torch.float32, False), None, 1.0, 1.0, "large")
    assert int(checks.flags.sum()) == 0


def test_the_load_time_self_check_covers_the_whole_check(kernel: native.Kernel) -> None:  # noqa: F811
    import random

    class Broken:
        def row_check(self, *args: object) -> None:
            pass

    problem = native._check_row_check(Broken(), random.Random(0))  # type: ignore[arg-type]
    assert problem is not None
    assert "the product check with C by rows" in problem


def _verdict(k: native.Kernel, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, judge: tuple[float, float, float],
             *, given: bool) -> int:
    """Failing products (0 or 1) of ``c = a @ b`` by ``sdc_row_verdict``: ``b``'s row sums given, or computed in
    the call."""
    batched = a.dim() == 3
    batch, r, p, n = (a.shape[0] if batched else 1), a.shape[-2], a.shape[-1], c.shape[-1]
    work = torch.empty(r + 2 * batch * (r + p))
    failed = torch.zeros(1, dtype=torch.int64)
    s, t, ones = b.sum(-1).contiguous(), b.abs().sum(-1).contiguous(), torch.ones(n)
    operand = None if given else (b.data_ptr(), (b.stride(0) if batched else 0, b.stride(-2), b.stride(-1)),
                                  ones.data_ptr())
    k.row_verdict(a.data_ptr(), (batch, r, p), (a.stride(0) if batched else 0, a.stride(-2), a.stride(-1)), operand,
                  s.data_ptr(), t.data_ptr(), p if given and batched else 0, c.data_ptr(), n,
                  (c.stride(0) if batched else 0, c.stride(-2), c.stride(-1)), 1.0, None, 0, 1.0, work.data_ptr(),
                  judge, failed.data_ptr())
    return int(failed)


@pytest.mark.parametrize("layout", ["rows", "columns", "batched rows", "batched columns"])
@pytest.mark.parametrize("given", [True, False], ids=["sums-given", "sums-computed"])
def test_the_judged_check_fails_a_product_exactly_where_the_torch_form_would(
        kernel: native.Kernel, layout: str, given: bool) -> None:  # noqa: F811
    # The same test as the pass's end judges in torch (|difference| <= coefficient bound + absolute, where the bound
    # is below the limit), at every instruction set: a clean product passes under the rigorous coefficient, one
    # element off by 1e-2 of its row's magnitude fails, a NaN fails, and a bound past the limit passes.
    g = torch.Generator().manual_seed(len(layout) * 2 + given)
    batch = 3 if "batched" in layout else 1
    a, b = torch.randn(batch, 37, 70, generator=g), torch.randn(batch, 70, 29, generator=g)
    clean = a @ b
    if "columns" in layout:
        clean, b = clean.mT.contiguous().mT, b.mT.contiguous().mT
    if batch == 1:
        a, b, clean = a[0], b[0], clean[0]
    coefficient = 2 * (70 + 29) * 2.0 ** -24
    rigorous = (coefficient, 1e-30, math.inf)
    off, nan = clean.clone(), clean.clone()
    at = (1, 5, 3) if batch > 1 else (5, 3)
    off[at] += 1e-2 * float(a.abs().sum(-1).max())
    nan[at] = math.nan
    for each in isas(kernel):
        assert _verdict(each, a, b, clean, rigorous, given=given) == 0, each.isa_name
        assert _verdict(each, a, b, off, rigorous, given=given) == 1, each.isa_name
        assert _verdict(each, a, b, nan, rigorous, given=given) == 1, each.isa_name
        assert _verdict(each, a, b, off, (coefficient, 1e-30, 0.0), given=given) == 0, each.isa_name


def test_the_judged_check_counts_into_the_site_s_flag_and_refuses_bad_strides(
        kernel: native.Kernel) -> None:  # noqa: F811
    # Through the checks: the failing product is counted into its own site's slot, once per product, whatever the
    # number of failing rows; and an operand with no unit stride raises by name.
    model = nn.Linear(16, 8)
    checks = ProductChecks(model)
    checks.begin_step()
    x, y = torch.randn(10, 16), torch.randn(16, 12)
    z = x @ y
    z[:, 0] += 100.0  # every row off
    checks._verify_product(x, y, x @ y, None, 1.0, 1.0, "clean")
    checks._verify_product(x, y, z, None, 1.0, 1.0, "every row off")
    checks._verify_product(x, y, z, None, 1.0, 1.0, "every row off")
    assert not checks._pending
    assert checks.flags[checks.sites.index("every row off")] == 2
    assert checks.flags[checks.sites.index("clean")] == 0
    strided = torch.ones(8, 8)[::2, ::2]
    with pytest.raises(native.NativeKernelError, match="unit row or column stride"):
        _verdict(kernel, strided, torch.ones(4, 4), torch.ones(4, 4), (1.0, 0.0, math.inf), given=True)


def test_the_load_time_self_check_covers_the_judged_check(kernel: native.Kernel) -> None:  # noqa: F811
    import random

    class Broken:
        def row_verdict(self, *args: object) -> None:
            pass

    assert native._check_row_verdict(kernel, random.Random(0)) is None
    problem = native._check_row_verdict(Broken(), random.Random(0))  # type: ignore[arg-type]
    assert problem is not None
    assert "one element off by 1" in problem


def test_the_compiled_check_keeps_its_buffers_on_the_cpu_under_another_default_device(
        kernel: native.Kernel) -> None:  # noqa: F811
    # A training script may set torch's default device (torch.set_default_device("cuda")); the compiled check's
    # scratch and a weight's sums are CPU memory the kernel writes, whatever that default ("meta" here: a buffer
    # made there has no memory, and the kernel would write through a null address).
    model = nn.Linear(16, 8)
    checks = ProductChecks(model)
    checks.begin_step()
    x, w = torch.randn(10, 16), model.weight.detach()
    faulty = x @ w.t()
    faulty[4, 2] += 100.0
    with torch.device("meta"):
        checks._verify_product(x, w.t(), x @ w.t(), None, 1.0, 1.0, "clean")
        checks._verify_product(x, w.t(), faulty, None, 1.0, 1.0, "faulty")
        checks._verify_product(x, torch.randn(16, 12, device="cpu"), x @ torch.zeros(16, 12, device="cpu"), None,
                               1.0, 1.0, "zeros")
    assert checks._work.device.type == "cpu"
    assert all(t.device.type == "cpu" for stats in checks._weight_rows.values() for t in stats)
    failing = {checks.sites[i] for i in torch.nonzero(checks.flags).flatten().tolist()}
    assert failing == {"faulty", "zeros"}


def test_a_weight_s_sums_are_written_again_each_step_into_the_buffers_kept_for_it(
        kernel: native.Kernel) -> None:  # noqa: F811
    # A weight's row sums are computed once per step into buffers kept from step to step (a fresh pair per
    # weight and step cost more than the passes). They must be written again every step, even for a change
    # its version counter does not see (a write through ``.data``, as a script's EMA swap or a fault would).
    model = nn.Linear(24, 12)
    checks = ProductChecks(model)
    x, dy = torch.randn(10, 24), torch.randn(10, 12)

    def step(fault: bool) -> tuple[int, set[int]]:
        checks.begin_step()
        w = model.weight.detach()
        y = torch.addmm(model.bias.detach(), x, w.t())
        if fault:
            y[3, 5] += 1.0
        with checks.watching():
            checks._verify_product(x, w.t(), y, model.bias.detach(), 1.0, 1.0, "forward")
            checks._verify_product(dy, w, dy @ w, None, 1.0, 1.0, "backward dX")  # the other layout
        buffers = {t.data_ptr() for stats in checks._weight_rows.values() for t in stats}
        return int(checks.flags.sum()), buffers

    failing, first = step(fault=False)
    assert failing == 0
    version = model.weight._version
    model.weight.data.mul_(-3.0)  # unseen by the version counter
    assert model.weight._version == version
    assert step(fault=False) == (0, first)  # judged by the new weight's sums, in the same buffers
    assert step(fault=True) == (1, first)
    assert len(checks._weight_buffers) == 1  # one weight, one entry for both of its layouts
