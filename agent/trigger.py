"""The magnitude trigger: a cheap per-step test, against each rank's own recent history, that asks for a
confirmation when a rank's loss or local gradient norm jumps.

A finite error in a rank's forward or backward (a flipped exponent bit, a
wrong partial sum) that lands between two audits is spread by the all-reduce
to every replica alike, so no comparison between ranks can see it afterwards.
What the faulty rank can see is that its own numbers jumped: its loss or the
norm of its local gradients (taken by the communication hook, which reads
every gradient anyway) moved by more than ``ratio`` from the median of its
last ``window`` clean steps. Comparing ranks with each other does not work:
healthy ranks differ as much as their data does.

During its warm-up (a fresh job's first ``warmup`` steps, before it has a
history) it cannot compare a rank with itself; :func:`cross_rank_outliers`
covers that window with the one comparison between ranks that healthy
variation never reaches: a rank's loss or local gradient norm orders of
magnitude (``factor``, 1e3) away from the median of all ranks'. A
resumed job needs no warm-up: :meth:`MagnitudeTrigger.state_dict` goes into the
checkpoint and :meth:`MagnitudeTrigger.load_state_dict` restores it, so the
trigger watches from the first step after the restart.

The trigger never raises an alarm. It only asks the guard to recompute the
rank's micro-batch on other nodes (sdcguard.agent.confirm) before the update; a jump
that the recomputation reproduces is real training, not a fault. Its history
stays on the device, so the test adds no host synchronisation; only steps
that passed every check join the history.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

# The statistics it watches, in history columns.
LOSS, GRAD_NORM = range(2)


class MagnitudeTrigger:
    """One rank's trigger: ``fires(loss, norm)`` on the device, ``observe(...)`` after a trusted step.

    ``ratio`` > 1 is the jump that fires it (the loss upwards, the gradient
    norm either way); ``window`` steps of history, of which at least
    ``warmup`` must be there before it fires at all. Raises ``ValueError``
    naming a bad argument.
    """

    def __init__(self, ratio: float, window: int, warmup: int, device: torch.device) -> None:
        if not ratio > 1:
            raise ValueError(f"trigger_ratio: must be > 1 (or 0 to turn the trigger off), got {ratio}")
        if window < 1:
            raise ValueError(f"trigger_window: must be >= 1, got {window}")
        if not 1 <= warmup <= window:
            raise ValueError(f"trigger_warmup: must be between 1 and trigger_window ({window}), got {warmup}")
        self.log_ratio = math.log(ratio)
        self.window = window
        self.warmup = warmup
        self.history = torch.full((window, 2), math.nan, dtype=torch.float64, device=device)
        self.seen = 0
        self._last: torch.Tensor | None = None

    def fires(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """A 0-dim bool on the device: does this step's loss or gradient norm jump against the history?

        A NaN never fires it (the non-finite check owns those), nor does a
        value at or below zero (a ratio means nothing there). An infinite
        norm of finite gradients (their squares overflowed) fires it."""
        values = torch.stack([loss.detach().reshape(()).to(self.history), norm.reshape(()).to(self.history)])
        logs = torch.where(values > 0, torch.log(values), torch.full_like(values, math.nan))
        self._last = logs
        if self.seen < self.warmup:
            return torch.zeros((), dtype=torch.bool, device=self.history.device)
        median = lower_nanmedian(self.history)
        jump = logs - median
        # NaN comparisons are False: an unwatched statistic never fires.
        up = jump[LOSS] > self.log_ratio
        either = jump[GRAD_NORM].abs() > self.log_ratio
        return up | either

    @property
    def warming_up(self) -> bool:
        """Whether it has too little history to fire (the steps :func:`cross_rank_outliers` covers)."""
        return self.seen < self.warmup

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed job needs to watch from its first step, for a checkpoint: the history (on the
        CPU, so any device can load it), how many steps it has seen, and the window and warm-up it was kept
        with."""
        return {"history": self.history.detach().to("cpu", copy=True), "seen": self.seen,
                "window": self.window, "warmup": self.warmup}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result onto this trigger's device. A history kept with another window
        keeps its most recent ``window`` steps (or all it has), and ``seen`` becomes the number of steps kept;
        ``ValueError`` names a missing or malformed key, and then nothing changes."""
        for key in ("history", "seen"):
            if key not in state:
                raise ValueError(f"trigger state: missing {key!r}")
        history, seen = state["history"], state["seen"]
        if not isinstance(history, torch.Tensor) or history.dim() != 2 or history.shape[1] != 2:
            raise ValueError(f"trigger state: history must be a [window, 2] tensor, got "
                             f"{getattr(history, 'shape', type(history).__name__)}")
        if not isinstance(seen, int) or seen < 0:
            raise ValueError(f"trigger state: seen must be an int >= 0, got {seen!r}")
        old_window = history.shape[0]
        # The rows in the order they were observed (a ring buffer indexed by seen % window), oldest first.
        count = min(seen, old_window)
        order = [(seen - count + i) % old_window for i in range(count)]
        rows = history[order][-self.window:].to(self.history)
        fresh = torch.full_like(self.history, math.nan)
        kept = rows.shape[0]
        # Oldest first from row 0: observe() then writes row ``kept % window``, the oldest once it is full.
        fresh[:kept] = rows
        self.history.copy_(fresh)
        self.seen = kept
        self._last = None

    def state(self) -> tuple[torch.Tensor, int]:
        """A copy of the history and how many steps it has seen, for ``load_state``."""
        return self.history.clone(), self.seen

    def load_state(self, state: tuple[torch.Tensor, int]) -> None:
        """Take the history another trigger of the same window had (``state()``): a run that starts mid-way
        (a fault-injection campaign's) watches with the history of the steps it did not train itself.
        ValueError for a history of another shape."""
        history, seen = state
        if history.shape != self.history.shape:
            raise ValueError(f"state: a history of shape {tuple(history.shape)}, this trigger keeps "
                             f"{tuple(self.history.shape)}")
        self.history.copy_(history)
        self.seen = int(seen)
        self._last = None

    def observe(self) -> None:
        """Add the values of the last ``fires`` call to the history (call it only for a trusted step)."""
        if self._last is None:
            return
        last = self._last
        self.history[self.seen % self.window] = torch.where(torch.isfinite(last), last, torch.full_like(last, math.nan))
        self.seen += 1
        self._last = None


def lower_nanmedian(columns: torch.Tensor) -> torch.Tensor:
    """Each column's median of its non-NaN values (the lower of the two middle ones for an even count; NaN for a
    column of NaNs): ``torch.nanmedian(columns, dim=0).values`` bit for bit, on the device, with no host sync.

    ``torch.nanmedian`` along a dimension has no deterministic CUDA kernel (it also returns indices, and which
    of equal values they name is not fixed), so under ``torch.use_deterministic_algorithms(True)``, which the
    guard turns on for every job of two or more ranks, CUDA refuses it. A sort (NaN last, on every device)
    and a gather at ``(valid - 1) // 2`` are deterministic everywhere and pick the same value."""
    ordered = torch.sort(columns, dim=0).values
    valid = (~torch.isnan(columns)).sum(0, keepdim=True)
    # A column without a valid value gathers row 0 of its sorted NaNs: NaN, as nanmedian gives.
    middle = torch.div(valid - 1, 2, rounding_mode="floor").clamp_min(0)
    return torch.gather(ordered, 0, middle).squeeze(0)


