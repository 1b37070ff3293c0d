"""The detectors teams use today, run on the series a training run records (they change nothing in it).

- **Loss spike**: the mean loss over the ranks (what a dashboard plots)
  against an exponential running mean and variance; an alarm when the loss
  is non-finite or more than ``LOSS_SPIKE_SIGMAS`` running standard
  deviations above the running mean, after ``LOSS_SPIKE_WARMUP`` steps.
  It names no rank.
- **MAD**: the seed's outlier test on the ranks' local gradient norms: at each
  step, a rank whose distance from the median exceeds ``MAD_K`` median
  absolute deviations (k = 336, the seed's threshold) is the suspect; a
  non-finite norm counts as an outlier.

A baseline that fires on the clean run at some step is not credited with a
catch at that step of a faulted run (it would have fired without the
fault): its clean firings are its false alarms, counted apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOSS_SPIKE_SIGMAS = 6.0
LOSS_SPIKE_ALPHA = 0.05
LOSS_SPIKE_WARMUP = 10
MAD_K = 336.0


@dataclass(frozen=True)
class Firing:
    """The first step a baseline fired at or after the start of its watch, and whom it named."""

    step: int
    suspects: list[int]


def loss_spike(mean_losses: list[float], watch_from: int = 0, ignore: frozenset[int] = frozenset()) -> Firing | None:
    """The first step ``>= watch_from`` and not in ``ignore`` at which the loss-spike detector fires on
    ``mean_losses`` (index = step)."""
    mean = var = 0.0
    for step, loss in enumerate(mean_losses):
        watched = step >= watch_from and step not in ignore
        if not math.isfinite(loss):
            if watched:
                return Firing(step, [])
            continue
        if step >= LOSS_SPIKE_WARMUP and watched and loss - mean > LOSS_SPIKE_SIGMAS * math.sqrt(var):
            return Firing(step, [])
        if step == 0:
            mean = loss
        else:
            delta = loss - mean
            mean += LOSS_SPIKE_ALPHA * delta
            var = (1 - LOSS_SPIKE_ALPHA) * (var + LOSS_SPIKE_ALPHA * delta * delta)
    return None


def mad_outliers(norms: list[float], k: float = MAD_K) -> list[int]:
    """The ranks whose norm is more than ``k`` median absolute deviations from the median (non-finite: always)."""
    bad = [r for r, x in enumerate(norms) if not math.isfinite(x)]
    if bad:
        return bad
    ordered = sorted(norms)
    median = _median(ordered)
    mad = _median(sorted(abs(x - median) for x in norms))
    if mad == 0:
        return [r for r, x in enumerate(norms) if x != median]
    return [r for r, x in enumerate(norms) if abs(x - median) / mad > k]


def mad(norms_by_step: list[list[float]], watch_from: int = 0, k: float = MAD_K,
        ignore: frozenset[int] = frozenset()) -> Firing | None:
    """The first step ``>= watch_from`` and not in ``ignore`` at which the MAD test names a rank
    (``norms_by_step[step][rank]``)."""
    for step in range(watch_from, len(norms_by_step)):
        if step in ignore:
            continue
        suspects = mad_outliers(norms_by_step[step], k)
        if suspects:
            return Firing(step, suspects)
    return None


def firing_steps(mean_losses: list[float], norms_by_step: list[list[float]]) -> dict[str, frozenset[int]]:
    """The steps each baseline fires on (for a clean run: its false alarms); the loss spike re-arms after each."""
    spikes: set[int] = set()
    while (fired := loss_spike(mean_losses, 0, frozenset(spikes))) is not None:
        spikes.add(fired.step)
    return {"loss_spike": frozenset(spikes),
            "mad": frozenset(step for step, row in enumerate(norms_by_step) if mad_outliers(row))}


def count_firings(mean_losses: list[float], norms_by_step: list[list[float]]) -> dict[str, int]:
    """How many steps each baseline fires on (for a clean run: its false alarms)."""
    return {name: len(steps) for name, steps in firing_steps(mean_losses, norms_by_step).items()}


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
