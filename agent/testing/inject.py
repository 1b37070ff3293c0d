"""Fault injection for drills and tests (``SDCGUARD_INJECT``): off unless asked, loud when on.

``SDCGUARD_INJECT="kind=finite_activation,rank=3,step=120,factor=1e4,repeat=50"``

A fault is bound to the hardware of a rank (``rank=R``) or of a node
(``node=NAME``), as a real faulty GPU is. A fault with ``repeat > 1`` is a
persistent one: during its steps (``step`` to ``step+repeat-1``) it corrupts
every computation of that hardware, its own micro-batch, the micro-batches it
recomputes for the audit or a confirmation, and its replays (``sdcguard replay``
of a capsule of one of its steps, run as that rank or on that node:
:meth:`Injector.install_on_module`). ``repeat=1`` is a transient fault: it
corrupts only the first computation of its step (the rank's own forward and
backward), so a recomputation of the same micro-batch on the same hardware,
and a replay, comes out right.

The injector installs its own hooks on the guarded model, as a profiler does
(:meth:`Injector.install`): a forward hook on the last ``Linear`` (or on the
``module=`` named, such as one rank's tensor-parallel layer) for the
activation faults, a gradient hook on one parameter for ``grad_bitflip``, an
optimizer post-step hook for ``weight_bitflip`` and an after-reduce observer
of the guard's communication hook for ``reduced_grad_corrupt``. The guard
knows nothing of it beyond calling ``install``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

KINDS = (
    "nan_activation",
    "finite_activation",
    "weight_bitflip",
    "grad_bitflip",
    "reduced_grad_corrupt",
    "checkpoint_corrupt",
)
ENV_VAR = "SDCGUARD_INJECT"
COMPUTE_KINDS = ("nan_activation", "finite_activation", "grad_bitflip")
"""Faults of a computation (a forward or backward): the ones ``repeat`` decides whether recomputations see."""


@dataclass(frozen=True)
class Injection:
    """One fault to inject."""

    kind: str
    step: int
    rank: int | None = None
    node: str | None = None
    factor: float = 1e4
    """Multiplier for finite_activation and reduced_grad_corrupt."""
    bit: int = 22
    """Bit flipped by weight_bitflip and grad_bitflip (22: the top mantissa bit of an fp32)."""
    repeat: int = 1
    """Consecutive steps it fires; above 1 it also corrupts every recomputation on that hardware."""
    param: str | None = None
    """The parameter weight_bitflip and grad_bitflip corrupt (its name in the module); None: the
    first trainable parameter for weight_bitflip, the last for grad_bitflip."""
    module: str | None = None
    """The module whose output nan_activation and finite_activation corrupt (its name in the model); None: the
    last ``Linear``. A tensor-parallel layer's output (``ColwiseParallel``'s) is this rank's local shard of it:
    the fault of one rank's TP site."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.step < 0:
            raise ValueError(f"step: must be >= 0, got {self.step}")
        if self.repeat < 1:
            raise ValueError(f"repeat: must be >= 1, got {self.repeat}")
        if self.rank is None and self.node is None:
            raise ValueError("rank: give rank=R or node=NAME to say whose hardware is faulty")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"rank: must be >= 0, got {self.rank}")
        if not 0 <= self.bit < 64:
            raise ValueError(f"bit: must be in 0..63, got {self.bit}")

    @classmethod
    def parse(cls, text: str) -> Injection:
        """Parse ``key=value`` pairs separated by commas; ``ValueError`` names a bad key or value."""
        fields: dict[str, str] = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"{ENV_VAR}: {part!r} is not key=value")
            if key not in ("kind", "step", "rank", "node", "factor", "bit", "repeat", "param", "module"):
                raise ValueError(f"{key}: not an injection key (kind, step, rank, node, factor, bit, repeat, param, "
                                 "module)")
            fields[key] = value.strip()
        if "kind" not in fields:
            raise ValueError("kind: missing")
        if "step" not in fields:
            raise ValueError("step: missing")
        return cls(
            kind=fields["kind"],
            step=_number(fields, "step", int, 0),
            rank=_number(fields, "rank", int, None),
            node=fields.get("node") or None,
            factor=_number(fields, "factor", float, 1e4),
            bit=_number(fields, "bit", int, 22),
            repeat=_number(fields, "repeat", int, 1),
            param=fields.get("param") or None,
            module=fields.get("module") or None,
        )

    def fires(self, step: int, rank: int, node: str) -> bool:
        """Whether this fault corrupts what ``rank`` (on ``node``) computes at ``step``."""
        if not self.step <= step < self.step + self.repeat:
            return False
        if self.node is not None:
            return node == self.node
        return rank == self.rank

    def describe(self) -> str:
        """One line for the logs."""
        where = f"node={self.node}" if self.node is not None else f"rank={self.rank}"
        target = f" param={self.param}" if self.param else ""
        target += f" module={self.module}" if self.module else ""
        return (f"kind={self.kind} {where} step={self.step} repeat={self.repeat} "
                f"factor={self.factor:g} bit={self.bit}{target}")


