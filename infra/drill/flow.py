"""The incident drill: set-up, clean run, faulty run, pipeline, decision, recovery, comparison.

``prepare`` (:mod:`sdcguard.infra.drill.setup`) seeds a simulated HyperPod cluster on a
running local stand-in and deploys the pipeline with the real deploy code
path; ``run_drill`` then plays one incident on it and returns its
:class:`~sdcguard.infra.drill.summary.DrillSummary`. A stage can serve several drills
in a row (the tests do): each drill writes its checkpoints under a prefix of
its own and runs on whatever nodes the cluster has by then.

The drill is split by idea: :mod:`~sdcguard.infra.drill.options` (what to inject and
how the job runs), :mod:`~sdcguard.infra.drill.setup` and :mod:`~sdcguard.infra.drill.stage`
(the stand-in, the cluster, the stack), :mod:`~sdcguard.infra.drill.cluster` (the
drill's own reads of the cluster), :mod:`~sdcguard.infra.drill.ledger_watch` (the
pipeline seen through the ledger), :mod:`~sdcguard.infra.drill.operator` (the operator
CLI and the prompt), :mod:`~sdcguard.infra.drill.runs` (the training runs) and
:mod:`~sdcguard.infra.drill.stages` (one method per stage, a typed result each). This
module plays the stages in order and writes the report;
:class:`~sdcguard.infra.drill.report.Story` says what happened. A drill that cannot
detect, localise or recover raises :class:`DrillFailed` naming the step that
failed; the summary built so far travels with it.

The fault lives in the faulty node's hardware: the drill registers it with
the stand-in (:mod:`sdcguard.infra.drill.hardware`), so the pipeline's node checks,
Kubernetes Jobs that replay the suspect's capsule on a node, meet it on that
node and nowhere else; the summary records what they said
(:mod:`sdcguard.infra.drill.node_checks`). With ``DrillOptions.replacement_faulty``
the stand-in's replacements inherit the fault, and the drill passes only if
the job never resumes onto one: a further replacement qualifies, or the
incident stops in NEEDS_ATTENTION with the failed node cordoned.

With ``DrillOptions.chaos`` a fraction of the pipeline's Kubernetes API and
SageMaker HyperPod calls fail transiently from the faulty run until the
incident ends (:mod:`sdcguard.infra.drill.chaos`); the drill must pass all the same.
"""

from __future__ import annotations

import time
from pathlib import Path

from sdcguard.infra.drill.cluster import placements
from sdcguard.infra.drill.failure import DrillFailed
from sdcguard.infra.drill.job_run import RunResult, Trainer, TrainerError
from sdcguard.infra.drill.operator import ask as _ask
from sdcguard.infra.drill.options import EXPECTED_DETECTOR, FAULTS, SHARDINGS, Decision, DrillOptions
from sdcguard.infra.drill.report import Marks, Say, Story, plot_losses, timeline_lines, write_report
from sdcguard.infra.drill.runs import run_clean
from sdcguard.infra.drill.setup import prepare
from sdcguard.infra.drill.stage import Stage
from sdcguard.infra.drill.stages import Drill, Outcome, Restart
from sdcguard.infra.drill.summary import DrillSummary

__all__ = [
    "FAULTS", "SHARDINGS", "Decision", "DrillFailed", "DrillOptions", "Stage", "placements", "prepare", "run_clean",
    "run_drill", "timeline",
]


def run_drill(stage: Stage, options: DrillOptions, work_dir: Path, *, trainer: Trainer | None = None,
              clean: RunResult | None = None, say: Say = lambda line: None) -> DrillSummary:
    """Play one incident on ``stage`` and return its summary (also written to ``work_dir``).

    ``trainer`` runs the training jobs (one is started for this drill when
    None; pass one started early to overlap its torch import with set-up).
    ``clean`` is a fault-free run of the same job to compare against (one is
    run when None); :func:`run_clean` makes one that several drills can share.

    Raises ValueError for options the drill cannot play and
    :class:`DrillFailed` naming the step (clean run, detection, localisation,
    pipeline, decision, recovery, comparison) that failed; its ``summary``
    holds what was known by then, and the report is written either way.
    """
    options.validate()
    work_dir.mkdir(parents=True, exist_ok=True)
    story = Story(say)
    outcome = Outcome(
        summary=DrillSummary(
            fault=options.fault,
            sharding=options.sharding,
            replacement_faulty=options.replacement_faulty,
            fault_rank=options.fault_rank,
            fault_step=options.fault_step,
            steps=options.steps,
            expected_detector=EXPECTED_DETECTOR[options.fault],
            decision=options.decision,
            hyperpod_cluster=stage.seeded["hyperpod_cluster"],
            stack=stage.stack_name,
            drill_seconds={},
            report_dir=str(work_dir),
        ),
        marks=Marks(fault_step=options.fault_step, alarm_step=None, suspect_window_start=None,
                    resumed_from_step=None),
    )
    try:
        try:
            if trainer is None:
                with Trainer(stage.env, work_dir / "ranks.log") as own:
                    _play(Drill(stage, options, work_dir, story, own, outcome, ask=_ask), clean)
            else:
                _play(Drill(stage, options, work_dir, story, trainer, outcome, ask=_ask), clean)
        except TrainerError as exc:
            raise DrillFailed("training", str(exc)) from exc
    except DrillFailed as exc:
        outcome.summary.verdict = "FAILED"
        outcome.summary.failed_step = exc.step
        outcome.summary.failure = exc.message
        exc.summary = outcome.summary
        raise
    finally:
        _write(work_dir, outcome, story)
    return outcome.summary


def _play(drill: Drill, clean: RunResult | None) -> None:
    """The drill's story, one stage after the other; each stage raises DrillFailed when its check fails."""
    before = drill.cluster_before()
    reference = drill.clean_run(clean, before)
    with drill.faulty_hardware(before):
        with drill.chaos():
            faulty = drill.faulty_run(before)
            waiting = drill.pipeline_to_reviewer(faulty)
            review = drill.review(waiting)
            ended = drill.pipeline_to_end(waiting, review)
        start = drill.incident_outcome(before, faulty, waiting, ended, review)
        if isinstance(start, Restart):  # else no new node qualified: the job stays suspended, nothing to compare
            recovered = drill.recovered_run(faulty, start)
            drill.comparison(reference, recovered, start, review)
    drill.summary.verdict = "PASSED"


def _write(work_dir: Path, outcome: Outcome, story: Story) -> None:
    began = time.monotonic()
    plot = work_dir / "losses.png"
    if outcome.curves:
        plot_losses(plot, outcome.curves, outcome.marks)
    outcome.seconds["report"] = round(time.monotonic() - began, 2)
    written = write_report(work_dir, outcome.summary, outcome.documents)
    if outcome.curves:
        written.append(plot)
    story.report(work_dir, written)


def timeline(summary: DrillSummary) -> list[str]:
    """The timeline rows of a summary (seconds after the alarm)."""
    return timeline_lines(summary.phase_seconds or {})
