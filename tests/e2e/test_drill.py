"""The incident drill end to end: every fault kind is caught, contained, approved, replaced and recovered from.

One stand-in, one seeded 3-node cluster and one deployed stack serve every
case (each drill checkpoints under a prefix of its own and runs on whatever
nodes the cluster has by then), and one fault-free run is the reference for
all of them (the HSDP drill, whose job shards its weights, runs its own). The
jobs are short (20 steps, every check and checkpoint every 5 steps) so the
file stays within a few minutes on two cores.

The assertions are on what the drill observed in the system: the alarm the
agent published, the incident the pipeline left in the ledger (with the
node checks: the suspect's capsule replayed on its node, the replacement's
qualification), the HyperPod instances and Kubernetes nodes, the resume
pointer, and the recovered run's final fingerprint against the fault-free one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdcguard.cli import main
from sdcguard.infra.drill.flow import (
    DrillFailed,
    DrillOptions,
    Stage,
    placements,
    prepare,
    run_clean,
    run_drill,
)
from sdcguard.infra.drill.job_run import RunResult, Trainer
from sdcguard.infra.drill.summary import DrillSummary
from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lineage.pointer import read_pointer
from sdcguard.lineage.store import open_store
from sdcguard.lineage.verify import read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]

SHORT = DrillOptions(steps=20, fault_step=12, audit_every=5, fingerprint_every=5, checkpoint_every=5)


@pytest.fixture(scope="module")
def stage(standin: LocalStandIn) -> Stage:
    staged = prepare(standin, name=f"drill-{uuid.uuid4().hex[:6]}")
    staged.operator = main  # as `sdcguard drill` does: the operator's commands in this process
    return staged


@pytest.fixture(scope="module")
def trainer(stage: Stage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    with Trainer(stage.env, tmp_path_factory.mktemp("trainer") / "ranks.log") as running:
        yield running


@pytest.fixture(scope="module")
def clean(stage: Stage, trainer: Trainer, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run_clean(stage, SHORT, trainer, tmp_path_factory.mktemp("clean"))


def _drill(stage: Stage, trainer: Trainer, clean: RunResult, tmp_path: Path, **changes: Any) -> DrillSummary:
    options = DrillOptions(**{**SHORT.__dict__, **changes})
    return run_drill(stage, options, tmp_path, trainer=trainer, clean=clean)


def _phases_in_order(phase_seconds: dict[str, float | None] | None, names: list[str]) -> None:
    assert phase_seconds is not None
    seconds = [phase_seconds[n] for n in names]
    reached = [s for s in seconds if s is not None]
    assert reached == seconds, phase_seconds
    assert reached == sorted(reached), phase_seconds


# fault, the detector that must catch it, the step it must be caught at, the checkpoint resumed from.
# The finite activation error moves that rank's loss far enough for the magnitude trigger: its
# confirmation (a recomputation on another node) catches it at the fault step, not at the next audit.
APPROVED = [
    ("finite_activation", 3, "magnitude_trigger", 12, 10),
    ("nan_activation", 1, "nonfinite_grad", 12, 10),
    ("weight_bitflip", 4, "weight_fingerprint", 15, 10),
    ("grad_bitflip", 2, "ring_audit", 15, 10),
]


@pytest.mark.parametrize(("fault", "rank", "detector", "alarm_step", "resumed"), APPROVED, ids=[a[0] for a in APPROVED])
def test_an_approved_incident_replaces_the_node_and_recovers_bit_exactly(
    stage: Stage, trainer: Trainer, clean: RunResult, tmp_path: Path,
    fault: str, rank: int, detector: str, alarm_step: int, resumed: int,
) -> None:
    # Given the job on the cluster's current nodes, with the fault on one rank's GPU,
    before = [p.node_name for p in placements(stage)]
    faulty_node = before[rank // 2]

    # when the drill runs the faulty job and a reviewer approves,
    summary = _drill(stage, trainer, clean, tmp_path, fault=fault, fault_rank=rank)

    # the right detector caught it at the right step and blamed that rank on that node alone,
    assert summary.verdict == "PASSED"
    assert (summary.detector, summary.alarm_step) == (detector, alarm_step)
    assert summary.suspect_ranks == [rank]
    assert summary.suspect_instances == [faulty_node.removeprefix("hyperpod-")]
    assert summary.localized_correctly is True
    # the pipeline closed the incident with that node (and only it) replaced,
    assert summary.incident_state == "CLOSED"
    after = [p.node_name for p in placements(stage)]
    assert [a == b for a, b in zip(before, after, strict=True)] == [i != rank // 2 for i in range(3)]
    assert summary.new_instances == [n.removeprefix("hyperpod-") for n in after]
    (replacement,) = summary.replacements or []
    assert replacement.old == faulty_node.removeprefix("hyperpod-")
    assert f"hyperpod-{replacement.new}" == after[rank // 2]
    # the pointer went back to the last checkpoint before the suspect window,
    assert summary.trusted_through_step == resumed
    assert summary.pointer_after == f"checkpoints/step-{resumed:09d}"
    pointer, _ = read_pointer(open_store(_prefix(tmp_path), client=stage.client("s3")))
    assert pointer is not None
    # (the recovered run has checkpointed to the end since; the pipeline's rollback is in the history)
    assert pointer.step == SHORT.steps
    rollback = [h for h in pointer.history if h.incident_id == summary.incident_id]
    assert [h.step for h in rollback] == [resumed]
    # and the job, restarted from it on the new node set, ended bit-identical to the fault-free run.
    assert summary.resumed_from_step == resumed
    assert summary.recovered_bit_exact is True
    assert summary.recovered_fingerprint == summary.clean_fingerprint == clean.final_fingerprints[0]
    # Before approval the suspect's capsule, replayed on its cordoned node, met the persistent fault on every
    # repetition; the replacement replayed it with the healthy bits. The weight flip's alarm comes from no
    # recomputation, so it leaves no capsule, and both checks say they did not run.
    checks = {(c.purpose, c.node): c for c in summary.node_checks or []}
    if fault == "weight_bitflip":
        assert summary.suspect_reproduced is None
        assert (summary.suspect_reproduction or "").startswith("not run")
        assert summary.replacement_qualified is None
        _phases_in_order(summary.phase_seconds, ["alarm", "cordon", "approval", "replaced", "resumed"])
    else:
        assert (summary.suspect_reproduced, summary.suspect_reproduction) == ("5/5", "reproduced 5/5: persistent")
        assert checks["reproduce", faulty_node].state == "failed"
        assert summary.replacement_qualified is True
        assert checks["qualify", after[rank // 2]].state == "passed"
        _phases_in_order(summary.phase_seconds,
                         ["alarm", "cordon", "reproduced", "approval", "replaced", "qualified", "resumed"])
    # The report holds the summary, the alarm, the incident, its evidence and the plot.
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["recovered_bit_exact"] is True
    assert (written["suspect_reproduced"], written["replacement_qualified"]) == (
        (None, None) if fault == "weight_bitflip" else ("5/5", True))
    assert json.loads((tmp_path / "incident.json").read_text())["state"] == "CLOSED"
    assert json.loads((tmp_path / "alarm.json").read_text())["detector"] == detector
    assert (tmp_path / "evidence.json").exists()
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _prefix(work_dir: Path) -> str:
    spec = json.loads((work_dir / "faulty" / "spec.json").read_text())
    return str(spec["guard"]["checkpoint_prefix"])


def test_under_hsdp_an_approved_incident_recovers_bit_exactly_from_sharded_checkpoints(
    stage: Stage, trainer: Trainer, tmp_path: Path
) -> None:
    # Given the job under HSDP (each node holds one replica of the model, sharded over its 2 ranks) and a
    # persistent finite error on rank 3's GPU,
    before = [p.node_name for p in placements(stage)]

    # when the drill runs it (with a fault-free HSDP run of its own to compare with) and a reviewer approves,
    options = DrillOptions(**{**SHORT.__dict__, "sharding": "hsdp", "fault_rank": 3, "steps": 16})
    summary = run_drill(stage, options, tmp_path, trainer=trainer)

    # the magnitude trigger's confirmation (ranks 1 and 5 recompute rank 3's micro-batch) caught it at its own
    # step, naming rank 3 alone,
    assert (summary.verdict, summary.sharding) == ("PASSED", "hsdp")
    assert (summary.detector, summary.alarm_step, summary.suspect_ranks) == ("magnitude_trigger", 12, [3])
    assert summary.suspect_instances == [before[1].removeprefix("hyperpod-")]
    # the pipeline replaced its node and moved the pointer back to the sharded checkpoint of step 10,
    assert summary.incident_state == "CLOSED"
    assert [r.old for r in summary.replacements or []] == [before[1].removeprefix("hyperpod-")]
    assert (summary.trusted_through_step, summary.pointer_after) == (10, "checkpoints/step-000000010")
    manifest = read_manifest(open_store(_prefix(tmp_path), client=stage.client("s3")), 10)
    assert manifest.sharding is not None
    assert (manifest.sharding.replicas, manifest.sharding.shards) == (3, 2)
    assert any(o.name.endswith(".distcp") for o in manifest.objects)
    # and the job, resumed from it on the new node set, ended bit-identical to the fault-free HSDP run.
    assert summary.resumed_from_step == 10
    assert summary.recovered_bit_exact is True
    assert summary.recovered_fingerprint == summary.clean_fingerprint
    # and the sharded capsule reproduced the fault on the suspect and qualified the replacement.
    assert (summary.suspect_reproduced, summary.replacement_qualified) == ("5/5", True)


def test_a_rejected_incident_releases_the_node_and_resumes_from_the_pointer_it_had(
    stage: Stage, trainer: Trainer, clean: RunResult, tmp_path: Path
) -> None:
    before = [p.node_name for p in placements(stage)]

    summary = _drill(stage, trainer, clean, tmp_path, fault="finite_activation", fault_rank=5, decision="reject")

    assert summary.verdict == "PASSED"
    assert summary.localized_correctly is True
    assert summary.incident_state == "FALSE_ALARM"
    # nothing replaced: the same nodes, the suspect one schedulable again,
    assert summary.replacements == []
    assert [p.node_name for p in placements(stage)] == before
    assert summary.new_instances == summary.old_instances
    # the pointer left where the faulty run put it (its last checkpoint, inside the suspect window),
    assert summary.pointer_before == summary.pointer_after == "checkpoints/step-000000015"
    assert summary.resumed_from_step == 15
    # and no bit-exact claim: the updates of steps 12-14 were corrupted and are kept.
    assert (summary.recovery_claim or "").startswith("none:")
    assert summary.recovered_bit_exact is False
    assert (summary.phase_seconds or {})["replaced"] is None
    # The reproduction ran before the decision; nothing new arrived to qualify.
    assert summary.suspect_reproduced == "5/5"
    assert summary.replacement_qualified is None
    assert [c.purpose for c in summary.node_checks or []] == ["reproduce"]
    _phases_in_order(summary.phase_seconds, ["alarm", "cordon", "reproduced", "approval", "resumed"])


CHAOS_SEED = 12  # fails the first read of the job and the first patch of a node (5xx: state retries)


def test_under_chaos_every_fault_is_retried_and_the_drill_still_recovers_bit_exactly(
    stage: Stage, trainer: Trainer, clean: RunResult, tmp_path: Path
) -> None:
    # Given a fifth of the pipeline's Kubernetes API and HyperPod calls failing transiently (throttling, 5xx),
    before = [p.node_name for p in placements(stage)]

    # when the drill runs a fault through the pipeline and a reviewer approves,
    summary = _drill(stage, trainer, clean, tmp_path, fault="finite_activation", fault_rank=1, chaos=0.2,
                     chaos_seed=CHAOS_SEED)

    # the outcome is the one without chaos: one incident, one replacement, a bit-exact recovery,
    assert (summary.verdict, summary.incident_state, summary.recovered_bit_exact) == ("PASSED", "CLOSED", True)
    (replacement,) = summary.replacements or []
    assert replacement.old == before[0].removeprefix("hyperpod-")
    assert summary.recovered_fingerprint == clean.final_fingerprints[0]
    # and the report counts the faults and the retries that absorbed every one of them.
    chaos = summary.chaos
    assert chaos is not None
    assert (chaos.rate, chaos.seed, chaos.incidents_opened) == (0.2, CHAOS_SEED, 1)
    assert chaos.faults_injected > 0
    assert sum(sum(c.injected.values()) for c in chaos.by_call.values()) == chaos.faults_injected
    assert (chaos.retries_absorbed, chaos.not_retried) == (chaos.faults_injected, 0)
    assert json.loads((tmp_path / "summary.json").read_text())["chaos"]["faults_injected"] == chaos.faults_injected


def test_a_fault_that_is_never_detected_fails_the_drill_at_detection(
    stage: Stage, trainer: Trainer, clean: RunResult, tmp_path: Path
) -> None:
    # A fault bound to a node the job does not run on never fires.
    class Elsewhere(DrillOptions):
        def injection(self, node_name: str) -> str:
            return super().injection("hyperpod-i-00000000000000000")

    options = Elsewhere(**SHORT.__dict__)
    with pytest.raises(DrillFailed) as failed:
        run_drill(stage, options, tmp_path, trainer=trainer, clean=clean)

    assert failed.value.step == "detection"
    written = json.loads((tmp_path / "summary.json").read_text())
    assert (written["verdict"], written["failed_step"]) == ("FAILED", "detection")
    assert "no alarm" in written["failure"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fault", "finite_activation", "--fault-step", "5"], "--fault-step: must be after the first checkpoint"),
        (["--fault-rank", "6"], "--fault-rank: must be a rank from 0 to 5"),
        (["--steps", "40"], "give --steps above 40"),
        (["--chaos", "1"], "--chaos: must be a fraction of calls from 0 up to (not including) 1"),
    ],
)
def test_the_command_refuses_options_it_cannot_play_before_starting_anything(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["drill", *argv]) == 1
    assert message in capsys.readouterr().err


REQUIRED_KEYS = {
    "fault", "detector", "fault_rank", "fault_step", "alarm_step", "suspect_ranks", "suspect_instances",
    "localized_correctly", "old_instances", "new_instances", "resumed_from_step", "recovered_bit_exact",
    "incident_state", "phase_seconds", "node_checks", "suspect_reproduced", "replacement_qualified",
}


def test_the_command_runs_a_whole_drill_and_prints_only_the_summary_with_json(tmp_path: Path) -> None:
    # The command as `./dev drill` runs it, in a process of its own (it starts its own stand-in).
    report = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "sdcguard", "drill", "--json", "--steps", "30", "--fault-step", "12",
         "--report", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )

    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)  # nothing but the summary on stdout
    assert set(summary) >= REQUIRED_KEYS
    assert (summary["verdict"], summary["incident_state"], summary["recovered_bit_exact"]) == ("PASSED", "CLOSED", True)
    # Caught at the fault step by the magnitude trigger's confirmation (the next audit would be step 20).
    assert (summary["alarm_step"], summary["resumed_from_step"]) == (12, 10)
    phases = ["alarm", "cordon", "reproduced", "approval", "replaced", "qualified", "resumed"]
    assert set(summary["phase_seconds"]) == set(phases)
    _phases_in_order(summary["phase_seconds"], phases)
    assert (summary["suspect_reproduced"], summary["replacement_qualified"]) == ("5/5", True)
    assert "[6/7] fingerprints" in done.stderr  # the progress went to stderr
    # and the pipeline's progress said what the node checks said.
    assert re.search(r"pipeline  reproduction +\+ *[\d.]+ s  on hyperpod-i-\w+: reproduced 5/5: persistent", done.stderr)
    assert re.search(r"pipeline  qualification +\+ *[\d.]+ s  of hyperpod-i-\w+: passed", done.stderr)
    assert json.loads((report / "summary.json").read_text())["recovered_fingerprint"] == summary["clean_fingerprint"]
    assert (report / "losses.png").exists()


def test_the_interactive_pause_shows_kubectl_lines_that_read_the_containment(
    stage: Stage, trainer: Trainer, clean: RunResult, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an interactive drill, whose reviewer runs the kubectl lines it was shown before answering,
    import shlex

    from sdcguard.contract import Incident
    from sdcguard.contract.naming import node_name
    from sdcguard.infra.drill import flow

    said: list[str] = []
    ran: dict[str, subprocess.CompletedProcess[str]] = {}

    def reviewer(incident: Incident) -> tuple[str, str]:
        lines = [line.split("$ ", 1)[1] for line in said if "$ kubectl " in line]
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "kubeconfig")}
        for line in lines:
            ran[line] = subprocess.run(shlex.split(line), env=env, capture_output=True, text=True, timeout=120,
                                       check=False)
        return "approve", "checked with kubectl"

    monkeypatch.setattr(flow, "_ask", reviewer)

    # when the drill pauses for the decision,
    options = DrillOptions(**{**SHORT.__dict__, "decision": "ask"})
    summary = run_drill(stage, options, tmp_path, trainer=trainer, clean=clean, say=said.append)

    # the lines it showed ran against its stand-in and read the cordoned node and the suspended job.
    assert summary.verdict == "PASSED"
    assert summary.suspect_instances
    node = node_name(summary.suspect_instances[0])
    assert all(r.returncode == 0 for r in ran.values()), {k: r.stderr for k, r in ran.items()}
    [unschedulable] = [r.stdout for line, r in ran.items() if f"get node {node} " in line and "unschedulable" in line]
    assert unschedulable.splitlines()[0] == "true"
    [suspended] = [r.stdout for line, r in ran.items() if "get pytorchjob" in line]
    assert suspended.strip() == "true"


def test_a_faulty_replacement_is_never_resumed_onto(stage: Stage, trainer: Trainer, clean: RunResult,
                                                     tmp_path: Path) -> None:
    """Last in the file: the incident stops for attention and leaves the stage's job suspended."""
    # Given a stand-in whose replacements of the faulty node inherit its fault,
    before = [p.node_name for p in placements(stage)]
    faulty_node = before[1]

    # when the drill runs the default fault on rank 3 and a reviewer approves,
    summary = _drill(stage, trainer, clean, tmp_path, fault_rank=3, replacement_faulty=True)

    # the drill passed without ever resuming the job onto a node that failed its qualification:
    assert summary.verdict == "PASSED"
    assert summary.suspect_reproduced == "5/5"
    assert summary.resumed_onto_unqualified is False
    qualified = summary.replacement_qualified
    failed = [c.node for c in summary.node_checks or [] if c.purpose == "qualify" and c.state != "passed"]
    assert failed
    assert faulty_node not in failed
    if summary.incident_state == "NEEDS_ATTENTION":
        # every replacement inherited the fault and failed: the job stays suspended, the new nodes cordoned,
        assert qualified is False or (isinstance(qualified, list) and not any(qualified))
        assert (summary.replacement_outcome or "").startswith("NEEDS_ATTENTION: ")
        assert summary.recovered_bit_exact is None
        from sdcguard.infra.drill.cluster import hyperpod_nodes, job_suspended, node

        assert job_suspended(stage)
        # (the last one stays cordoned for a person; one replaced again has left the cluster)
        assert node(stage, failed[-1]).spec.unschedulable
        assert not {name.removeprefix("hyperpod-") for name in failed[:-1]} & set(hyperpod_nodes(stage))
    else:
        # or a further replacement qualified and the job resumed onto it alone.
        assert summary.incident_state == "CLOSED"
        assert isinstance(qualified, list)
        assert qualified[-1] is True
        assert not set(failed) & {p.node_name for p in placements(stage)}
        assert summary.recovered_bit_exact is True
    assert json.loads((tmp_path / "summary.json").read_text())["replacement_faulty"] is True
