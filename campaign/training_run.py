"""The campaign's training loop, written once: guarded steps, with what the run's own monitoring sees.

Every run of the campaign (the clean reference, the clean checks, a faulted
run under each configuration, a checkpoint's resume, the soak) is this loop
with its own step range and its own reasons to stop: ``steps()`` yields
after each step, and the caller stops by leaving its ``for``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager

from sdcguard.agent.guard import SDCGuard, StepResult
from sdcguard.campaign.observers import GradNormProbe


def count_flags(result: StepResult, counters: dict[str, int]) -> None:
    """Add up the step result's yes/no fields (``audited``, ``overflow``, and whatever the guard adds)."""
    for f in dataclasses.fields(result):
        value = getattr(result, f.name)
        if isinstance(value, bool) and value:
            counters[f.name] = counters.get(f.name, 0) + 1


class TrainingRun:
    """One guarded run: its losses, local gradient norms (with a probe) and flag counts, step by step."""

    def __init__(self, guard: SDCGuard, probe: GradNormProbe | None = None) -> None:
        self.guard = guard
        self.probe = probe
        self.losses: list[float] = []
        """This rank's loss at every step trained."""
        self.norms: list[float] = []
        """This rank's local gradient norm at every step trained (with a probe; else empty)."""
        self.flags: dict[str, int] = {}
        """How many steps set each of the step result's yes/no fields."""
        self.last_step: int | None = None
        """The last step trained (None before the first)."""

    def steps(self, steps: Iterable[int], *, before: Callable[[int], object] | None = None,
              around: Callable[[int], AbstractContextManager[object]] | None = None,
              ) -> Iterator[tuple[int, StepResult]]:
        """Train ``steps`` in order, yielding (step, its result) after each.

        ``before(step)`` runs first (keep state, arm a fault), then ``guard.step(step)`` inside ``around(step)``
        (a fault's dispatch mode, a census).
        """
        for step in steps:
            if before is not None:
                before(step)
            if self.probe is not None:
                self.probe.begin_step()
            with around(step) if around is not None else contextlib.nullcontext():
                result = self.guard.step(step)
            count_flags(result, self.flags)
            self.losses.append(result.loss)
            if self.probe is not None:
                self.norms.append(self.probe.norm())
            self.last_step = step
            yield step, result

    def train(self, steps: Iterable[int], *, before: Callable[[int], object] | None = None,
              around: Callable[[int], AbstractContextManager[object]] | None = None) -> None:
        """Train every step of ``steps``, stopping at none (the hooks as ``steps()``'s)."""
        for _ in self.steps(steps, before=before, around=around):
            pass
