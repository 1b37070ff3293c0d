"""The drill's stages, one method each, each returning a typed result the next stage takes.

cluster as found → fault-free run → faulty run → pipeline to the reviewer →
the review → pipeline to its end → what the incident left → recovered run →
comparison. A stage checks what it is responsible for and raises
:class:`~sdcguard.infra.drill.failure.DrillFailed` naming the step when the check
fails; every stage writes what it learned into the drill's summary first, so
a failed drill still reports it. :mod:`sdcguard.infra.drill.flow` plays them in order.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sdcguard.contract import Alarm, Incident, IncidentState
from sdcguard.contract.naming import node_name as hyperpod_node_name
from sdcguard.infra.drill import node_checks
from sdcguard.infra.drill.chaos import incident_history, summarise
from sdcguard.infra.drill.cluster import (
    check_held,
    check_released,
    check_replaced,
    instance_of,
    job_suspended,
    node,
    placements,
)
from sdcguard.infra.drill.failure import DrillFailed
from sdcguard.infra.drill.hardware import faulty_node, injections
from sdcguard.infra.drill.job_run import JobRun, Placement, RunResult, Trainer
from sdcguard.infra.drill.ledger_watch import ENDS, WAITING, IncidentWatch, entered_at, incidents_since
from sdcguard.infra.drill.operator import run_operator
from sdcguard.infra.drill.options import DrillOptions
from sdcguard.infra.drill.report import LossCurve, Marks, Story, phase_seconds
from sdcguard.infra.drill.runs import job, one_fingerprint
from sdcguard.infra.drill.stage import Stage, aws_environment
from sdcguard.infra.drill.summary import DrillSummary, Published, ReplacementRow

Ask = Callable[[Incident], tuple[str, str]]
"""Asks a reviewer about an incident waiting for approval: (decision, reason)."""


@dataclass
class Outcome:
    """What a drill has learned so far: the summary, the report's documents, the loss curves and marks."""

    summary: DrillSummary
    marks: Marks
    documents: dict[str, Any] = field(default_factory=dict)
    curves: list[LossCurve] = field(default_factory=list)

    @property
    def seconds(self) -> dict[str, float]:
        """How long each part of the drill took (the summary's ``drill_seconds``)."""
        return self.summary.drill_seconds


# -- what each stage hands the next --------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterBefore:
    """The job's placement before the drill, and the node the fault will be on."""

    placements: list[Placement]
    fault_node: str


@dataclass(frozen=True)
class CleanRun:
    """The fault-free run's final weights-and-optimizer fingerprint."""

    fingerprint: str


@dataclass(frozen=True)
class FaultyRun:
    """The faulty run's alarm, where its checkpoints went and what was injected."""

    alarm: Alarm
    prefix: str
    inject: dict[int, str]


@dataclass(frozen=True)
class AwaitingReviewer:
    """The incident waiting for the reviewer, and the resume pointer at that moment."""

    watch: IncidentWatch
    incident: Incident
    store: Any
    pointer_before: Any


@dataclass(frozen=True)
class Review:
    """What the reviewer decided, and why."""

    decision: str
    reason: str


@dataclass(frozen=True)
class IncidentEnded:
    """The incident in the state it ended in, and the node checks it recorded."""

    incident: Incident
    checks: list[Any] = field(default_factory=list)
    """``NodeCheckRow``s: the reproduction on the suspect and every qualification of a new node."""


@dataclass(frozen=True)
class Restart:
    """Where the recovered run starts: the nodes the job has now, the pointer's step, the injection left."""

    placements: list[Placement]
    step: int
    inject: dict[int, str]


@dataclass(frozen=True)
class JobHeld:
    """No new node qualified: the incident stopped for attention with the job suspended, so nothing restarts."""

    incident_state: str
    cordoned: list[str]


@dataclass(frozen=True)
class RecoveredRun:
    """The recovered run's final fingerprint."""

    fingerprint: str


