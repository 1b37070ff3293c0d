"""Node checks: replay the alarm's capsule on a node, as a Kubernetes Job, and record what it says.

Two uses, one mechanism. Before approval, the capsule is replayed on the
cordoned suspect (``reproduce``): "reproduced 5/5: persistent" tells the
reviewer the hardware gets this computation wrong every time; "reproduced
0/5" that it did not do so again. It decides nothing on its own. After a
replacement, the capsule is replayed on every new node (``qualify``): the job
resumes onto a node only when it gave the healthy bits N times out of N.

Each check is a batch/v1 Job in the PyTorchJob's namespace that runs the
pipeline's own image (``NodeCheckImage``, by digest) as the pipeline's own
service account (:data:`SERVICE_ACCOUNT`), with nothing of the training's
but its GPU request, pinned to the node by its hostname label and tolerating
sdcguard's quarantine taint and the cordon's, running ``sdcguard replay
<capsule> --repeat N --json``. A tenant of the namespace can create pods,
Jobs and logs there, so nothing is believed by its name: the Job is created
carrying a nonce the ledger stored first (a Job of that name made by anyone
else is not adopted), its uid is recorded, and only a pod it controls, on
the checked node, is read. Its answer is the last line of that pod's log
that parses as the replay report (or, when there is none, the container's
exit code); a Job or a report that shows an injected fault
(``SDCGUARD_INJECT``) is refused. The capsule lives beside the
checkpoints, one per localised suspect rank (``<checkpoint prefix>/capsules/
step-<step>-rank-<rank>``, the agent's naming restated here: the Lambda
package never imports the agent, which needs torch), and it counts only once
its ``CAPSULE.json`` exists.

A check that cannot be run (no capsule, the Job refused) is recorded as
skipped, one that ran without an answer (unusable capsule, deadline, no
report) as inconclusive: for the suspect either way the flow goes on to the
reviewer, who sees why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from botocore.exceptions import ClientError
from kubernetes import client as k8s

from sdcguard.contract import Incident, IncidentState, NodeCheck, Replacement
from sdcguard.contract.incident import REPLACEMENT_REJECTED
from sdcguard.contract.naming import NODE_PREFIX
from sdcguard.lambdas.cordon import TAINT_KEY
from sdcguard.lambdas.errors import IncidentNotWaiting
from sdcguard.lambdas.kube_errors import kubernetes_errors
from sdcguard.lambdas.ledger import Ledger

S = IncidentState
Purpose = Literal["reproduce", "qualify"]

CAPSULES_DIR = "capsules"
CAPSULE_MANIFEST = "CAPSULE.json"
CONTAINER = "sdcguard-replay"
TTL_SECONDS_AFTER_FINISHED = 3600
HOSTNAME_LABEL = "kubernetes.io/hostname"
LABEL_NAME, LABEL_INCIDENT, LABEL_PURPOSE, LABEL_NODE = (
    "app.kubernetes.io/name", "sdcguard.io/incident", "sdcguard.io/purpose", "sdcguard.io/node",
)  # fmt: skip
SERVICE_ACCOUNT = "sdcguard-node-check"
"""The pipeline's service account the replay pods run as (infra/deploy/rbac-namespace.yaml), not the training's."""
ANNOTATION_NONCE = "sdcguard.io/nonce"
INJECT_ENV = "SDCGUARD_INJECT"
"""The fault injector's variable (sdcguard.agent.testing.inject): a check that runs with it answers what it was told."""
EXIT_OUTCOMES = {0: "match", 1: "mismatch", 2: "unusable"}
"""``sdcguard replay``'s exit codes."""
LOG_TAIL_LINES = 200


def capsule_location(checkpoint_prefix: str, step: int, rank: int) -> str:
    """Where the agent writes the capsule of ``rank``'s step ``step`` (sdcguard.agent.capsule.capsule_dir's naming)."""
    return f"{checkpoint_prefix.rstrip('/')}/{CAPSULES_DIR}/step-{step:09d}-rank-{rank:05d}"


