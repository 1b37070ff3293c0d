"""What the guard does with an alarm: build it, write the suspects' replay capsules, publish it, apply the policy.

:class:`AlarmPolicy` turns a detector's :class:`~sdcguard.agent.decide.AlarmDecision`
into the contract's Alarm (sdcguard.agent.alarm's ``build_alarm``: the job's and the
ranks' identity, the last clean steps), and :meth:`AlarmPolicy.handle` does
what ``on_alarm`` asks once one is raised: the update skipped, a replay
capsule of each localised suspect whose step a recomputation on another node
disagreed with (its location in the alarm's message), the alarm published by
one rank while the others wait, then "continue", "raise" (GuardAlarm) or
"stop" (exit with ALARM_EXIT_CODE).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from sdcguard.agent.alarm import RankIdentity, build_alarm
from sdcguard.agent.config import ALARM_EXIT_CODE, GuardConfig
from sdcguard.agent.data_parallel import DataParallel
from sdcguard.agent.decide import AlarmDecision
from sdcguard.agent.publisher import Publisher, PublishOutcome
from sdcguard.agent.topology import Topology
from sdcguard.contract import Alarm, LastClean

if TYPE_CHECKING:
    from sdcguard.agent.parallelism import Parallelism

log = logging.getLogger(__name__)


class GuardAlarm(RuntimeError):
    """Raised by ``SDCGuard.step`` under ``on_alarm="raise"``; ``.alarm`` is the published alarm."""

    def __init__(self, alarm: Alarm) -> None:
        super().__init__(f"SDC alarm at step {alarm.step} ({alarm.detector.value}): suspects {alarm.suspect_ranks}")
        self.alarm = alarm


class AlarmPolicy:
    """The guard's alarms: how each is built, what is done once one is raised, and every one raised so far.

    ``config`` is read at every alarm (the guard may turn checks off before the first step: its settings
    then are the parallelism's ``job.config``)."""

    def __init__(self, parallel: Parallelism, *, topology: Topology, identities: Sequence[RankIdentity], run_id: int,
                 publisher: Publisher, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                 group: dist.ProcessGroup | None) -> None:
        self.parallel = parallel
        self.topology = topology
        self.identities = list(identities)
        self.run_id = run_id
        self.publisher = publisher
        self.optimizer = optimizer
        self.scaler = scaler
        self.group = group
        self.raised: list[Alarm] = []
        """Every alarm raised, in order (with its capsule's note, on the publishing rank)."""
        self._capsule_unset_logged = False

    @property
    def config(self) -> GuardConfig:
        return self.parallel.job.config

    def build(self, step: int, said: AlarmDecision, last_clean: Mapping[str, int | None]) -> Alarm:
        """The contract's Alarm of ``said`` at ``step`` (its id the same on every rank); ``pydantic``'s
        ValidationError, naming the field, if something does not fit the contract."""
        return build_alarm(
            alarm_id=f"{self.run_id:016x}-{step}-{said.detector.value}",
            config=self.config,
            topology=self.topology,
            identities=self.identities,
            detector=said.detector,
            step=step,
            suspects=said.suspects,
            localized=said.localized and bool(said.suspects),
            evidence=said.evidence,
            last_clean=LastClean(**last_clean),
            message=said.message,
            fault_persistence=said.persistence,
        )

    def handle(self, alarm: Alarm) -> tuple[Alarm, PublishOutcome | None]:
        """Skip the update, publish from one rank (after writing a replay capsule where one applies: its
        location goes into the message), wait for it, then apply the policy: returns the alarm as published
        and, on the publishing rank, what became of it (under "continue"); raises GuardAlarm ("raise") or
        SystemExit(ALARM_EXIT_CODE) ("stop"). Every rank calls it with the same alarm."""
        self.optimizer.zero_grad(set_to_none=True)
        # Every rank: under a mesh the capsule's state is gathered by all (the note is the publisher's alone).
        note = self.capsule_note(alarm)
        if self.topology.rank == alarm.publisher_rank and note:
            # The alarm's message is capped (1024 characters): the capsule's sentence is kept whole.
            head = alarm.message[:max(0, 1022 - len(note))]
            alarm = alarm.model_copy(update={"message": f"{head}; {note}" if head else note[:1024]})
        self.raised.append(alarm)
        log.error("SDC alarm at step %d by %s: suspects %s (%s)", alarm.step, alarm.detector.value,
                  alarm.suspect_ranks, alarm.message)
        published = None
        if self.topology.rank == alarm.publisher_rank:
            published = self.publisher.publish(alarm)
        # The others wait for the publisher: under "stop", torchrun would
        # otherwise kill it when the first rank exits.
        if self.topology.world_size > 1:
            dist.barrier(group=self.group)
        if self.config.on_alarm == "raise":
            raise GuardAlarm(alarm)
        if self.config.on_alarm == "stop":
            log.error("stopping: exit code %d (on_alarm=stop)", ALARM_EXIT_CODE)
            sys.stderr.flush()
            raise SystemExit(ALARM_EXIT_CODE)
        return alarm, published

    def capsule_note(self, alarm: Alarm) -> str:
        """Write a replay capsule (sdcguard.agent.capsule) of each localised suspect whose own step a recomputation on
        another node disagreed with, before the alarm is published; on the publishing rank the sentence for
        the alarm's message ("" when none applies, and on every other rank). Never raises: a capsule that
        fails to be written is logged and said in the message, never a reason not to publish.

        Every rank calls it with the same alarm. Under DDP only the publishing rank works, with no
        collective: the alarm skipped the update, so the module's weights are still the ones the failing
        step started from, and the healthy result is this (non-suspect) rank's recomputation of the
        suspect's step. Under a mesh (FSDP2, HSDP) every rank agrees whether a capsule is due and gathers
        the unsharded state, and the publishing rank recomputes the step on the factory's plain model
        (sdcguard.agent.sharded_capsule)."""
        cfg = self.config
        evidence = alarm.evidence
        # Only a recomputation-based alarm's evidence holds pairs (the audit's) or confirmations.
        pairs = [*getattr(evidence, "pairs", []), *getattr(evidence, "confirmation", [])]
        if not (alarm.localized and pairs):
            return ""  # not a recomputation-based, localised alarm
        disagreed = {p.audited for p in pairs if not p.loss_match or p.mismatched_params}
        rank_of = {ident.global_rank: r for r, ident in enumerate(self.identities)}
        nodes = {rank_of.get(s.global_rank, s.global_rank): s.node for s in alarm.suspects}
        # From the alarm alone, so every rank names the same suspects.
        suspects = [r for r in sorted(nodes) if r in disagreed and r != alarm.publisher_rank]
        if not suspects:
            return ""  # e.g. an auditor blamed for its recomputation of another rank's step
        publishing = self.topology.rank == alarm.publisher_rank
        if not cfg.capsule_factory and publishing and not self._capsule_unset_logged:
            # Said once per guard in the log, not in every alarm.
            self._capsule_unset_logged = True
            log.warning("no replay capsule for localised alarms: capsule_factory (SDCGUARD_CAPSULE_FACTORY) "
                        "is unset; see docs/replay.md")
        parallel = self.parallel
        origins = {s: {"alarm_id": alarm.alarm_id, "detector": alarm.detector.value, "suspect_rank": str(s),
                       "node": nodes[s], "written_by_rank": str(alarm.publisher_rank)} for s in suspects}
        if not isinstance(parallel, DataParallel):
            from sdcguard.agent.sharded import ShardedDataParallel
            from sdcguard.agent.sharded_capsule import write_sharded_capsules  # only on an alarm

            assert isinstance(parallel, ShardedDataParallel)
            try:
                written = write_sharded_capsules(parallel, step=alarm.step, suspects=suspects,
                                                 publisher=alarm.publisher_rank, origins=origins)
            except Exception as exc:  # the alarm is published whatever became of its capsule
                log.exception("step %d: no replay capsule of rank(s) %s", alarm.step, suspects)
                written = {s: f"no replay capsule: gathering the state failed ({type(exc).__name__}: {exc})"
                           for s in suspects} if publishing else {}
            if not publishing or not cfg.capsule_factory:
                return ""
            return capsule_sentence(alarm.step, suspects, written)
        if not (publishing and cfg.capsule_factory):
            return ""
        from sdcguard.agent.capsule import Expected, ReplaySettings, write_capsule  # only on an alarm
        from sdcguard.agent.determinism import environment_signature

        notes: dict[int, str] = {}
        for suspect in suspects:
            try:
                batches = parallel.job.micro_batches(alarm.step, suspect)
                healthy = parallel._recompute(alarm.step, suspect, batches)
                module = parallel.model.module
                written_one = write_capsule(
                    cfg.checkpoint_prefix, module=module, batches=batches,
                    settings=ReplaySettings.capture(
                        module, seed=cfg.seed, step=alarm.step, rank=suspect, autocast_dtype=cfg.autocast_dtype,
                        grad_scale=None if self.scaler is None else getattr(self.scaler, "_scale", None),
                        eager=cfg.product_checks),
                    expected=Expected.from_recomputation(healthy), signature=environment_signature(parallel.device),
                    factory=cfg.capsule_factory, cap_bytes=cfg.capsule_max_bytes, origin=origins[suspect])
                notes[suspect] = written_one.describe()
            except Exception as exc:  # the alarm is published whatever became of its capsule
                log.exception("step %d: the replay capsule of rank %d was not written", alarm.step, suspect)
                notes[suspect] = f"no replay capsule: writing it failed ({type(exc).__name__}: {exc})"
        return capsule_sentence(alarm.step, suspects, notes)


def capsule_sentence(step: int, suspects: list[int], notes: Mapping[int, str]) -> str:
    """Each suspect's capsule note, logged, joined into the alarm's sentence."""
    said = []
    for suspect in suspects:
        note = notes.get(suspect, "no replay capsule: none was written")
        (log.warning if note.startswith("no ") else log.info)("step %d, rank %d: %s", step, suspect, note)
        said.append(f"rank {suspect}: {note}" if len(suspects) > 1 else note)
    return "; ".join(said) + "."
