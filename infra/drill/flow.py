"""The incident drill, stage by stage: set-up, clean run, faulty run, pipeline, decision, recovery, comparison.

``prepare`` seeds a simulated HyperPod cluster on a running local stand-in and
deploys the pipeline with the real deploy code path; ``run_drill`` then plays
one incident on it and returns its :class:`~infra.drill.summary.DrillSummary`.
A stage can serve several drills in a row (the tests do): each drill writes
its checkpoints under a prefix of its own and runs on whatever nodes the
cluster has by then.

This module decides (what to run, what to check, when the drill failed);
:class:`~infra.drill.report.Story` says what happened. A drill that cannot
detect, localise or recover raises :class:`DrillFailed` naming the step that
failed; the summary built so far travels with it.

With ``DrillOptions.chaos`` a fraction of the pipeline's Kubernetes API and
SageMaker HyperPod calls fail transiently from the faulty run until the
incident ends (:mod:`infra.drill.chaos`); the drill must pass all the same.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from kubernetes import client as k8s

from contract import Alarm, Incident, IncidentState
from contract.naming import NODE_PREFIX, instance_id_of
from contract.naming import node_name as hyperpod_node_name
from infra.drill.chaos import DrillChaos, incident_history, summarise
from infra.drill.job_run import JobRun, Placement, RunResult, Trainer, TrainerError
from infra.drill.report import (
    LossCurve,
    Marks,
    Say,
    Story,
    phase_seconds,
    plot_losses,
    timeline_lines,
    write_report,
)
from infra.drill.summary import DrillSummary, Published, ReplacementRow

S = IncidentState
Operator = Callable[[list[str]], int]
"""The operator CLI, ``sdcguard ARGV``: prints what the command prints and returns its exit status."""


def cli_in_a_subprocess(argv: list[str]) -> int:
    """``python -m sdcguard ARGV`` in a child process with this process's environment (the default operator).

    ``sdcguard drill`` passes the CLI's own ``main`` instead, which runs in this
    process; the drill cannot import it (the CLI is above it)."""
    done = subprocess.run([sys.executable, "-m", "sdcguard", *argv], capture_output=True, text=True, check=False)
    sys.stdout.write(done.stdout + done.stderr)
    return done.returncode
Decision = Literal["approve", "reject", "ask"]

# The agent's injection kinds the drill offers, and the detector that should catch each.
EXPECTED_DETECTOR = {
    "finite_activation": "ring_audit",
    "nan_activation": "nonfinite_grad",
    "weight_bitflip": "weight_fingerprint",
    "grad_bitflip": "ring_audit",
}
FAULTS = tuple(EXPECTED_DETECTOR)
SHARDINGS = ("ddp", "hsdp")
"""How the drill's job holds its weights: DDP, or FSDP2 with one replica group per node (``agent.train``'s)."""
WAITING = S.AWAITING_APPROVAL
ENDS = frozenset({S.CLOSED, S.FALSE_ALARM, S.CONTAINED, S.DRY_RUN, S.NEEDS_ATTENTION, S.FAILED})
REVIEWER_REASON = "sdcguard drill: ring audit evidence reviewed"


class DrillFailed(RuntimeError):
    """A step of the drill failed; ``step`` names it and ``summary`` holds what was learned before."""

    def __init__(self, step: str, message: str, summary: DrillSummary | None = None) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message
        self.summary = summary


@dataclass(frozen=True)
class DrillOptions:
    """What one drill injects and how the job runs. ``validate`` raises ValueError naming the option."""

    fault: str = "finite_activation"
    fault_rank: int = 3
    fault_step: int = 33
    steps: int = 60
    decision: Decision = "approve"
    audit_every: int = 10
    fingerprint_every: int = 5
    checkpoint_every: int = 10
    nodes: int = 3
    ranks_per_node: int = 2
    seed: int = 0
    reason: str = REVIEWER_REASON
    chaos: float = 0.0
    """The fraction of the pipeline's Kubernetes API and SageMaker HyperPod calls that fail transiently."""
    chaos_seed: int = 0
    """Which calls fail: the same seed fails the same calls (the n-th of each operation)."""
    sharding: str = "ddp"
    """One of SHARDINGS; under hsdp each node holds one replica of the model, sharded over its ranks."""

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.nodes * self.ranks_per_node

    def expected_alarm_step(self) -> int:
        """The step at which the agent should raise the alarm for this fault."""
        if self.fault == "nan_activation":
            return self.fault_step  # the non-finite check runs on every step
        if self.fault == "weight_bitflip":
            # The flip lands after the fault step's update; the next weight comparison
            # (a fingerprint step, or the check before a checkpoint save) sees it.
            cadences = [c for c in (self.fingerprint_every, self.checkpoint_every) if c]
            return min((self.fault_step // c + 1) * c for c in cadences)
        return math.ceil(self.fault_step / self.audit_every) * self.audit_every

    def validate(self) -> None:
        """Refuse options the drill cannot play out, naming the option and why."""
        if self.fault not in FAULTS:
            raise ValueError(f"--fault: {self.fault!r} is not one of {', '.join(FAULTS)}")
        if self.nodes < 3:
            raise ValueError(f"nodes: the ring audit localises a node only with 3 or more nodes, got {self.nodes}")
        if not 0 <= self.fault_rank < self.world_size:
            raise ValueError(f"--fault-rank: must be a rank from 0 to {self.world_size - 1}, got {self.fault_rank}")
        for name in ("audit_every", "fingerprint_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.fault_step <= self.checkpoint_every:
            raise ValueError(
                f"--fault-step: must be after the first checkpoint (step {self.checkpoint_every}) so that a clean "
                f"checkpoint exists to resume from, got {self.fault_step}"
            )
        alarm = self.expected_alarm_step()
        if alarm >= self.steps:
            raise ValueError(
                f"--steps: the {self.fault} fault at step {self.fault_step} is first checked at step {alarm}; "
                f"give --steps above {alarm} (got {self.steps})"
            )
        if self.decision not in ("approve", "reject", "ask"):
            raise ValueError(f"decision: must be approve, reject or ask, got {self.decision!r}")
        if not 0 <= self.chaos < 1:
            raise ValueError(f"--chaos: must be a fraction of calls from 0 up to (not including) 1, got {self.chaos}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"--sharding: must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")

    def injection(self, node_name: str) -> str:
        """``SDCGUARD_INJECT`` for the faulty rank, bound to its node: it fires nowhere else."""
        # A weight flip toggles the bit on every step it fires, so it fires once; the
        # others stay on, as a broken GPU does, until the hardware is replaced.
        repeat = 1 if self.fault == "weight_bitflip" else self.steps
        return f"kind={self.fault},node={node_name},step={self.fault_step},repeat={repeat}"


@dataclass
class Stage:
    """A seeded cluster with the pipeline deployed on a running stand-in."""

    standin: Any
    seeded: dict[str, Any]
    stack_name: str
    outputs: dict[str, str]
    seconds: dict[str, float] = field(default_factory=dict)
    operator: Operator = cli_in_a_subprocess
    """How the drill runs ``sdcguard incidents``/``approve``/``reject``."""
    chaos: DrillChaos = field(init=False)
    """The stand-in's chaos knobs (off unless a drill turns them on)."""

    def __post_init__(self) -> None:
        self.chaos = DrillChaos(self.standin)

    def client(self, service: str) -> Any:
        """A boto3 client bound to the stand-in."""
        return self.standin.client(service)

    @property
    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables that reach the stand-in."""
        return dict(self.standin.env)

    def kube(self) -> k8s.ApiClient:
        """A Kubernetes client for the seeded EKS cluster (through EKS DescribeCluster and an STS token)."""
        from lambdas.eks_token import kubernetes_client

        return kubernetes_client(self.seeded["eks_cluster"], eks=self.client("eks"), sts=self.client("sts"))


@contextlib.contextmanager
def aws_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Point this process's default boto3 clients at ``env`` (as `sdcguard local up` tells a shell), then restore."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def prepare(standin: Any, *, name: str = "sdcguard-demo", nodes: int = 3, ranks_per_node: int = 2,
            say: Say = lambda line: None) -> Stage:
    """Seed a HyperPod cluster called ``name`` on ``standin`` and deploy the pipeline guarding it.

    The stack (also called ``name``) is deployed by ``infra.deploy.deploy.deploy``,
    the code path of ``sdcguard deploy``, reaching the stand-in through
    ``AWS_ENDPOINT_URL``. Raises :class:`DrillFailed` (step "set-up") when
    either fails.
    """
    from infra.deploy.deploy import DeployError, deploy
    from infra.local.seed import SeedError, seed

    story = Story(say)
    seconds: dict[str, float] = {}
    began = time.monotonic()
    try:
        seeded = seed(standin, nodes=nodes, ranks_per_node=ranks_per_node, faulty_node=None, cluster=name,
                      job=f"{name}-job", minutes=60)
    except SeedError as exc:
        raise DrillFailed("set-up", f"seeding the cluster failed: {exc}") from exc
    seconds["seed"] = round(time.monotonic() - began, 2)
    story.seeded(seeded["hyperpod_cluster"], seeded["nodes"])
    began = time.monotonic()
    overrides = {
        "HyperPodClusterName": seeded["hyperpod_cluster"],
        "EksClusterName": seeded["eks_cluster"],
        "JobNamespace": seeded["namespace"],
        "JobName": seeded["job"],
        "CheckpointBucket": seeded["bucket"],
        "CheckpointPrefix": seeded["checkpoint_prefix"],
        "EventBusName": f"{name}-bus",
        # The drill's ranks publish with the stand-in's own credentials, not as a training role.
        "AllowAnyPublisher": "true",
        "ReviewerEmail": "oncall@example.com",
        "ApprovalTimeoutSeconds": "3600",
        "MaxQuarantinedNodes": "2",
        "MaxReplacementsPerDay": "20",
        "ReplacementPollSeconds": "1",
        "ReplacementMaxPolls": "60",
    }
    with aws_environment(standin.env):
        try:
            result = deploy(name, overrides, progress=story.deploying, poll_seconds=0.2)
        except DeployError as exc:
            raise DrillFailed("set-up", f"deploying the pipeline failed: {exc}") from exc
    seconds["deploy"] = round(time.monotonic() - began, 2)
    story.deployed(result.stack_name, result.status, seconds["deploy"], result.outputs["EventBusName"],
                   result.outputs["LedgerTableName"])
    stage = Stage(standin, seeded, result.stack_name, result.outputs, seconds)
    story.warming()
    began = time.monotonic()
    warmed = warm_functions(stage)
    seconds["warm_functions"] = round(time.monotonic() - began, 2)
    story.warmed(warmed, seconds["warm_functions"])
    return stage


WARM_UP = {"sdcguard_drill_warm_up": True}


def warm_functions(stage: Stage) -> int:
    """Invoke every Lambda function of the stack once with an input each refuses, so later calls are warm.

    Every handler parses its input into a model that forbids unknown fields,
    so the warm-up call fails at once (``MalformedEvent``) and touches
    nothing; what it leaves is the stand-in's worker process with the code
    imported. Returns how many functions were warmed.
    """
    from concurrent.futures import ThreadPoolExecutor

    cfn = stage.client("cloudformation")
    pages = cfn.get_paginator("list_stack_resources").paginate(StackName=stage.stack_name)
    names = [r["PhysicalResourceId"] for p in pages for r in p["StackResourceSummaries"]
             if r["ResourceType"] == "AWS::Lambda::Function"]
    lam = stage.client("lambda")
    payload = json.dumps(WARM_UP).encode()
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        list(pool.map(lambda name: lam.invoke(FunctionName=name, Payload=payload)["StatusCode"], names))
    return len(names)


# -- reading the cluster (the drill's own reads: never under chaos) ------------------------------------


def placements(stage: Stage) -> list[Placement]:
    """The job's pods and the nodes they run on now, in worker order (from the Kubernetes API)."""
    job = stage.seeded["job"]
    with stage.chaos.paused():
        api = stage.kube()
        try:
            pods = k8s.CoreV1Api(api).list_namespaced_pod(
                stage.seeded["namespace"], label_selector=f"training.kubeflow.org/job-name={job}").items
        finally:
            api.close()
    ordered = sorted(pods, key=lambda p: int(p.metadata.labels["training.kubeflow.org/replica-index"]))
    return [Placement(node_name=p.spec.node_name, pod=p.metadata.name) for p in ordered]


def instance_of(node_name: str) -> str:
    """The EC2 instance id in a HyperPod node name."""
    return instance_id_of(node_name) or node_name.removeprefix(NODE_PREFIX)


def _node(stage: Stage, name: str) -> Any:
    with stage.chaos.paused():
        api = stage.kube()
        try:
            return k8s.CoreV1Api(api).read_node(name)
        finally:
            api.close()


def _job_suspended(stage: Stage) -> bool:
    with stage.chaos.paused():
        api = stage.kube()
        try:
            job = k8s.CustomObjectsApi(api).get_namespaced_custom_object(
                "kubeflow.org", "v1", stage.seeded["namespace"], "pytorchjobs", stage.seeded["job"])
        finally:
            api.close()
    return bool(job.get("spec", {}).get("runPolicy", {}).get("suspend"))


def _hyperpod_nodes(stage: Stage) -> dict[str, str]:
    sm = stage.client("sagemaker")
    with stage.chaos.paused():
        pages = sm.get_paginator("list_cluster_nodes").paginate(ClusterName=stage.seeded["hyperpod_cluster"])
        return {n["InstanceId"]: n["InstanceStatus"]["Status"] for p in pages for n in p["ClusterNodeSummaries"]}


# -- the pipeline, watched through the ledger ---------------------------------------------------------


def _ts(at: datetime) -> float:
    return at.timestamp()


class IncidentWatch:
    """Follows one incident in the ledger and tells each state as it is reached."""

    def __init__(self, stage: Stage, alarm: Alarm, story: Story) -> None:
        from lambdas.ledger import Ledger, idempotency_key, incident_id_for

        self.ledger = Ledger(stage.outputs["LedgerTableName"], stage.client("dynamodb"))
        self.incident_id = incident_id_for(idempotency_key(alarm))
        self.alarm_at = _ts(alarm.time)
        self.story = story
        self.shown = 0

    def current(self) -> Incident | None:
        """The incident, or None while it is not recorded yet."""
        from lambdas.errors import IncidentNotFound

        try:
            return self.ledger.get(self.incident_id)
        except IncidentNotFound:
            return None

    def wait(self, states: frozenset[IncidentState], timeout: float) -> Incident:
        """Poll until the incident is in one of ``states`` or has ended; print new transitions on the way.

        Raises TimeoutError naming the state it was left in.
        """
        deadline = time.monotonic() + timeout
        while True:
            incident = self.current()
            if incident is not None:
                for transition in incident.transitions[self.shown:]:
                    self.story.transition(transition, self.alarm_at)
                self.shown = len(incident.transitions)
                if incident.state in states or incident.state in ENDS:
                    return incident
            if time.monotonic() > deadline:
                where = incident.state.value if incident else "not recorded"
                raise TimeoutError(f"incident {self.incident_id} still {where} after {timeout:.0f} s")
            time.sleep(0.2)


def _operator(stage: Stage, argv: list[str]) -> tuple[int, list[str]]:
    """Run the operator CLI (``sdcguard ...``) as ``stage.operator``; its exit status and output lines."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = stage.operator(argv)
        except SystemExit as exc:  # argparse refusing the arguments
            status = int(exc.code or 0) if not isinstance(exc.code, str) else 2
    return status, [line for line in out.getvalue().splitlines() if line.strip()]


def _prompt(question: str) -> str:
    """Ask on stderr (stdout may carry the JSON summary) and read one line; DrillFailed at end of input."""
    sys.stderr.write(question)
    sys.stderr.flush()
    line = sys.stdin.readline()
    if not line:
        raise DrillFailed("decision", "no answer: standard input closed")
    return line.strip()


def _ask(incident: Incident) -> tuple[str, str]:
    """Ask the person at the keyboard to approve or reject; (decision, reason)."""
    instances = ", ".join(incident.instance_ids) or "?"
    while True:
        answer = _prompt(f"approve the replacement of {instances}? [a]pprove / [r]eject: ").lower()
        if answer in ("a", "approve", "y", "yes"):
            decision = "approve"
            break
        if answer in ("r", "reject", "n", "no"):
            decision = "reject"
            break
        sys.stderr.write("please answer a (approve) or r (reject)\n")
    reason = _prompt("reason (recorded in the ledger): ") or REVIEWER_REASON
    return decision, reason


# -- the drill ----------------------------------------------------------------------------------------


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


def _guard_settings(stage: Stage, options: DrillOptions) -> dict[str, Any]:
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
    }


def run_clean(stage: Stage, options: DrillOptions, trainer: Trainer, work_dir: Path, *,
              say: Say = lambda line: None) -> RunResult:
    """A fault-free run of the drill's job on the cluster's current nodes, for several drills to share.

    Raises ValueError for bad options and :class:`DrillFailed` ("clean run")
    when it does not finish with one fingerprint on every rank.
    """
    options.validate()
    run = JobRun(name="clean", checkpoint_prefix=f"s3://{stage.seeded['bucket']}/drill-clean/{uuid.uuid4().hex[:8]}",
                 placements=placements(stage), steps=options.steps, guard=_guard_settings(stage, options),
                 ranks_per_node=options.ranks_per_node, checkpoint_every=options.checkpoint_every, seed=options.seed,
                 sharding=options.sharding)
    result = trainer.run(run, work_dir, progress=Story(say).progress("clean"))
    _one_fingerprint(result, "clean run")
    return result


def _one_fingerprint(result: RunResult, step: str) -> str:
    prints = set(result.final_fingerprints)
    if not result.finished or len(prints) != 1 or None in prints:
        raise DrillFailed(step, f"the {result.run.name} run did not finish with one fingerprint on every rank "
                          f"(exit codes {result.exit_codes}):\n{result.log_tail()}")
    return str(prints.pop())


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
                    _play(_Drill(stage, options, work_dir, story, own, outcome), clean)
            else:
                _play(_Drill(stage, options, work_dir, story, trainer, outcome), clean)
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


def _play(drill: _Drill, clean: RunResult | None) -> None:
    """The drill's story, one stage after the other; each stage raises DrillFailed when its check fails."""
    before, fault_node = drill.cluster_before()
    clean_print = drill.clean_run(clean, before)
    with drill.chaos():
        faulty = drill.faulty_run(before, fault_node)
        waiting = drill.pipeline_to_reviewer(faulty)
        decision = drill.review(waiting)
        ended = drill.pipeline_to_end(waiting, decision)
    start = drill.incident_outcome(faulty, waiting, ended, decision, fault_node)
    recovered_print = drill.recovered_run(faulty, start)
    drill.comparison(clean_print, recovered_print, start.step, decision)
    drill.summary.verdict = "PASSED"


@dataclass(frozen=True)
class _Faulty:
    """The faulty run's alarm, where its checkpoints went and what was injected."""

    alarm: Alarm
    prefix: str
    inject: dict[int, str]


@dataclass(frozen=True)
class _Waiting:
    """The incident waiting for the reviewer, and the resume pointer at that moment."""

    watch: IncidentWatch
    incident: Incident
    store: Any
    pointer_before: Any


@dataclass(frozen=True)
class _Restart:
    """Where the recovered run starts: the nodes the job has now, the pointer's step, the injection left."""

    placements: list[Placement]
    step: int
    inject: dict[int, str]


@dataclass
class _Drill:
    """One drill in progress: what every stage needs, and the summary the stages fill in."""

    stage: Stage
    options: DrillOptions
    work_dir: Path
    story: Story
    trainer: Trainer
    outcome: Outcome
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def summary(self) -> DrillSummary:
        """The summary so far."""
        return self.outcome.summary

    def _job(self, name: str, prefix: str, where: list[Placement], inject: dict[int, str]) -> JobRun:
        options = self.options
        return JobRun(name=name, checkpoint_prefix=prefix, placements=where, steps=options.steps,
                      guard=_guard_settings(self.stage, options), ranks_per_node=options.ranks_per_node,
                      checkpoint_every=options.checkpoint_every, seed=options.seed, inject=inject,
                      sharding=options.sharding)

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

    def cluster_before(self) -> tuple[list[Placement], str]:
        """The job's placement before the drill, and the node the fault will be on."""
        options = self.options
        before = placements(self.stage)
        if len(before) != options.nodes:
            raise DrillFailed("set-up", f"the job runs on {len(before)} nodes, the drill needs {options.nodes}")
        fault_node = before[options.fault_rank // options.ranks_per_node].node_name
        self.summary.old_instances = [instance_of(p.node_name) for p in before]
        self.summary.fault_instance = instance_of(fault_node)
        return before, fault_node

    # 2. the fault-free run

    def clean_run(self, clean: RunResult | None, before: list[Placement]) -> str:
        """The reference run's fingerprint (running it, or checking that ``clean`` is the same job)."""
        options = self.options
        self.story.clean_run(options.nodes, options.ranks_per_node, options.steps, options.checkpoint_every,
                             options.sharding)
        if clean is None:
            clean = self.trainer.run(
                self._job("clean", f"s3://{self.stage.seeded['bucket']}/drill-clean/{self.run_id}", before, {}),
                self.work_dir, progress=self.story.progress("clean"))
            self.outcome.seconds["clean_run"] = round(clean.seconds, 2)
        else:
            expected = self._job("clean", clean.run.checkpoint_prefix, list(clean.run.placements), {})
            if (clean.run.steps, clean.run.seed, clean.run.checkpoint_every, clean.run.world_size, clean.run.guard,
                    clean.run.sharding) != (expected.steps, expected.seed, expected.checkpoint_every,
                                            expected.world_size, expected.guard, expected.sharding):
                raise ValueError("clean: the given fault-free run is not the same job as this drill's")
            self.story.clean_reused(clean.log_path.parent)
        fingerprint = _one_fingerprint(clean, "clean run")
        self.summary.clean_fingerprint = fingerprint
        self.outcome.curves.append(LossCurve("clean", *clean.mean_losses()))
        self.story.clean_done(fingerprint, clean.seconds)
        return fingerprint

    # 3. the same job with a fault on one rank's hardware

    def faulty_run(self, before: list[Placement], fault_node: str) -> _Faulty:
        """Run the job with the fault; the alarm must name the faulty rank alone and reach the bus."""
        options, summary = self.options, self.summary
        # Exactly the stack's guarded prefix: the pointer rewrite refuses any other, sub-prefixes included.
        # A stage may hold an earlier drill's checkpoints, pointer and spooled alarms there: start from nothing.
        prefix = f"s3://{self.stage.seeded['bucket']}/{self.stage.seeded['checkpoint_prefix']}"
        from lineage.store import open_store

        store = open_store(prefix, client=self.stage.client("s3"))
        for key in store.list():
            store.delete(key)
        inject = {options.fault_rank: options.injection(fault_node)}
        self.story.faulty_run(options.fault, options.fault_rank, fault_node, options.fault_step, prefix)
        faulty = self.trainer.run(self._job("faulty", prefix, before, inject), self.work_dir,
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
        return _Faulty(alarm, prefix, inject)

    # 4. the pipeline, up to the reviewer

    def pipeline_to_reviewer(self, faulty: _Faulty) -> _Waiting:
        """Follow the incident to AWAITING_APPROVAL; by then the node must be cordoned and the job suspended."""
        from lineage.pointer import read_pointer
        from lineage.store import open_store

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
        cordoned = all(_node(self.stage, hyperpod_node_name(i)).spec.unschedulable for i in waiting.instance_ids)
        suspended = _job_suspended(self.stage)
        self.story.contained(waiting.instance_ids, cordoned, suspended)
        if not (cordoned and suspended):
            raise DrillFailed("pipeline", f"containment incomplete: cordoned={cordoned}, suspended={suspended}")
        return _Waiting(watch, waiting, store, pointer_before)

    # the decision, through the operator CLI

    def review(self, waiting: _Waiting) -> str:
        """Show the incident as the reviewer sees it and answer it with ``sdcguard approve``/``reject``."""
        incident_id = waiting.watch.incident_id
        stack = ["--stack-name", self.stage.stack_name]
        began = time.monotonic()
        with aws_environment(self.stage.env):
            _, shown = _operator(self.stage, ["incidents", *stack, "show", incident_id])
        self.story.waiting(incident_id, shown)
        decision: str = self.options.decision
        reason = self.options.reason
        if decision == "ask":
            self.kubectl_hints(waiting)
            decision, reason = _ask(waiting.incident)
        self.summary.decision = decision
        self.story.reviewer(decision, incident_id, reason)
        with aws_environment(self.stage.env):
            status, answer = _operator(self.stage, [decision, incident_id, "--reason", reason, *stack])
        self.story.answered(answer)
        if status != 0:
            raise DrillFailed("decision", f"sdcguard {decision} exited {status}: {' '.join(answer)}")
        self.outcome.seconds["review_and_decision"] = round(time.monotonic() - began, 2)
        return decision

    def kubectl_hints(self, waiting: _Waiting) -> Path:
        """Write a kubeconfig for the drill's stand-in and show the kubectl lines that check the containment."""
        from infra.local.kubeconfig import operator_commands, write_kubeconfig

        seeded = self.stage.seeded
        path, _ = write_kubeconfig(seeded["eks_cluster"], self.work_dir / "kubeconfig", env=self.stage.env)
        lines = [line for instance in waiting.incident.instance_ids
                 for line in operator_commands("contained", hyperpod_node_name(instance), seeded["namespace"],
                                               seeded["job"])]
        self.story.kubectl(path, lines)
        return path

    # 5. replacement, pointer, resume (or release)

    def pipeline_to_end(self, waiting: _Waiting, decision: str) -> Incident:
        """Follow the incident to its end: CLOSED after an approval, FALSE_ALARM after a rejection."""
        began = time.monotonic()
        ended = self._wait(waiting.watch, ENDS)
        self.outcome.seconds["pipeline_after_decision"] = round(time.monotonic() - began, 2)
        want = S.CLOSED if decision == "approve" else S.FALSE_ALARM
        if ended.state != want:
            raise DrillFailed("pipeline", f"incident ended {ended.state.value}, not {want.value}: {ended.failure}")
        self.summary.phase_seconds = phase_seconds({
            "alarm": waiting.watch.alarm_at,
            "cordon": _at(ended, S.CORDONED),
            "approval": _at(ended, S.APPROVED if decision == "approve" else S.REJECTED),
            "replaced": _at(ended, S.REPLACED),
            "resumed": _at(ended, S.RESUMED) or _at(ended, S.FALSE_ALARM),
        })
        return ended

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
            opened = self._incidents_since(began_at)
            history = []
            if self.summary.incident_id is not None:
                history = incident_history(self.stage.client("stepfunctions"),
                                           self.stage.outputs["IncidentStateMachineArn"], self.summary.incident_id)
            self.summary.chaos = summarise(knobs, history, len(opened))
            self.story.chaos_tally(self.summary.chaos)
        if len(opened) != 1:
            raise DrillFailed("pipeline", f"the ledger opened {len(opened)} incidents for the job under chaos, "
                              f"not one: {', '.join(i.incident_id for i in opened) or 'none'}")

    def _incidents_since(self, began_at: datetime) -> list[Incident]:
        from lambdas.ledger import Ledger

        ledger = Ledger(self.stage.outputs["LedgerTableName"], self.stage.client("dynamodb"))
        job = self.stage.seeded["job"]
        return [i for i in ledger.list(hyperpod_cluster=self.stage.seeded["hyperpod_cluster"])
                if i.alarm.job.job_name == job and i.created_at >= began_at]

    def incident_outcome(self, faulty: _Faulty, waiting: _Waiting, ended: Incident, decision: str,
                         fault_node: str) -> _Restart:
        """Check what the incident left on the cluster and the pointer; where the recovered run starts."""
        from lineage.pointer import read_pointer

        summary, alarm = self.summary, faulty.alarm
        pointer_after, _ = read_pointer(waiting.store)
        summary.pointer_after = pointer_after.checkpoint if pointer_after else None
        after = placements(self.stage)
        summary.new_instances = [instance_of(p.node_name) for p in after]
        summary.replacements = [ReplacementRow(old=r.old_instance_id, new=r.new_instance_id, status=r.status)
                                for r in ended.replacements]
        if decision == "approve":
            _check_replaced(self.stage, ended, fault_node, after, summary.old_instances or [])
            if pointer_after is None or pointer_after.step > alarm.trusted_through_step():
                raise DrillFailed("pipeline", f"the resume pointer is {summary.pointer_after}, not at or before the "
                                  f"trusted step {alarm.trusted_through_step()}")
            self.story.replaced([(r.old_instance_id, r.new_instance_id) for r in ended.replacements],
                                summary.pointer_before, pointer_after.checkpoint)
            inject = faulty.inject  # the fault stays with the old hardware: it no longer matches any node
        else:
            _check_released(self.stage, ended, fault_node, waiting.pointer_before, pointer_after)
            self.story.released(fault_node, summary.pointer_after)
            # A rejection treats the alarm as a false (transient) one: the resumed job runs without the fault.
            inject = {}
        if _job_suspended(self.stage):
            raise DrillFailed("pipeline", "the job is still suspended after the incident ended")
        return _Restart(after, pointer_after.step if pointer_after else 0, inject)

    # the recovered run

    def recovered_run(self, faulty: _Faulty, start: _Restart) -> str:
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
        fingerprint = _one_fingerprint(recovered, "recovery")
        if recovered.resumed_from != start.step:
            raise DrillFailed("recovery", f"the recovered run started at step {recovered.resumed_from}, "
                              f"not at the pointer's step {start.step}")
        return fingerprint

    # 6. the comparison

    def comparison(self, clean_print: str, recovered_print: str, start_step: int, decision: str) -> None:
        """After an approval the recovered run must equal the fault-free one bit for bit; after a rejection, no claim."""
        summary = self.summary
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


def _at(incident: Incident, state: IncidentState) -> float | None:
    at = incident.entered(state)
    return _ts(at) if at is not None else None


def _check_replaced(stage: Stage, incident: Incident, fault_node: str, after: list[Placement],
                    old_instances: list[str]) -> None:
    old = instance_of(fault_node)
    pairs = {r.old_instance_id: r.new_instance_id for r in incident.replacements}
    new = pairs.get(old)
    hyperpod = _hyperpod_nodes(stage)
    problems = []
    if new is None:
        problems.append(f"no replacement recorded for {old}")
    elif hyperpod.get(new) != "Running":
        problems.append(f"replacement {new} is {hyperpod.get(new)} in HyperPod")
    if len(incident.replacements) != 1:
        problems.append(f"{len(incident.replacements)} replacements recorded, not one")
    arrived = sorted({instance_of(p.node_name) for p in after} - set(old_instances))
    if len(arrived) != 1:
        problems.append(f"the job runs on {len(arrived)} new instances ({', '.join(arrived) or 'none'}), not one")
    if old in hyperpod:
        problems.append(f"{old} is still a HyperPod node")
    if any(p.node_name == fault_node for p in after):
        problems.append(f"a pod still runs on {fault_node}")
    if new is not None and _node(stage, hyperpod_node_name(new)).spec.unschedulable:
        problems.append(f"the new node {hyperpod_node_name(new)} is unschedulable")
    if problems:
        raise DrillFailed("pipeline", "; ".join(problems))


def _check_released(stage: Stage, incident: Incident, fault_node: str, pointer_before: Any,
                    pointer_after: Any) -> None:
    node = _node(stage, fault_node)
    problems = []
    if node.spec.unschedulable:
        problems.append(f"{fault_node} is still cordoned")
    if incident.replacements:
        problems.append("a node was replaced on the reject path")
    if pointer_before != pointer_after:
        problems.append("the resume pointer moved on the reject path")
    if problems:
        raise DrillFailed("pipeline", "; ".join(problems))


def timeline(summary: DrillSummary) -> list[str]:
    """The timeline rows of a summary (seconds after the alarm)."""
    return timeline_lines(summary.phase_seconds or {})