def _number(fields: Mapping[str, str], key: str, kind: Callable[[str], object], default: object) -> Any:
    if key not in fields:
        return default
    try:
        return kind(fields[key])
    except ValueError:
        raise ValueError(f"{key}: {fields[key]!r} is not a number") from None


def from_env(env: Mapping[str, str] | None = None) -> Injection | None:
    """The injection asked for in ``SDCGUARD_INJECT``, or None (the default). ValueError if malformed."""
    env = os.environ if env is None else env
    text = env.get(ENV_VAR, "").strip()
    return Injection.parse(text) if text else None


def announce(injection: Injection, rank: int) -> None:
    """Say loudly, on stderr and in the log, that this process injects faults."""
    line = f"SDCGUARD FAULT INJECTION IS ON (rank {rank}): {injection.describe()}"
    print(f"!!! {line} !!!", file=sys.stderr, flush=True)
    log.warning(line)


def flip_bit(t: torch.Tensor, bit: int, index: int = 0) -> None:
    """Flip ``bit`` of element ``index`` of ``t`` in place, through an integer view of the same width."""
    flat = t.detach().view(-1)
    ints = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()])
    width = flat.element_size() * 8
    if bit >= width:
        raise ValueError(f"bit: {bit} is beyond a {width}-bit element")
    mask = 1 << bit
    if mask >= 1 << (width - 1):  # the sign bit: express it as the negative value of that width
        mask -= 1 << width
    ints[index] ^= mask


