"""Recompute a rank's step on the bare module, bit for bit as its own pass ran it, changing nothing.

The ring audit (sdcguard.agent.ring_audit) and the confirmations (sdcguard.agent.confirm) both
recompute another rank's micro-batches with the same pre-update weights, the
same data and the same random state; the module's buffers (batch-norm
statistics) and the random state are saved before and restored after, so a
check never changes the training it checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Recomputation:
    """A micro-batch recomputed on the bare module: its loss and local gradients by parameter name."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


class _Preserved:
    """Saves the module's buffers and the random state on entry and puts them back on exit.

    A forward in training mode updates batch-norm statistics, and dropout
    draws from the generator: without this, every audit or confirmation would
    change the training it checks."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.buffers = [b.detach().clone() for b in self.module.buffers()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None

    def __exit__(self, *_: object) -> None:
        with torch.no_grad():
            for buffer, saved in zip(self.module.buffers(), self.buffers, strict=True):
                buffer.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def preserved(module: torch.nn.Module) -> _Preserved:
    """A context manager that restores ``module``'s buffers and the random state it found."""
    return _Preserved(module)


def recompute(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    names: Sequence[str],
    params: Sequence[torch.nn.Parameter],
    seed: Callable[[], None],
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Recomputation:
    """Recompute one micro-batch on the bare module (no all-reduce), changing nothing: :func:`recompute_step`
    of a step of that one micro-batch."""
    return recompute_step(module, loss_fn, [batch], names, params, seed, scale)


def recompute_step(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batches: Sequence[Any],
    names: Sequence[str],
    params: Sequence[torch.nn.Parameter],
    seed: Callable[[], None],
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Recomputation:
    """Recompute a rank's whole step on the bare module (no all-reduce), as its own pass ran it; change nothing.

    ``seed()`` seeds the random state for the owner's step; the random state
    and the module's buffers are restored afterwards. Each of the K
    ``batches`` runs its forward under ``forward_context()`` (the owner's autocast and compile stance:
    ``sdcguard.agent.replay.autocast_and_stance``), its loss divided by K
    (when K > 1), as the owner's did; the local gradients are summed in the
    order the owner's ``.grad`` accumulated them (no_sync for all but the
    last micro-batch), so the result has the owner's bits. A parameter that
    gets no gradient in a micro-batch adds nothing (not a zero: -0.0 + 0.0 is
    +0.0), and one that gets none in the whole step is zeros, as DDP hands its
    bucket slot. Gradients come from ``torch.autograd.grad``, so the ``.grad``
    fields (which hold this step's reduced gradients) are left alone.
    ``scale`` is the GradScaler's scaling when one is in use. The loss is the
    sum of the divided losses, in order: the mean the owner reports.
    """
    k = len(batches)
    total: torch.Tensor | None = None
    summed: list[torch.Tensor | None] = [None] * len(params)
    with preserved(module):
        seed()
        for batch in batches:
            with forward_context():
                loss = loss_fn(module, batch)
            if k > 1:
                loss = loss / k
            grads = torch.autograd.grad(scale(loss) if scale is not None else loss, list(params), allow_unused=True)
            for i, grad in enumerate(grads):
                if grad is not None:
                    prior = summed[i]
                    summed[i] = grad if prior is None else prior + grad
            total = loss.detach() if total is None else total + loss.detach()
    assert total is not None, "a step has at least one micro-batch"
    out: dict[str, torch.Tensor] = {}
    for name, p, acc in zip(names, params, summed, strict=True):
        out[name] = acc if acc is not None else torch.zeros_like(p)
    return Recomputation(loss=total, grads=out)
