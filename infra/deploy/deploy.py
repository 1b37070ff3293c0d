"""``sdcguard deploy``: package the pipeline, upload it, and create or update its stack.

One code path for AWS and the local stand-in: every client comes from a boto3
session, which honours ``AWS_ENDPOINT_URL`` (as ``sdcguard local up`` prints
it). The only difference is the package's target: the Lambda runtime (Python
3.12) on AWS, the interpreter running the stand-in when ``AWS_ENDPOINT_URL`` is
set (see :mod:`sdcguard.infra.deploy.package`); ``--python-version``/``--architecture``
override either.

Steps: check the parameter overrides against the template (unknown names,
values outside AllowedValues/AllowedPattern, missing required ones: refused
before anything changes) and against the rules a single value cannot state
(who may publish on the bus; the replacement wait's polls within the
execution history limit); look up the HyperPod cluster's ARN; build or reuse
the package; upload it, the state machine definitions and the template to the
code bucket (created if needed; objects are named by content hash, so an
unchanged tree uploads nothing); create or update the stack; print its events
as they arrive; print the outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import ClientError

from sdcguard.infra.deploy.cfn_yaml import load_template
from sdcguard.infra.deploy.execution_history import POLL_LOOPS, ROUNDS, HistoryBudgetError, check_budget
from sdcguard.infra.deploy.package import (
    LAMBDA_TARGET,
    Package,
    PackageError,
    Target,
    build_package,
    local_target,
)
from sdcguard.infra.deploy.stack_events import StackTimeout, follow, last_event

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = Path(__file__).resolve().with_name("template.yaml")
DEFINITIONS = {
    "IncidentDefinitionKey": ROOT / "stepfunctions" / "incident.asl.json",
    "DecideDefinitionKey": ROOT / "stepfunctions" / "decide.asl.json",
}
# Parameters the deploy script fills in itself; an override of these is refused.
MANAGED = frozenset({"CodeBucket", "CodeKey", "IncidentDefinitionKey", "DecideDefinitionKey"})
STACK_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,44}$")  # 45: the function names append "-replacement-status"
UNUSABLE = frozenset({"ROLLBACK_COMPLETE", "ROLLBACK_FAILED", "DELETE_FAILED", "CREATE_FAILED"})


STANDIN_NODE_CHECK_IMAGE = "sdcguard/node-check@sha256:" + hashlib.sha256(b"the stand-in runs no images").hexdigest()
"""NodeCheckImage on the local stand-in when none is given: it runs every container as a local process."""

STANDIN_NODE_CHECK_FACTORIES = "sdcguard.agent.testing.train:replay_model"
"""NodeCheckFactories on the local stand-in when none is given: the reference job's capsule factory (its Jobs run
this checkout, which holds it)."""


class DeployError(RuntimeError):
    """The deployment was refused or failed; the message says what to fix."""


@dataclass
class DeployResult:
    """What a deployment did."""

    stack_name: str
    stack_id: str
    status: str
    outputs: dict[str, str]
    changed: bool
    """False when the stack already matched (no update was needed)."""
    package: Package
    code_bucket: str
    uploaded: list[str] = field(default_factory=list)
    """Keys uploaded by this run (empty when everything was already there)."""

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready summary (``sdcguard deploy --json``)."""
        return {
            "stack_name": self.stack_name,
            "stack_id": self.stack_id,
            "status": self.status,
            "changed": self.changed,
            "outputs": self.outputs,
            "code_bucket": self.code_bucket,
            "package": {
                "sha256": self.package.sha256,
                "target": str(self.package.target),
                "cached": self.package.cached,
                "size": self.package.size,
                "seconds": round(self.package.seconds, 2),
            },
            "uploaded": self.uploaded,
        }


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
    """``Key=Value`` strings as a dict. Raises :class:`DeployError` naming a malformed or repeated item."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DeployError(f"parameter override {item!r}: expected Key=Value")
        if key in out:
            raise DeployError(f"parameter override {key!r} given twice")
        out[key] = value
    return out


def check_overrides(template: Mapping[str, Any], overrides: Mapping[str, str]) -> None:
    """Refuse overrides the template would refuse, naming the parameter. Raises :class:`DeployError`."""
    params: dict[str, Any] = template.get("Parameters", {})
    unknown = sorted(set(overrides) - set(params))
    if unknown:
        raise DeployError(f"unknown template parameter(s): {', '.join(unknown)} (known: {', '.join(sorted(params))})")
    managed = sorted(set(overrides) & MANAGED)
    if managed:
        raise DeployError(f"{', '.join(managed)}: set by sdcguard deploy itself (use --code-bucket for the bucket)")
    for key, value in overrides.items():
        spec = params[key]
        allowed = spec.get("AllowedValues")
        if allowed is not None and value not in [str(a) for a in allowed]:
            raise DeployError(f"{key}={value!r}: must be one of {', '.join(str(a) for a in allowed)}")
        pattern = spec.get("AllowedPattern")
        if pattern is not None and not re.fullmatch(pattern, value):
            raise DeployError(f"{key}={value!r}: does not match {pattern}")
        if spec.get("Type") == "Number":
            try:
                number = float(value)
            except ValueError:
                raise DeployError(f"{key}={value!r}: not a number") from None
            if "MinValue" in spec and number < float(spec["MinValue"]):
                raise DeployError(f"{key}={value}: below the minimum {spec['MinValue']}")
            if "MaxValue" in spec and number > float(spec["MaxValue"]):
                raise DeployError(f"{key}={value}: above the maximum {spec['MaxValue']}")


def check_publisher(effective: Mapping[str, str]) -> None:
    """Refuse a bus that would be open to every principal of the account by accident.

    Without ``TrainingRoleArn`` the bus has no resource policy, and any
    principal of the account whose IAM allows ``events:PutEvents`` can start
    incidents (suspend the job, cordon nodes). That needs an explicit
    ``AllowAnyPublisher=true``; with a role it must stay false. The template's
    ``Rules`` say the same to CloudFormation. Raises :class:`DeployError`.
    """
    role, anyone = effective.get("TrainingRoleArn", ""), effective.get("AllowAnyPublisher", "false")
    if not role and anyone != "true":
        raise DeployError(
            "TrainingRoleArn is empty: without it any principal of the account allowed events:PutEvents can "
            "start incidents. Give the training pods' role as TrainingRoleArn=arn:...:role/NAME, or accept an "
            "open bus explicitly with AllowAnyPublisher=true"
        )
    if role and anyone == "true":
        raise DeployError("AllowAnyPublisher=true contradicts TrainingRoleArn (only that role may publish): drop one")


def check_history_budget(effective: Mapping[str, str], incident_definition: Path) -> None:
    """Refuse poll bounds (``ReplacementMaxPolls``, ``NodeCheckMaxPolls``) and ``MaxReplacementRounds`` whose
    worst case could overrun the execution history (25,000 events).

    The bound is read from the incident machine's definition (see
    :mod:`sdcguard.infra.deploy.execution_history`). Raises :class:`DeployError`.
    """
    try:
        definition = json.loads(incident_definition.read_text())
        names = {*POLL_LOOPS.values(), ROUNDS}
        check_budget(definition, {n: int(float(effective[n])) for n in sorted(names) if n in effective})
    except HistoryBudgetError as exc:
        raise DeployError(str(exc)) from None
    except (OSError, ValueError, KeyError) as exc:
        raise DeployError(f"cannot check the poll loops against {incident_definition.name}: {exc}") from None


def node_check_defaults(values: dict[str, str], previous: Mapping[str, str], *, local: bool) -> list[str]:
    """Fill in the node checks' parameters the stand-in needs, and refuse what only the stand-in may set.

    On the stand-in (``local``), which runs no images and simulates faulty GPUs by injecting faults, a new
    stack gets :data:`STANDIN_NODE_CHECK_IMAGE`, ``NodeCheckAcceptInjectedFaults=true`` and
    :data:`STANDIN_NODE_CHECK_FACTORIES` unless given. On AWS ``NodeCheckAcceptInjectedFaults=true`` is refused.
    Returns the lines to tell the operator (what was filled in, or that no node check will run or none can
    replay a capsule). Raises :class:`DeployError`.
    """
    said: list[str] = []
    if local:
        for key, value in (("NodeCheckImage", STANDIN_NODE_CHECK_IMAGE), ("NodeCheckAcceptInjectedFaults", "true"),
                           ("NodeCheckFactories", STANDIN_NODE_CHECK_FACTORIES)):
            if key not in values and key not in previous:
                values[key] = value
                said.append(f"on the local stand-in: {key}={value}")
        return said
    accept = values.get("NodeCheckAcceptInjectedFaults", previous.get("NodeCheckAcceptInjectedFaults", "false"))
    if accept == "true":
        raise DeployError(
            "NodeCheckAcceptInjectedFaults=true is for the local stand-in only: on AWS a replay report that says a "
            "fault was injected is what someone made the node say. Drop it"
        )
    if not values.get("NodeCheckFactories", previous.get("NodeCheckFactories", "")):
        said.append(
            "warning: NodeCheckFactories is empty: every node check's replay will refuse its capsule's factory (a "
            "capsule is untrusted input). Name the training's factory, NodeCheckFactories=module:function"
        )
    if not values.get("NodeCheckImage", previous.get("NodeCheckImage", "")):
        said.append(
            "warning: NodeCheckImage is empty: no node check will run (no reproduction on the suspect, no "
            "qualification of its replacement). Give the pipeline's replay image as NodeCheckImage=REPO@sha256:..."
        )
    return said


def default_target(architecture: str | None = None, python_version: str | None = None) -> Target:
    """The package target: the stand-in's interpreter when ``AWS_ENDPOINT_URL`` is set, else Lambda's."""
    base = local_target() if os.environ.get("AWS_ENDPOINT_URL") else LAMBDA_TARGET
    return Target(python_version or base.python_version, architecture or base.architecture)


def deploy(
    stack_name: str,
    overrides: Mapping[str, str],
    *,
    session: boto3.Session | None = None,
    code_bucket: str | None = None,
    target: Target | None = None,
    template_path: Path = TEMPLATE,
    definitions: Mapping[str, Path] | None = None,
    progress: Callable[[str], None] | None = None,
    poll_seconds: float = 2.0,
    timeout_seconds: float = 3600.0,
) -> DeployResult:
    """Create or update the stack ``stack_name`` with the pipeline.

    ``overrides`` are template parameters; on an update, parameters not given
    keep their previous values. ``definitions`` maps the template's definition
    parameters to ASL files (default: ``stepfunctions/*.asl.json``). Raises :class:`DeployError` for a refused
    parameter, an unusable stack, a package that cannot be built, or a stack
    operation that fails (with the failed resources and their reasons).
    Nothing is changed when the parameters are refused.
    """
    say = progress or (lambda line: None)
    session = session or boto3.Session()
    if not STACK_NAME.match(stack_name):
        raise DeployError(f"stack name {stack_name!r}: 1-45 letters, digits and hyphens, starting with a letter")
    template = load_template(template_path)
    check_overrides(template, overrides)
    cfn = session.client("cloudformation")
    existing = _describe(cfn, stack_name)
    if existing and existing["StackStatus"] in UNUSABLE:
        raise DeployError(
            f"stack {stack_name} is {existing['StackStatus']} and cannot be updated: "
            f"remove it with `sdcguard destroy --stack-name {stack_name}` first"
        )
    previous = {p["ParameterKey"]: p.get("ParameterValue", "") for p in (existing or {}).get("Parameters", [])}
    values = dict(overrides)
    target = target or default_target(architecture=values.get("LambdaArchitecture"))
    values["LambdaArchitecture"] = target.architecture
    # The cluster's ARN carries an id, not its name: look it up when the name is
    # new (a new stack, or a changed name) and no ARN was given.
    if "HyperPodClusterArn" not in values:
        cluster = values.get("HyperPodClusterName")
        if cluster and (cluster != previous.get("HyperPodClusterName") or "HyperPodClusterArn" not in previous):
            values["HyperPodClusterArn"] = _hyperpod_arn(session, cluster)
    for line in node_check_defaults(values, previous, local=bool(os.environ.get("AWS_ENDPOINT_URL"))):
        say(line)
    missing = sorted(
        name
        for name, spec in template["Parameters"].items()
        if "Default" not in spec and name not in MANAGED and name not in values and name not in previous
    )
    if missing:
        raise DeployError(f"missing parameter(s) for a new stack: {', '.join(missing)} (give them as Key=Value)")
    check_overrides(template, {k: v for k, v in values.items() if k != "LambdaArchitecture"})
    effective = {
        **{k: str(spec["Default"]) for k, spec in template["Parameters"].items() if "Default" in spec},
        **previous,
        **values,
    }
    check_publisher(effective)

    definitions = DEFINITIONS if definitions is None else definitions
    absent = [str(p) for p in definitions.values() if not p.exists()]
    if absent or set(definitions) != set(DEFINITIONS):
        raise DeployError(f"state machine definition(s) missing: {', '.join(absent) or set(DEFINITIONS) - set(definitions)}")
    check_history_budget(effective, definitions["IncidentDefinitionKey"])
    say(f"packaging the Lambda code for {target}")
    try:
        package = build_package(target)
    except PackageError as exc:
        raise DeployError(str(exc)) from None
    say(f"package {package.path.name}: {package.size / 1e6:.1f} MB, "
        f"{'from the cache' if package.cached else 'built'} in {package.seconds:.1f} s")  # fmt: skip

    s3 = session.client("s3")
    bucket = code_bucket or _default_code_bucket(session)
    _ensure_bucket(s3, bucket, session.region_name or "us-east-1", say)
    prefix = f"sdcguard/{stack_name}"
    uploaded: list[str] = []
    values["CodeBucket"] = bucket
    values["CodeKey"] = _upload(s3, bucket, f"{prefix}/{package.key_name}", package.path.read_bytes(), uploaded, say)
    for param, path in definitions.items():
        data = path.read_bytes()
        key = f"{prefix}/{path.name.removesuffix('.asl.json')}-{_short_hash(data)}.asl.json"
        values[param] = _upload(s3, bucket, key, data, uploaded, say)
    body = template_path.read_bytes()
    template_key = _upload(s3, bucket, f"{prefix}/template-{_short_hash(body)}.yaml", body, uploaded, say)
    template_url = f"https://s3.{session.region_name or 'us-east-1'}.amazonaws.com/{bucket}/{template_key}"

    # Previous values are passed back explicitly rather than as UsePreviousValue:
    # the same request then works on AWS and on moto (which only remembers the
    # parameters given, not the defaults it reported).
    # One left out takes its default, so only values that differ from it are kept.
    kept = {
        k: v
        for k, v in previous.items()
        if k in template["Parameters"]
        and k not in values
        and str(template["Parameters"][k].get("Default", "\0")) != v
    }
    parameters: list[dict[str, Any]] = [
        {"ParameterKey": k, "ParameterValue": str(v)} for k, v in sorted({**kept, **values}.items())
    ]
    request: dict[str, Any] = {
        "StackName": stack_name,
        "TemplateURL": template_url,
        "Parameters": parameters,
        "Capabilities": ["CAPABILITY_IAM"],
        "Tags": [{"Key": "sdcguard:stack", "Value": stack_name}],
    }
    template_sha = hashlib.sha256(body).hexdigest()
    request["Tags"].append({"Key": "sdcguard:template-sha256", "Value": template_sha})
    if existing:
        tags = {t["Key"]: t["Value"] for t in existing.get("Tags", [])}
        effective = {
            **{k: str(spec["Default"]) for k, spec in template["Parameters"].items() if "Default" in spec},
            **previous,
            **values,
        }
        if tags.get("sdcguard:template-sha256") == template_sha and effective == previous:
            # Same template, same parameters: CloudFormation would change nothing.
            say("stack already up to date")
            return _result(cfn, stack_name, existing["StackId"], False, package, bucket, uploaded)
        since, skip = last_event(cfn, existing["StackId"])
        say(f"updating stack {stack_name}")
        try:
            stack_id = cfn.update_stack(**request)["StackId"]
        except ClientError as exc:
            if "No updates are to be performed" not in str(exc):
                raise DeployError(f"update of {stack_name} refused: {exc}") from None
            say("stack already up to date")
            return _result(cfn, stack_name, existing["StackId"], False, package, bucket, uploaded)
    else:
        since, skip = datetime.now(UTC).replace(microsecond=0), frozenset()
        say(f"creating stack {stack_name}")
        try:
            stack_id = cfn.create_stack(**request, OnFailure="ROLLBACK")["StackId"]
        except ClientError as exc:
            raise DeployError(f"creation of {stack_name} refused: {exc}") from None
    try:
        settled = follow(
            cfn, stack_id, since=since, skip=skip, on_event=say,
            poll_seconds=poll_seconds, timeout_seconds=timeout_seconds,
        )  # fmt: skip
    except StackTimeout as exc:
        raise DeployError(str(exc)) from None
    if not settled.ok:
        reasons = "; ".join(settled.failures) or "no resource reported a reason"
        raise DeployError(f"stack {stack_name} ended {settled.status}: {reasons}")
    return _result(cfn, stack_name, stack_id, True, package, bucket, uploaded)


def _result(
    cfn: Any, name: str, stack_id: str, changed: bool, package: Package, bucket: str, uploaded: list[str]
) -> DeployResult:
    stack = cfn.describe_stacks(StackName=stack_id)["Stacks"][0]
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    return DeployResult(name, stack_id, stack["StackStatus"], outputs, changed, package, bucket, uploaded)


def _describe(cfn: Any, stack_name: str) -> dict[str, Any] | None:
    try:
        stacks = cfn.describe_stacks(StackName=stack_name)["Stacks"]
    except ClientError as exc:
        if "does not exist" in str(exc):
            return None
        raise
    live = [s for s in stacks if s["StackStatus"] != "DELETE_COMPLETE"]
    return live[0] if live else None


def _hyperpod_arn(session: boto3.Session, cluster: str) -> str:
    try:
        return str(session.client("sagemaker").describe_cluster(ClusterName=cluster)["ClusterArn"])
    except ClientError as exc:
        raise DeployError(
            f"HyperPod cluster {cluster!r} not found ({exc.response['Error'].get('Code')}): "
            "check HyperPodClusterName and the region, or give HyperPodClusterArn"
        ) from None


def _default_code_bucket(session: boto3.Session) -> str:
    account = session.client("sts").get_caller_identity()["Account"]
    return f"sdcguard-code-{account}-{session.region_name or 'us-east-1'}"


def _ensure_bucket(s3: Any, bucket: str, region: str, say: Callable[[str], None]) -> None:
    try:
        s3.head_bucket(Bucket=bucket)
        return
    except ClientError as exc:
        if exc.response["Error"].get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise DeployError(f"code bucket {bucket}: {exc}") from None
    say(f"creating code bucket {bucket}")
    config = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    s3.create_bucket(Bucket=bucket, **config)
    s3.put_public_access_block(
        Bucket=bucket,
        PublicAccessBlockConfiguration={
            "BlockPublicAcls": True,
            "IgnorePublicAcls": True,
            "BlockPublicPolicy": True,
            "RestrictPublicBuckets": True,
        },
    )


def _upload(s3: Any, bucket: str, key: str, data: bytes, uploaded: list[str], say: Callable[[str], None]) -> str:
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return key  # named by content hash: already there means already right
    except ClientError as exc:
        if exc.response["Error"].get("Code") not in ("404", "NoSuchKey", "NotFound"):
            raise
    say(f"uploading s3://{bucket}/{key} ({len(data) / 1e6:.1f} MB)")
    s3.put_object(Bucket=bucket, Key=key, Body=data)
    uploaded.append(key)
    return key


def _short_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]