def capsule_committed(location: str, s3: Any) -> str | None:
    """None when the capsule at ``location`` is committed (its ``CAPSULE.json`` exists), else why not.

    Only an ``s3://`` location can be checked (and read by a Job). A throttled
    or failing S3 call propagates: it says nothing about the capsule.
    """
    if not location.startswith("s3://"):
        return f"no replay capsule at {location} (not an S3 location a Job could read)"
    bucket, _, key = location[len("s3://"):].partition("/")
    try:
        s3.head_object(Bucket=bucket, Key=f"{key}/{CAPSULE_MANIFEST}")
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NotFound"):
            return f"no replay capsule at {location}"
        if code in ("403", "AccessDenied", "Forbidden"):
            # S3 answers 403 for a missing key to a caller without ListBucket: the capsule may not exist.
            return f"no readable replay capsule at {location} (S3 denied access)"
        raise
    return None


def job_name(purpose: Purpose, incident_id: str, node: str) -> str:
    """``sdcguard-<purpose>-<short incident id>-<short node>``: at most 63 characters, a DNS-1123 label.

    The node part drops HyperPod's ``hyperpod-`` prefix; a node name too long
    (or changed to fit) carries a digest of the full name so two nodes never
    share a Job name.
    """
    short_incident = re.sub(r"[^a-z0-9]", "", incident_id.lower().removeprefix("sdc-"))[:10]
    head = f"sdcguard-{purpose}-{short_incident}-"
    short_node = re.sub(r"[^a-z0-9-]", "-", node.lower().removeprefix(NODE_PREFIX)).strip("-")
    room = 63 - len(head)
    if len(short_node) > room or short_node != node.lower().removeprefix(NODE_PREFIX):
        digest = hashlib.sha256(node.encode()).hexdigest()[:8]
        short_node = f"{short_node[: room - 9].strip('-')}-{digest}".strip("-")
    return head + short_node


# -- what to check ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One node to check, and the capsules that may be replayed on it, best first."""

    node: str
    instance_id: str | None
    capsules: tuple[str, ...]


def reproduce_targets(incident: Incident) -> list[Target]:
    """One per suspect node: the capsules of the suspect ranks on that node, lowest rank first."""
    alarm = incident.alarm
    by_node: dict[str, list[int]] = {}
    instance_of: dict[str, str] = {}
    for suspect in incident.suspects:
        by_node.setdefault(suspect.node, []).append(suspect.global_rank)
        instance_of[suspect.node] = suspect.instance_id
    return [
        Target(
            node=node,
            instance_id=instance_of[node],
            capsules=tuple(capsule_location(alarm.checkpoint_prefix, alarm.step, r) for r in sorted(ranks)),
        )
        for node, ranks in sorted(by_node.items())
    ]


def origin_of(incident: Incident, instance_id: str) -> str:
    """The suspect instance that ``instance_id`` ultimately replaces (through replacements that were rejected)."""
    seen: set[str] = set()
    current = instance_id
    while current not in seen:
        seen.add(current)
        previous = next((r.old_instance_id for r in incident.replacements if r.new_instance_id == current), None)
        if previous is None:
            return current
        current = previous
    return current


def qualify_targets(incident: Incident) -> list[Target]:
    """One per new node of the replacements that still stand: the capsules of the suspects it replaces first,
    then any other capsule of the incident (any capsule holds a computation with known healthy bits)."""
    alarm = incident.alarm
    every = [capsule_location(alarm.checkpoint_prefix, alarm.step, r) for r in sorted({s.global_rank for s in incident.suspects})]
    out = []
    for replacement in current_replacements(incident):
        new = replacement.new_instance_id
        assert new is not None  # current_replacements keeps only those with a new instance
        origin = origin_of(incident, replacement.old_instance_id)
        own = [
            capsule_location(alarm.checkpoint_prefix, alarm.step, s.global_rank)
            for s in sorted(incident.suspects, key=lambda s: s.global_rank)
            if s.instance_id == origin
        ]
        out.append(Target(node=NODE_PREFIX + new, instance_id=new, capsules=tuple(dict.fromkeys([*own, *every]))))
    return out


REJECTED = REPLACEMENT_REJECTED


def current_replacements(incident: Incident) -> list[Replacement]:
    """The replacements whose new node runs and was not rejected: the nodes the job would resume onto."""
    return [r for r in incident.replacements if r.new_instance_id and r.status != REJECTED]


# -- the Job ----------------------------------------------------------------------------------------


class JobSourceMissing(Exception):
    """The PyTorchJob has no Worker (or Master) container to copy the image and GPU request from."""


