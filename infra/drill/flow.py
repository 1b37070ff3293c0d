"""The incident drill, phase by phase: stage, clean run, faulty run, pipeline, decision, recovery, comparison.

``prepare`` seeds a simulated HyperPod cluster on a running local stand-in and
deploys the pipeline with the real deploy code path; ``run_drill`` then plays
one incident on it and returns the JSON summary. A stage can serve several
drills in a row (the tests do): each drill writes its checkpoints under a
prefix of its own and runs on whatever nodes the cluster has by then.

A drill that cannot detect, localise or recover raises :class:`DrillFailed`
naming the step that failed; the summary built so far travels with it.
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
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from kubernetes import client as k8s

from contract import Alarm, Incident, IncidentState
from contract.naming import NODE_PREFIX, instance_id_of
from contract.naming import node_name as hyperpod_node_name
from infra.drill.job_run import JobRun, Placement, RunResult, Trainer, TrainerError
from infra.drill.report import LossCurve, Marks, phase_seconds, plot_losses, timeline_lines, write_report

S = IncidentState
Say = Callable[[str], None]
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
WAITING = S.AWAITING_APPROVAL
ENDS = frozenset({S.CLOSED, S.FALSE_ALARM, S.CONTAINED, S.DRY_RUN, S.NEEDS_ATTENTION, S.FAILED})
REVIEWER_REASON = "sdcguard drill: ring audit evidence reviewed"


class DrillFailed(RuntimeError):
    """A step of the drill failed; ``step`` names it and ``summary`` holds what was learned before."""

    def __init__(self, step: str, message: str, summary: dict[str, Any] | None = None) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message
        self.summary = summary or {}


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

    seconds: dict[str, float] = {}
    began = time.monotonic()
    try:
        seeded = seed(standin, nodes=nodes, ranks_per_node=ranks_per_node, faulty_node=None, cluster=name,
                      job=f"{name}-job", minutes=60)
    except SeedError as exc:
        raise DrillFailed("set-up", f"seeding the cluster failed: {exc}") from exc
    seconds["seed"] = round(time.monotonic() - began, 2)
    say(f"seeded HyperPod cluster {seeded['hyperpod_cluster']}: "
        + ", ".join(f"{n['node_name']} (ranks {n['ranks'][0]}-{n['ranks'][-1]})" for n in seeded["nodes"]))
    began = time.monotonic()
    overrides = {
        "HyperPodClusterName": seeded["hyperpod_cluster"],
        "EksClusterName": seeded["eks_cluster"],
        "JobNamespace": seeded["namespace"],
        "CheckpointBucket": seeded["bucket"],
        "CheckpointPrefix": seeded["checkpoint_prefix"],
        "EventBusName": f"{name}-bus",
        "ReviewerEmail": "oncall@example.com",
        "ApprovalTimeoutSeconds": "3600",
        "MaxQuarantinedNodes": "2",
        "MaxReplacementsPerDay": "20",
        "ReplacementPollSeconds": "1",
        "ReplacementMaxPolls": "60",
    }
    with aws_environment(standin.env):
        try:
            result = deploy(name, overrides, progress=lambda line: say(f"  deploy: {line}"), poll_seconds=0.2)
        except DeployError as exc:
            raise DrillFailed("set-up", f"deploying the pipeline failed: {exc}") from exc
    seconds["deploy"] = round(time.monotonic() - began, 2)
    say(f"deployed stack {result.stack_name} ({result.status}) in {seconds['deploy']:.1f} s: "
        f"bus {result.outputs['EventBusName']}, ledger {result.outputs['LedgerTableName']}")
    stage = Stage(standin, seeded, result.stack_name, result.outputs, seconds)
    say("warming the stack's Lambda functions (one cold start each on the stand-in) ...")
    began = time.monotonic()
    warmed = warm_functions(stage)
    seconds["warm_functions"] = round(time.monotonic() - began, 2)
    say(f"warmed the stack's {warmed} Lambda functions in {seconds['warm_functions']:.1f} s "
        "(the stand-in starts a process per function on its first call)")
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


# -- reading the cluster -------------------------------------------------------------------------------


def placements(stage: Stage) -> list[Placement]:
    """The job's pods and the nodes they run on now, in worker order (from the Kubernetes API)."""
    job = stage.seeded["job"]
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
    api = stage.kube()
    try:
        return k8s.CoreV1Api(api).read_node(name)
    finally:
        api.close()


