"""The product checks' compiled path (sdcguard.agent.native_products, csrc/products.cpp): the same verdicts and
names as the Python form, every product after a site's first checked in one call, a weight's sums written again
each step, a model copied with its checks, a script's default device ignored, and a build that
fails leaving the Python form (an error only where the compiled path was demanded)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sdcguard.agent import native, native_products, product_checks
from sdcguard.agent.product_checks import ProductChecks
from sdcguard.agent.testing.train import SyntheticData, loss_fn
from tests.unit.test_product_checks import BACKWARD, FORWARD, SHAPE, _flip_product, _model

needs_compiler = pytest.mark.skipif(
    (shutil.which("c++") is None and shutil.which("g++") is None)
    or not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
    reason="no C++ compiler or no Python headers on this machine")


@pytest.fixture
def products_mode(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set ``SDCGUARD_PRODUCTS_KERNEL`` for a test; the loader reads it afresh and forgets it afterwards."""
    def choose(value: str) -> None:
        monkeypatch.setenv(native_products.ENV, value)
        native_products.reset_for_tests()

    yield choose
    native_products.reset_for_tests()


class _PythonChecked:
    """Counts the products the Python form checked (``_verify_product``), as the compiled path declines them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = ProductChecks._verify_product

        def counted(checks: ProductChecks, *args: Any, **kwargs: Any) -> None:
            self.count += 1
            original(checks, *args, **kwargs)

        monkeypatch.setattr(ProductChecks, "_verify_product", counted)


def _faulty_steps(direction: str, target: int, python: _PythonChecked | None = None
                  ) -> tuple[list[list[str]], int, int, list[int]]:
    """Three steps of the test model, a flipped exponent bit in the ``target``-th product of ``direction`` in the
    last: (the failing sites of each step, the products checked and unchecked in the last step, and how many the
    Python form checked in each)."""
    model = _model()
    checks = ProductChecks(model)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    failing, in_python = [], []
    for step in range(3):
        checks.begin_step()
        model.zero_grad(set_to_none=True)
        before = python.count if python is not None else 0
        fault = _flip_product(direction, target, bit=30) if step == 2 else contextlib.nullcontext([1])
        with fault as fired, checks.watching():
            loss_fn(model, data(step, 0)).backward()
        assert fired == [1]
        failing.append([name for _, name in checks.findings(checks.flags.reshape(1, -1))])
        in_python.append((python.count if python is not None else 0) - before)
    return failing, checks.checked, checks.unchecked, in_python


def _compiled_interception() -> None:
    """Skip where this process's product operators are not intercepted in C++ (the library not built)."""
    ProductChecks(nn.Linear(2, 2))  # installs the interception, if no test has yet
    if product_checks._INTERCEPTION.library is None:
        pytest.skip("the product checks' compiled path is not built in this process")


@needs_compiler
@pytest.mark.parametrize(("direction", "target"), [("fwd", 0), ("fwd", 2), ("fwd", 6), ("bwd", 1), ("bwd", 11)])
def test_the_compiled_path_gives_the_python_form_s_verdicts_and_names(
        products_mode: Any, monkeypatch: pytest.MonkeyPatch, direction: str, target: int) -> None:
    _compiled_interception()
    python = _PythonChecked(monkeypatch)
    products = len(FORWARD) + len(BACKWARD)
    products_mode("python")  # named and checked in Python, handed over by the C++ kernels
    *expected, in_python = _faulty_steps(direction, target, python)
    names = FORWARD if direction == "fwd" else BACKWARD
    assert expected == [[[], [], [names[target]]], products, 0]
    assert in_python == [products] * 3
    products_mode("compiled")
    *found, in_python = _faulty_steps(direction, target, python)
    assert found == expected
    # Once a product's bound is known (from the Python form's first product of its shape), it is checked in C++.
    assert 0 < in_python[0] < products
    assert in_python[1:] == [0, 0]


