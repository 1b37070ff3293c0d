"""(3) The clean soak: clean training at the guard's defaults for many steps. Its alarms are false alarms; its
series feed the baselines' false-alarm counts."""

from __future__ import annotations

import time

from sdcguard.campaign.observers import GradNormProbe
from sdcguard.campaign.rank import Rank
from sdcguard.campaign.records import SoakAlarm, SoakRecord
from sdcguard.campaign.training_run import TrainingRun

PROGRESS_EVERY = 5_000
"""Soak steps between two progress lines."""


def run(rank: Rank) -> None:
    """Train ``soak_steps`` clean steps at the defaults and write the soak's record."""
    steps = rank.settings.soak_steps
    guard, module, _ = rank.guard("defaults", 0)
    probe = GradNormProbe(module)
    training = TrainingRun(guard, probe)
    alarms: list[SoakAlarm] = []
    started = time.perf_counter()

    def progress(step: int) -> None:
        if step and step % PROGRESS_EVERY == 0:
            rank.say(f"soak at step {step:,} of {steps:,} ({time.perf_counter() - started:.0f} s)")

    for step, result in training.steps(range(steps), before=progress):
        if result.alarm is not None:
            alarms.append(SoakAlarm(step=step, detector=result.alarm.detector.value,
                                    suspects=result.alarm.suspect_ranks, message=result.alarm.message[:200]))
    seconds = time.perf_counter() - started
    probe.remove()
    losses, norms, flags = training.losses, training.norms, training.flags
    del guard, training
    rows = rank.group.gather(losses + norms)
    rank.say(f"soak done: {steps * rank.world:,} rank-steps in {seconds:.0f} s")
    rank.write(SoakRecord(
        steps=steps, rank_steps=steps * rank.world, seconds=seconds, alarms=alarms, flags=flags,
        mean_losses=[sum(rows[r][s] for r in range(rank.world)) / rank.world for s in range(steps)],
        norms=[[rows[r][steps + s] for r in range(rank.world)] for s in range(steps)]))
