"""The operator's commands: ``sdcguard incidents``, ``incidents show|abort|release ID``, ``approve ID``, ``reject ID``.

Pointed at an account or at the local stand-in by the usual AWS environment
variables (``AWS_ENDPOINT_URL`` included). ``approve``/``reject`` start the
same decision state machine a reviewer starts from the Step Functions
console, with the caller's identity from STS as the reviewer, and wait for
its answer.

The three commands share this module; ``configure`` tells them apart by the
name the dispatcher gave the sub-parser. The ledger is read with
:class:`sdcguard.lambdas.ledger.Ledger`, the pipeline's own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError

from sdcguard.contract import Incident, IncidentState, NodeCheck
from sdcguard.errors import CommandError
from sdcguard.lambdas.blast_radius import stopped_holding
from sdcguard.lambdas.close import plain_cause
from sdcguard.lambdas.errors import (
    IncidentNotFound,
    IncidentNotWaiting,
    KubernetesObjectMissing,
    TransientKubernetesError,
    UnsafeResume,
)
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lambdas.notify import PERSISTENCE

DEFAULT_STACK = "sdcguard"
NO_CREDENTIALS = (
    "no AWS credentials: set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
    "(for the local stand-in, paste the exports `sdcguard local up` prints)"
)
PAST_TENSE = {"approve": "approved", "reject": "rejected"}
FAILURE_MESSAGES = {
    "IncidentNotWaiting": "incident {id} is not waiting for approval{state}; nothing changed",
    "ApprovalExpired": "the approval request of incident {id} has expired{state}: the incident stopped safely "
    "for attention (node cordoned, job suspended); nothing changed",
    "UnknownDecision": "the decision machine refused the input for incident {id}; nothing changed",
}


def _command(parser: argparse.ArgumentParser) -> str:
    return parser.prog.split()[-1]


def _common(parser: argparse.ArgumentParser, *, again: bool = False) -> None:
    """``--stack-name`` and ``--table``; ``again`` for a sub-command, where they may be repeated after it.

    A sub-parser's defaults would overwrite the values given before the
    sub-command, so there the options only set a value when they are given.
    """
    stack_default = argparse.SUPPRESS if again else os.environ.get("SDCGUARD_STACK", DEFAULT_STACK)
    table_default = argparse.SUPPRESS if again else os.environ.get("SDCGUARD_LEDGER_TABLE")
    parser.add_argument("--stack-name", default=stack_default,
                        help="the deployed stack whose outputs name the ledger and the decision machine (default: "
                        f"{os.environ.get('SDCGUARD_STACK', DEFAULT_STACK)})")
    parser.add_argument("--table", default=table_default,
                        help="the ledger table (default: the stack's LedgerTableName output)")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``incidents``, ``approve`` or ``reject``, whichever ``parser`` is for."""
    command = _command(parser)
    _common(parser)
    if command == "incidents":
        parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
        parser.add_argument("--all", action="store_true",
                            help="every incident; by default only the open ones: still running, or stopped "
                            "with nodes held for a human (NEEDS_ATTENTION, CONTAINED, FAILED)")
        sub = parser.add_subparsers(dest="incidents_command", metavar="{show,abort,release}")
        show = sub.add_parser("show", help="one incident: state, where it stopped and why, suspects, evidence, timeline")
        show.add_argument("incident_id", metavar="ID")
        show.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                          help="print the whole incident record as JSON")
        _common(show, again=True)
        abort = sub.add_parser(
            "abort",
            help="stop a running incident: its execution is stopped, the nodes it cordoned uncordoned, its hold on "
            "the job released (ABORTED, recorded with your identity). Needs access to the EKS cluster.",
        )
        release = sub.add_parser(
            "release",
            help="free what a stopped incident (NEEDS_ATTENTION, CONTAINED, FAILED) holds: uncordon its nodes, "
            "release its hold on the job (RELEASED, recorded with your identity). Needs access to the EKS cluster.",
        )
        for ending in (abort, release):
            ending.add_argument("incident_id", metavar="ID")
            ending.add_argument("--reason", required=True, help="why (recorded in the ledger with your identity)")
            resume = ending.add_mutually_exclusive_group()
            resume.add_argument(
                "--resume-from", metavar="CHECKPOINT",
                help="for an incident approved but not rolled back (approved, replacing, not qualified, no safe "
                "checkpoint): point the job at this checkpoint (its step, or checkpoints/step-NNNNNNNNN; it must "
                "verify and be at or before the alarm's trusted step) and resume it. Without this or "
                "--rewrite-pointer such a job stays suspended")
            resume.add_argument(
                "--rewrite-pointer", action="store_true",
                help="the same, to the checkpoint the pipeline's own rewrite chooses (the newest verified one at "
                "or before the alarm's trusted step)")
            _common(ending, again=True)
        return
    parser.add_argument("incident_id", metavar="ID", help="the incident (see `sdcguard incidents`)")
    parser.add_argument("--reason", required=True, help="why (recorded in the ledger with your identity)")
    parser.add_argument("--state-machine-arn", default=os.environ.get("SDCGUARD_DECIDE_STATE_MACHINE_ARN"),
                        help="the decision machine (default: the stack's DecideStateMachineArn output, or the one machine named *decide)")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the decision machine (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Run the command; raises :class:`~sdcguard.errors.CommandError` with a clear message on failure."""
    try:
        if args.command == "incidents":
            ledger = Ledger(_ledger_table(args))
            sub = getattr(args, "incidents_command", None)
            if sub == "show":
                return _show(ledger, args.incident_id, as_json=args.json)
            if sub in ("abort", "release"):
                return _end(args, ledger, sub)
            return _list(ledger, as_json=args.json, everything=args.all)
        return _decide(args, "approve" if args.command == "approve" else "reject")
    except IncidentNotFound as exc:
        raise CommandError(str(exc)) from None
    except NoCredentialsError:
        raise CommandError(NO_CREDENTIALS) from None
    except NoRegionError:
        raise CommandError("no AWS region: set AWS_DEFAULT_REGION (or AWS_REGION)") from None


# -- incidents ------------------------------------------------------------------


def incident_row(incident: Incident) -> dict[str, Any]:
    """The summary of one incident that ``incidents --json`` prints."""
    return {
        "id": incident.incident_id,
        "state": incident.state.value,
        "detector": incident.alarm.detector.value,
        "step": incident.alarm.step,
        "job": f"{incident.alarm.job.namespace}/{incident.alarm.job.job_name}",
        "instance_ids": incident.instance_ids,
        "nodes": incident.alarm.suspect_nodes,
        "fault_persistence": incident.alarm.fault_persistence,
        "duplicate_alarms": incident.duplicate_alarms,
        "created_at": incident.created_at.isoformat(),
        "updated_at": incident.updated_at.isoformat(),
    }


def is_open(incident: Incident) -> bool:
    """Whether ``incident`` is one someone may still have to act on: running, or stopped holding nodes."""
    return not incident.state.terminal or stopped_holding(incident)


def next_steps(incident: Incident) -> list[str]:
    """What the operator can do from where ``incident`` stands (the runbook's steps for this stopping point)."""
    from sdcguard.lambdas.abort import unsafe_to_resume

    i = incident.incident_id
    if incident.state == IncidentState.AWAITING_APPROVAL:
        return [f'sdcguard approve {i} --reason "..."   or   sdcguard reject {i} --reason "..."']
    # Approved, not rolled back: ending it leaves the job suspended unless told where to resume from.
    resume = [] if unsafe_to_resume(incident) is None else [
        f"ending it leaves the job suspended (its pointer was never rewritten); to resume, add --resume-from a "
        f"checkpoint at or before step {incident.alarm.trusted_through_step()}, or --rewrite-pointer"]
    if not incident.state.terminal:
        return [f'running; to stop it and free what it holds: sdcguard incidents abort {i} --reason "..."', *resume]
    if stopped_holding(incident):
        held = "its cordoned node(s) and its hold on the job" if incident.entered(IncidentState.CORDONED) else (
            "its hold on the job (it stopped before cordoning anything)"
            if incident.entered(IncidentState.SUSPENDED) else "nothing on the cluster yet (it stopped before suspending the job)"
        )
        return [f"it holds {held}; once looked at: sdcguard incidents release {i} --reason \"...\"", *resume]
    return []


def _list(ledger: Ledger, *, as_json: bool, everything: bool = False) -> int:
    rows = [incident_row(i) for i in ledger.list() if everything or is_open(i)]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no incidents" if everything else "no open incidents (--all lists the ended ones too)")
        return 0
    header = ("ID", "STATE", "DETECTOR", "STEP", "JOB", "INSTANCES", "CREATED")
    table = [header] + [
        (r["id"], r["state"], r["detector"], str(r["step"]), r["job"], ",".join(r["instance_ids"]) or "-", r["created_at"][:19])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _job_of(check: NodeCheck) -> str:
    return f"  (Job {check.job})" if check.job else ""


def _show(ledger: Ledger, incident_id: str, *, as_json: bool) -> int:
    incident = ledger.get(incident_id)
    if as_json:
        print(incident.model_dump_json(indent=2))
        return 0
    alarm = incident.alarm
    print(f"incident   {incident.incident_id}")
    print(f"state      {incident.state.value}  (mode {incident.mode})")
    if incident.repeat_of is not None:
        print(f"repeat     {incident.repeat_of.describe()}")
    print(f"job        {alarm.job.namespace}/{alarm.job.job_name} on {alarm.job.hyperpod_cluster}")
    print(f"alarm      {alarm.detector.value} at step {alarm.step}, trusted through step {alarm.trusted_through_step()}, "
          f"{incident.duplicate_alarms} duplicate(s)")
    print(f"fault      {PERSISTENCE[alarm.fault_persistence]}")
    for s in incident.suspects:
        print(f"suspect    rank {s.global_rank}  pod {s.pod}  node {s.node}  instance {s.instance_id}")
    if not incident.suspects:
        for raw in alarm.suspects:
            print(f"suspect    rank {raw.global_rank}  pod {raw.pod}  node {raw.node}  (unresolved)")
    evidence = incident.evidence
    if evidence:
        print(f"evidence   {evidence.get('verdict')}")
        instances = evidence.get("instances")
        for entry in instances if isinstance(instances, list) else []:
            if isinstance(entry, dict):
                for reason in entry.get("reasons", []):
                    print(f"           {entry.get('instance_id')}: {reason}")
        print(f"           {evidence.get('note', '')}")
    for check in (c for c in incident.node_checks if c.purpose == "reproduce"):
        print(f"reproduce  {check.node}: {check.summary}{_job_of(check)}")
        if check.image:
            print(f"           image {check.image}")
    if incident.decision:
        d = incident.decision
        print(f"decision   {d.decision} by {d.reviewer}: {d.reason}")
        if d.execution_arn:
            print(f"           through {d.execution_arn} (its StartExecution event in CloudTrail names the caller)")
    for r in incident.replacements:
        print(f"replaced   {r.old_instance_id} -> {r.new_instance_id or '?'} ({r.status})")
    for check in (c for c in incident.node_checks if c.purpose == "qualify"):
        print(f"qualify    {check.node}: {check.summary}{_job_of(check)}")
        if check.image:
            print(f"           image {check.image}")
    if incident.checkpoint_after:
        print(f"pointer    {incident.checkpoint_before or '-'} -> {incident.checkpoint_after}")
    if incident.failure:
        print(f"stopped    in {incident.failure.state}: {incident.failure.error}: {plain_cause(incident.failure.cause)}")
    if incident.opened_by:
        print(f"execution  {incident.opened_by}")
    for line in next_steps(incident):
        print(f"next       {line}")
    print("timeline")
    for t in incident.transitions:
        note = f"  {t.note}" if t.note else ""
        print(f"  {t.at.isoformat(timespec='seconds')}  {t.state.value:<20} {t.actor}{note}")
    return 0


# -- abort / release ----------------------------------------------------------------


def _end(args: argparse.Namespace, ledger: Ledger, how: str) -> int:
    """``incidents abort`` / ``incidents release`` with the caller's own credentials and identity."""
    from sdcguard.lambdas.abort import Resume, abort_incident, release_stopped
    from sdcguard.lambdas.eks_token import kubernetes_client

    operator = boto3.client("sts").get_caller_identity()["Arn"]
    incident = ledger.get(args.incident_id)
    topic = _stack_outputs(args.stack_name).get("TopicArn") if not args.table else None

    def api() -> Any:
        return kubernetes_client(incident.alarm.job.eks_cluster)

    resume = Resume(args.resume_from) if args.resume_from or args.rewrite_pointer else None
    try:
        if how == "abort":
            ended = abort_incident(
                ledger, api, args.incident_id, operator=operator, reason=args.reason,
                sfn=boto3.client("stepfunctions"), topic_arn=topic, resume=resume, s3=boto3.client("s3"),
            )  # fmt: skip
        else:
            ended = release_stopped(ledger, api, args.incident_id, operator=operator, reason=args.reason,
                                    topic_arn=topic, resume=resume, s3=boto3.client("s3"))
    except (IncidentNotWaiting, UnsafeResume) as exc:
        raise CommandError(str(exc)) from None
    except (TransientKubernetesError, KubernetesObjectMissing) as exc:
        raise CommandError(f"the EKS cluster did not answer as needed ({exc}); run the command again") from None
    print(f"{ended.state.value.lower()} incident {args.incident_id} as {operator}: {args.reason}")
    print(job_outcome(ended))
    return 0


def job_outcome(ended: Incident) -> str:
    """What abort or release did to the job: resumed from which checkpoint, or left suspended and why."""
    from sdcguard.lambdas.abort import unsafe_to_resume

    unsafe = unsafe_to_resume(ended)
    if unsafe is not None:
        return unsafe[0].upper() + unsafe[1:] + "."
    if ended.entered(IncidentState.SUSPENDED) is None:
        return "The job was never suspended."
    if ended.checkpoint_after is not None:
        return (f"The job resumes (unless another incident holds it) from {ended.checkpoint_after} "
                f"(step {ended.resumed_from_step}), before the suspect window.")
    return ("The job resumes (unless another incident holds it) from the checkpoint its resume pointer names "
            "(left as it was: the incident was never approved).")


# -- approve / reject -------------------------------------------------------------


def _decide(args: argparse.Namespace, decision: str) -> int:
    reviewer = boto3.client("sts").get_caller_identity()["Arn"]
    machine = _decide_machine(args)
    sfn = boto3.client("stepfunctions")
    name = re.sub(r"[^A-Za-z0-9_-]", "-", f"{args.incident_id}-{decision}-{time.time_ns()}")[:80]
    payload = {"incident_id": args.incident_id, "decision": decision, "reason": args.reason, "reviewer": reviewer}
    execution = sfn.start_execution(stateMachineArn=machine, name=name, input=json.dumps(payload))["executionArn"]
    deadline = time.monotonic() + args.wait
    while True:
        described = sfn.describe_execution(executionArn=execution)
        if described["status"] != "RUNNING":
            break
        if time.monotonic() > deadline:
            raise CommandError(f"the decision machine is still running after {args.wait:g} s: {execution}")
        time.sleep(0.5)
    if described["status"] == "SUCCEEDED":
        print(f"{PAST_TENSE[decision]} incident {args.incident_id} as {reviewer}: {args.reason}")
        return 0
    error = described.get("error", "")
    template = FAILURE_MESSAGES.get(error)
    if template is None:
        raise CommandError(f"the decision machine {described['status']}: {error} {described.get('cause', '')} ({execution})")
    raise CommandError(template.format(id=args.incident_id, state=_state_note(args)))


def _state_note(args: argparse.Namespace) -> str:
    """`` (it is CLOSED)`` from the ledger, or nothing when the ledger cannot say."""
    try:
        incident = Ledger(_ledger_table(args)).get(args.incident_id)
        decided = incident.decision
        # A late or second decision says what the incident is doing now, and whose decision it follows.
        by = f", after {decided.decision} by {decided.reviewer}" if decided is not None else ""
        return f" (it is {incident.state.value}{by})"
    except (CommandError, IncidentNotFound, ClientError, BotoCoreError):  # only a note on a message already failing
        return ""


def _stack_outputs(stack: str) -> dict[str, str]:
    """The stack's outputs; none when there is no such stack. Missing credentials propagate."""
    try:
        described = boto3.client("cloudformation").describe_stacks(StackName=stack)["Stacks"][0]
    except (NoCredentialsError, NoRegionError):
        raise  # the user must hear about these, not about a missing table
    except (ClientError, BotoCoreError):  # no such stack, or no CloudFormation to ask: the caller says what to pass instead
        return {}
    return {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}


def _ledger_table(args: argparse.Namespace) -> str:
    if args.table:
        return str(args.table)
    table = _stack_outputs(args.stack_name).get("LedgerTableName")
    if not table:
        raise CommandError(f"no ledger table: pass --table, set SDCGUARD_LEDGER_TABLE, or deploy stack {args.stack_name!r}")
    return table


def _decide_machine(args: argparse.Namespace) -> str:
    if args.state_machine_arn:
        return str(args.state_machine_arn)
    arn = _stack_outputs(args.stack_name).get("DecideStateMachineArn")
    if arn:
        return arn
    machines = [
        m["stateMachineArn"]
        for page in boto3.client("stepfunctions").get_paginator("list_state_machines").paginate()
        for m in page["stateMachines"]
        if m["name"].lower().endswith("decide")
    ]
    if len(machines) == 1:
        return machines[0]
    raise CommandError(
        "cannot tell which decision machine to start "
        f"({len(machines)} named *decide); pass --state-machine-arn or --stack-name"
    )
