"""The records the ranks write, one JSON line per finished unit, and the parent reads (``outcome.py``).

Each record is a typed dataclass; ``to_dict()`` gives the JSON line's
object, with its keys in the order the campaign has always written them (a
line is a stable, diffable artefact: the same inputs give the same bytes).
Figures gathered from every rank are indexed ``[step][rank]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sdcguard.campaign.faults import FaultSpec
from sdcguard.campaign.injectors import ModelShape

Series = list[list[float]]
"""A figure per step and rank: ``series[step][rank]``."""


@dataclass(frozen=True)
class ReferenceRecord:
    """The clean reference run, trained from step 0 by every world (``world_reference`` once merged, for the
    other worlds')."""

    steps: int
    seconds: float
    shape: ModelShape
    model: str
    """The trained module's class, ``module.qualname``."""
    trainable: int
    """Trainable parameters (elements)."""
    losses: Series
    norms: Series
    """Local gradient norms."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "reference", "steps": self.steps, "seconds": self.seconds,
                "shape": dataclasses.asdict(self.shape), "model": self.model, "trainable": self.trainable,
                "losses": self.losses, "norms": self.norms}


@dataclass(frozen=True)
class CleanAlarm:
    """An alarm on a clean run: a false alarm."""

    step: int
    detector: str
    suspects: list[int]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SoakAlarm(CleanAlarm):
    """A false alarm of the soak, with (the start of) its message."""

    message: str


@dataclass(frozen=True)
class CleanRun:
    """One detector configuration on the clean run."""

    alarms: list[CleanAlarm]
    """Must be none."""
    identical: bool
    """The final state, every rank, is bit-identical to the reference's."""
    steps: int
    seconds: float
    flags: dict[str, int]
    """How many steps set each of the step result's yes/no fields."""
    from_step: int | None = None
    """For the restart check: the step the run restarted at from a snapshot (not written when None)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"alarms": [a.to_dict() for a in self.alarms], "identical": self.identical,
                               "steps": self.steps, "seconds": self.seconds, "flags": self.flags}
        if self.from_step is not None:
            out["from_step"] = self.from_step
        return out


@dataclass(frozen=True)
class CleanChecksRecord:
    """Every fault configuration on the clean run from step 0, and a restart from a snapshot."""

    configs: dict[str, CleanRun]
    restart: CleanRun

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "clean_checks", "configs": {name: run.to_dict() for name, run in self.configs.items()},
                "restart": self.restart.to_dict()}


@dataclass(frozen=True)
class FirstAlarm:
    """The first alarm of a faulted run, with the checkpoint the pipeline would roll back to."""

    step: int
    detector: str
    suspects: list[int]
    localized: bool
    trusted_through: int
    rollback_step: int
    rollback_ok: bool
    """The rollback's checkpoint predates the fault."""
    fault_persistence: str | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EndState:
    """A faulted run's end state against the clean run's at the same step, and its series (every rank's)."""

    end_step: int
    exact_final: bool
    """Weights, buffers and optimizer state bit-identical to the clean run's, every rank."""
    finite_final: bool
    weight_rel: float
    """The largest relative distance of a rank's weights from the clean run's (inf when not finite)."""
    losses: Series
    norms: Series
    series_start: int
    all_finite: bool | None = None
    """(The run without detectors) every loss, local and reduced gradient of every rank was finite at every
    step. None (not written) for the other runs."""
    reduced_identical: bool | None = None
    """(The run without detectors) every rank received the same reduced gradients at every step. None (not
    written) for the other runs."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"end_step": self.end_step, "exact_final": self.exact_final,
                               "finite_final": self.finite_final, "weight_rel": self.weight_rel,
                               "losses": self.losses, "norms": self.norms, "series_start": self.series_start}
        if self.all_finite is not None:
            out["all_finite"] = self.all_finite
        if self.reduced_identical is not None:
            out["reduced_identical"] = self.reduced_identical
        return out


@dataclass(frozen=True)
class DetectorRun:
    """A faulted run under one detector configuration, trained or derived from the run without detectors."""

    alarm: FirstAlarm | None
    last_step: int
    fired: int
    """Corruptions the injector applied, all ranks."""
    flags: dict[str, int]
    derived: str | None = None
    """The fact of the run without detectors that proved this one silent, when it was not trained
    (``detectors.silence_shown_by``); not written when None."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"alarm": None if self.alarm is None else self.alarm.to_dict(),
                               "last_step": self.last_step, "fired": self.fired, "flags": self.flags}
        if self.derived is not None:
            out["derived"] = self.derived
        return out