def _job_suspended(stage: Stage) -> bool:
    api = stage.kube()
    try:
        job = k8s.CustomObjectsApi(api).get_namespaced_custom_object(
            "kubeflow.org", "v1", stage.seeded["namespace"], "pytorchjobs", stage.seeded["job"])
    finally:
        api.close()
    return bool(job.get("spec", {}).get("runPolicy", {}).get("suspend"))


def _hyperpod_nodes(stage: Stage) -> dict[str, str]:
    sm = stage.client("sagemaker")
    pages = sm.get_paginator("list_cluster_nodes").paginate(ClusterName=stage.seeded["hyperpod_cluster"])
    return {n["InstanceId"]: n["InstanceStatus"]["Status"] for p in pages for n in p["ClusterNodeSummaries"]}


# -- the pipeline, watched through the ledger ---------------------------------------------------------


def _ts(at: datetime) -> float:
    return at.timestamp()


class IncidentWatch:
    """Follows one incident in the ledger and prints each state as it is reached."""

    def __init__(self, stage: Stage, alarm: Alarm, say: Say) -> None:
        from lambdas.ledger import Ledger, idempotency_key, incident_id_for

        self.ledger = Ledger(stage.outputs["LedgerTableName"], stage.client("dynamodb"))
        self.incident_id = incident_id_for(idempotency_key(alarm))
        self.alarm_at = _ts(alarm.time)
        self.say = say
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
                for t in incident.transitions[self.shown:]:
                    note = f"  {t.note}" if t.note else ""
                    self.say(f"  pipeline  {t.state.value:<19} +{_ts(t.at) - self.alarm_at:6.2f} s  ({t.actor}){note}")
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

    summary: dict[str, Any]
    seconds: dict[str, float]
    marks: Marks
    documents: dict[str, Any] = field(default_factory=dict)
    curves: list[LossCurve] = field(default_factory=list)


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
                 ranks_per_node=options.ranks_per_node, checkpoint_every=options.checkpoint_every, seed=options.seed)
    result = trainer.run(run, work_dir, progress=lambda line: say(f"  clean     {line}"))
    _one_fingerprint(result, "clean run", {})
    return result


def _one_fingerprint(result: RunResult, step: str, summary: dict[str, Any]) -> str:
    prints = set(result.final_fingerprints)
    if not result.finished or len(prints) != 1 or None in prints:
        raise DrillFailed(step, f"the {result.run.name} run did not finish with one fingerprint on every rank "
                          f"(exit codes {result.exit_codes}):\n{result.log_tail()}", summary)
    return str(prints.pop())


