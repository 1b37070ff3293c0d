"""Product checks (sdcguard.agent.product_checks): silent on clean training, a flipped bit inside any product caught and
named, a fault after the product not seen, and the bound neither vacuous nor too tight."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sdcguard.agent.product_checks import COUNT, FIRST, ProductChecks
from sdcguard.agent.testing.train import JobShape, SyntheticData, TinyGPT, loss_fn
from sdcguard.campaign.injectors import ProductMode, flip

SHAPE = JobShape(vocab=64, dim=32, heads=2, layers=2, seq=16, batch=8, dropout=0.1)

# The products of one pass of TinyGPT(layers=2), in the order they run, named as the checks must name them
# (written out here, not read from the module: the oracle for "names the right site").
FORWARD = [name for i in range(2) for name in (
    f"blocks.{i}.qkv forward", f"blocks.{i} forward", f"blocks.{i} #1 forward", f"blocks.{i}.proj forward",
    f"blocks.{i}.fc forward", f"blocks.{i}.out forward")] + ["head forward"]
BACKWARD = ["head backward dX", "head backward dW"] + [name for i in (1, 0) for name in (
    f"blocks.{i}.out backward dX", f"blocks.{i}.out backward dW", f"blocks.{i}.fc backward dX",
    f"blocks.{i}.fc backward dW", f"blocks.{i}.proj backward dX", f"blocks.{i}.proj backward dW",
    f"blocks.{i} #1 backward dA", f"blocks.{i} #1 backward dB", f"blocks.{i} backward dA",
    f"blocks.{i} backward dB", f"blocks.{i}.qkv backward dX", f"blocks.{i}.qkv backward dW")]


def _model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(SHAPE.vocab, SHAPE.dim, SHAPE.heads, SHAPE.layers, SHAPE.seq, SHAPE.dropout)


def _autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _train(model: nn.Module, checks: ProductChecks, steps: int, *, dtype: torch.dtype | None = None,
           around: Callable[[int], contextlib.AbstractContextManager[object]] | None = None) -> list[list[str]]:
    """Train ``steps`` steps with the checks on; the failing sites of each step."""
    data = SyntheticData(SHAPE, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    failing = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        checks.begin_step()
        with around(step) if around is not None else contextlib.nullcontext(), checks.watching():
            with _autocast(dtype):
                loss = loss_fn(model, data(step, 0))
            loss.backward()
        optimizer.step()
        failing.append([name for _, name in checks.findings(checks.flags.reshape(1, -1))])
    return failing


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_a_clean_run_never_trips_and_every_product_is_checked(dtype: torch.dtype | None) -> None:
    # Given a small attention model with dropout, trained from scratch (its largest relative changes)
    model = _model()
    checks = ProductChecks(model)
    # When it trains with every product checked
    failing = _train(model, checks, 60 if dtype is None else 40, dtype=dtype)
    # Then no product ever fails its bound, and all of them were checked
    assert failing == [[]] * len(failing)
    assert checks.checked == len(FORWARD) + len(BACKWARD)
    assert checks.unchecked == 0
    assert checks.sites == FORWARD + BACKWARD
    assert checks.summary().tolist() == [-1, 0]


def test_the_checks_change_nothing_in_training() -> None:
    plain, checked = _model(), _model()
    data = SyntheticData(SHAPE, torch.device("cpu"))
    checks = ProductChecks(checked)
    for model, watch in ((plain, contextlib.nullcontext()), (checked, checks.watching())):
        torch.manual_seed(1)
        with watch:
            loss_fn(model, data(0, 0)).backward()
    for a, b in zip(plain.parameters(), checked.parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        assert torch.equal(a.grad, b.grad)


@contextlib.contextmanager
def _flip_product(direction: str, target: int, bit: int, element: int = 5) -> Iterator[list[int]]:
    """The campaign's product fault: bit ``bit`` of one element of the ``target``-th product in ``direction``."""
    count, fired = [0], [0]

    def corrupt(out: torch.Tensor, where: str) -> None:
        if where != direction:
            return
        if count[0] == target:
            flip(out, element % out.numel(), bit)
            fired[0] += 1
        count[0] += 1

    # A dispatch mode: below the checks' interception wherever it is entered, so the checks see the corrupted
    # result, as they see a faulty kernel's.
    with ProductMode(corrupt):
        yield fired


