"""Fault injectors that install themselves around a running guard, from the outside, as a profiler does.

Nothing here is known to the guard: products are corrupted by a
``TorchDispatchMode`` entered around ``guard.step``, activations by forward
hooks, local gradients by tensor hooks on the parameters, weights and updates
by the optimizer's step hooks, one rank's all-reduce result by a wrapper of
``torch.distributed.all_reduce`` that corrupts the future it returns (float
tensors only: the gradient buckets; in place until the fault is removed,
``all_reduce_wrap.py``), and checkpoint objects by the checkpoint writer's
``corrupt`` callback. Every injector counts what it corrupted in ``fired``.

A micro-batch *pass* starts at each forward of the bare module (the DDP pass
and each recomputation): a transient fault corrupts only pass 0 of its step,
the others every pass of their steps, as hardware that is still faulty would.

With the guard's product checks on, their own checksums are computed where
the checks see a product (below autograd, above any dispatch mode) and so
pass through the fault's (today as
``aten.matmul``, which the fault does not count; an ``mm`` would be). The
fault skips everything the checks compute (``install(checks=...)``), so it
corrupts the same product of training with the checks on as with them off,
and the runs of every configuration stay comparable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sdcguard.agent.product_checks import ProductChecks
from sdcguard.campaign.all_reduce_wrap import AllReduce, wrapped_all_reduce
from sdcguard.campaign.faults import FaultSpec

_aten = torch.ops.aten
PRODUCTS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.convolution, _aten.convolution_backward}
"""The matrix-product operators a product fault corrupts (as overload packets)."""


@dataclass(frozen=True)
class ModelShape:
    """What the injectors need to know of the model, measured on one clean step."""

    products: dict[str, int]
    """Matrix products per micro-batch pass, by direction (``fwd``, ``bwd``)."""
    allreduces: int
    """Float all-reduces per step (the gradient buckets)."""
    linears: list[str]
    """Names of the model's ``nn.Linear`` modules."""
    params: list[tuple[str, int]]
    """(name, number of elements) of each trainable parameter."""


