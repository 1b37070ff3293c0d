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

The trigger never raises an alarm. It only asks the guard to recompute the
rank's micro-batch on other nodes (agent.confirm) before the update; a jump
that the recomputation reproduces is real training, not a fault. Its history
stays on the device, so the test adds no host synchronisation; only steps
that passed every check join the history.
"""

from __future__ import annotations

import math

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
        median = torch.nanmedian(self.history, dim=0).values
        jump = logs - median
        # NaN comparisons are False: an unwatched statistic never fires.
        up = jump[LOSS] > self.log_ratio
        either = jump[GRAD_NORM].abs() > self.log_ratio
        return up | either

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