@pytest.mark.parametrize(("direction", "names"), [("fwd", FORWARD), ("bwd", BACKWARD)])
def test_an_exponent_flip_inside_any_product_trips_and_names_its_site(direction: str, names: list[str]) -> None:
    model = _model()
    checks = ProductChecks(model)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    for target, name in enumerate(names):
        checks.begin_step()
        model.zero_grad(set_to_none=True)
        with _flip_product(direction, target, bit=30) as fired, checks.watching():
            loss_fn(model, data(0, 0)).backward()
        assert fired == [1]
        # Exactly that product, and nothing after it (its successors computed on the corrupted value agree).
        assert [s for _, s in checks.findings(checks.flags.reshape(1, -1))] == [name]
        summary = checks.summary()
        assert summary[COUNT] == 1
        assert checks.site_name(int(summary[FIRST])) == name
        assert checks.findings(torch.stack([torch.tensor([-1, 0]), summary])) == [(1, name)]


def test_only_the_products_leave_torch_and_a_fault_below_is_seen_whatever_the_order_of_entry() -> None:
    from sdcguard.agent import product_checks

    interception = product_checks._INTERCEPTION
    installed = interception._installed
    model = _model()
    checks = ProductChecks(model)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    other_thread: list[list[str]] = []
    for target, name in ((3, FORWARD[3]), (0, BACKWARD[0])):
        direction = "fwd" if name in FORWARD else "bwd"
        checks.begin_step()
        model.zero_grad(set_to_none=True)
        # The fault's mode entered inside the checks this time: under a dispatch mode of the checks' own it would
        # have run first and corrupted the result after the checks had passed it.
        with checks.watching(), _flip_product(direction, target, bit=30) as fired:
            # No dispatch mode of the checks' own: the pass's other operators never enter Python.
            assert torch._C._len_torch_dispatch_stack() == 1  # the fault's alone
            loss_fn(model, data(0, 0)).backward()
            # Another thread's product meanwhile (a data loader's, a metric's) is not this rank's pass.
            checked = checks.checked
            worker = threading.Thread(target=lambda: torch.randn(8, 8) @ torch.randn(8, 8))
            worker.start()
            worker.join()
            other_thread.append([str(checks.checked - checked)])
        assert fired == [1]
        assert [s for _, s in checks.findings(checks.flags.reshape(1, -1))] == [name]
    assert other_thread == [["0"], ["0"]]
    # Installed while checks are: taken off with the last of them, torch's own kernels back.
    assert interception._installed == installed + 1
    checks.remove()
    assert interception._installed == installed
    if installed == 0:
        assert interception._library is None
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "ADInplaceOrView")


def test_a_flip_in_the_bf16_products_under_autocast_trips() -> None:
    model = _model()
    checks = ProductChecks(model)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    for direction, target, name in (("fwd", 4, FORWARD[4]), ("bwd", 3, BACKWARD[3])):
        checks.begin_step()
        with _flip_product_bf16(direction, target), checks.watching(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, data(0, 0))
        with _flip_product_bf16(direction, target), checks.watching():
            loss.backward()
        assert [s for _, s in checks.findings(checks.flags.reshape(1, -1))] == [name]


@contextlib.contextmanager
def _flip_product_bf16(direction: str, target: int) -> Iterator[None]:
    count = [0]

    def corrupt(out: torch.Tensor, where: str) -> None:
        if where == direction:
            if count[0] == target:
                ints = out.detach().view(-1).view(torch.int16)
                ints[3] ^= 1 << 14  # the top exponent bit of a bf16
            count[0] += 1

    class Bf16ProductMode(ProductMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm) \
                    and out.dtype == torch.bfloat16:
                self.corrupt(out, "bwd" if torch._C._current_autograd_node() is not None else "fwd")
            return out

    with Bf16ProductMode(corrupt):
        yield