def worker_container(pytorchjob: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The PyTorchJob's Worker replica's first container (the Master's when there is no Worker), and the pod
    template's service account. Raises :class:`JobSourceMissing`."""
    specs = (pytorchjob.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    for replica in ("Worker", "Master"):
        pod_spec = (((specs.get(replica) or {}).get("template") or {}).get("spec")) or {}
        containers = pod_spec.get("containers") or []
        if containers and containers[0].get("image"):
            return containers[0], pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount")
    raise JobSourceMissing("the PyTorchJob has no Worker or Master container with an image")


def job_manifest(
    *,
    name: str,
    namespace: str,
    purpose: Purpose,
    incident_id: str,
    node: str,
    capsule: str,
    repeats: int,
    deadline_seconds: int,
    image: str,
    nonce: str,
    resources: dict[str, Any] | None = None,
    region: str = "",
    factories: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The batch/v1 Job that replays ``capsule`` ``repeats`` times on ``node`` (see the module docstring).

    ``factories`` are the only capsule factories its replay may import (``--allow-factory``, the pipeline's
    ``NodeCheckFactories``): a capsule is untrusted input, and the training's environment is not passed on.

    It runs ``image`` (the pipeline's) as :data:`SERVICE_ACCOUNT`, with no
    environment of the training's: ``NODE_NAME`` from the downward API (so
    the report names the node it really ran on) and ``AWS_REGION``. Only the
    GPU request (``resources``) is the training's, so the replay gets the same
    devices. The Job carries ``nonce`` (annotation :data:`ANNOTATION_NONCE`).
    """
    env: list[dict[str, Any]] = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    if region:
        env.append({"name": "AWS_REGION", "value": region})
    replay: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": ["sdcguard", "replay", capsule, "--repeat", str(repeats), "--json",
                    *(arg for factory in factories for arg in ("--allow-factory", factory))],
        "env": env,
    }
    if resources:
        replay["resources"] = resources
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": SERVICE_ACCOUNT,
        # It needs no Kubernetes API; its AWS credentials come from the account's role binding (Pod Identity, IRSA).
        "automountServiceAccountToken": False,
        "nodeSelector": {HOSTNAME_LABEL: node},
        "tolerations": [
            {"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
        ],
        "containers": [replay],
    }
    labels = {LABEL_NAME: "sdcguard", LABEL_INCIDENT: incident_id, LABEL_PURPOSE: purpose, LABEL_NODE: node}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": {ANNOTATION_NONCE: nonce}},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": deadline_seconds,
            "ttlSecondsAfterFinished": TTL_SECONDS_AFTER_FINISHED,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


# -- reading a result ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What a finished Job said: the node's state and the repetitions behind it."""

    state: Literal["passed", "failed", "inconclusive"]
    matched: int
    reproduced: int
    repeats: int
    why: str = ""
    """For inconclusive: the reason."""
    foreign: bool = False
    """The Job read is not the one the pipeline created: it is left as it is (never deleted)."""


def parse_report(log: str) -> dict[str, Any] | None:
    """The last line of ``log`` that is a JSON object with an ``outcome`` key (``sdcguard replay --json``)."""
    for line in reversed(log.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and "outcome" in value:
            return value
    return None


def answer_from_report(report: dict[str, Any], *, node: str, repeats: int, accept_injected: bool = False) -> Answer:
    """The answer of a replay report; a report from another node, one that does not add up, or one that says a
    fault was injected (unless ``accept_injected``: the stand-in's simulated GPUs), is inconclusive."""
    injection = report.get("injection")
    if injection and not accept_injected:
        return Answer(
            "inconclusive", 0, 0, repeats,
            f"refused: the replay reports an injected fault ({str(injection)[:120]}), not the node's own answer",
        )  # fmt: skip
    ran_on = report.get("node")
    if ran_on and ran_on != node:
        return Answer("inconclusive", 0, 0, repeats, f"the replay reports node {ran_on}, not {node}")
    outcome = report.get("outcome")
    matched, reproduced = report.get("matched"), report.get("reproduced")
    n = report.get("repeats", repeats)
    if outcome == "unusable":
        reasons = report.get("reasons") or []
        why = f"{report.get('problem') or 'unusable'}: {reasons[0] if reasons else 'no reason given'}"
        return Answer("inconclusive", 0, 0, repeats, f"capsule unusable on {node}: {why}")
    if not (isinstance(matched, int) and isinstance(reproduced, int) and isinstance(n, int)) or matched + reproduced != n:
        return Answer("inconclusive", 0, 0, repeats, f"the replay report does not add up: {str(report)[:200]}")
    if outcome == "match" and reproduced == 0:
        return Answer("passed", matched, 0, n)
    if outcome == "mismatch" and reproduced > 0:
        return Answer("failed", matched, reproduced, n)
    return Answer("inconclusive", 0, 0, repeats, f"the replay report's outcome {outcome!r} does not match its counts")


def answer_from_exit_code(code: int | None, *, repeats: int) -> Answer:
    """The answer from the exit code alone (no report in the log): 0 passed (every repetition matched),
    anything else inconclusive. Exit code 1 would mean a mismatch, but an uncaught exception exits 1 too, so
    without the report it is not taken as one: a crash is never "reproduced"."""
    outcome = EXIT_OUTCOMES.get(code) if code is not None else None
    if outcome == "match":
        return Answer("passed", repeats, 0, repeats, "exit code 0, no report in the log")
    if outcome == "mismatch":
        # A crash (an uncaught Python exception) exits 1 as well: without the report, 1 says nothing.
        return Answer("inconclusive", 0, 0, repeats, "exit code 1 and no report in the log (a crash exits 1 too)")
    if outcome == "unusable":
        return Answer("inconclusive", 0, 0, repeats, "capsule unusable (exit code 2, no report in the log)")
    what = "no exit code" if code is None else f"exit code {code}"
    return Answer("inconclusive", 0, 0, repeats, f"{what} and no report in the log")


def describe(check: NodeCheck) -> str:
    """The one-line summary of a finished check (see :class:`sdcguard.contract.NodeCheck.summary`)."""
    n = check.repeats
    if check.purpose == "reproduce":
        if check.state == "skipped":
            return check.summary if check.summary.startswith("not run") else f"not run: {check.summary}"
        if check.state == "inconclusive":
            return check.summary if check.summary.startswith("inconclusive") else f"inconclusive: {check.summary}"
        if check.state == "passed":
            return f"reproduced 0/{n}"
        kind = "persistent" if check.reproduced == n else "intermittent"
        return f"reproduced {check.reproduced}/{n}: {kind}"
    if check.state == "passed":
        return f"qualified {check.matched}/{n} on {check.node}"
    if check.state == "failed":
        return f"not qualified on {check.node}: {check.reproduced}/{n} repetitions wrong"
    return f"not qualified on {check.node}: {check.summary}"


def finish(check: NodeCheck, answer: Answer) -> NodeCheck:
    """``check`` with the answer recorded and its summary written."""
    done = check.model_copy(
        update={
            "state": answer.state,
            "matched": answer.matched,
            "reproduced": answer.reproduced,
            "repeats": answer.repeats,
            "summary": answer.why,
            "finished_at": datetime.now(UTC),
        }
    )
    return done.model_copy(update={"summary": describe(done)[:1024]})


def skipped(purpose: Purpose, target: Target, why: str, *, capsule: str = "", repeats: int = 0) -> NodeCheck:
    """A check that was never run, with why."""
    now = datetime.now(UTC)
    check = NodeCheck(
        purpose=purpose, node=target.node, instance_id=target.instance_id, capsule=capsule, repeats=repeats,
        state="skipped", summary=f"not run: {why}"[:1024], started_at=now, finished_at=now,
    )  # fmt: skip
    return check.model_copy(update={"summary": describe(check)[:1024]})


# -- the ledger ---------------------------------------------------------------------------------------


def with_checks(incident: Incident, checks: Iterable[NodeCheck], *, actor: str) -> Incident:
    """``incident`` with ``checks`` recorded, each replacing the one of the same purpose and node."""
    checks = list(checks)
    if not checks:
        return incident
    keys = {(c.purpose, c.node) for c in checks}
    kept = [c for c in incident.node_checks if (c.purpose, c.node) not in keys]
    return incident.advance(incident.state, actor=actor, node_checks=[*kept, *checks])


def checks_of(incident: Incident, purpose: Purpose, nodes: Iterable[str] | None = None) -> list[NodeCheck]:
    """The incident's checks of ``purpose`` (on ``nodes`` only, when given)."""
    wanted = set(nodes) if nodes is not None else None
    return [c for c in incident.node_checks if c.purpose == purpose and (wanted is None or c.node in wanted)]


# -- starting -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """What :func:`start_checks` did, counting the checks an earlier attempt started too."""

    started: int
    """Checks with a Job (running, or already finished)."""
    skipped: int


STAGE: dict[str, frozenset[IncidentState]] = {
    "reproduce": frozenset({S.CORDONED}),
    "qualify": frozenset({S.REPLACED}),
}
"""Where each check belongs: reproduction after the cordon, before the evidence; qualification after the
replacement runs, before the pointer is rewritten."""


def start_checks(
    ledger: Ledger,
    api: k8s.ApiClient,
    incident_id: str,
    purpose: Purpose,
    *,
    repeats: int,
    deadline_seconds: int,
    s3: Any,
    image: str,
    region: str = "",
    factories: tuple[str, ...] = (),
    actor: str = "start_node_check",
) -> Started:
    """Create one replay Job per node to check (see :func:`reproduce_targets`, :func:`qualify_targets`) running
    ``image`` (the pipeline's; empty: nothing is run), whose replay may import only ``factories``, and record each check in the ledger as running, with the
    created Job's uid; a node whose capsule is missing, whose Job the API refused, or whose Job name is taken by a
    Job the pipeline did not create, is recorded as skipped with the reason (that Job is left alone).

    Each Job's nonce is in the ledger (``node_check_nonces``) before the Job is created; a Job of the name that
    exists already is adopted only when it carries that nonce (an earlier attempt's). Idempotent: a node
    already checked for ``purpose`` is not started again.

    Raises :class:`IncidentNotWaiting` when the incident is not at the check's stage (:data:`STAGE`), and
    :class:`TransientKubernetesError` for an API failure worth retrying.
    """
    incident = ledger.get(incident_id)
    if incident.state not in STAGE[purpose]:
        raise IncidentNotWaiting(
            f"incident {incident_id} is {incident.state.value}; a {purpose} check runs in "
            + " or ".join(sorted(s.value for s in STAGE[purpose]))
        )
    targets = reproduce_targets(incident) if purpose == "reproduce" else qualify_targets(incident)
    done = {c.node for c in checks_of(incident, purpose)}
    todo = [t for t in targets if t.node not in done]
    namespace = incident.alarm.job.namespace
    new: list[NodeCheck] = []
    planned: list[tuple[Target, str, str, dict[str, Any] | None]] = []  # target, Job name, capsule, resources
    source: dict[str, Any] | None = None
    source_problem = ""
    for target in todo:
        if not image:
            new.append(skipped(purpose, target, "no NodeCheckImage is configured (the pipeline's replay image)", repeats=repeats))
            continue
        capsule, missing = _first_committed(target.capsules, s3)
        if capsule is None:
            new.append(skipped(purpose, target, missing, repeats=repeats))
            continue
        if source is None and not source_problem:
            source, source_problem = _read_source(api, namespace, incident.alarm.job.job_name)
        if source is None:
            new.append(skipped(purpose, target, source_problem, capsule=capsule, repeats=repeats))
            continue
        planned.append((target, job_name(purpose, incident_id, target.node), capsule, source.get("resources")))

    # The nonces are written before any Job is created: a retry finds them, and so knows its own Jobs.
    nonces = dict(incident.node_check_nonces)
    wanted = {name: nonces.get(name) or uuid.uuid4().hex for _, name, _, _ in planned}
    if any(name not in nonces for name in wanted):
        incident = ledger.update(
            incident_id,
            lambda current: current.model_copy(
                update={"node_check_nonces": {**wanted, **current.node_check_nonces}}
            ),
        )
        nonces = dict(incident.node_check_nonces)
    for target, name, capsule, resources in planned:
        manifest = job_manifest(
            name=name, namespace=namespace, purpose=purpose, incident_id=incident_id, node=target.node,
            capsule=capsule, repeats=repeats, deadline_seconds=deadline_seconds, image=image, nonce=nonces[name],
            resources=resources, region=region, factories=factories,
        )  # fmt: skip
        uid, refused = _create(api, namespace, manifest)
        if refused:
            new.append(skipped(purpose, target, refused, capsule=capsule, repeats=repeats).model_copy(update={"image": image}))
            continue
        running = NodeCheck(
            purpose=purpose, node=target.node, instance_id=target.instance_id, job=name, capsule=capsule,
            repeats=repeats, state="running", started_at=datetime.now(UTC), image=image, job_uid=uid,
            summary=f"replaying {capsule.rsplit('/', 1)[-1]} {repeats} times on {target.node}",
        )  # fmt: skip
        new.append(running)

    def record(current: Incident) -> Incident:
        already = {c.node for c in checks_of(current, purpose)}
        return with_checks(current, [c for c in new if c.node not in already], actor=actor)

    incident = ledger.update(incident_id, record)
    # Counted from the ledger, so a retried start answers as the first did.
    wanted_nodes = {t.node for t in targets}
    recorded = [c for c in checks_of(incident, purpose) if c.node in wanted_nodes]
    return Started(started=sum(c.state != "skipped" for c in recorded), skipped=sum(c.state == "skipped" for c in recorded))


def _first_committed(capsules: Iterable[str], s3: Any) -> tuple[str | None, str]:
    first_reason = ""
    for capsule in capsules:
        reason = capsule_committed(capsule, s3)
        if reason is None:
            return capsule, ""
        first_reason = first_reason or reason
    return None, first_reason or "no replay capsule: the alarm names no suspect rank"


def _read_source(api: k8s.ApiClient, namespace: str, name: str) -> tuple[dict[str, Any] | None, str]:
    """The training's Worker container (for its GPU request only), or why it cannot be read."""
    what = f"PyTorchJob {namespace}/{name}"
    with kubernetes_errors(what):
        try:
            job = k8s.CustomObjectsApi(api).get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name)
        except k8s.exceptions.ApiException as exc:
            if exc.status in (403, 404):
                return None, f"cannot read {what} for its GPU request (HTTP {exc.status})"
            raise
    try:
        return worker_container(job)[0], ""
    except JobSourceMissing as exc:
        return None, f"{what}: {exc}"


def _create(api: k8s.ApiClient, namespace: str, manifest: dict[str, Any]) -> tuple[str, str]:
    """Create the Job: (its uid, "") when the pipeline's Job exists afterwards, else ("", why not).

    A 409 is an earlier attempt's Job only when it carries this manifest's
    nonce; one that does not was made by someone else: refused, and left as it is.
    """
    name = manifest["metadata"]["name"]
    nonce = manifest["metadata"]["annotations"][ANNOTATION_NONCE]
    batch = k8s.BatchV1Api(api)
    with kubernetes_errors(f"job {namespace}/{name}"):
        try:
            created = batch.create_namespaced_job(namespace, manifest)
            return _uid(created), ""
        except k8s.exceptions.ApiException as exc:
            if exc.status is not None and 400 <= exc.status < 500 and exc.status not in (409, 429):
                return "", f"the Job was refused: HTTP {exc.status} {exc.reason}: {_message(exc)}"
            if exc.status != 409:
                raise
        existing = batch.read_namespaced_job(name, namespace)
    carried = ((existing.metadata.annotations or {}) if existing.metadata else {}).get(ANNOTATION_NONCE)
    if carried != nonce:
        return "", (
            f"a Job {namespace}/{name} exists that the pipeline did not create (it does not carry the nonce the "
            "ledger recorded before creating it): not adopted, not read, not deleted"
        )
    return _uid(existing), ""


def _uid(job: Any) -> str:
    if isinstance(job, dict):  # what a create answers when the client does not deserialise it
        return str((job.get("metadata") or {}).get("uid") or "")
    return str(getattr(job.metadata, "uid", "") or "") if job.metadata else ""


def _message(exc: k8s.exceptions.ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message", ""))[:300]
    except (ValueError, AttributeError):
        return str(exc.body or "")[:300]


# -- polling ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """Where an incident's checks of one purpose stand after one poll."""

    done: bool
    summary: str
    qualified: bool | None
    """qualify: True when every new node passed, False when one failed or had no answer, None when none
    was checked (no capsule). Always None for reproduce."""
    failed_instance_ids: list[str]
    gave_up: bool = False
    """Checks were still running when the wait loop's bound was reached (recorded as inconclusive)."""


def poll_checks(
    ledger: Ledger,
    api: k8s.ApiClient,
    incident_id: str,
    purpose: Purpose,
    *,
    give_up: bool = False,
    accept_injected: bool = False,
    actor: str = "node_check_status",
) -> Progress:
    """Read each running check's Job once; record the finished ones (deleting their Jobs).

    With ``give_up`` (the wait loop's bound reached), a check still running is
    recorded as inconclusive and its Job deleted. A Job that vanished is
    inconclusive; one that is not the Job the check created is refused and left
    alone. ``accept_injected``: see :func:`answer_from_report`. Raises
    :class:`TransientKubernetesError`.
    """
    incident = ledger.get(incident_id)
    namespace = incident.alarm.job.namespace
    finished: list[NodeCheck] = []
    gave_up = False
    for check in checks_of(incident, purpose):
        if check.finished:
            continue
        answer = read_answer(api, namespace, check, accept_injected=accept_injected)
        if answer is None and give_up:
            gave_up = True
            answer = Answer("inconclusive", 0, 0, check.repeats, "the Job did not finish within the wait loop's bound")
        if answer is None:
            continue
        if not answer.foreign:  # a Job someone else made is theirs: not deleted
            delete_job(api, namespace, check.job)
        finished.append(finish(check, answer))

    def record(current: Incident) -> Incident:
        running = {c.node for c in checks_of(current, purpose) if not c.finished}
        return with_checks(current, [c for c in finished if c.node in running], actor=actor)

    incident = ledger.update(incident_id, record) if finished else incident
    return dataclasses.replace(progress(incident, purpose), gave_up=gave_up)


def progress(incident: Incident, purpose: Purpose) -> Progress:
    """The state of ``purpose``'s checks as the ledger records them."""
    if purpose == "reproduce":
        checks = checks_of(incident, purpose, [t.node for t in reproduce_targets(incident)])
        done = all(c.finished for c in checks)
        return Progress(done=done, summary=reproduce_summary(checks), qualified=None, failed_instance_ids=[])
    nodes = [t.node for t in qualify_targets(incident)]
    checks = checks_of(incident, purpose, nodes)
    done = all(c.finished for c in checks) and {c.node for c in checks} >= set(nodes)
    failed = sorted(c.instance_id for c in checks if c.state in ("failed", "inconclusive") and c.instance_id)
    qualified: bool | None
    if not done:
        qualified = None
    elif failed:
        qualified = False
    elif checks and all(c.state == "passed" for c in checks):
        qualified = True
    else:
        qualified = None  # skipped: no capsule to qualify with
    return Progress(done=done, summary=qualify_summary(checks), qualified=qualified, failed_instance_ids=failed)


def reproduce_summary(checks: list[NodeCheck]) -> str:
    """``reproduced 5/5: persistent`` for one suspect node; ``<node>: ...; <node>: ...`` for several."""
    if not checks:
        return "not run: no suspect node"
    if len(checks) == 1:
        return checks[0].summary
    return "; ".join(f"{c.node}: {c.summary}" for c in checks)


def qualify_summary(checks: list[NodeCheck]) -> str:
    """``qualified 5/5 on <node>`` per new node, joined; ``not qualified: no capsule`` when none was run."""
    if not checks:
        return "not qualified: no new node to check"
    return "; ".join(c.summary for c in checks)


def read_answer(api: k8s.ApiClient, namespace: str, check: NodeCheck, *, accept_injected: bool = False) -> Answer | None:
    """The answer of ``check``'s Job, or None while it runs. Raises :class:`TransientKubernetesError`.

    Only the Job whose uid the check recorded counts, and only the one pod it
    controls on the checked node; anything else (another Job of the name, a
    second pod claiming the Job, a Job or report with an injected fault) is
    refused as inconclusive.
    """
    batch, core = k8s.BatchV1Api(api), k8s.CoreV1Api(api)
    with kubernetes_errors(f"job {namespace}/{check.job}"):
        try:
            job = batch.read_namespaced_job(check.job, namespace)
        except k8s.exceptions.ApiException as exc:
            if exc.status == 404:
                return Answer("inconclusive", 0, 0, check.repeats, f"the Job {check.job} is gone (deleted before it was read)")
            raise
    refused = _not_ours(job, check)
    if refused:
        return Answer("inconclusive", 0, 0, check.repeats, f"refused: {refused}", foreign=True)
    state = job_state(job)
    if state is None:
        return None
    with kubernetes_errors(f"pods of job {namespace}/{check.job}"):
        listed = core.list_namespaced_pod(
            namespace, label_selector=f"job-name={check.job}", field_selector=f"spec.nodeName={check.node}"
        ).items
    pods = [p for p in listed if _controlled_by(p, check.job_uid) and _node_of(p) == check.node]
    if len(pods) > 1:
        names = ", ".join(sorted(str(p.metadata.name) for p in pods))
        return Answer("inconclusive", 0, 0, check.repeats, f"refused: {len(pods)} pods claim to be the Job's one pod ({names})")
    pod = pods[0] if pods else None
    if state == "DeadlineExceeded":
        return Answer("inconclusive", 0, 0, check.repeats, f"deadline: the Job ran past its deadline{_why_not_run(pod)}")
    if pod is None:
        return Answer("inconclusive", 0, 0, check.repeats, "the Job finished without a pod on the node")
    log = ""
    with kubernetes_errors(f"log of pod {namespace}/{pod.metadata.name}"):
        try:
            log = read_log(core, pod.metadata.name, namespace)
        except k8s.exceptions.ApiException as exc:
            if exc.status not in (400, 404):  # no log (never started, or gone): fall back on the exit code
                raise
    report = parse_report(log or "")
    if report is not None:
        return answer_from_report(report, node=check.node, repeats=check.repeats, accept_injected=accept_injected)
    return answer_from_exit_code(_exit_code(pod), repeats=check.repeats)


def _not_ours(job: Any, check: NodeCheck) -> str:
    """Why ``job`` is not the Job ``check`` created and may not be believed, or ""."""
    uid = str(getattr(job.metadata, "uid", "") or "") if job.metadata else ""
    if not check.job_uid or uid != check.job_uid:
        return f"the Job {check.job} (uid {uid or 'none'}) is not the one the pipeline created (uid {check.job_uid or 'not recorded'})"
    template = job.spec.template.spec if job.spec and job.spec.template and job.spec.template.spec else None
    for container in (template.containers or []) if template else []:
        if any(e.name == INJECT_ENV for e in container.env or []):
            return f"the Job {check.job} runs with {INJECT_ENV} in its environment: its answer is what it was told"
        if check.image and container.image != check.image:
            return f"the Job {check.job} runs image {container.image}, not the pipeline's {check.image}"
    return ""


def _controlled_by(pod: Any, uid: str) -> bool:
    owners = (pod.metadata.owner_references or []) if pod.metadata else []
    return bool(uid) and any(o.controller and o.kind == "Job" and o.uid == uid for o in owners)


def _node_of(pod: Any) -> str | None:
    return pod.spec.node_name if pod.spec else None


def read_log(core: k8s.CoreV1Api, pod: str, namespace: str) -> str:
    """The replay container's log (its last :data:`LOG_TAIL_LINES` lines), as text.

    Read raw: the client (36.x) deserialises a ``str`` response from bytes
    that it did not decode, handing back the ``b'...'`` repr of the log, in
    which no line is the report.
    """
    response = core.read_namespaced_pod_log(
        pod, namespace, container=CONTAINER, tail_lines=LOG_TAIL_LINES, _preload_content=False
    )
    data = response.data
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)


def job_state(job: Any) -> str | None:
    """None while the Job runs; else ``Complete``, ``Failed`` or ``DeadlineExceeded``."""
    status = job.status
    if status is None:
        return None
    for condition in status.conditions or []:
        if condition.status == "True" and condition.type in ("Complete", "Failed"):
            return "DeadlineExceeded" if condition.reason == "DeadlineExceeded" else condition.type
    if (status.succeeded or 0) >= 1:
        return "Complete"
    if (status.failed or 0) >= 1:
        return "Failed"
    return None


def _exit_code(pod: Any) -> int | None:
    for status in (pod.status.container_statuses or []) if pod.status else []:
        terminated = status.state.terminated if status.state else None
        if terminated is not None:
            return int(terminated.exit_code)
    return None


def _why_not_run(pod: Any) -> str:
    if pod is None:
        return " (no pod was created)"
    conditions = (pod.status.conditions or []) if pod.status else []
    unscheduled = next((c for c in conditions if c.type == "PodScheduled" and c.status == "False"), None)
    if unscheduled is not None:
        return f" (the pod was never scheduled: {unscheduled.reason or ''} {unscheduled.message or ''})".replace("  ", " ")
    return ""


def delete_job(api: k8s.ApiClient, namespace: str, name: str) -> None:
    """Delete the Job and its pods (background propagation); one already gone is fine."""
    if not name:
        return
    with kubernetes_errors(f"job {namespace}/{name}"):
        try:
            k8s.BatchV1Api(api).delete_namespaced_job(name, namespace, propagation_policy="Background")
        except k8s.exceptions.ApiException as exc:
            if exc.status != 404:
                raise
