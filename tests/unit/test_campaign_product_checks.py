"""The campaign's product-check rows, and a product fault beside the product checks, without a process group.

Asked for, the product checks are a row alone (every other check off) and ``all_products`` (``all`` with
them on), beside ``all`` with them off; not asked for, the rows are what they were. They are a per-step
check: a run of them trains to its end and is never derived. A product fault corrupts the same product of
training with the checks on as with them off, also when the checks' own checksums are matrix products that
pass through the fault's dispatch mode, and the checks name that product.
"""

from __future__ import annotations

from typing import Any

import torch

from sdcguard.agent.product_checks import ProductChecks
from sdcguard.campaign import detectors
from sdcguard.campaign.faults import FaultSpec
from sdcguard.campaign.injectors import ModelShape, ProductMode, install


def test_the_rows_are_unchanged_unless_the_product_checks_are_asked_for() -> None:
    plain = detectors.configs(audit_every=10, fingerprint_every=5)
    assert "product_checks" not in plain
    assert "all_products" not in plain
    assert plain["all"] == {"audit_every": 10, "fingerprint_every": 5}
    rows = detectors.configs(audit_every=100, fingerprint_every=10, product_checks=True)
    assert list(rows)[-4:] == ["product_checks", "all", "all_products", "defaults"]
    assert rows["product_checks"] == {**plain["nonfinite"], "nonfinite": False, "product_checks": True}
    assert rows["all"] == {"audit_every": 100, "fingerprint_every": 10, "product_checks": False}
    assert rows["all_products"] == {"audit_every": 100, "fingerprint_every": 10, "product_checks": True}
    assert all(
        rows[name]["product_checks"] is False
        for name in rows
        if name not in ("product_checks", "all_products", "defaults")
    )


def test_the_product_checks_alone_train_to_the_end_and_are_never_derived() -> None:
    rows = detectors.configs(audit_every=100, fingerprint_every=10, product_checks=True)
    for name in ("product_checks", "all_products"):
        assert detectors.last_alarm_step(rows[name], 22, 36) == 35, name
        assert detectors.silence_shown_by(rows[name]) is None, name
    assert detectors.last_alarm_step(rows["ring_audit"], 22, 36) == 21  # audit every 100: no due step


class _ChecksumsByMatmul(ProductChecks):
    """Product checks whose own work includes an ``mm`` of the product's output (as a checksum could be), every
    product named and checked in Python (``on_product`` sees each one)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, compiled=False)

    def on_product(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.dim() == 2:
            torch.mm(torch.ones(1, out.shape[0]), out)
        super().on_product(func, args, kwargs, out)


def _step(
    checks: type[ProductChecks] | None,
    product: int,
    pass_checks: bool = True,
) -> tuple[torch.Tensor, list[torch.Tensor], int, str | None]:
    """One forward and backward of a small model with a transient flip of mantissa bit 21 in forward product
    ``product``: (output, gradients, corruptions applied, the product the checks named)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fault = FaultSpec(
        row_id="matmul_fwd/transient/000",
        model="matmul_fwd",
        persistence="transient",
        seed=0,
        rank=0,
        step=1,
        steps=(1,),
        bit=21,
        bit_class="mantissa",
        direction="fwd",
        product=product,
        element=5,
        target=0,
        factor=1.0,
        period=0,
    )
    shape = ModelShape(products={"fwd": 2, "bwd": 3}, allreduces=1, linears=["0", "2"], params=[])
    watching = checks(model) if checks is not None else None
    inst = install(
        fault,
        rank=0,
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        shape=shape,
        checks=watching if pass_checks else None,
    )
    inst.begin_step(1)
    x = torch.randn(4, 8)
    with inst.active():
        if watching is None:
            y = model(x)
            y.sum().backward()
        else:
            watching.begin_step()
            with watching.watching():
                y = model(x)
                y.sum().backward()
    inst.remove()
    named = None
    if watching is not None:
        first, count = watching.summary().tolist()
        named = watching.site_name(first) if count else None
    return y.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], inst.fired, named


def test_a_product_fault_corrupts_the_same_product_with_the_checks_on_and_they_name_it() -> None:
    for product, site in ((0, "0 forward"), (1, "2 forward")):
        y_off, grads_off, fired_off, _ = _step(None, product)
        for checks in (ProductChecks, _ChecksumsByMatmul):
            y_on, grads_on, fired_on, named = _step(checks, product)
            assert fired_on == fired_off == 1
            assert torch.equal(y_on, y_off), (product, checks)
            assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off, strict=True)), (product, checks)
            assert named == site, (product, checks)


def test_without_the_pause_a_checksum_product_would_take_the_fault() -> None:
    # The control: checks whose checksums are ``mm``s, not handed to install(), shift the fault's count.
    y_off, _, _, _ = _step(None, 1)
    y_on, _, _, _ = _step(_ChecksumsByMatmul, 1, pass_checks=False)
    assert not torch.equal(y_on, y_off)


def test_the_fault_s_mode_sees_only_the_products_of_training_beside_the_agent_s_checks() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    seen: list[str] = []
    checks = ProductChecks(model)
    with ProductMode(lambda _out, direction: seen.append(direction)):
        checks.begin_step()
        with checks.watching():
            model(torch.randn(4, 8)).sum().backward()
    assert seen == ["fwd", "fwd", "bwd", "bwd", "bwd"]


def test_the_command_line_asks_for_them_and_for_the_agent_s_cadences() -> None:
    from sdcguard.campaign.campaign import parser, settings_from

    asked = settings_from(
        parser().parse_args(["--product-checks", "--audit-every", "100", "--fingerprint-every", "10"])
    )
    assert (asked.product_checks, asked.audit_every, asked.fingerprint_every) == (True, 100, 10)
    assert not settings_from(parser().parse_args([])).product_checks