def test_a_fault_after_the_product_is_not_seen() -> None:
    # Given an activation corrupted in memory after its product (the campaign's activation fault)
    model = _model()
    checks = ProductChecks(model)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    torch.manual_seed(3)
    clean = loss_fn(model, data(0, 0)).item()

    def scale(_m: nn.Module, _i: object, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out.view(-1)[7] *= 1e4
        return out

    handle = model.get_submodule("blocks.0.fc").register_forward_hook(scale)
    checks.begin_step()
    torch.manual_seed(3)
    with checks.watching():
        loss = loss_fn(model, data(0, 0))
        loss.backward()
    handle.remove()
    # Then training changed, and every product, computed on what it was given, passed: by design
    assert loss.item() != clean
    assert checks.summary().tolist() == [-1, 0]


def test_the_bound_is_not_vacuous_a_much_tighter_one_trips_on_clean_data() -> None:
    # The rigorous bound is a worst case; the margin at which clean rounding first exceeds it says how far.
    tripped_at = None
    for margin in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5):
        model = _model()
        checks = ProductChecks(model, margin=margin)
        if any(_train(model, checks, 3)):
            tripped_at = margin
            break
    print(f"the bound tightened {1 / tripped_at if tripped_at else math.inf:g}x trips on clean data")
    assert tripped_at is not None
    assert tripped_at >= 1e-2  # measured: 1e-2, the bound tightened 100x (10x does not trip)