@dataclass(frozen=True)
class BaselineRun:
    """The faulted run without detectors: the outcome (benign or silent, its size) and the baselines' series."""

    alarm: FirstAlarm | None
    last_step: int
    fired: int
    flags: dict[str, int]
    end: EndState
    benign_at: int | None
    """The step after which the run was back on the clean run's state (the rest is the clean run), or None."""

    def to_dict(self) -> dict[str, Any]:
        return {"alarm": None if self.alarm is None else self.alarm.to_dict(), "last_step": self.last_step,
                "fired": self.fired, "flags": self.flags, **self.end.to_dict(), "benign_at": self.benign_at}


@dataclass(frozen=True)
class FaultRecord:
    """Every run of one compute fault."""

    fault: FaultSpec
    start: int
    """Where the run without detectors started (its series' first step)."""
    end: int
    none: BaselineRun
    runs: dict[str, DetectorRun]
    seconds: float = 0.0
    world: int = 0
    """The world (process group) that ran it."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "fault", "fault": self.fault.to_dict(), "start": self.start, "end": self.end,
                "none": self.none.to_dict(), "runs": {name: run.to_dict() for name, run in self.runs.items()},
                "seconds": self.seconds, "world": self.world}


@dataclass(frozen=True)
class VerifiedResume:
    """sdcguard's side of a checkpoint fault: the agent's verified resume and the pipeline's choice."""

    resumed: int | None
    refused: str | None
    """Why the agent refused the checkpoint (the start of its CheckpointCorrupt), or None."""
    rollback_step: int | None
    rollback_ok: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class UnverifiedLoad:
    """What a loader that trusts the bytes does with the corrupted checkpoint: fail loudly, or train on."""

    loud: bool
    problem: str | None
    wrong_step: bool
    end: EndState | None = None
    """The training after the load, when it was not loud."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loud": self.loud, "problem": self.problem, "wrong_step": self.wrong_step}
        if self.end is not None:
            out.update(self.end.to_dict())
        return out


@dataclass(frozen=True)
class CheckpointFaultRecord:
    """A checkpoint fault: the corrupted object, the verified resume, and a loader without checks."""

    fault: FaultSpec
    fired: int
    landed: list[int] | None
    """(object size, byte offset) of the first flipped byte, on the rank that flipped it."""
    verified: VerifiedResume
    unverified: UnverifiedLoad
    seconds: float = 0.0
    world: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "checkpoint_fault", "fault": self.fault.to_dict(), "fired": self.fired,
                "landed": self.landed, "verified": self.verified.to_dict(), "unverified": self.unverified.to_dict(),
                "seconds": self.seconds, "world": self.world}


@dataclass(frozen=True)
class SoakRecord:
    """Clean training at the defaults: false alarms, the guard's flags, and the baselines' series."""

    steps: int
    rank_steps: int
    seconds: float
    alarms: list[SoakAlarm]
    flags: dict[str, int]
    mean_losses: list[float]
    """The loss per step, averaged over the ranks."""
    norms: Series

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "soak", "steps": self.steps, "rank_steps": self.rank_steps, "seconds": self.seconds,
                "alarms": [a.to_dict() for a in self.alarms], "flags": self.flags,
                "mean_losses": self.mean_losses, "norms": self.norms}


Record = ReferenceRecord | CleanChecksRecord | FaultRecord | CheckpointFaultRecord | SoakRecord
"""One line of ``runs.<world>.jsonl``."""
