"""The drill's training runs: the job every run trains, the fault-free one several drills can share.

Every run of a drill is the same job (steps, seed, checkpoint cadence, guard
settings, sharding); only where it runs, where its checkpoints go and what is
injected differ. A run counts as finished when every rank ends with the same
weights-and-optimizer fingerprint.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sdcguard.infra.drill.cluster import placements
from sdcguard.infra.drill.failure import DrillFailed
from sdcguard.infra.drill.job_run import JobRun, Placement, RunResult, Trainer
from sdcguard.infra.drill.options import DrillOptions
from sdcguard.infra.drill.report import Say, Story
from sdcguard.infra.drill.stage import Stage

REPLAY_FACTORY = "sdcguard.agent.testing.train:replay_model"
"""The drill's job's capsule factory: on a localised alarm the agent writes a replay capsule naming it, which the
pipeline's node checks replay on the suspect and on its replacement (the job keeps ``sdcguard.agent.testing.train``'s default sizes,
so the factory needs no ``SDCGUARD_MODEL_SHAPE``)."""


def guard_settings(stage: Stage, options: DrillOptions) -> dict[str, Any]:
    """The ``GuardConfig`` fields every run of the drill's job gets: cadences, the stack's bus, the seeded job."""
    seeded = stage.seeded
    return {
        "audit_every": options.audit_every,
        "fingerprint_every": options.fingerprint_every,
        "event_bus": stage.outputs["EventBusName"],
        "hyperpod_cluster": seeded["hyperpod_cluster"],
        "eks_cluster": seeded["eks_cluster"],
        "namespace": seeded["namespace"],
        "job_name": seeded["job"],
        "publish_budget_s": 10.0,
        "capsule_factory": REPLAY_FACTORY,
    }


def job(stage: Stage, options: DrillOptions, name: str, prefix: str, where: list[Placement],
        inject: Mapping[int, str] | None = None) -> JobRun:
    """The drill's job as run ``name``: checkpoints under ``prefix``, on ``where``, with ``inject`` by rank."""
    return JobRun(name=name, checkpoint_prefix=prefix, placements=where, steps=options.steps,
                  guard=guard_settings(stage, options), ranks_per_node=options.ranks_per_node,
                  checkpoint_every=options.checkpoint_every, seed=options.seed, inject=dict(inject or {}),
                  sharding=options.sharding)


def run_clean(stage: Stage, options: DrillOptions, trainer: Trainer, work_dir: Path, *,
              say: Say = lambda line: None) -> RunResult:
    """A fault-free run of the drill's job on the cluster's current nodes, for several drills to share.

    Raises ValueError for bad options and :class:`DrillFailed` ("clean run")
    when it does not finish with one fingerprint on every rank.
    """
    options.validate()
    run = job(stage, options, "clean", f"s3://{stage.seeded['bucket']}/drill-clean/{uuid.uuid4().hex[:8]}",
              placements(stage))
    result = trainer.run(run, work_dir, progress=Story(say).progress("clean"))
    one_fingerprint(result, "clean run")
    return result


def one_fingerprint(result: RunResult, step: str) -> str:
    """The fingerprint every rank of ``result`` ended with; :class:`DrillFailed` (``step``) when they differ or it stopped."""
    prints = set(result.final_fingerprints)
    if not result.finished or len(prints) != 1 or None in prints:
        raise DrillFailed(step, f"the {result.run.name} run did not finish with one fingerprint on every rank "
                          f"(exit codes {result.exit_codes}):\n{result.log_tail()}")
    return str(prints.pop())
