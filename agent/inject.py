"""Fault injection for drills and tests (``SDCGUARD_INJECT``): off unless asked, loud when on.

``SDCGUARD_INJECT="kind=finite_activation,rank=3,step=120,factor=1e4,repeat=50"``

A fault is bound to the hardware of a rank (``rank=R``) or of a node
(``node=NAME``), as a real faulty GPU is: while it fires (steps ``step`` to
``step+repeat-1``) it corrupts everything that hardware computes, its own
micro-batch and the micro-batch it recomputes for the ring audit alike.
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
            if key not in ("kind", "step", "rank", "node", "factor", "bit", "repeat"):
                raise ValueError(f"{key}: not an injection key (kind, step, rank, node, factor, bit, repeat)")
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
        return (f"kind={self.kind} {where} step={self.step} repeat={self.repeat} "
                f"factor={self.factor:g} bit={self.bit}")


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
    """Applies one injection at the points the guard and the hook offer.

    The guard tells it the step and whether it is computing; the hooks ask it
    whether to corrupt. Each method is a no-op unless the fault fires here.
    """

    def __init__(self, injection: Injection | None, rank: int, node: str) -> None:
        self.injection = injection
        self.rank = rank
        self.node = node
        self.step = -1
        self.grad_target: str | None = None
        """Name of the parameter whose local gradient grad_bitflip flipped this step."""
        if injection is not None:
            announce(injection, rank)

    def _on(self, kind: str) -> bool:
        inj = self.injection
        return inj is not None and inj.kind == kind and inj.fires(self.step, self.rank, self.node)

    def begin_step(self, step: int) -> None:
        """Arm for ``step``."""
        self.step = step
        self.grad_target = None

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

    def wants_local_gradients(self) -> bool:
        """Whether ``local_gradients`` may corrupt something this step (else the hook need not list them)."""
        return self._on("grad_bitflip")

    def local_gradients(self, names: list[str], grads: list[torch.Tensor]) -> None:
        """grad_bitflip: flip a bit of the first local gradient of a bucket, before the all-reduce."""
        if self._on("grad_bitflip") and grads and self.grad_target is None:
            assert self.injection is not None
            flip_bit(grads[0], self.injection.bit)
            self.grad_target = names[0]

    def recomputed_gradient(self, name: str, grad: torch.Tensor) -> None:
        """grad_bitflip on the audit's recomputation: the same hardware corrupts the same gradient."""
        if self._on("grad_bitflip") and name == self.grad_target:
            assert self.injection is not None
            flip_bit(grad, self.injection.bit)

    def reduced_bucket(self, index: int, reduced: torch.Tensor) -> None:
        """reduced_grad_corrupt: scale one element of this rank's all-reduce result of bucket 0."""
        if index == 0 and self._on("reduced_grad_corrupt"):
            assert self.injection is not None
            flat = reduced.view(-1)
            flat[0] = flat[0] * self.injection.factor if flat[0] != 0 else self.injection.factor

    def weights(self, params: list[torch.Tensor]) -> None:
        """weight_bitflip: flip a bit of the first weight, after the update."""
        if self._on("weight_bitflip") and params:
            assert self.injection is not None
            with torch.no_grad():
                flip_bit(params[0], self.injection.bit)


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