def flip(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip ``bit`` of element ``index`` (of the flattened ``t``) in place; ``t`` is fp32."""
    ints = t.detach().view(-1).view(torch.int32)
    ints[index] ^= -(1 << 31) if bit == 31 else 1 << bit


def _weighted(params: list[tuple[str, int]], draw: int) -> tuple[int, int]:
    """(parameter index, element index) for a draw uniform over all elements of all parameters."""
    total = sum(n for _, n in params)
    at = draw % total
    for i, (_, n) in enumerate(params):
        if at < n:
            return i, at
        at -= n
    raise AssertionError("unreachable")


@dataclass
class Installed:
    """One fault installed on one rank: arm it per step, enter ``active()`` around ``guard.step``, then remove."""

    fault: FaultSpec
    mine: bool
    """Whether this rank is the faulty one (elsewhere everything is a no-op)."""
    step: int = -1
    passes: int = -1
    """Forward passes of the bare module begun in this step, minus one."""
    fired: int = 0
    checking: int = 0
    """Above 0 while the guard's product checks compute their checksums (products the fault skips)."""
    _mode: TorchDispatchMode | None = None
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def begin_step(self, step: int) -> None:
        """Arm for ``step``."""
        self.step = step
        self.passes = -1

    def on(self) -> bool:
        """Whether the fault corrupts what is computed now (this rank, a firing step, an eligible pass)."""
        if not (self.mine and self.fault.fires(self.step)) or self.checking:
            return False
        return self.fault.persistence != "transient" or self.passes <= 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Around ``guard.step``: the dispatch mode of a product fault while it fires (nothing otherwise)."""
        if self._mode is not None and self.mine and self.fault.fires(self.step):
            with self._mode:
                yield
        else:
            yield

    def remove(self) -> None:
        """Take every hook and wrapper out again."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


class ProductMode(TorchDispatchMode):
    """Hands the output of every matrix product to ``corrupt(output, direction)``."""

    def __init__(self, corrupt: Callable[[torch.Tensor, str], None]) -> None:
        super().__init__()
        self.corrupt = corrupt

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in PRODUCTS:
            target = out if isinstance(out, torch.Tensor) else next(
                (t for t in out if isinstance(t, torch.Tensor)), None)
            if target is not None and target.dtype == torch.float32 and target.numel():
                # The autograd engine runs a node while it computes a backward product.
                direction = "bwd" if torch._C._current_autograd_node() is not None else "fwd"
                self.corrupt(target, direction)
        return out


def install(fault: FaultSpec, *, rank: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
            shape: ModelShape, checks: ProductChecks | None = None) -> Installed:
    """Install ``fault`` around ``module`` (the bare model inside DDP) and ``optimizer`` on this rank.

    Every rank installs (so that every rank counts passes alike); only the
    faulty rank corrupts. ``checks`` is the guard's product checks when they
    are on (``guard.products``): the products of their checksums are then
    not the fault's. ``checkpoint`` faults are installed through
    :func:`checkpoint_corrupter` instead. Raises ValueError for an unknown model.
    """
    inst = Installed(fault=fault, mine=rank == fault.rank)
    if checks is not None:
        _beside_checks(inst, checks)
    handle = module.register_forward_pre_hook(lambda *_: setattr(inst, "passes", inst.passes + 1))
    inst._undo.append(handle.remove)
    kind = fault.model
    if kind in ("matmul_fwd", "matmul_bwd"):
        _products(inst, shape)
    elif kind == "mercurial":
        _mercurial(inst)
    elif kind in ("activation", "null"):
        _activation(inst, module, shape)
    elif kind == "gradient":
        _gradient(inst, module, shape)
    elif kind == "weight":
        _weight(inst, module, optimizer, shape)
    elif kind == "optimizer":
        _update(inst, module, optimizer, shape)
    elif kind == "allreduce":
        _allreduce(inst, shape)
    else:
        raise ValueError(f"fault model {kind!r} is not installed around a step")
    return inst


def _beside_checks(inst: Installed, checks: ProductChecks) -> None:
    """Mark the product checks' own work as not the fault's, until ``inst.remove()``: ``checks.on_product`` (a
    product the Python interception hands over) and ``checks.check_named`` (one the compiled path's C++ kernels
    named and left to the Python form); the products the C++ kernels check themselves run no torch operator."""
    for name in ("on_product", "check_named"):
        original = getattr(checks, name)

        def paused(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            inst.checking += 1
            try:
                return _original(*args, **kwargs)
            finally:
                inst.checking -= 1

        setattr(checks, name, paused)  # on the instance: the class keeps its own
        inst._undo.append(lambda name=name: delattr(checks, name))  # type: ignore[misc]


def _products(inst: Installed, shape: ModelShape) -> None:
    fault = inst.fault
    count = max(shape.products.get(fault.direction, 0), 1)
    target = fault.product % count
    seen: dict[tuple[int, int], int] = {}

    def corrupt(out: torch.Tensor, direction: str) -> None:
        if direction != fault.direction or not inst.on():
            return
        # Products are counted per pass of each step: the same product of every pass is hit.
        key = (inst.step, inst.passes)
        n = seen.get(key, 0)
        seen[key] = n + 1
        if n == target:
            flip(out, fault.element % out.numel(), fault.bit)
            inst.fired += 1

    inst._mode = ProductMode(corrupt)


def _mercurial(inst: Installed) -> None:
    fault = inst.fault

    def corrupt(out: torch.Tensor, _direction: str) -> None:
        if not inst.on():
            return
        flat = out.view(-1) if out.is_contiguous() else None
        if flat is None:
            return
        ints = flat.view(torch.int32)
        mask = -(1 << 31) if fault.bit == 31 else 1 << fault.bit
        if fault.period:
            # A lane of a warp-wide unit: every period-th element from its position.
            ints[fault.element % fault.period::fault.period] ^= mask
        else:
            # A stuck bit: forced to 1 in the same element of every product.
            ints[fault.element % flat.numel()] |= mask
        inst.fired += 1

    inst._mode = ProductMode(corrupt)


def _activation(inst: Installed, module: torch.nn.Module, shape: ModelShape) -> None:
    fault = inst.fault
    name = shape.linears[fault.target % len(shape.linears)]
    layer = module.get_submodule(name)

    def hook(_m: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not inst.on():
            return None
        out = output.clone()
        flat = out.view(-1)
        index = fault.element % flat.numel()
        flat[index] = flat[index] * fault.factor
        inst.fired += 1
        return out

    inst._undo.append(layer.register_forward_hook(hook).remove)


def _gradient(inst: Installed, module: torch.nn.Module, shape: ModelShape) -> None:
    fault = inst.fault
    which, element = _weighted(shape.params, fault.element)
    param = dict(module.named_parameters())[shape.params[which][0]]

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if not inst.on():
            return None
        out = grad.clone()
        flip(out, element, fault.bit)
        inst.fired += 1
        return out

    inst._undo.append(param.register_hook(hook).remove)


def _weight(inst: Installed, module: torch.nn.Module, optimizer: torch.optim.Optimizer, shape: ModelShape) -> None:
    fault = inst.fault
    which, element = _weighted(shape.params, fault.element)
    param = dict(module.named_parameters())[shape.params[which][0]]
    mask = -(1 << 31) if fault.bit == 31 else 1 << fault.bit
    stuck: dict[str, int] = {}

    def after(*_: Any) -> None:
        if not (inst.mine and fault.fires(inst.step)):
            return
        ints = param.detach().view(-1).view(torch.int32)
        if fault.persistence == "transient":
            ints[element] ^= mask
        else:
            # A stuck memory cell: the bit keeps the wrong value it first took.
            if "value" not in stuck:
                stuck["value"] = 0 if int(ints[element]) & mask else mask
            ints[element] = (ints[element] & ~mask) | stuck["value"]
        inst.fired += 1

    inst._undo.append(optimizer.register_step_post_hook(after).remove)


def _update(inst: Installed, module: torch.nn.Module, optimizer: torch.optim.Optimizer, shape: ModelShape) -> None:
    fault = inst.fault
    which, element = _weighted(shape.params, fault.element)
    param = dict(module.named_parameters())[shape.params[which][0]]
    before: dict[str, torch.Tensor] = {}
    slots: list[str] = []

    def tensor() -> torch.Tensor | None:
        if not slots:
            # The weight itself, or one of the optimizer's tensors shaped like it (Adam: exp_avg, exp_avg_sq;
            # SGD: momentum_buffer), known once the optimizer has stepped.
            state = optimizer.state.get(param, {})
            slots.extend(["param", *sorted(k for k, v in state.items()
                                           if isinstance(v, torch.Tensor) and v.shape == param.shape)])
        slot = slots[fault.target % len(slots)]
        if slot == "param":
            return param
        value = optimizer.state.get(param, {}).get(slot)
        return value if isinstance(value, torch.Tensor) else None

    def pre(*_: Any) -> None:
        if not (inst.mine and fault.fires(inst.step)):
            return
        t = tensor()
        if t is not None:
            before["old"] = t.detach().view(-1)[element].clone()

    def post(*_: Any) -> None:
        old = before.pop("old", None)
        t = tensor()
        if old is None or t is None:
            return
        flat = t.detach().view(-1)
        delta = (flat[element] - old).reshape(1)
        flip(delta, 0, fault.bit)
        flat[element] = old + delta[0]
        inst.fired += 1

    inst._undo.append(optimizer.register_step_pre_hook(pre).remove)
    inst._undo.append(optimizer.register_step_post_hook(post).remove)


class _CorruptingWork:
    """A collective's Work whose future corrupts the result before anyone sees it."""

    def __init__(self, work: Any, corrupt: Callable[[torch.Tensor], None]) -> None:
        self._work = work
        self._corrupt = corrupt

    def get_future(self) -> torch.futures.Future[Any]:
        def corrupted(done: torch.futures.Future[Any]) -> Any:
            value = done.value()
            self._corrupt(value[0] if isinstance(value, list) else value)
            return value

        return self._work.get_future().then(corrupted)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the campaign's all-reduce fault supports only get_future() on async work")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _allreduce(inst: Installed, shape: ModelShape) -> None:
    fault = inst.fault
    target = fault.target % max(shape.allreduces, 1)
    seen = {"step": -1, "n": 0}

    def corrupt(t: torch.Tensor) -> None:
        flip(t, fault.element % t.numel(), fault.bit)
        inst.fired += 1

    def corrupting(original: AllReduce) -> AllReduce:
        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = original(tensor, *args, **kwargs)
            if not (tensor.is_floating_point() and tensor.dtype == torch.float32 and inst.mine
                    and fault.fires(inst.step)):
                return work
            if seen["step"] != inst.step:
                seen["step"], seen["n"] = inst.step, 0
            n = seen["n"]
            seen["n"] += 1
            if n != target:
                return work
            if kwargs.get("async_op") or (len(args) >= 3 and args[2]):
                return _CorruptingWork(work, corrupt)
            corrupt(tensor)
            return work

        return all_reduce

    # Wrapped from here until ``inst.remove()``: the installed fault's lifetime, not a ``with`` block.
    scope = contextlib.ExitStack()
    scope.enter_context(wrapped_all_reduce(corrupting))
    inst._undo.append(scope.close)


def checkpoint_corrupter(fault: FaultSpec, rank: int, counter: list[int],
                         hits: list[tuple[int, int]] | None = None) -> Callable[..., bytes]:
    """The checkpoint writer's ``corrupt`` callback for a ``checkpoint`` fault: flips one bit of one object.

    The writer calls it on every object a rank stores (rank 0: model,
    optimizer, trainer, its RNG; the others: their RNG), in that order; the
    fault picks one by ``target`` and flips bit ``bit % 8`` of the byte at
    ``element % size``. ``counter[0]`` counts what it corrupted; ``hits`` gets (object size, byte offset) of
    each corruption.
    """
    calls: dict[int, int] = {}

    def corrupt(data: bytes, *, step: int, rank: int = rank) -> bytes:
        ordinal = calls.get(step, 0)
        calls[step] = ordinal + 1
        objects = 4 if rank == 0 else 1
        if rank != fault.rank or not fault.fires(step) or ordinal != fault.target % objects or not data:
            return data
        at = fault.element % len(data)
        counter[0] += 1
        if hits is not None:
            hits.append((len(data), at))
        return data[:at] + bytes([data[at] ^ (1 << (fault.bit % 8))]) + data[at + 1:]

    return corrupt