def test_the_python_form_throughout_where_it_is_chosen_before_any_checks(tmp_path: Path) -> None:
    # SDCGUARD_PRODUCTS_KERNEL=python in a fresh process: the Python interception, no C++ kernel registered, and
    # the same verdicts and names.
    script = tmp_path / "python_form.py"
    script.write_text(
        "import json, torch\n"
        "from sdcguard.agent import product_checks\n"
        "from tests.unit.test_product_checks_compiled import _faulty_steps\n"
        "result = _faulty_steps('bwd', 7)\n"
        "print(json.dumps([result[:3], product_checks._INTERCEPTION.library is None]))\n")
    env = {**os.environ, native_products.ENV: "python", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found, python_interception = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == [[[], [], [BACKWARD[7]]], len(FORWARD) + len(BACKWARD), 0]
    assert python_interception


@needs_compiler
def test_a_weight_changed_through_data_between_steps_is_judged_by_its_new_sums(products_mode: Any) -> None:
    # The compiled path keeps a weight's row sums from step to step in buffers of its own, and must write them
    # again every step: a write through ``.data`` (an EMA swap, a fault) is unseen by the version counter.
    products_mode("compiled")
    model = nn.Linear(24, 12)
    checks = ProductChecks(model)
    x = torch.randn(10, 24)

    def step(fault: bool) -> int:
        checks.begin_step()
        model.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            if fault:
                stack.enter_context(_flip_product("fwd", 0, bit=30))
            stack.enter_context(checks.watching())
            model(x).square().sum().backward()
        return int(checks.flags.sum())

    _compiled_interception()
    assert [step(fault=False) for _ in range(2)] == [0, 0]
    assert checks._named_in_cpp
    version = model.weight._version
    model.weight.data.mul_(-3.0)
    assert model.weight._version == version
    assert step(fault=False) == 0  # stale sums would fail every product of the weight
    assert step(fault=True) == 1


def test_a_model_with_the_checks_can_be_deep_copied_and_the_copy_trains_unchecked() -> None:
    # An EMA or evaluation copy made after the checks are installed (it failed: the compiled kernels the checks
    # hold cannot be copied). The copy's hooks name for the same checks, which watch only the original's pass.
    model = _model()
    checks = ProductChecks(model)
    twin = copy.deepcopy(model)
    hooked = next(getattr(hook, "__self__", None) for hook in twin._forward_hooks.values())
    assert hooked is checks
    data = SyntheticData(SHAPE, torch.device("cpu"))
    loss_fn(twin, data(0, 0)).backward()  # outside the checks: nothing seen, nothing named
    assert (checks.checked, checks.sites) == (0, [])
    for step in range(2):
        checks.begin_step()
        with _flip_product("bwd", 5, bit=30) if step == 1 else contextlib.nullcontext(), checks.watching():
            loss_fn(model, data(step, 0)).backward()
    assert [name for _, name in checks.findings(checks.flags.reshape(1, -1))] == [BACKWARD[5]]
    assert checks.checked == len(FORWARD) + len(BACKWARD)


@needs_compiler
def test_a_script_s_default_device_and_dtype_do_not_reach_the_compiled_path(products_mode: Any) -> None:
    products_mode("compiled")
    model = _model()
    checks = ProductChecks(model)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    for step in range(3):
        batch = data(step, 0)
        torch.set_default_device("meta")
        torch.set_default_dtype(torch.float64)
        try:
            checks.begin_step()
            with _flip_product("fwd", 3, bit=30) if step == 2 else contextlib.nullcontext(), checks.watching():
                loss_fn(model, batch).backward()
        finally:
            torch.set_default_device(None)
            torch.set_default_dtype(torch.float32)
        found = [name for _, name in checks.findings(checks.flags.reshape(1, -1))]
        assert found == ([FORWARD[3]] if step == 2 else [])


def test_a_build_that_fails_leaves_the_python_form_and_is_an_error_where_demanded(
        products_mode: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    products_mode("auto")
    with caplog.at_level(logging.WARNING, logger="sdcguard.agent.native_products"):
        assert native_products.library() is None
    assert "run in Python" in caplog.text
    assert "false failed to build products.cpp" in caplog.text
    if native.kernel() is not None:
        # Still checked, and a fault still caught, by the Python form.
        failing, checked, unchecked, _ = _faulty_steps("bwd", 4)
        assert failing[-1] == [BACKWARD[4]]
        assert (checked, unchecked) == (len(FORWARD) + len(BACKWARD), 0)
    products_mode("compiled")
    with pytest.raises(native.NativeKernelError, match="false failed to build"):
        native_products.library()
    products_mode("python")
    assert native_products.library() is None
    products_mode("fast")
    with pytest.raises(ValueError, match="SDCGUARD_PRODUCTS_KERNEL='fast' is not valid"):
        native_products.library()


@needs_compiler
def test_python_m_builds_it_into_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    assert native_products.main([]) == 0
    assert "product checks' library:" in capsys.readouterr().out
    assert len(list(tmp_path.glob("products-*.so"))) == 1


class _ConvInBackward(torch.autograd.Function):
    """Identity forward; its backward doubles the gradient through a convolution (a product in a backward node
    with no forward product of its own)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        channels = grad.shape[1]
        return nn.functional.conv1d(grad, torch.full((channels, 1, 1), 2.0), groups=channels)


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(_ConvInBackward.apply(self.conv(x)).flatten(1))


@needs_compiler
def test_convolutions_and_matrix_products_share_one_naming_in_both_forms(products_mode: Any) -> None:
    _compiled_interception()
    named = {}
    for mode in ("python", "compiled"):
        products_mode(mode)
        torch.manual_seed(0)
        model = _Convs()
        checks = ProductChecks(model)
        for _ in range(2):
            checks.begin_step()
            with checks.watching():
                model(torch.randn(5, 4, 4)).square().sum().backward()
            assert checks.flags.sum() == 0
        named[mode] = (checks.sites, checks.checked, checks.unchecked, checks._named_in_cpp)
    sites = ["conv forward", "fc forward", "fc backward dX", "fc backward dW", "<_ConvInBackwardBackward> backward dA",
             "conv backward dW"]  # the input needs no gradient
    assert named["python"] == (sites, 6, 0, False)
    assert named["compiled"] == (sites, 6, 0, True)