class Injector:
    """Applies one injection through hooks it installs on the guarded model (:meth:`install`).

    It counts the computations (forwards of the module) of the current step:
    the first is the rank's own micro-batch, later ones are recomputations.
    Each hook is a no-op unless the fault fires here and now.
    """

    def __init__(self, injection: Injection | None, rank: int, node: str) -> None:
        self.injection = injection
        self.rank = rank
        self.node = node
        self.step = -1
        self.computation = 0
        """Forwards of the module so far in this step (1 during the rank's own)."""
        self.handles: list[Any] = []
        if injection is not None:
            announce(injection, rank)

    def _on(self, kind: str) -> bool:
        inj = self.injection
        if inj is None or inj.kind != kind or not inj.fires(self.step, self.rank, self.node):
            return False
        # A transient fault (repeat=1) hits only the first computation of its step.
        return inj.repeat > 1 or kind not in COMPUTE_KINDS or self.computation <= 1

    def begin_step(self, step: int) -> None:
        """Arm for ``step`` (the guard's step hook calls it)."""
        self.step = step
        self.computation = 0

    def install(self, guard: Any) -> None:
        """Install the hooks this injection needs on ``guard``'s model and optimizer (nothing when off).

        ``guard`` offers ``model`` (DDP), ``optimizer``, ``hook`` (the
        communication hook, with ``after_reduce`` observers) and
        ``register_step_hook``. Raises ``ValueError`` when the model lacks
        what the injection needs (a ``Linear``, the named parameter).
        """
        inj = self.injection
        if inj is None or inj.kind == "checkpoint_corrupt":
            return
        module: torch.nn.Module = guard.model.module
        guard.register_step_hook(self.begin_step)
        self.handles.append(module.register_forward_pre_hook(self._count))
        if inj.kind in ("nan_activation", "finite_activation"):
            self._hook_activation(module)
        elif inj.kind == "grad_bitflip":
            before = getattr(guard.hook, "before_reduce", None)
            if before is not None:
                # A sharded model: the gradients exist whole only as they enter the reduce-scatter.
                before.append(self.unreduced_gradients)
            else:
                param = self._target(module, last=True)
                self.handles.append(param.register_hook(self._flip_gradient))
        elif inj.kind == "weight_bitflip":
            param = self._target(module, last=False)
            self.handles.append(guard.optimizer.register_step_post_hook(
                lambda *_: self.weights([param])))
        elif inj.kind == "reduced_grad_corrupt":
            guard.hook.after_reduce.append(self.reduced_bucket)

    def install_on_module(self, module: torch.nn.Module, step: int) -> bool:
        """Install the computation faults' hooks on a bare module, armed for ``step``, for a replay of that
        step (``sdcguard replay``): no guard, optimizer or all-reduce, so only the faults of a computation
        (:data:`COMPUTE_KINDS`) apply. Every forward from here on counts as a recomputation: a persistent
        fault whose steps cover ``step`` corrupts each one, a transient one none (it hit only the rank's own
        first computation, long done). Returns whether the fault fires here (kind, step, rank or node);
        raises ``ValueError`` when the model lacks what the injection needs."""
        inj = self.injection
        if inj is None or inj.kind not in COMPUTE_KINDS:
            return False
        self.begin_step(step)
        self.computation = 1  # the rank's own computation of this step was the training's
        self.handles.append(module.register_forward_pre_hook(self._count))
        if inj.kind == "grad_bitflip":
            param = self._target(module, last=True)
            self.handles.append(param.register_hook(self._flip_gradient))
        else:
            self._hook_activation(module)
        return inj.repeat > 1 and inj.fires(step, self.rank, self.node)

    def remove(self) -> None:
        """Take out every hook this injector installed on modules and parameters."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook_activation(self, module: torch.nn.Module) -> None:
        assert self.injection is not None
        if self.injection.module is not None:
            named = dict(module.named_modules())
            if self.injection.module not in named:
                raise ValueError(f"module: the model has no module {self.injection.module!r}")
            self.handles.append(named[self.injection.module].register_forward_hook(self.activation_hook()))
            return
        # The last Linear (in a GPT, the head): no dropout after it can
        # mask the corrupted element, as it could deeper inside the model.
        linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        if not linears:
            raise ValueError("injection: an activation fault needs a torch.nn.Linear in the model")
        self.handles.append(linears[-1].register_forward_hook(self.activation_hook()))

    def _target(self, module: torch.nn.Module, *, last: bool) -> torch.Tensor:
        assert self.injection is not None
        named = dict(module.named_parameters())
        if self.injection.param is not None:
            if self.injection.param not in named:
                raise ValueError(f"param: the model has no parameter {self.injection.param!r}")
            return named[self.injection.param]
        trainable = [p for p in named.values() if p.requires_grad]
        if not trainable:
            raise ValueError("injection: the model has no trainable parameter to corrupt")
        return trainable[-1] if last else trainable[0]

    def _count(self, _module: torch.nn.Module, _inputs: tuple[object, ...]) -> None:
        self.computation += 1

    def activation_hook(self) -> Callable[[torch.nn.Module, tuple[object, ...], torch.Tensor], torch.Tensor | None]:
        """A forward hook that corrupts one activation (nan_activation, finite_activation): the output's last element."""

        def hook(_module: torch.nn.Module, _inputs: tuple[object, ...], output: torch.Tensor) -> torch.Tensor | None:
            if not (self._on("nan_activation") or self._on("finite_activation")):
                return None
            assert self.injection is not None
            out = output.clone()
            flat = out.view(-1)
            # The last element: the guard hooks the model's last Linear, whose
            # every output element reaches the loss.
            if self.injection.kind == "nan_activation":
                flat[-1] = float("nan")
            else:
                flat[-1] = flat[-1] * self.injection.factor
            return out

        return hook

    def _flip_gradient(self, grad: torch.Tensor) -> torch.Tensor | None:
        """grad_bitflip: the target parameter's gradient with one bit flipped, as it is computed."""
        if not self._on("grad_bitflip"):
            return None
        assert self.injection is not None
        out = grad.clone()
        flip_bit(out, self.injection.bit)
        return out

    def unreduced_gradients(self, index: int, flat: torch.Tensor) -> None:
        """grad_bitflip on a sharded model: flip a bit of the first FSDP group's local gradients, in place,
        as they enter the reduce-scatter."""
        if index == 0 and self._on("grad_bitflip"):
            assert self.injection is not None
            flip_bit(flat, self.injection.bit)

    def reduced_bucket(self, index: int, reduced: torch.Tensor) -> None:
        """reduced_grad_corrupt: scale one element of this rank's all-reduce result of bucket 0."""
        if index == 0 and self._on("reduced_grad_corrupt"):
            assert self.injection is not None
            flat = reduced.view(-1)
            flat[0] = flat[0] * self.injection.factor if flat[0] != 0 else self.injection.factor

    def weights(self, params: list[torch.Tensor]) -> None:
        """weight_bitflip: flip a bit of the first of ``params``, after the update."""
        if self._on("weight_bitflip") and params:
            assert self.injection is not None
            target = params[0]
            # A sharded parameter (a DTensor): this rank's own shard.
            target = target.to_local() if hasattr(target, "to_local") else target
            with torch.no_grad():
                flip_bit(target, self.injection.bit)


def corrupt_checkpoint_bytes(data: bytes, *, step: int, rank: int, node: str = "",
                             injection: Injection | None = None) -> bytes:
    """checkpoint_corrupt, for the checkpoint writer: ``data`` with one byte flipped when the fault fires.

    Called on the bytes of each object after they are digested and before (or
    instead of) the upload, so the stored object no longer matches its
    manifest. ``injection`` defaults to ``SDCGUARD_INJECT``. Returns ``data``
    unchanged otherwise.
    """
    injection = from_env() if injection is None else injection
    if (injection is None or injection.kind != "checkpoint_corrupt" or not data
            or not injection.fires(step, rank, node)):
        return data
    log.warning("SDCGUARD FAULT INJECTION: corrupting a checkpoint object at step %d on rank %d", step, rank)
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