@dataclass(frozen=True)
class Comparison:
    """The recovered run against the fault-free one: equal bit for bit, and the words the drill said."""

    bit_exact: bool
    verdict: str


def _at(alarm_at: float, seconds_after: float | None) -> float | None:
    return None if seconds_after is None else alarm_at + seconds_after


# -- the stages -------------------------------------------------------------------------------------------


@dataclass
class Drill:
    """One drill in progress: what every stage needs, and the summary the stages fill in."""

    stage: Stage
    options: DrillOptions
    work_dir: Path
    story: Story
    trainer: Trainer
    outcome: Outcome
    ask: Ask
    """How ``--interactive`` asks for the decision (the operator's prompt; a test passes its own reviewer)."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    node_faults: Any = None
    """The stand-in's node hardware faults while :meth:`faulty_hardware` holds them."""

    @property
    def summary(self) -> DrillSummary:
        """The summary so far."""
        return self.outcome.summary

    def _job(self, name: str, prefix: str, where: list[Placement], inject: dict[int, str]) -> JobRun:
        return job(self.stage, self.options, name, prefix, where, inject)

    def _keep(self, incident: Incident | None) -> None:
        """Put the incident as it stands (and its evidence) into the report, failed or not."""
        if incident is not None:
            self.outcome.documents["incident"] = incident.model_dump(mode="json")
            self.outcome.documents["evidence"] = incident.evidence

    def _wait(self, watch: IncidentWatch, states: frozenset[IncidentState]) -> Incident:
        try:
            incident = watch.wait(states, timeout=240)
        except TimeoutError as exc:
            self._keep(watch.current())
            raise DrillFailed("pipeline", str(exc)) from exc
        self._keep(incident)
        self.summary.incident_state = incident.state.value
        return incident

    # 1. the cluster as the drill finds it

    def cluster_before(self) -> ClusterBefore:
        """The job's placement before the drill, and the node the fault will be on."""
        options = self.options
        before = placements(self.stage)
        if len(before) != options.nodes:
            raise DrillFailed("set-up", f"the job runs on {len(before)} nodes, the drill needs {options.nodes}")
        fault_node = before[options.fault_rank // options.ranks_per_node].node_name
        self.summary.old_instances = [instance_of(p.node_name) for p in before]
        self.summary.fault_instance = instance_of(fault_node)
        return ClusterBefore(before, fault_node)

    @contextlib.contextmanager
    def faulty_hardware(self, before: ClusterBefore) -> Iterator[None]:
        """The fault node's GPU faulty on the stand-in inside the block, so the node checks' Jobs there meet the
        fault the faulty rank met; with ``replacement_faulty`` every replacement of it is faulty too."""
        options = self.options
        spec = options.injection(before.fault_node)
        with faulty_node(self.stage, before.fault_node, spec,
                         replacements_inherit=options.replacement_faulty) as faults:
            self.story.faulty_hardware(before.fault_node, spec, options.replacement_faulty)
            self.node_faults = faults
            try:
                yield
            finally:
                self.node_faults = None

    # 2. the fault-free run

    def clean_run(self, clean: RunResult | None, before: ClusterBefore) -> CleanRun:
        """The reference run's fingerprint (running it, or checking that ``clean`` is the same job)."""
        options = self.options
        self.story.clean_run(options.nodes, options.ranks_per_node, options.steps, options.checkpoint_every,
                             options.sharding)
        if clean is None:
            clean = self.trainer.run(
                self._job("clean", f"s3://{self.stage.seeded['bucket']}/drill-clean/{self.run_id}",
                          before.placements, {}),
                self.work_dir, progress=self.story.progress("clean"))
            self.outcome.seconds["clean_run"] = round(clean.seconds, 2)
        else:
            expected = self._job("clean", clean.run.checkpoint_prefix, list(clean.run.placements), {})
            if (clean.run.steps, clean.run.seed, clean.run.checkpoint_every, clean.run.world_size, clean.run.guard,
                    clean.run.sharding) != (expected.steps, expected.seed, expected.checkpoint_every,
                                            expected.world_size, expected.guard, expected.sharding):
                raise ValueError("clean: the given fault-free run is not the same job as this drill's")
            self.story.clean_reused(clean.log_path.parent)
        fingerprint = one_fingerprint(clean, "clean run")
        self.summary.clean_fingerprint = fingerprint
        self.outcome.curves.append(LossCurve("clean", *clean.mean_losses()))
        self.story.clean_done(fingerprint, clean.seconds)
        return CleanRun(fingerprint)

    # 3. the same job with a fault on one rank's hardware

    def faulty_run(self, before: ClusterBefore) -> FaultyRun:
        """Run the job with the fault; the alarm must name the faulty rank alone and reach the bus."""
        options, summary, fault_node = self.options, self.summary, before.fault_node
        # Exactly the stack's guarded prefix: the pointer rewrite refuses any other, sub-prefixes included.
        # A stage may hold an earlier drill's checkpoints, pointer and spooled alarms there: start from nothing.
        prefix = f"s3://{self.stage.seeded['bucket']}/{self.stage.seeded['checkpoint_prefix']}"
        from sdcguard.lineage.store import open_store

        store = open_store(prefix, client=self.stage.client("s3"))
        for key in store.list():
            store.delete(key)
        inject = {options.fault_rank: options.injection(fault_node)}
        self.story.faulty_run(options.fault, options.fault_rank, fault_node, options.fault_step, prefix)
        faulty = self.trainer.run(self._job("faulty", prefix, before.placements, inject), self.work_dir,
                                  progress=self.story.progress("faulty"))
        self.outcome.seconds["faulty_run"] = round(faulty.seconds, 2)
        self.outcome.curves.append(LossCurve("faulty", *faulty.mean_losses()))
        alarm = faulty.alarm
        if alarm is None:
            raise DrillFailed("detection", f"the faulty run raised no alarm (exit codes {faulty.exit_codes}):\n"
                              f"{faulty.log_tail()}")
        self.outcome.documents["alarm"] = alarm.model_dump(mode="json")
        self.outcome.marks = Marks(options.fault_step, alarm.step, alarm.trusted_through_step() + 1, None)
        suspect_instances = sorted({instance_of(n) for n in alarm.suspect_nodes})
        summary.detector = alarm.detector.value
        summary.alarm_step = alarm.step
        summary.alarm_id = alarm.alarm_id
        summary.suspect_ranks = alarm.suspect_ranks
        summary.suspect_nodes = alarm.suspect_nodes
        summary.suspect_instances = suspect_instances
        summary.trusted_through_step = alarm.trusted_through_step()
        summary.published = Published.model_validate(faulty.published) if faulty.published else None
        summary.faulty_exit_codes = faulty.exit_codes
        self.story.alarm(alarm, faulty.exit_codes)
        delivered = bool(summary.published and summary.published.delivered)
        self.story.published(alarm.publisher_rank, self.stage.outputs["EventBusName"], delivered)
        localized = alarm.localized and alarm.suspect_ranks == [options.fault_rank] \
            and suspect_instances == [instance_of(fault_node)]
        summary.localized_correctly = localized
        if not localized:
            raise DrillFailed("localisation", f"the alarm blames ranks {alarm.suspect_ranks} on {alarm.suspect_nodes}; "
                              f"the fault was on rank {options.fault_rank} on {fault_node}")
        if not delivered:
            raise DrillFailed("detection", f"the alarm was not delivered to EventBridge: {faulty.published}")
        return FaultyRun(alarm, prefix, inject)

    # 4. the pipeline, up to the reviewer

    def pipeline_to_reviewer(self, faulty: FaultyRun) -> AwaitingReviewer:
        """Follow the incident to AWAITING_APPROVAL; by then the node must be cordoned and the job suspended."""
        from sdcguard.lineage.pointer import read_pointer
        from sdcguard.lineage.store import open_store

        self.story.pipeline()
        began = time.monotonic()
        watch = IncidentWatch(self.stage, faulty.alarm, self.story)
        self.summary.incident_id = watch.incident_id
        store = open_store(faulty.prefix, client=self.stage.client("s3"))
        waiting = self._wait(watch, frozenset({WAITING}))
        if waiting.state != WAITING:
            raise DrillFailed("pipeline", f"incident ended {waiting.state.value} before approval: {waiting.failure}")
        self.outcome.seconds["pipeline_to_approval"] = round(time.monotonic() - began, 2)
        pointer_before, _ = read_pointer(store)
        self.summary.pointer_before = pointer_before.checkpoint if pointer_before else None
        cordoned = all(node(self.stage, hyperpod_node_name(i)).spec.unschedulable for i in waiting.instance_ids)
        suspended = job_suspended(self.stage)
        self.story.contained(waiting.instance_ids, cordoned, suspended)
        if not (cordoned and suspended):
            raise DrillFailed("pipeline", f"containment incomplete: cordoned={cordoned}, suspended={suspended}")
        self._reproduction(waiting, watch.alarm_at, faulty.alarm.suspect_nodes[0])
        return AwaitingReviewer(watch, waiting, store, pointer_before)

    def _reproduction(self, waiting: Incident, alarm_at: float, suspect_node: str) -> None:
        """Before approval the suspect's capsule has been replayed on its node: a persistent fault reproduces on
        every repetition; an alarm without a capsule says the reproduction did not run."""
        options, summary = self.options, self.summary
        checks = node_checks.rows(waiting, alarm_at)
        summary.node_checks = checks
        result = node_checks.reproduction(checks, suspect_node)
        summary.suspect_reproduced, summary.suspect_reproduction = result.reproduced, result.line
        problem = node_checks.reproduction_problem(result, persistent=options.persistent,
                                                   leaves_capsule=options.leaves_capsule)
        if problem is not None:
            raise DrillFailed("reproduction", problem)

    # the decision, through the operator CLI

    def review(self, waiting: AwaitingReviewer) -> Review:
        """Show the incident as the reviewer sees it and answer it with ``sdcguard approve``/``reject``."""
        incident_id = waiting.watch.incident_id
        stack = ["--stack-name", self.stage.stack_name]
        began = time.monotonic()
        with aws_environment(self.stage.env):
            _, shown = run_operator(self.stage, ["incidents", *stack, "show", incident_id])
        self.story.waiting(incident_id, shown)
        decision: str = self.options.decision
        reason = self.options.reason
        if decision == "ask":
            self.kubectl_hints(waiting)
            decision, reason = self.ask(waiting.incident)
        self.summary.decision = decision
        self.story.reviewer(decision, incident_id, reason)
        with aws_environment(self.stage.env):
            status, answer = run_operator(self.stage, [decision, incident_id, "--reason", reason, *stack])
        self.story.answered(answer)
        if status != 0:
            raise DrillFailed("decision", f"sdcguard {decision} exited {status}: {' '.join(answer)}")
        self.outcome.seconds["review_and_decision"] = round(time.monotonic() - began, 2)
        return Review(decision, reason)

    def kubectl_hints(self, waiting: AwaitingReviewer) -> Path:
        """Write a kubeconfig for the drill's stand-in and show the kubectl lines that check the containment."""
        from sdcguard.infra.local.kubeconfig import operator_commands, write_kubeconfig

        seeded = self.stage.seeded
        path, _ = write_kubeconfig(seeded["eks_cluster"], self.work_dir / "kubeconfig", env=self.stage.env)
        lines = [line for instance in waiting.incident.instance_ids
                 for line in operator_commands("contained", hyperpod_node_name(instance), seeded["namespace"],
                                               seeded["job"])]
        self.story.kubectl(path, lines)
        return path

    # 5. replacement, pointer, resume (or release)

    def pipeline_to_end(self, waiting: AwaitingReviewer, review: Review) -> IncidentEnded:
        """Follow the incident to its end: CLOSED after an approval, FALSE_ALARM after a rejection.

        With ``replacement_faulty`` every replacement fails its qualification, so
        NEEDS_ATTENTION (no new node qualified) is the other right end after an approval."""
        began = time.monotonic()
        ended = self._wait(waiting.watch, ENDS)
        self.outcome.seconds["pipeline_after_decision"] = round(time.monotonic() - began, 2)
        approved = review.decision == "approve"
        want = {IncidentState.CLOSED} if approved else {IncidentState.FALSE_ALARM}
        if approved and self.options.replacement_faulty:
            want.add(IncidentState.NEEDS_ATTENTION)
        checks = node_checks.rows(ended, waiting.watch.alarm_at)
        self.summary.phase_seconds = phase_seconds({
            "alarm": waiting.watch.alarm_at,
            "cordon": entered_at(ended, IncidentState.CORDONED),
            "reproduced": _at(waiting.watch.alarm_at, node_checks.finished_at(checks, "reproduce")),
            "approval": entered_at(ended, IncidentState.APPROVED if approved else IncidentState.REJECTED),
            "replaced": entered_at(ended, IncidentState.REPLACED),
            "qualified": _at(waiting.watch.alarm_at, node_checks.finished_at(checks, "qualify")),
            "resumed": entered_at(ended, IncidentState.RESUMED) or entered_at(ended, IncidentState.FALSE_ALARM),
        })
        self._qualification(checks)
        if ended.state not in want:
            raise DrillFailed("pipeline", f"incident ended {ended.state.value}, not "
                              f"{' or '.join(sorted(w.value for w in want))}: {ended.failure}")
        return IncidentEnded(ended, checks)

    def _qualification(self, checks: list[Any]) -> None:
        """What the qualifications said, into the summary; each must match what the drill knows of the node.

        A healthy replacement must pass; one that inherited the fault must fail. An alarm without a capsule
        leaves nothing to qualify with, and the pipeline says so."""
        summary, options = self.summary, self.options
        summary.node_checks = checks
        result = node_checks.qualification(checks)
        summary.replacement_qualified, summary.replacement_qualification = result.qualified, result.line
        faults = self.node_faults
        wrong = []
        for check in (c for c in checks if c.purpose == "qualify"):
            verdict = node_checks.qualified(check)
            if not options.leaves_capsule or verdict is None:
                continue  # no capsule: nothing to judge the node with (checked against the resume below)
            faulty = faults is not None and faults.for_node(check.node) is not None
            if verdict == faulty:  # passed on a faulty node, or failed on a healthy one
                wrong.append(f"{check.node} ({'faulty' if faulty else 'healthy'}) "
                             f"{'passed' if verdict else 'failed'} its qualification: {check.summary or check.state}")
        if wrong:
            raise DrillFailed("qualification", "; ".join(wrong))

    @contextlib.contextmanager
    def chaos(self) -> Iterator[None]:
        """With ``options.chaos``: the chaos knobs on inside, off after; the tally goes into the summary.

        Under chaos the ledger must also hold exactly one incident for the job
        from this drill, however often the calls around it were retried.
        """
        rate = self.options.chaos
        if not rate:
            yield
            return
        knobs = self.stage.chaos
        knobs.on(rate, self.options.chaos_seed)
        self.story.chaos_on(rate, self.options.chaos_seed)
        began_at = datetime.now(UTC)
        try:
            yield
        finally:
            knobs.off()
            opened = incidents_since(self.stage, began_at)
            history = []
            if self.summary.incident_id is not None:
                history = incident_history(self.stage.client("stepfunctions"),
                                           self.stage.outputs["IncidentStateMachineArn"], self.summary.incident_id)
            self.summary.chaos = summarise(knobs, history, len(opened))
            self.story.chaos_tally(self.summary.chaos)
        if len(opened) != 1:
            raise DrillFailed("pipeline", f"the ledger opened {len(opened)} incidents for the job under chaos, "
                              f"not one: {', '.join(i.incident_id for i in opened) or 'none'}")

    def incident_outcome(self, before: ClusterBefore, faulty: FaultyRun, waiting: AwaitingReviewer,
                         ended: IncidentEnded, review: Review) -> Restart | JobHeld:
        """Check what the incident left on the cluster and the pointer; where the recovered run starts.

        After an approval the job must run on no new node that failed its
        qualification: either on a replacement that qualified (Restart), or
        not at all, suspended for attention with the failed nodes cordoned
        (JobHeld)."""
        from sdcguard.lineage.pointer import read_pointer

        summary, alarm, incident, fault_node = self.summary, faulty.alarm, ended.incident, before.fault_node
        pointer_after, _ = read_pointer(waiting.store)
        summary.pointer_after = pointer_after.checkpoint if pointer_after else None
        after = placements(self.stage)
        summary.new_instances = [instance_of(p.node_name) for p in after]
        summary.replacements = [ReplacementRow(old=r.old_instance_id, new=r.new_instance_id, status=r.status)
                                for r in incident.replacements]
        failed = node_checks.unqualified_nodes(ended.checks)
        if review.decision == "approve":
            summary.resumed_onto_unqualified = (incident.entered(IncidentState.RESUMED) is not None
                                                and any(p.node_name in failed for p in after))
            if incident.state == IncidentState.NEEDS_ATTENTION:
                return self._held(incident, failed)
            check_replaced(self.stage, incident, fault_node, after, summary.old_instances or [], failed)
            self._resumed_onto_qualified(after, ended.checks)
            if pointer_after is None or pointer_after.step > alarm.trusted_through_step():
                raise DrillFailed("pipeline", f"the resume pointer is {summary.pointer_after}, not at or before the "
                                  f"trusted step {alarm.trusted_through_step()}")
            if failed:
                summary.replacement_outcome = (f"{', '.join(failed)} failed qualification and was cordoned; a further "
                                               "replacement qualified and the job resumed onto it")
            self.story.replaced([(r.old_instance_id, r.new_instance_id) for r in incident.replacements],
                                summary.pointer_before, pointer_after.checkpoint)
            # The fault stays with the hardware: a rank on a node that still carries one (none, unless the job
            # resumed onto a faulty replacement) meets it again.
            inject = injections(self.node_faults, after, self.options.ranks_per_node,
                                self.options.fault_rank % self.options.ranks_per_node)
        else:
            check_released(self.stage, incident, fault_node, waiting.pointer_before, pointer_after)
            self.story.released(fault_node, summary.pointer_after)
            # A rejection treats the alarm as a false (transient) one: the resumed job runs without the fault.
            inject = {}
        if job_suspended(self.stage):
            raise DrillFailed("pipeline", "the job is still suspended after the incident ended")
        return Restart(after, pointer_after.step if pointer_after else 0, inject)

    def _held(self, incident: Incident, failed: list[str]) -> JobHeld:
        """NEEDS_ATTENTION after an approval: the job never resumed, it is suspended, every new node that failed
        its qualification is cordoned (:class:`DrillFailed` "pipeline" otherwise)."""
        cordoned, gone = check_held(self.stage, incident, failed)
        summary = self.summary
        replaced = f"; {', '.join(gone)} failed it too and {'was' if len(gone) == 1 else 'were'} replaced" if gone else ""
        summary.replacement_outcome = (f"NEEDS_ATTENTION: {', '.join(cordoned)} failed qualification and "
                                       f"{'is' if len(cordoned) == 1 else 'are'} cordoned{replaced}; "
                                       "the job stays suspended")
        summary.recovery_claim = ("none: no replacement qualified, so the incident stopped for attention and the job "
                                  "was not resumed onto an unqualified node")
        why = f"{incident.failure.error}: {incident.failure.cause}" if incident.failure else ""
        self.story.held(cordoned, gone, why)
        return JobHeld(incident.state.value, cordoned)

    def _resumed_onto_qualified(self, after: list[Placement], checks: list[Any]) -> None:
        """With a capsule, every new node the job runs on passed its qualification (:class:`DrillFailed`
        "qualification" otherwise); without one the pipeline could qualify none, and says so."""
        if not self.options.leaves_capsule:
            return
        old = set(self.summary.old_instances or [])
        passed = {c.node for c in checks if c.purpose == "qualify" and node_checks.qualified(c) is True}
        unqualified = [p.node_name for p in after if instance_of(p.node_name) not in old and p.node_name not in passed]
        if unqualified:
            raise DrillFailed("qualification", f"the job resumed onto {', '.join(unqualified)} without a passed "
                              "qualification")

    # the recovered run

    def recovered_run(self, faulty: FaultyRun, start: Restart) -> RecoveredRun:
        """Restart the job from the resume pointer on the nodes it has now; it must start there and not alarm."""
        self.story.restarting([p.node_name for p in start.placements], start.step)
        recovered = self.trainer.run(self._job("recovered", faulty.prefix, start.placements, start.inject),
                                     self.work_dir, progress=self.story.progress("recovered"))
        self.outcome.seconds["recovered_run"] = round(recovered.seconds, 2)
        self.outcome.curves.append(LossCurve("recovered", *recovered.mean_losses()))
        self.summary.resumed_from_step = recovered.resumed_from
        marks = self.outcome.marks
        self.outcome.marks = Marks(marks.fault_step, marks.alarm_step, marks.suspect_window_start,
                                   recovered.resumed_from)
        if recovered.alarm is not None:
            raise DrillFailed("recovery", f"the recovered run raised an alarm at step {recovered.alarm.step}: "
                              f"{recovered.alarm.message}")
        fingerprint = one_fingerprint(recovered, "recovery")
        if recovered.resumed_from != start.step:
            raise DrillFailed("recovery", f"the recovered run started at step {recovered.resumed_from}, "
                              f"not at the pointer's step {start.step}")
        return RecoveredRun(fingerprint)

    # 6. the comparison

    def comparison(self, clean: CleanRun, recovered: RecoveredRun, start: Restart, review: Review) -> Comparison:
        """After an approval the recovered run must equal the fault-free one bit for bit; after a rejection, no claim."""
        summary, start_step, decision = self.summary, start.step, review.decision
        clean_print, recovered_print = clean.fingerprint, recovered.fingerprint
        summary.recovered_fingerprint = recovered_print
        summary.recovered_bit_exact = recovered_print == clean_print
        if recovered_print == clean_print:
            verdict = "bit-identical"
        elif decision == "approve":
            verdict = "DIFFERENT"
        else:
            verdict = (f"different, as expected after a rejection: the checkpoint of step {start_step} "
                       "keeps whatever the fault did before the alarm")
        self.story.fingerprints(clean_print, recovered_print, verdict)
        if decision == "approve":
            summary.recovery_claim = "bit-exact: the recovered run must equal the fault-free run"
            if not summary.recovered_bit_exact:
                raise DrillFailed("comparison", "the recovered run's final state differs from the fault-free run")
        else:
            summary.recovery_claim = (
                "none: the reviewer rejected the alarm, so the job resumed from the pointer it had "
                f"(step {start_step}) on the same nodes; state the fault left in that checkpoint is kept"
            )
        return Comparison(summary.recovered_bit_exact, verdict)