def cross_rank_outliers(values: torch.Tensor, factor: float = 1e3) -> torch.Tensor:
    """Which ranks' values are orders of magnitude away from every other rank's: a bool ``[world]`` on the device.

    ``values`` is ``[world, 2]``: each rank's loss and local gradient norm
    this step (columns :data:`LOSS`, :data:`GRAD_NORM`), gathered. A rank is
    an outlier when its loss is more than ``factor`` times the median of the
    other ranks' losses, or its gradient norm more than ``factor`` times
    above or below their median: the test of the warm-up steps, when a rank
    has no history of its own to compare with. The reference is the median
    of every rank's value (from three ranks up one outlier cannot move it
    past the healthy ones); with two ranks, the other rank's value (an
    outlier then names one rank for the loss, both for the norm, and the
    confirmation by recomputation decides). NaN, infinite, zero and negative
    values never fire it and are left out of the reference (the
    non-finite check owns the first two; a ratio means nothing for the
    reference); a rank with no valid other is never an outlier. No host
    synchronisation. Raises ``ValueError`` for another shape or a factor not
    above 1.
    """
    if values.dim() != 2 or values.shape[1] != 2:
        raise ValueError(f"values: must be [world, 2] (loss, gradient norm per rank), got {tuple(values.shape)}")
    if not factor > 1:
        raise ValueError(f"factor: must be > 1, got {factor}")
    world = values.shape[0]
    v = values.detach().to(torch.float64)
    logs = torch.where(torch.isfinite(v) & (v > 0), torch.log(v.clamp_min(torch.finfo(torch.float64).tiny)),
                       torch.full_like(v, math.nan))
    valid = ~torch.isnan(logs)
    ordered, order = torch.sort(logs, dim=0)  # NaN last
    position = torch.empty_like(order)
    position.scatter_(0, order, torch.arange(world, device=v.device).unsqueeze(1).expand(world, 2).contiguous())
    n = valid.sum(0, keepdim=True)  # valid values per column
    # From 3 valid values up, their (lower) median: one outlier cannot move it past the healthy ranks'. The
    # median of the *others* would not do with 3 ranks: of two others, one may be the outlier. With 2, the other.
    middle = torch.div(n - 1, 2, rounding_mode="floor").clamp_min(0).expand(world, 2)
    other = (1 - position).clamp(0, world - 1)
    median = torch.gather(ordered, 0, torch.where(n >= 3, middle, other))
    distance = logs - median
    limit = math.log(factor)
    has_others = valid & (n >= 2)
    loss_up = distance[:, LOSS] > limit
    norm_off = distance[:, GRAD_NORM].abs() > limit
    return (has_others[:, LOSS] & loss_up) | (has_others[:, GRAD_NORM] & norm_off)
