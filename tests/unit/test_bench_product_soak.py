"""``./dev bench product_soak``: the product checks' clean soak counts what it checks and what fails."""

from __future__ import annotations

import pytest

from benchmarks import bench_product_soak


@pytest.mark.parametrize("config", bench_product_soak.CONFIGS)
def test_a_short_clean_soak_checks_every_product_and_none_fails(config: str) -> None:
    lines: list[str] = []
    row = bench_product_soak.soak(config, 3, 1, lines.append)
    assert (row.config, row.steps) == (config, 3)
    assert row.checked > 0
    assert row.checked % 3 == 0  # the same products every step
    assert (row.failed, row.failed_sites) == (0, [])
    assert len(lines) == 3
    assert "products checked, 0 failed" in lines[-1]


def test_a_soak_counts_a_failing_product_as_a_false_alarm_and_names_its_site(monkeypatch: pytest.MonkeyPatch) -> None:
    # A bound shrunk a million-fold trips on clean data: what the soak would report for a bound that is too tight.
    real = bench_product_soak.ProductChecks
    monkeypatch.setattr(bench_product_soak, "ProductChecks", lambda model: real(model, margin=1e-6))
    row = bench_product_soak.soak("gpt-fp32", 2, 0, lambda line: None)
    assert row.failed > 0
    assert any(site.endswith(("forward", "dX", "dW", "dA", "dB")) for site in row.failed_sites)


def test_an_unknown_configuration_is_refused_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_product_soak.main(["--configs", "gpt-fp16"])
    assert "gpt-fp32, gpt-bf16" in capsys.readouterr().err