def _smallest_caught(dtype: torch.dtype, m: int = 256, p: int = 256, n: int = 256) -> float:
    """The smallest relative error of one output element of ``X Wᵀ`` (typical magnitude) that the check trips on."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, p, generator=g).to(dtype)
    w = torch.randn(n, p, generator=g).to(dtype)
    layer = nn.Linear(p, n, bias=False)
    checks = ProductChecks(layer)
    y = torch.nn.functional.linear(x, w)
    index = int(torch.argmin((y.float().abs() - y.float().abs().median()).abs()))
    for k in range(0, 30):
        relative = 2.0 ** -k
        corrupted = y.clone()
        flat = corrupted.view(-1)
        flat[index] = flat[index] * (1 + relative)
        checks.begin_step()
        checks._verify_product(x, w.t(), corrupted, None, 1.0, 1.0, "probe")
        if int(checks.flags.sum()) == 0:
            return 2.0 ** -(k - 1)
    return 0.0


@pytest.mark.parametrize(("dtype", "at_most"), [(torch.float32, 0.5), (torch.bfloat16, 4.0),
                                                 (torch.float16, 4.0)])
def test_the_smallest_error_caught_per_dtype(dtype: torch.dtype, at_most: float) -> None:
    # A 256x256x256 product, an element of median magnitude: the relative error the bound starts to see.
    smallest = _smallest_caught(dtype)
    print(f"{dtype}: the smallest relative error of a median element caught: {smallest:g}")
    assert 0 < smallest <= at_most


@pytest.mark.parametrize("dims", [1, 2])
def test_a_convolution_and_its_backward_products_are_checked(dims: int) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d if dims == 2 else nn.Conv1d
    model = nn.Sequential(conv(3, 8, 3, padding=1), nn.ReLU(), conv(8, 8, 3, groups=2, stride=2), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 4 ** dims, 10))
    checks = ProductChecks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    shape = (4, 3) + (9,) * dims
    for _ in range(30):
        x, target = torch.randn(shape, generator=g), torch.randint(10, (4,), generator=g)
        optimizer.zero_grad()
        checks.begin_step()
        with checks.watching():
            nn.functional.cross_entropy(model(x), target).backward()
        optimizer.step()
        assert checks.summary().tolist() == [-1, 0]
    assert checks.unchecked == 0
    assert {"0 forward", "2 forward", "0 backward dW", "2 backward dX", "2 backward dW"} <= set(checks.sites)
    # The first convolution's input needs no gradient: no dX product there.
    assert "0 backward dX" not in checks.sites
    for direction, target_product, name in (("fwd", 1, "2 forward"), ("bwd", 0, "2 backward dX")):
        checks.begin_step()
        with _flip_conv(direction, target_product), checks.watching():
            nn.functional.cross_entropy(model(x), target).backward()
        assert [s for _, s in checks.findings(checks.flags.reshape(1, -1))] == [name]


@contextlib.contextmanager
def _flip_conv(direction: str, target: int) -> Iterator[None]:
    count = [0]

    class ConvFault(ProductMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            packet = func.overloadpacket
            backward = torch._C._current_autograd_node() is not None
            if packet in (torch.ops.aten.convolution, torch.ops.aten.convolution_backward) \
                    and ("bwd" if backward else "fwd") == direction:
                if count[0] == target:
                    flip(out[0] if backward else out, 2, 30)
                count[0] += 1
            return out

    with ConvFault(lambda *_: None):
        yield


def test_kinds_can_be_switched_off_and_bad_settings_are_refused() -> None:
    model = _model()
    checks = ProductChecks(model, enabled=("forward", "linear", "matmul"))
    data = SyntheticData(SHAPE, torch.device("cpu"))
    with _flip_product("bwd", 0, bit=30), checks.watching():
        loss_fn(model, data(0, 0)).backward()
    assert checks.summary().tolist() == [-1, 0]
    assert checks.checked == len(FORWARD)
    with pytest.raises(ValueError, match="enabled"):
        ProductChecks(model, enabled=("sideways",))
    with pytest.raises(ValueError, match="margin"):
        ProductChecks(model, margin=0)
    with pytest.raises(ValueError, match="gathered"):
        checks.findings(torch.zeros(2, 3, dtype=torch.int64))


def test_the_bound_grows_with_the_accumulation_length_as_gamma_n() -> None:
    from sdcguard.agent.product_checks import Arithmetic, gamma

    fp32 = Arithmetic.of(torch.float32, torch.float32, torch.device("cpu"), conv=False)
    bf16 = Arithmetic.of(torch.bfloat16, torch.bfloat16, torch.device("cpu"), conv=False)
    assert fp32 is not None
    assert bf16 is not None
    assert gamma(10, 2.0 ** -24) == pytest.approx(10 * 2.0 ** -24, rel=1e-6)
    assert math.isinf(gamma(2 ** 24, 2.0 ** -24))
    # bf16 outputs add their own rounding (2^-8) on top of the fp32 accumulation.
    assert bf16.coefficient(64, 64) > 2.0 ** -8 > fp32.coefficient(64, 64)
    assert fp32.coefficient(1024, 64) > fp32.coefficient(64, 64)


@pytest.mark.parametrize(("m", "p", "n"), [(64, 16, 48), (8, 32, 256), (3, 200, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_both_directions_with_a_bias_pass_clean_and_catch_a_flip(m: int, p: int, n: int, dtype: torch.dtype) -> None:
    # Wide weights (n·p > m·p) take the row sums, tall ones the column sums: both, with nn.Linear's bias.
    layer = nn.Linear(p, n).to(dtype)
    checks = ProductChecks(layer)
    g = torch.Generator().manual_seed(m + p + n)
    for trial in range(20):
        x = (torch.randn(m, p, generator=g) * 10.0 ** (trial % 5 - 2)).to(dtype)
        checks.begin_step()
        with checks.watching():
            y = layer(x)
        assert checks.summary().tolist() == [-1, 0], trial
    # An exponent flip that grows one element 2^16-fold (one that shrinks it is an error of the element's own
    # size: within bf16's bound, as measured above).
    corrupted = y.detach().clone()
    corrupted.view(-1)[m * n // 2] *= 2.0 ** 16
    checks.begin_step()
    checks._verify_product(x, layer.weight.detach().t(), corrupted, layer.bias.detach(), 1.0, 1.0, "probe")
    assert checks.findings(checks.flags.reshape(1, -1)) == [(0, "probe")]


class _WeightReads(TorchDispatchMode):
    """Counts the operators, other than the products themselves and views, that read a weight matrix's memory."""

    _PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in model.parameters() if p.dim() >= 2}
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        view = func.is_view or func.overloadpacket in (torch.ops.aten.t, torch.ops.aten.mT)
        if func.overloadpacket not in self._PRODUCTS and not view and any(
                isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages
                for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            self.reads += 1
        return out


def test_a_weight_is_summed_once_per_step_not_once_per_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # The weight's row sums serve the forward and dX products of every micro-batch of the step: after the first
    # micro-batch the checks read no weight matrix (the model's own operators do, as without the checks; before,
    # each product read W and |W| once more; a bias, a vector, is still summed per product). The torch path,
    # whose operators a dispatch mode sees (the compiled kernel's reads are not operators).
    monkeypatch.setenv("SDCGUARD_FINGERPRINT_KERNEL", "torch")
    model = _model()
    checks = ProductChecks(model)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    plain = _WeightReads(model)
    with plain:
        loss_fn(model, data(0, 0)).backward()
    checks.begin_step()
    reads = []
    for micro in range(3):
        counter = _WeightReads(model)
        with counter, checks.watching():  # the counter outside: it sees what the checks compute
            loss_fn(model, data(0, micro)).backward()
        reads.append(counter.reads)
    assert reads[0] > plain.reads
    assert reads[1:] == [plain.reads, plain.reads]
    assert checks.summary().tolist() == [-1, 0]
    # A new step sums the (updated) weights afresh.
    checks.begin_step()
    counter = _WeightReads(model)
    with counter, checks.watching():
        loss_fn(model, data(1, 0)).backward()
    assert counter.reads == reads[0]


def test_a_site_counts_its_failing_products_over_the_step_s_micro_batches() -> None:
    # A pass's checksums are judged together when it ends; flags count failing products per site, not
    # failing checksum rows, and add up over the micro-batches of a step.
    model = _model()
    checks = ProductChecks(model)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    checks.begin_step()
    for micro in range(2):
        with _flip_product("fwd", 0, bit=30, element=7) as fired, checks.watching():
            loss_fn(model, data(0, micro)).backward()
        assert fired == [1]
    site = checks.sites.index(FORWARD[0])
    assert int(checks.flags[site]) == 2
    assert int(checks.flags.sum()) == 2
    assert checks.summary().tolist() == [site, 1]


def test_a_change_of_the_fp32_matmul_precision_between_passes_changes_the_bound() -> None:
    # A product's bound terms are kept per pass's settings: an error the fp32 bound sees, and bf16 operands'
    # ("medium") would not, is judged by the precision in force at each pass, both ways.
    layer = nn.Linear(32, 16, bias=False)
    checks = ProductChecks(layer)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 32, generator=g)
    w = layer.weight.detach()
    y = x @ w.t()
    y[0, 0] += 1e-4 * float(x[0].abs() @ w.abs().sum(0))

    def failing() -> int:
        checks.begin_step()
        with checks.watching():  # a pass reads the settings as it starts
            checks._verify_product(x, w.t(), y, None, 1.0, 1.0, "probe")
        return int(checks.flags.sum())

    prior = torch.get_float32_matmul_precision()
    try:
        verdicts = []
        for precision in ("highest", "medium", "highest"):
            torch.set_float32_matmul_precision(precision)
            verdicts.append(failing())
    finally:
        torch.set_float32_matmul_precision(prior)
    assert verdicts == [1, 0, 1]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _Checkpointed(nn.Module):
    """Two blocks, each recomputed in the backward (activation checkpointing, either implementation)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return x


# The products of the backward pass under activation checkpointing, in the order they run (written out: the
# oracle). Non-reentrant checkpointing recomputes a block only as far as its saved tensors need (fc1's product);
# the reentrant one recomputes it whole, then runs its backward.
_RECOMPUTED_BACKWARD = {
    False: [name for i in (1, 0) for name in (
        f"blocks.{i}.fc1 forward (recomputed)", f"blocks.{i}.fc2 backward dX", f"blocks.{i}.fc2 backward dW",
        f"blocks.{i}.fc1 backward dX", f"blocks.{i}.fc1 backward dW")],
    True: [name for i in (1, 0) for name in (
        f"blocks.{i}.fc1 forward (recomputed)", f"blocks.{i}.fc2 forward (recomputed)",
        f"blocks.{i}.fc2 backward dX", f"blocks.{i}.fc2 backward dW", f"blocks.{i}.fc1 backward dX",
        f"blocks.{i}.fc1 backward dW")],
}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_under_activation_checkpointing_every_product_is_checked_and_named_as_it_is(reentrant: bool) -> None:
    # The recomputation runs a block's forward inside a backward node: its products are forward products
    # ("recomputed"), and the node's own backward products keep their names (dX, dW), so a fault is named right.
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    checks = ProductChecks(model)
    names = _RECOMPUTED_BACKWARD[reentrant]

    def step(seed: int) -> None:
        checks.begin_step()
        model.zero_grad(set_to_none=True)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        with checks.watching():
            model(x).square().sum().backward()

    for seed in range(3):
        step(seed)
        assert int(checks.flags.sum()) == 0
    assert checks.checked == 4 + len(names)
    for target, name in enumerate(names):
        with _flip_product("bwd", target, 30) as fired:
            step(target)
        assert fired == [1]
        assert checks.findings(checks.flags.unsqueeze(0)) == [(0, name)], name


def _counting_backend() -> tuple[list[int], Callable[[Any, Any], Any]]:
    """A torch.compile backend that runs the graph as it is and counts its runs: whether compiled code ran."""
    runs = [0]

    def backend(graph: Any, _inputs: Any) -> Any:
        def run(*args: Any) -> Any:
            runs[0] += 1
            return graph.forward(*args)
        return run
    return runs, backend


@pytest.mark.parametrize("form", ["torch.compile(model)", "module.compile()"])
def test_a_compiled_model_is_warned_of_it_runs_eagerly_inside_the_checks(
        form: str, caplog: pytest.LogCaptureFixture) -> None:
    # Compiled code calls none of the operators the checks see: inside the checks it runs eagerly, so they still
    # see every product, and the user is told why the step is slower; outside them it runs compiled. Before the
    # checks' first pass, the compiled code runs with the naming hooks installed (they do nothing outside the
    # checks; they once broke torch.compile's tracing of the module's call).
    torch._dynamo.reset()  # what an earlier test compiled (or chose not to) is in dynamo's process-wide caches
    runs, backend = _counting_backend()

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    if form == "module.compile()":
        model[0].compile(backend=backend)
        net: Any = model
    else:
        net = torch.compile(model, backend=backend)
    with caplog.at_level("WARNING", logger="sdcguard.agent.product_checks"):
        checks = ProductChecks(net)
    assert "compiled (torch.compile)" in caplog.text
    assert ("0" if form == "module.compile()" else "<model>") in caplog.text
    x = torch.randn(8, 16)
    net(x).sum().backward()
    assert runs == [1]
    checks.begin_step()
    with checks.watching():
        net(x).sum().backward()
    assert runs == [1]  # not the compiled code
    assert checks.checked == 5
    assert int(checks.flags.sum()) == 0
    net(x).sum().backward()
    assert runs == [2]  # compiled again outside the checks
    torch._dynamo.reset()
    caplog.clear()
    with caplog.at_level("WARNING", logger="sdcguard.agent.product_checks"):
        ProductChecks(nn.Sequential(nn.Linear(4, 4)))
    assert not caplog.text


def test_a_compiled_function_the_model_calls_runs_eagerly_inside_the_checks_and_its_products_are_seen() -> None:
    # No module of the model is compiled (nothing to warn of at installation), yet a product inside a compiled
    # function would pass unseen if the compiled code ran: its products are not the operators' calls.
    torch._dynamo.reset()
    runs, backend = _counting_backend()

    @torch.compile(backend=backend)
    def projected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.w = nn.Parameter(torch.randn(16, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return projected(self.lin(x), self.w).sum()

    model = Model()
    checks = ProductChecks(model)
    x = torch.randn(8, 16)
    model(x).backward()
    assert runs == [1]
    for target in (None, 0):
        checks.begin_step()
        with checks.watching(), (_flip_product("bwd", target, 30) if target is not None
                                 else contextlib.nullcontext([1])) as fired:
            model(x).backward()
        assert runs == [1]  # not the compiled code
        assert fired == [1]
        assert checks.sites == ["lin forward", "<model> forward", "<model> backward dA", "<model> backward dB",
                                "lin backward dW"]
        assert checks.checked == 5
        flagged = [name for _, name in checks.findings(checks.flags.reshape(1, -1))]
        assert flagged == ([] if target is None else ["<model> backward dA"])
    torch._dynamo.reset()