def run_drill(stage: Stage, options: DrillOptions, work_dir: Path, *, trainer: Trainer | None = None,
              clean: RunResult | None = None, say: Say = lambda line: None) -> dict[str, Any]:
    """Play one incident on ``stage`` and return the JSON summary (also written to ``work_dir``).

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
    seconds: dict[str, float] = {}
    outcome = Outcome(
        summary={
            "fault": options.fault,
            "fault_rank": options.fault_rank,
            "fault_step": options.fault_step,
            "steps": options.steps,
            "expected_detector": EXPECTED_DETECTOR[options.fault],
            "decision": options.decision,
            "hyperpod_cluster": stage.seeded["hyperpod_cluster"],
            "stack": stage.stack_name,
            "drill_seconds": seconds,
            "report_dir": str(work_dir),
        },
        seconds=seconds,
        marks=Marks(fault_step=options.fault_step, alarm_step=None, suspect_window_start=None,
                    resumed_from_step=None),
    )
    try:
        try:
            if trainer is None:
                with Trainer(stage.env, work_dir / "ranks.log") as own:
                    _play(stage, options, work_dir, say, outcome, own, clean)
            else:
                _play(stage, options, work_dir, say, outcome, trainer, clean)
        except TrainerError as exc:
            raise DrillFailed("training", str(exc)) from exc
    except DrillFailed as exc:
        outcome.summary.update(verdict="FAILED", failed_step=exc.step, failure=exc.message)
        exc.summary = outcome.summary
        raise
    finally:
        _write(work_dir, outcome, say)
    return outcome.summary


def _write(work_dir: Path, outcome: Outcome, say: Say) -> None:
    began = time.monotonic()
    plot = work_dir / "losses.png"
    if outcome.curves:
        plot_losses(plot, outcome.curves, outcome.marks)
    outcome.seconds["report"] = round(time.monotonic() - began, 2)
    written = write_report(work_dir, outcome.summary, outcome.documents)
    if outcome.curves:
        written.append(plot)
    say(f"report: {work_dir} ({', '.join(p.name for p in written)})")


def _play(stage: Stage, options: DrillOptions, work_dir: Path, say: Say, outcome: Outcome, trainer: Trainer,
          clean: RunResult | None) -> None:
    seeded, bucket = stage.seeded, stage.seeded["bucket"]
    run_id = uuid.uuid4().hex[:8]
    guard = _guard_settings(stage, options)
    summary, seconds, documents, curves = outcome.summary, outcome.seconds, outcome.documents, outcome.curves
    before = placements(stage)
    if len(before) != options.nodes:
        raise DrillFailed("set-up", f"the job runs on {len(before)} nodes, the drill needs {options.nodes}", summary)
    fault_node = before[options.fault_rank // options.ranks_per_node].node_name
    summary["old_instances"] = [instance_of(p.node_name) for p in before]
    summary["fault_instance"] = instance_of(fault_node)

    def job(name: str, prefix: str, where: list[Placement], inject: dict[int, str]) -> JobRun:
        return JobRun(name=name, checkpoint_prefix=prefix, placements=where, steps=options.steps, guard=guard,
                      ranks_per_node=options.ranks_per_node, checkpoint_every=options.checkpoint_every,
                      seed=options.seed, inject=inject)

    def progress(tag: str) -> Say:
        return lambda line: say(f"  {tag:<9} {line}")

    # 2. The fault-free run.
    say(f"[2/7] fault-free run: {options.nodes} nodes x {options.ranks_per_node} ranks (gloo, CPU), "
        f"{options.steps} steps, checkpoint every {options.checkpoint_every}")
    if clean is None:
        clean = trainer.run(job("clean", f"s3://{bucket}/drill-clean/{run_id}", before, {}), work_dir,
                            progress=progress("clean"))
        seconds["clean_run"] = round(clean.seconds, 2)
    else:
        expected = job("clean", clean.run.checkpoint_prefix, list(clean.run.placements), {})
        if (clean.run.steps, clean.run.seed, clean.run.checkpoint_every, clean.run.world_size, clean.run.guard) != (
                expected.steps, expected.seed, expected.checkpoint_every, expected.world_size, expected.guard):
            raise ValueError("clean: the given fault-free run is not the same job as this drill's")
        say(f"  clean     reusing the fault-free run of {clean.log_path.parent} (the same job and steps)")
    clean_print = _one_fingerprint(clean, "clean run", summary)
    summary["clean_fingerprint"] = clean_print
    curves.append(LossCurve("clean", *clean.mean_losses()))
    say(f"  clean     final weights+optimizer fingerprint {clean_print} ({clean.seconds:.1f} s)")

    # 3. The same job with a fault on one rank's hardware.
    prefix = f"s3://{bucket}/{seeded['checkpoint_prefix']}/{run_id}"
    inject = {options.fault_rank: options.injection(fault_node)}
    say(f"[3/7] faulty run: {options.fault} on rank {options.fault_rank} (node {fault_node}) from step "
        f"{options.fault_step}; checkpoints under {prefix}")
    faulty = trainer.run(job("faulty", prefix, before, inject), work_dir, progress=progress("faulty"))
    seconds["faulty_run"] = round(faulty.seconds, 2)
    curves.append(LossCurve("faulty", *faulty.mean_losses()))
    alarm = faulty.alarm
    if alarm is None:
        raise DrillFailed("detection", f"the faulty run raised no alarm (exit codes {faulty.exit_codes}):\n"
                          f"{faulty.log_tail()}", summary)
    documents["alarm"] = alarm.model_dump(mode="json")
    window_start = alarm.trusted_through_step() + 1
    outcome.marks = Marks(options.fault_step, alarm.step, window_start, None)
    suspect_instances = sorted({instance_of(n) for n in alarm.suspect_nodes})
    summary.update(
        detector=alarm.detector.value,
        alarm_step=alarm.step,
        alarm_id=alarm.alarm_id,
        suspect_ranks=alarm.suspect_ranks,
        suspect_nodes=alarm.suspect_nodes,
        suspect_instances=suspect_instances,
        trusted_through_step=alarm.trusted_through_step(),
        published=faulty.published,
        faulty_exit_codes=faulty.exit_codes,
    )
    say(f"  alarm     {alarm.detector.value} at step {alarm.step}: suspects ranks {alarm.suspect_ranks} on "
        f"{', '.join(alarm.suspect_nodes) or 'no node'}; update skipped, exit codes {sorted(set(faulty.exit_codes))}")
    delivered = bool(faulty.published and faulty.published.get("delivered"))
    say(f"  alarm     published by rank {alarm.publisher_rank} to bus {guard['event_bus']}: "
        f"{'delivered' if delivered else 'NOT delivered'}")
    localized = alarm.localized and alarm.suspect_ranks == [options.fault_rank] \
        and suspect_instances == [instance_of(fault_node)]
    summary["localized_correctly"] = localized
    if not localized:
        raise DrillFailed("localisation", f"the alarm blames ranks {alarm.suspect_ranks} on {alarm.suspect_nodes}; "
                          f"the fault was on rank {options.fault_rank} on {fault_node}", summary)
    if not delivered:
        raise DrillFailed("detection", f"the alarm was not delivered to EventBridge: {faulty.published}", summary)

    # 4. The pipeline, up to the reviewer.
    say("[4/7] incident pipeline (EventBridge rule -> Step Functions -> Lambda handlers), from the ledger:")
    began = time.monotonic()
    watch = IncidentWatch(stage, alarm, say)

    def keep(incident: Incident | None) -> None:
        """Put the incident as it stands (and its evidence) into the report, failed or not."""
        if incident is not None:
            documents["incident"] = incident.model_dump(mode="json")
            documents["evidence"] = incident.evidence
    summary["incident_id"] = watch.incident_id
    from lineage.pointer import read_pointer
    from lineage.store import open_store

    store = open_store(prefix, client=stage.client("s3"))
    try:
        waiting = watch.wait(frozenset({WAITING}), timeout=240)
    except TimeoutError as exc:
        keep(watch.current())
        raise DrillFailed("pipeline", str(exc), summary) from exc
    keep(waiting)
    summary["incident_state"] = waiting.state.value
    if waiting.state != WAITING:
        raise DrillFailed("pipeline", f"incident ended {waiting.state.value} before approval: {waiting.failure}", summary)
    seconds["pipeline_to_approval"] = round(time.monotonic() - began, 2)
    pointer_before, _ = read_pointer(store)
    summary["pointer_before"] = pointer_before.checkpoint if pointer_before else None
    cordoned = all(_node(stage, hyperpod_node_name(i)).spec.unschedulable for i in waiting.instance_ids)
    suspended = _job_suspended(stage)
    say(f"  contained: node(s) {', '.join(waiting.instance_ids)} cordoned={cordoned}, job suspended={suspended}")
    if not (cordoned and suspended):
        raise DrillFailed("pipeline", f"containment incomplete: cordoned={cordoned}, suspended={suspended}", summary)
    stack = ["--stack-name", stage.stack_name]
    began = time.monotonic()
    with aws_environment(stage.env):
        _, shown = _operator(stage, ["incidents", *stack, "show", watch.incident_id])
    say(f"  the incident waits for a reviewer (sdcguard incidents show {watch.incident_id}):")
    for line in shown:
        say(f"    | {line}")

    # The decision, through the operator CLI.
    decision: str = options.decision
    reason = options.reason
    if decision == "ask":
        decision, reason = _ask(waiting)
    summary["decision"] = decision
    say(f"  reviewer: sdcguard {decision} {watch.incident_id} --reason {json.dumps(reason)}")
    with aws_environment(stage.env):
        status, answer = _operator(stage, [decision, watch.incident_id, "--reason", reason, *stack])
    for line in answer:
        say(f"    | {line}")
    if status != 0:
        raise DrillFailed("decision", f"sdcguard {decision} exited {status}: {' '.join(answer)}", summary)
    seconds["review_and_decision"] = round(time.monotonic() - began, 2)

    # 5. Replacement, pointer, resume (or release).
    began = time.monotonic()
    try:
        ended = watch.wait(frozenset(ENDS), timeout=240)
    except TimeoutError as exc:
        keep(watch.current())
        raise DrillFailed("pipeline", str(exc), summary) from exc
    seconds["pipeline_after_decision"] = round(time.monotonic() - began, 2)
    keep(ended)
    summary["incident_state"] = ended.state.value
    want = S.CLOSED if decision == "approve" else S.FALSE_ALARM
    if ended.state != want:
        raise DrillFailed("pipeline", f"incident ended {ended.state.value}, not {want.value}: {ended.failure}", summary)
    summary["phase_seconds"] = phase_seconds({
        "alarm": watch.alarm_at,
        "cordon": _at(ended, S.CORDONED),
        "approval": _at(ended, S.APPROVED if decision == "approve" else S.REJECTED),
        "replaced": _at(ended, S.REPLACED),
        "resumed": _at(ended, S.RESUMED) or _at(ended, S.FALSE_ALARM),
    })
    pointer_after, _ = read_pointer(store)
    summary["pointer_after"] = pointer_after.checkpoint if pointer_after else None
    after = placements(stage)
    summary["new_instances"] = [instance_of(p.node_name) for p in after]
    summary["replacements"] = [{"old": r.old_instance_id, "new": r.new_instance_id, "status": r.status}
                               for r in ended.replacements]
    if decision == "approve":
        _check_replaced(stage, ended, summary, fault_node, after)
        if pointer_after is None or pointer_after.step > alarm.trusted_through_step():
            raise DrillFailed("pipeline", f"the resume pointer is {summary['pointer_after']}, not at or before the "
                              f"trusted step {alarm.trusted_through_step()}", summary)
        say(f"[5/7] replaced {', '.join(f'{r.old_instance_id} -> {r.new_instance_id}' for r in ended.replacements)}; "
            f"pointer {summary['pointer_before']} -> {pointer_after.checkpoint}; job resumed")
        recovery_inject = inject  # the fault stays with the old hardware: it no longer matches any node
    else:
        _check_released(stage, ended, summary, fault_node, pointer_before, pointer_after)
        say(f"[5/7] released: {fault_node} uncordoned, pointer left at {summary['pointer_after']}, job resumed")
        # A rejection treats the alarm as a false (transient) one: the resumed job runs without the fault.
        recovery_inject = {}
    if _job_suspended(stage):
        raise DrillFailed("pipeline", "the job is still suspended after the incident ended", summary)
    expected_start = pointer_after.step if pointer_after else 0
    say(f"  restarting the job on {', '.join(p.node_name for p in after)} from the resume pointer "
        f"(step {expected_start})")
    recovered = trainer.run(job("recovered", prefix, after, recovery_inject), work_dir,
                        progress=progress("recovered"))
    seconds["recovered_run"] = round(recovered.seconds, 2)
    curves.append(LossCurve("recovered", *recovered.mean_losses()))
    summary["resumed_from_step"] = recovered.resumed_from
    outcome.marks = Marks(options.fault_step, alarm.step, window_start, recovered.resumed_from)
    if recovered.alarm is not None:
        raise DrillFailed("recovery", f"the recovered run raised an alarm at step {recovered.alarm.step}: "
                          f"{recovered.alarm.message}", summary)
    recovered_print = _one_fingerprint(recovered, "recovery", summary)
    if recovered.resumed_from != expected_start:
        raise DrillFailed("recovery", f"the recovered run started at step {recovered.resumed_from}, "
                          f"not at the pointer's step {expected_start}", summary)

    # 6. The comparison.
    summary["recovered_fingerprint"] = recovered_print
    summary["recovered_bit_exact"] = recovered_print == clean_print
    if recovered_print == clean_print:
        verdict = "bit-identical"
    elif decision == "approve":
        verdict = "DIFFERENT"
    else:
        verdict = (f"different, as expected after a rejection: the checkpoint of step {expected_start} "
                   "keeps whatever the fault did before the alarm")
    say(f"[6/7] fingerprints: clean     {clean_print}\n"
        f"                    recovered {recovered_print}  -> {verdict}")
    if decision == "approve":
        summary["recovery_claim"] = "bit-exact: the recovered run must equal the fault-free run"
        if not summary["recovered_bit_exact"]:
            raise DrillFailed("comparison", "the recovered run's final state differs from the fault-free run", summary)
    else:
        summary["recovery_claim"] = (
            "none: the reviewer rejected the alarm, so the job resumed from the pointer it had "
            f"(step {expected_start}) on the same nodes; state the fault left in that checkpoint is kept"
        )
    summary["verdict"] = "PASSED"


def _at(incident: Incident, state: IncidentState) -> float | None:
    at = incident.entered(state)
    return _ts(at) if at is not None else None


def _check_replaced(stage: Stage, incident: Incident, summary: dict[str, Any], fault_node: str,
                    after: list[Placement]) -> None:
    old = instance_of(fault_node)
    pairs = {r.old_instance_id: r.new_instance_id for r in incident.replacements}
    new = pairs.get(old)
    hyperpod = _hyperpod_nodes(stage)
    problems = []
    if new is None:
        problems.append(f"no replacement recorded for {old}")
    elif hyperpod.get(new) != "Running":
        problems.append(f"replacement {new} is {hyperpod.get(new)} in HyperPod")
    if old in hyperpod:
        problems.append(f"{old} is still a HyperPod node")
    if any(p.node_name == fault_node for p in after):
        problems.append(f"a pod still runs on {fault_node}")
    if new is not None and _node(stage, hyperpod_node_name(new)).spec.unschedulable:
        problems.append(f"the new node {hyperpod_node_name(new)} is unschedulable")
    if problems:
        raise DrillFailed("pipeline", "; ".join(problems), summary)


def _check_released(stage: Stage, incident: Incident, summary: dict[str, Any], fault_node: str,
                    pointer_before: Any, pointer_after: Any) -> None:
    node = _node(stage, fault_node)
    problems = []
    if node.spec.unschedulable:
        problems.append(f"{fault_node} is still cordoned")
    if incident.replacements:
        problems.append("a node was replaced on the reject path")
    if pointer_before != pointer_after:
        problems.append("the resume pointer moved on the reject path")
    if problems:
        raise DrillFailed("pipeline", "; ".join(problems), summary)


def timeline(summary: dict[str, Any]) -> list[str]:
    """The timeline rows of a summary (seconds after the alarm)."""
    return timeline_lines(summary.get("phase_seconds") or {})
