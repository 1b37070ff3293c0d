"""``./dev bench products``: its passes-skipped row runs the checks' Python and skips only the compiled passes,
and a short run prints the four rows and the three-way split of the checks' cost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks import bench_products
from sdcguard.agent import native
from sdcguard.agent.product_checks import ProductChecks


def _step_with_a_fault(checks: ProductChecks, weight: torch.Tensor) -> tuple[int, int]:
    """(products checked, failing sites) of one step whose only product carries a large error."""
    x = torch.randn(8, 32)
    checks.begin_step()
    out = nn.functional.linear(x, weight)
    out[2, 3] += 1e4
    checks._verify_product(x, weight.t(), out, None, 1.0, 1.0, "probe")
    return checks.checked, int(checks.flags.sum())


def test_the_passes_skipped_row_runs_the_checks_but_not_the_compiled_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = native.kernel()
    if real is None:
        pytest.skip("the compiled kernel is not loaded here")
    calls: list[str] = []
    model = nn.Linear(32, 16)
    full, skipped = ProductChecks(model), bench_products._PassesSkipped(model)
    try:
        def done(*_args: object) -> int:
            calls.append("skipped")
            return 0

        monkeypatch.setattr(bench_products, "_done", done)
        for checks in (full, skipped):
            checks._refresh()  # as a pass starts
        assert isinstance(skipped._kernel, bench_products._SkippedKernel)
        assert skipped._kernel.lib.sdc_fp_best_isa() == real.lib.sdc_fp_best_isa()  # the rest is the real library
        weight = model.weight.detach()
        assert _step_with_a_fault(full, weight) == (1, 1)
        assert not calls
        assert _step_with_a_fault(skipped, weight) == (1, 0)  # seen and counted as checked; its pass never ran
        assert calls
    finally:
        full.remove()
        skipped.remove()


def test_a_short_run_prints_four_rows_and_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_products.main(["--rounds", "4", "--models", "gpt-example"]) == 0
    out = capsys.readouterr().out
    for row in bench_products.ROWS:
        assert f"| {row} " in out
    assert "seeing the products" in out
    assert "the checks' Python" in out
    assert "the compiled passes" in out
