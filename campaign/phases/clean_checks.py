"""(2) Every configuration on the clean run: no alarm allowed, the final state bit-identical to the reference's;
a run restarted from a snapshot must reproduce the clean run; and the magnitude trigger's clean history.

A detector that fires on the clean run, or a configuration that changes the
arithmetic of training, would make every outcome wrong: the parent refuses
the campaign then ("CLEAN-RUN PROBLEMS").
"""

from __future__ import annotations

import time

from sdcguard.campaign import detectors
from sdcguard.campaign.rank import Rank
from sdcguard.campaign.records import CleanAlarm, CleanChecksRecord, CleanRun
from sdcguard.campaign.training_run import TrainingRun


def run(rank: Rank) -> None:
    """Every fault configuration from step 0 and ``none`` restarted at ``first_step``; writes the record."""
    end = rank.settings.last_step
    configs = {name: clean_run(rank, name, 0, end) for name in rank.plan.fault_configs}
    restart = rank.settings.first_step
    record = CleanChecksRecord(configs=configs, restart=clean_run(rank, "none", restart, end, from_step=restart))
    rank.write(record)
    rank.say(f"clean checks done ({len(record.configs)} configurations)")


def trigger_histories(rank: Rank) -> None:
    """The magnitude trigger's clean history at every step, for each configuration that runs it (the clean
    checks keep them as they go; a world without them, or a replay, trains those clean runs for them)."""
    for name in rank.plan.fault_configs:
        if detectors.trigger_on(rank.configs[name]) and name not in rank.clean.trigger:
            clean_run(rank, name, 0, rank.settings.last_step)


def clean_run(rank: Rank, name: str, start: int, end: int, from_step: int | None = None) -> CleanRun:
    """Configuration ``name`` on the clean run from ``start`` to ``end``; from step 0, it keeps the magnitude
    trigger's history at every step in ``rank.clean.trigger``."""
    guard, module, optimizer = rank.guard(name, start)
    trigger = guard.trigger if start == 0 else None
    states = rank.clean.trigger.setdefault(name, {}) if trigger is not None else {}

    def keep_history(step: int) -> None:
        if trigger is not None:
            states[step] = trigger.state()

    alarms: list[CleanAlarm] = []
    training = TrainingRun(guard)
    started = time.perf_counter()
    for step, result in training.steps(range(start, end), before=keep_history):
        if result.alarm is not None:
            alarms.append(CleanAlarm(step=step, detector=result.alarm.detector.value,
                                     suspects=result.alarm.suspect_ranks))
    identical = rank.group.all(rank.clean.matches(end, module, optimizer))
    seconds = time.perf_counter() - started
    flags = training.flags
    del guard, training
    return CleanRun(alarms=alarms, identical=identical, steps=end - start, seconds=seconds, flags=flags,
                    from_step=from_step)
