"""(4) Every run of one compute fault: once without detectors (the outcome, and the baselines' series), then
once per detector configuration, until its first alarm or the last step at which it could raise one.

Every run starts a few clean steps before the fault (``lead``) from the
clean run's state there, with the magnitude trigger's clean history.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.product_checks import ProductChecks
from sdcguard.campaign import detectors
from sdcguard.campaign.end_state import compared
from sdcguard.campaign.faults import FaultSpec
from sdcguard.campaign.injectors import Installed, install
from sdcguard.campaign.observers import GradNormProbe, ReducedGradWatch
from sdcguard.campaign.rank import Rank
from sdcguard.campaign.records import BaselineRun, DetectorRun, FaultRecord, FirstAlarm
from sdcguard.campaign.training_run import TrainingRun
from sdcguard.contract import Alarm, LastClean


def run(rank: Rank, fault: FaultSpec) -> FaultRecord:
    """Every run of ``fault``; a detector's run is derived, not trained, where the run without detectors
    proves it silent (``detectors.silence_shown_by``, when the plan allows)."""
    end = fault.step + rank.settings.horizon
    base = baseline_run(rank, fault, start_of(rank, fault), end)
    runs: dict[str, DetectorRun] = {}
    for name in rank.plan.fault_configs:
        shown = detectors.silence_shown_by(rank.configs[name])
        if rank.plan.derive and shown is not None and getattr(base.end, shown):
            # The run without detectors shows this detector's input never left its clean range: trained, its
            # run would take the same steps and pass each one (see detectors.silence_shown_by).
            runs[name] = DetectorRun(alarm=None, last_step=base.last_step, fired=base.fired, flags={},
                                     derived=shown)
            continue
        runs[name] = detector_run(rank, fault, name, start_of(rank, fault), end, stop_after=base.benign_at)
    return FaultRecord(fault=fault, start=base.end.series_start, end=end, none=base, runs=runs)


def start_of(rank: Rank, fault: FaultSpec) -> int:
    """Where a run starts: a few clean steps before the fault (the trigger brings its history)."""
    return max(1, fault.step - rank.settings.lead)


def baseline_run(rank: Rank, fault: FaultSpec, start: int, end: int) -> BaselineRun:
    """The run without detectors, until ``end`` or, after the fault's last step, back on the clean run."""
    end = min(end, detectors.last_alarm_step(rank.configs["none"], start, end) + 1)
    guard, module, optimizer = rank.guard("none", start)
    inst = _installed(rank, fault, module, optimizer, guard.products)
    probe = GradNormProbe(module)
    watch = ReducedGradWatch(module, optimizer)
    training = TrainingRun(guard, probe)
    benign_at: int | None = None

    def back_on_clean_run(step: int) -> bool:
        nonlocal benign_at
        if rank.group.all(rank.clean.matches(step + 1, module, optimizer)):
            # Back on the clean trajectory after the fault's last step: the rest is the clean run.
            benign_at = step
            return True
        return False

    try:
        alarm = _until_alarm(rank, fault, "none", start, end, training, inst, stop=back_on_clean_run)
    finally:
        probe.remove()
        watch.remove()
    last = start if training.last_step is None else training.last_step
    fired = _fired(rank, inst)
    end_state = compared(rank, module, optimizer, last + 1, training.losses, training.norms, start, watch)
    flags = training.flags
    del guard, training
    return BaselineRun(alarm=alarm, last_step=last, fired=fired, flags=flags, end=end_state, benign_at=benign_at)


def detector_run(rank: Rank, fault: FaultSpec, name: str, start: int, end: int, stop_after: int | None,
                 ) -> DetectorRun:
    """The run under configuration ``name``, until its first alarm, ``end``, the last step at which ``name``
    could raise an alarm (a sampled detector's last due step), or, after the fault's last step,
    ``stop_after`` (where the run without detectors was back on the clean run)."""
    end = min(end, detectors.last_alarm_step(rank.configs[name], start, end) + 1)
    guard, module, optimizer = rank.guard(name, start)
    inst = _installed(rank, fault, module, optimizer, guard.products)
    training = TrainingRun(guard)
    alarm = _until_alarm(rank, fault, name, start, end, training, inst,
                         stop=lambda step: stop_after is not None and step >= stop_after)
    last = start if training.last_step is None else training.last_step
    fired = _fired(rank, inst)
    flags = training.flags
    del guard, training
    return DetectorRun(alarm=alarm, last_step=last, fired=fired, flags=flags)


def _until_alarm(rank: Rank, fault: FaultSpec, name: str, start: int, end: int, training: TrainingRun,
                 inst: Installed, stop: Callable[[int], bool]) -> FirstAlarm | None:
    """Train ``start .. end - 1`` with the fault armed at every step, until the first alarm (returned) or, from
    the fault's last step on, ``stop(step)``; the fault is removed however it ends."""
    try:
        for step, result in training.steps(range(start, end), before=inst.begin_step,
                                           around=lambda _step: inst.active()):
            if result.alarm is not None:
                return first_alarm(rank, result.alarm, name, start, fault)
            if step >= fault.last_step and stop(step):
                break
        return None
    finally:
        inst.remove()


def _installed(rank: Rank, fault: FaultSpec, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               checks: ProductChecks | None) -> Installed:
    """``fault`` installed on this rank; ``checks``, the guard's product checks when they are on, keep their own
    checksums out of the fault's count of products."""
    assert rank.shape is not None, "the reference measures the shape first"
    return install(fault, rank=rank.rank, module=module, optimizer=optimizer, shape=rank.shape, checks=checks)


def _fired(rank: Rank, inst: Installed) -> int:
    """How many corruptions the injector applied, all ranks together (collective)."""
    return int(sum(row[0] for row in rank.group.gather([float(inst.fired)])))


def first_alarm(rank: Rank, alarm: Alarm, name: str, start: int, fault: FaultSpec) -> FirstAlarm:
    """The first alarm of a run, with the checkpoint the pipeline would roll back to."""
    # The run began at ``start`` from the clean run's state, where the sampled
    # detectors had last passed at their cadence: give the alarm that history.
    overrides = rank.configs[name]
    cadences = {"ring_audit": overrides.get("audit_every", GuardConfig.audit_every),
                "weight_fingerprint": overrides.get("fingerprint_every", GuardConfig.fingerprint_every)}
    history = {}
    for detector, every in cadences.items():
        if every and getattr(alarm.last_clean, detector) is None and start >= 1:
            history[detector] = (start - 1) // every * every
    full = alarm.model_copy(update={"last_clean": LastClean(**{**alarm.last_clean.model_dump(), **history})})
    trusted = full.trusted_through_step()
    every = rank.settings.checkpoint_every
    rollback = trusted // every * every if trusted >= 0 else 0
    persistence = getattr(alarm, "fault_persistence", None)
    return FirstAlarm(step=alarm.step, detector=alarm.detector.value, suspects=alarm.suspect_ranks,
                      localized=alarm.localized, trusted_through=trusted, rollback_step=rollback,
                      rollback_ok=rollback <= fault.step, fault_persistence=getattr(persistence, "value", persistence))
