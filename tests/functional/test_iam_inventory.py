"""Least privilege that works: each role grants exactly the actions its code really calls on the stand-in.

Every call is made with the credentials of the role that would make it on
AWS (the template's policy, rendered for the scenarios' table, topic,
cluster and bucket: :mod:`tests.functional.template_roles`), and the
stand-in enforces IAM: a grant missing on any path driven here (failure
paths included: every handler that runs once, asked out of order, ends with
its named error after powertools removed its in-progress record) is a
refusal, and :func:`test_no_role_is_refused_anything` names it.

The calls are recorded (see :mod:`tests.functional.recorded_calls`) while
the handler scenarios of ``test_handlers_pipeline`` run again, and then those
of ``test_node_check_handlers`` (real replay Jobs, in a seeded world of their
own with roles rendered for its names), each handler attributed to the role
the template gives its function; the agent's
checkpoint save, re-save and load, its multipart upload and abort, and its
alarm spool are attributed to the training policy; the operator CLI's
list/show/approve to the reviewer policy. Each role must grant what its code
called (nothing missing) and nothing else (nothing unused), apart from
:data:`NOT_EXERCISED`: actions that are needed on AWS but that no code here
calls, each with the reason. The Kubernetes groups of the template's access
entries must be granted exactly the Kubernetes requests their handlers made,
per group and per scope: the cluster-scoped ones by ``infra/deploy/rbac.yaml``,
the namespaced ones (all in the job's namespace) by
``infra/deploy/rbac-namespace.yaml``.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import inspect
import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import yaml

from sdcguard.infra.deploy.cfn_yaml import load_template
from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lambdas import clients
from tests.functional import test_handlers_ops_cli as ops_cli
from tests.functional import test_handlers_pipeline as pipeline
from tests.functional.recorded_calls import Recorder, dynamodb_resource, iam_actions, rbac_request
from tests.functional.template_roles import ACCOUNT, REGION, ActingWithRoles, create_role

if TYPE_CHECKING:
    from mypy_boto3_events import EventBridgeClient

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = load_template(ROOT / "infra" / "deploy" / "template.yaml")
RBAC = [d for d in yaml.safe_load_all((ROOT / "infra" / "deploy" / "rbac.yaml").read_text()) if d]
RBAC_NAMESPACE = [d for d in yaml.safe_load_all((ROOT / "infra" / "deploy" / "rbac-namespace.yaml").read_text()) if d]

world = pipeline.world  # the handler scenarios' stand-in set-up (a module fixture)
setup = ops_cli.setup  # the operator CLI's ledger and decide machine

_LOGS = "the Lambda runtime writes the function's logs to its log group, not the handler"
_XRAY = "Active tracing: the runtime's X-Ray daemon sends the segments, not the handler's SDK calls"
_KMS = "the reviewers' topic is encrypted with the stack's key: SNS calls KMS as the publisher (moto does not)"
LAMBDA_RUNTIME = {
    "logs:CreateLogStream": _LOGS,
    "logs:PutLogEvents": _LOGS,
    "xray:PutTraceSegments": _XRAY,
    "xray:PutTelemetryRecords": _XRAY,
}
PUBLISHES = {"kms:GenerateDataKey": _KMS, "kms:Decrypt": _KMS}
_VERSIONED = (
    "on a versioned checkpoint bucket (recommended) S3 authorizes reads and GetObjectAttributes as the Version "
    "actions; moto does not tell them apart"
)
NOT_EXERCISED: dict[str, dict[str, str]] = {
    "LedgerRole": {**LAMBDA_RUNTIME, **PUBLISHES},
    "KubernetesRole": {**LAMBDA_RUNTIME, **PUBLISHES},
    "KubernetesReadRole": {**LAMBDA_RUNTIME},
    "EvidenceRole": {**LAMBDA_RUNTIME},
    "ApprovalRole": {
        **LAMBDA_RUNTIME,
        **PUBLISHES,
        "s3:GetObjectVersion": _VERSIONED,
        "s3:GetObjectVersionAttributes": _VERSIONED,
    },
    "ReplaceRole": {**LAMBDA_RUNTIME},
    "NodeCheckRole": {**LAMBDA_RUNTIME},
    "PointerRole": {
        **LAMBDA_RUNTIME,
        "s3:GetObjectVersion": _VERSIONED,
        "s3:GetObjectVersionAttributes": _VERSIONED,
    },
    "DecideRole": {**LAMBDA_RUNTIME},
    "TrainingPolicy": {},
    "ReviewerPolicy": {
        "cloudformation:DescribeStacks": "the CLI finds the ledger and the decide machine from the stack's outputs "
        "when no --table/--state-machine-arn is given; the stand-in CLI tests pass both",
    },
}


# -- what the template grants ---------------------------------------------------------------


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _statements(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in _as_list(document["Statement"]) if s["Effect"] == "Allow"]


def granted(template: dict[str, Any]) -> dict[str, set[str]]:
    """Allowed actions by role (inline policies) or managed policy."""
    out: dict[str, set[str]] = {}
    for name, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        if resource["Type"] == "AWS::IAM::Role":
            documents = [p["PolicyDocument"] for p in props.get("Policies", [])]
        elif resource["Type"] == "AWS::IAM::ManagedPolicy":
            documents = [props["PolicyDocument"]]
        else:
            continue
        out[name] = {a for d in documents for s in _statements(d) for a in _as_list(s["Action"])}
    return out


def function_roles(template: dict[str, Any]) -> dict[str, str]:
    """Handler module name -> the role its function runs as."""
    out = {}
    for resource in template["Resources"].values():
        if resource["Type"] == "AWS::Lambda::Function":
            props = resource["Properties"]
            handler = props["Handler"].removeprefix("sdcguard.lambdas.handlers.").removesuffix(".handler")
            out[handler] = props["Role"]["Fn::GetAtt"][0]
    return out


# -- what the code calls ------------------------------------------------------------------------


def _arguments(function: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    names = list(inspect.signature(function).parameters)
    unknown = [n for n in names if n not in values]
    assert not unknown, f"{function.__name__} wants fixtures the inventory does not provide: {unknown}"
    return {n: values[n] for n in names}


def _own_process(handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` with no client left by another handler: each function runs in its own process on AWS, so
    what it calls to build its clients (eks:DescribeCluster for its token) is its role's to grant."""

    @functools.wraps(handler)
    def run(*args: Any, **kwargs: Any) -> Any:
        clients.forget()
        return handler(*args, **kwargs)

    return run


def _run_handler_scenarios(world: pipeline.World, recorder: Recorder) -> dict[str, str]:
    """Every test of test_handlers_pipeline, with each handler's calls attributed to it.

    Returns each scenario's outcome ("passed", or the error): a scenario that
    fails still leaves the calls it made, and the inventory reports it.
    """
    ran: dict[str, str] = {}
    with pytest.MonkeyPatch.context() as patch:
        for name in function_roles(TEMPLATE):
            module = importlib.import_module(f"sdcguard.lambdas.handlers.{name}")
            patch.setattr(module, "handler", recorder.attributing(name, _own_process(module.handler)))
        for name, test in vars(pipeline).items():
            if not (name.startswith("test_") and inspect.isfunction(test)):
                continue
            with pytest.MonkeyPatch.context() as monkeypatch, tempfile.TemporaryDirectory() as tmp:
                arguments = _arguments(test, {"world": world, "monkeypatch": monkeypatch, "tmp_path": Path(tmp)})
                try:
                    test(**arguments)
                    ran[name] = "passed"
                except Exception as exc:  # reported by test_every_scenario_ran_and_every_handler_was_exercised
                    ran[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return ran


def _run_training_job(standin: LocalStandIn, recorder: Recorder, tmp: Path, acting: ActingWithRoles) -> None:
    """The agent's checkpoint save, re-save and load, a multipart upload and its abort, the alarm spool."""
    from datetime import UTC, datetime

    import torch
    from torch import nn

    from sdcguard.agent.alarm import job_identity
    from sdcguard.agent.checkpoint import CheckpointWriter
    from sdcguard.agent.config import GuardConfig
    from sdcguard.agent.publisher import Publisher
    from sdcguard.contract import Alarm
    from sdcguard.lineage.store import S3Store
    from tests.events import load_event

    s3 = standin.client("s3")
    bucket = f"inv-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    training_values = {
        "CheckpointBucket": bucket, "CheckpointPrefix": "jobs/inv",
        "EventBus.Arn": f"arn:aws:events:{REGION}:{ACCOUNT}:event-bus/{bucket}-bus",
    }  # fmt: skip
    acting.give("training", create_role(standin, TEMPLATE, "TrainingPolicy", training_values))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    training = recorder.acting_as
    prefix = f"s3://{bucket}/jobs/inv"
    with training("training"):
        writer = CheckpointWriter(prefix, client=standin.client("s3"), written_by="inventory")
        first = writer.load(model=model, optimizer=optimizer)
        writer.save(4, model=model, optimizer=optimizer, fingerprint="ab" * 24)
        writer.save(4, model=model, optimizer=optimizer, fingerprint="ab" * 24)  # re-save: replaces the manifest
        writer.save(8, model=model, optimizer=optimizer, fingerprint="cd" * 24)
        loaded = CheckpointWriter(prefix, client=standin.client("s3")).load(model=model, optimizer=optimizer)
    assert first is None
    assert loaded is not None
    assert loaded.step == 8

    # A checkpoint object big enough for parts, and an upload that fails half way (aborted, not left behind).
    failing = standin.client("s3")
    calls = {"n": 0}

    def fail_second_part(params: Any, **_: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionError("the network went away mid-upload")

    failing.meta.events.register("before-parameter-build.s3.UploadPart", fail_second_part)
    parts = {"multipart_threshold": 5 * 1024**2, "part_size": 5 * 1024**2}
    with training("training"):
        S3Store(bucket, "jobs/inv", client=s3, **parts).put_bytes("checkpoints/step-000000012/model.pt", b"\0" * 11 * 1024**2)
        with pytest.raises(ConnectionError):
            S3Store(bucket, "jobs/inv", client=failing, **parts).put_bytes(
                "checkpoints/step-000000016/model.pt", b"\1" * 11 * 1024**2
            )
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []  # the failed upload was aborted

    # An alarm spooled while EventBridge is unreachable, then republished by the next start.
    config = GuardConfig(
        checkpoint_prefix=prefix, spool_dir=str(tmp / "spool"), event_bus=f"{bucket}-bus",
        publish_budget_s=2.0, publish_retries=1,
    )  # fmt: skip
    standin.client("events").create_event_bus(Name=f"{bucket}-bus")
    spooled = "jobs/inv/alarms/"
    with training("training"):
        # put_events is all the publisher calls on its EventBridge client.
        unreachable = cast("EventBridgeClient", _Unreachable())
        outcome = Publisher(config, events_client=unreachable, s3_client=standin.client("s3")).publish(
            # Sent by this job (a start republishes only its own job's alarms).
            Alarm.model_validate({**load_event("alarm_ring_audit")["detail"], "job": job_identity(config).model_dump(),
                                  "checkpoint_prefix": prefix, "time": datetime.now(UTC).isoformat()})
        )
    assert not outcome.delivered
    _wait_for(lambda: s3.list_objects_v2(Bucket=bucket, Prefix=spooled).get("KeyCount", 0) == 1)
    with training("training"):
        outcomes = Publisher(config, events_client=standin.client("events"), s3_client=standin.client("s3")).republish_spooled()
    assert [o.delivered for o in outcomes.values()] == [True]
    assert s3.list_objects_v2(Bucket=bucket, Prefix=spooled).get("KeyCount", 0) == 0


class _Unreachable:
    """An EventBridge client whose endpoint never answers."""

    def put_events(self, **_: Any) -> Any:
        raise ConnectionError("EventBridge is unreachable")


def _wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.1)


def _run_reviewer(setup: ops_cli.Setup, recorder: Recorder) -> None:
    """What a reviewer does with the CLI: list, show, approve (as in test_handlers_ops_cli)."""
    incident_id = ops_cli.open_incident(setup, waiting=True)
    with recorder.acting_as("reviewer"):
        assert ops_cli.main(["incidents", "--json", "--table", setup.table]) == 0
        assert ops_cli.main(["incidents", "--table", setup.table, "show", incident_id]) == 0
        argv = ["approve", incident_id, "--reason", "inventory", "--table", setup.table, "--state-machine-arn", setup.machine]
        assert ops_cli.main(argv) == 0
    assert setup.ledger.get(incident_id).state.value == "APPROVED"


def _with_the_templates_indexes(standin: LocalStandIn, table: str) -> None:
    """Give the scenarios' ledger table the template's secondary indexes, as a deployed ledger has them."""
    ddb = standin.client("dynamodb")
    props = TEMPLATE["Resources"]["LedgerTable"]["Properties"]
    have = {i["IndexName"] for i in ddb.describe_table(TableName=table)["Table"].get("GlobalSecondaryIndexes", [])}
    for index in props.get("GlobalSecondaryIndexes", []):
        if index["IndexName"] not in have:
            ddb.update_table(
                TableName=table,
                AttributeDefinitions=props["AttributeDefinitions"],
                GlobalSecondaryIndexUpdates=[{"Create": index}],
            )


def _table_arn(name: str) -> str:
    return f"arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/{name}"


def world_values(world: pipeline.World) -> dict[str, str]:
    """The template's names for the handler scenarios' resources (the world fixture's settings)."""
    settings = os.environ  # set by the world fixture for the module
    return {
        "LedgerTable": world.ledger.table,
        "LedgerTable.Arn": _table_arn(world.ledger.table),
        # The node checks' world asks no approval and names no token table.
        "TokenTable.Arn": _table_arn(settings.get("TOKEN_TABLE") or "no-token-table"),
        "IdempotencyTable.Arn": _table_arn(settings["IDEMPOTENCY_TABLE"]),
        "ReviewerTopic": settings["TOPIC_ARN"],
        "HyperPodClusterArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:cluster/{world.seeded['hyperpod_cluster']}",
        "EksClusterName": str(world.seeded["eks_cluster"]),
        "CheckpointBucket": str(world.seeded["bucket"]),
        "CheckpointPrefix": settings["CHECKPOINT_PREFIX"],
        # The scenarios' decide machine is decide-<suffix>, not <stack>-decide.
        "Resource@ConfirmTheDecideExecution": settings["DECIDE_STATE_MACHINE_ARN"]
        .replace(":stateMachine:", ":execution:") + ":*",
    }


@pytest.fixture(scope="module")
def acting(standin: LocalStandIn, world: pipeline.World, setup: ops_cli.Setup) -> ActingWithRoles:
    """Each handler acts as its function's role; the reviewer as ReviewerPolicy (the training job's comes later)."""
    acting = ActingWithRoles(standin)
    values = world_values(world)
    roles: dict[str, str] = {}
    for handler, role in function_roles(TEMPLATE).items():
        if role not in roles:
            roles[role] = create_role(standin, TEMPLATE, role, values)
        acting.give(handler, roles[role])
    stack = setup.machine.rsplit(":", 1)[1].removesuffix("-decide")
    reviewer = {"LedgerTable.Arn": _table_arn(setup.table), "DecideStateMachine": setup.machine, "AWS::StackName": stack}
    acting.give("reviewer", create_role(standin, TEMPLATE, "ReviewerPolicy", reviewer))
    return acting


# The handlers that run once (powertools idempotency), each asked to act on an incident that is not yet
# where it acts: each must end with its own named error, which powertools lets through after deleting its
# in-progress record (a role without dynamodb:DeleteItem on the idempotency table ends with
# IdempotencyPersistenceLayerError instead, and the state machine's Catch never sees the named error).
ONCE = {
    "request_approval": lambda ref: {"incident_id": ref["incident_id"], "task_token": "token", "timeout_seconds": 60},
    "replace": lambda ref: {**ref, "instance_id": ref["instance_id"]},
    "rewrite_pointer": lambda ref: {"incident_id": ref["incident_id"]},
    "close": lambda ref: {"incident_id": ref["incident_id"]},
    "release": lambda ref: {"incident_id": ref["incident_id"]},
    "resume_job": lambda ref: {"incident_id": ref["incident_id"]},
    "cordon": lambda ref: {**ref, "instance_id": ref["instance_id"]},
}


def _out_of_order(world: pipeline.World) -> dict[str, str]:
    """An incident just resolved; the name of the error each run-once handler ends with when asked to act on it."""
    from sdcguard.lambdas.handlers import record, resolve

    incident_id = record.handler(pipeline.alarm_event(world, 0), pipeline.CTX)["incident_id"]
    (instance_id, *_) = resolve.handler({"incident_id": incident_id}, pipeline.CTX)["instance_ids"]
    ref = {"incident_id": incident_id, "instance_id": instance_id}
    ended: dict[str, str] = {}
    for name, event in ONCE.items():
        module = importlib.import_module(f"sdcguard.lambdas.handlers.{name}")
        try:
            module.handler(event(ref), pipeline.CTX)
            ended[name] = "returned"
        except Exception as exc:  # the outcome is the test's subject
            ended[name] = type(exc).__name__
    return ended


NODE_CHECK_SCENARIOS = (
    "test_a_faulty_replacement_fails_qualification_and_is_cordoned",
    "test_without_a_capsule_nothing_runs_and_the_flow_goes_on",
)
"""The node checks' scenarios replayed here: between them every call the three handlers make (the PyTorchJob
read, the capsule's S3 head found and missing, a Job created, read and deleted, its pod listed and its log read,
a failed new node cordoned). The others repeat those calls with other answers, each a Job on the
stand-in, so they run once, in test_node_check_handlers itself."""


@dataclass
class NodeCheckRun:
    """The node checks' scenarios: the roles their handlers acted as, and the ledger of their world."""

    acting: ActingWithRoles
    ledger_tables: list[str] = field(default_factory=list)


def _run_node_check_scenarios(standin: LocalStandIn, recorder: Recorder, run: NodeCheckRun) -> dict[str, str]:
    """:data:`NODE_CHECK_SCENARIOS` of test_node_check_handlers (real replay Jobs on a seeded cluster of its own, with a capsule and
    faulty nodes), each handler acting as its function's role rendered for that world's names."""
    from tests.functional import test_node_check_handlers as checks

    ran: dict[str, str] = {}
    acting = run.acting
    with checks.node_check_world(standin) as made:
        run.ledger_tables.append(made.ledger.table)
        _with_the_templates_indexes(standin, made.ledger.table)
        values = world_values(made)
        roles: dict[str, str] = {}
        for handler, role in function_roles(TEMPLATE).items():
            if role not in roles:
                roles[role] = create_role(standin, TEMPLATE, role, values)
            acting.give(handler, roles[role])
        with acting.installed(), pytest.MonkeyPatch.context() as patch:
            for name in function_roles(TEMPLATE):
                module = importlib.import_module(f"sdcguard.lambdas.handlers.{name}")
                patch.setattr(module, "handler", recorder.attributing(name, _own_process(module.handler)))
            for name, test in vars(checks).items():
                if name not in NODE_CHECK_SCENARIOS:
                    continue
                with pytest.MonkeyPatch.context() as monkeypatch, tempfile.TemporaryDirectory() as tmp:
                    arguments = _arguments(test, {"world": made, "monkeypatch": monkeypatch, "tmp_path": Path(tmp)})
                    try:
                        test(**arguments)
                        ran[f"node checks: {name}"] = "passed"
                    except Exception as exc:  # reported by test_every_scenario_ran_and_every_handler_was_exercised
                        ran[f"node checks: {name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return ran


@pytest.fixture(scope="module")
def node_checks(standin: LocalStandIn) -> NodeCheckRun:
    """The handlers' roles in the node checks' world (given while those scenarios run)."""
    return NodeCheckRun(ActingWithRoles(standin))


@pytest.fixture(scope="module")
def recorded(
    standin: LocalStandIn, world: pipeline.World, setup: ops_cli.Setup, acting: ActingWithRoles, node_checks: NodeCheckRun
) -> Recorder:
    _with_the_templates_indexes(standin, world.ledger.table)
    with Recorder() as recorder:
        with acting.installed(), tempfile.TemporaryDirectory() as tmp:
            recorder.scenarios = _run_handler_scenarios(world, recorder)
            _run_training_job(standin, recorder, Path(tmp), acting)
            try:
                _run_reviewer(setup, recorder)
                recorder.scenarios["reviewer"] = "passed"
            except Exception as exc:  # reported by test_every_scenario_ran_and_every_handler_was_exercised
                recorder.scenarios["reviewer"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            with pytest.MonkeyPatch.context() as patch:
                for name in function_roles(TEMPLATE):
                    module = importlib.import_module(f"sdcguard.lambdas.handlers.{name}")
                    patch.setattr(module, "handler", recorder.attributing(name, _own_process(module.handler)))
                failures = _out_of_order(world)
            recorder.scenarios.update({f"out of order: {name}": outcome for name, outcome in failures.items()})
        # Last: that world sets the handlers' environment for its own names while it lasts.
        recorder.scenarios.update(_run_node_check_scenarios(standin, recorder, node_checks))
    return recorder


def used_actions(recorder: Recorder) -> dict[str, set[str]]:
    """The IAM actions each role or managed policy needs, from the calls recorded."""
    owner = {**function_roles(TEMPLATE), "training": "TrainingPolicy", "reviewer": "ReviewerPolicy"}
    out: dict[str, set[str]] = {}
    for actor, calls in recorder.aws.items():
        out.setdefault(owner[actor], set()).update(a for call in calls for a in iam_actions(call))
    return out


# -- the tests ----------------------------------------------------------------------------------


def test_every_scenario_ran_and_every_handler_was_exercised(recorded: Recorder) -> None:
    assert len(recorded.scenarios) >= 15
    outcomes = {name: outcome for name, outcome in recorded.scenarios.items() if not name.startswith("out of order")}
    failed = {name: outcome for name, outcome in outcomes.items() if outcome != "passed"}
    assert failed == {}, json.dumps(failed, indent=1)
    assert set(function_roles(TEMPLATE)) <= set(recorded.aws) | set(recorded.kube)
    assert {"training", "reviewer"} <= set(recorded.aws)


@pytest.mark.parametrize("role", sorted(NOT_EXERCISED))
def test_each_role_grants_exactly_what_its_code_calls(recorded: Recorder, role: str) -> None:
    used = used_actions(recorded).get(role, set())
    allowed_unused = NOT_EXERCISED[role]
    have = granted(TEMPLATE)[role]
    missing, unused = used - have, have - used - set(allowed_unused)
    assert (sorted(missing), sorted(unused)) == ([], []), (
        f"{role}: grants {sorted(have)}; its code called {sorted(used)}"
    )
    assert set(allowed_unused) <= have, f"{role}: NOT_EXERCISED lists actions it does not grant"
    assert not set(allowed_unused) & used, f"{role}: NOT_EXERCISED lists actions the code did call"


def test_the_state_machines_may_invoke_exactly_their_tasks() -> None:
    for machine in ("IncidentStateMachine", "DecideStateMachine"):
        props = TEMPLATE["Resources"][machine]["Properties"]
        role = props["RoleArn"]["Fn::GetAtt"][0]
        asl = (ROOT / "stepfunctions" / f"{machine.removesuffix('StateMachine').lower()}.asl.json").read_text()
        needs = set()
        for resource in _task_resources(json.loads(asl)):
            if resource.startswith("arn:aws:states:::lambda:invoke"):
                needs.add("lambda:InvokeFunction")
            elif resource.startswith("arn:aws:states:::sns:publish"):
                needs |= {"sns:Publish", *PUBLISHES}
            else:
                raise AssertionError(f"{machine}: a task resource the inventory does not know: {resource}")
        assert granted(TEMPLATE)[role] == needs, machine


def _task_resources(definition: dict[str, Any]) -> Iterator[str]:
    for state in definition["States"].values():
        if state["Type"] == "Task":
            yield state["Resource"]
        for nested in [state.get("ItemProcessor"), state.get("Iterator"), *state.get("Branches", [])]:
            if nested:
                yield from _task_resources(nested)


def test_the_handlers_read_the_ledger_only_through_its_indexes(
    recorded: Recorder, world: pipeline.World, node_checks: NodeCheckRun
) -> None:
    """Scans read every incident ever opened: the guard's picture comes from the index of open incidents,
    an instance's history (the evidence step) from the index of incidents by suspect instance."""
    from sdcguard.lambdas.ledger import OPEN_INDEX, SUSPECT_INDEX

    handlers = set(function_roles(TEMPLATE))
    ledger_reads = {
        (actor, c.operation, index)
        for actor, calls in recorded.aws.items()
        if actor in handlers
        for c in calls
        if c.service == "dynamodb" and c.operation in ("Query", "Scan")
        for table, index in dynamodb_resource(c)
        if table in {world.ledger.table, *node_checks.ledger_tables}
    }
    # The replacement re-checks the limits under the lock where it acts, from the same index, and so does the
    # rejection of a replacement that failed its qualification before it asks for another.
    assert ledger_reads == {
        ("guard", "Query", OPEN_INDEX), ("replace", "Query", OPEN_INDEX), ("evidence", "Query", SUSPECT_INDEX),
        ("reject_replacement", "Query", OPEN_INDEX),
    }  # fmt: skip


def access_entry_groups(template: dict[str, Any]) -> dict[str, str]:
    """Role -> the Kubernetes group its EKS access entry gives it (the group parameter's default)."""
    out = {}
    for resource in template["Resources"].values():
        if resource["Type"] == "AWS::EKS::AccessEntry":
            (group,) = resource["Properties"]["KubernetesGroups"]
            out[resource["Properties"]["PrincipalArn"]["Fn::GetAtt"][0]] = template["Parameters"][group["Ref"]]["Default"]
    return out


def rbac_grants() -> dict[tuple[str, str], set[tuple[str, str, str]]]:
    """(group, scope) -> the (API group, resource, verb) its roles grant; scope "cluster" for rbac.yaml's
    ClusterRoleBindings, "namespace" for the RoleBindings of rbac-namespace.yaml (applied in the job's namespace)."""
    out: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
    for scope, docs, binding_kind in (("cluster", RBAC, "ClusterRoleBinding"), ("namespace", RBAC_NAMESPACE, "RoleBinding")):
        roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("ClusterRole", "Role")}
        for binding in (d for d in docs if d["kind"] == binding_kind):
            role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
            for subject in binding["subjects"]:
                out.setdefault((subject["name"], scope), set()).update(
                    (api_group, resource, verb)
                    for rule in role["rules"]
                    for api_group in rule["apiGroups"]
                    for resource in rule["resources"]
                    for verb in rule["verbs"]
                )
    return out


def _namespace(path: str) -> str | None:
    _, found, rest = path.partition("/namespaces/")
    return rest.split("/", 1)[0] if found and "/" in rest else None


def test_each_group_is_granted_exactly_the_kubernetes_requests_its_handlers_made(
    recorded: Recorder, standin: LocalStandIn
) -> None:
    from sdcguard.infra.local.eks.resources import ROLE_BINDINGS

    groups = access_entry_groups(TEMPLATE)
    used: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
    namespaces: set[str] = set()
    for actor, calls in recorded.kube.items():
        group = groups[function_roles(TEMPLATE)[actor]]
        for call in calls:
            namespace = _namespace(call.path)
            used.setdefault((group, "namespace" if namespace else "cluster"), set()).add(rbac_request(call))
            namespaces |= {namespace} if namespace else set()
    # Every grant used, nothing used that is not granted: per group, cluster-wide (the nodes) and in the
    # job's namespace (pods, PyTorchJobs, Jobs); nothing at the cluster scope but the nodes.
    assert used == rbac_grants()
    assert {resource for (_, scope), requests in used.items() if scope == "cluster" for _, resource, _ in requests} == {"nodes"}
    # resolve and guard only read.
    assert {verb for (group, _), requests in used.items() if group == groups["KubernetesReadRole"] for *_, verb in requests} == {"get"}
    assert {groups[function_roles(TEMPLATE)[actor]] for actor in ("resolve", "guard")} == {groups["KubernetesReadRole"]}
    # The namespaced requests went to the jobs' namespaces only, each holding the namespaced manifest's bindings.
    assert standin.eks is not None
    for namespace in namespaces:
        bound = {b["metadata"]["name"] for b in standin.eks.store.list(ROLE_BINDINGS, namespace)[0]}
        assert bound == {d["metadata"]["name"] for d in RBAC_NAMESPACE if d["kind"] == "RoleBinding"}, namespace
    # Only the roles with an EKS access entry talk to the Kubernetes API.
    kube_roles = {function_roles(TEMPLATE)[actor] for actor in recorded.kube}
    assert kube_roles == set(groups)


def test_each_run_once_handler_ends_with_its_named_error_under_enforcement(recorded: Recorder) -> None:
    from sdcguard.lambdas import errors

    ended = {name.removeprefix("out of order: "): o for name, o in recorded.scenarios.items() if name.startswith("out of order")}
    assert set(ended) == set(ONCE)
    assert {name: o for name, o in ended.items() if o not in errors.__all__} == {}


# Refusals a scenario provokes on purpose: (actor, action, resource pattern).
PROVOKED = {
    # test_decide_refuses_an_execution_it_cannot_confirm: an execution of another machine cannot be read,
    # so the decision is not confirmed (UnverifiedDecision), as on AWS.
    ("decide", "states:DescribeExecution", "arn:aws:states:*:*:execution:other-*"),
    # An execution of the approval machine handed to decide as if it were a decide execution: the same.
    ("decide", "states:DescribeExecution", "arn:aws:states:*:*:execution:approval-*"),
}


def test_no_role_is_refused_anything(recorded: Recorder, acting: ActingWithRoles, node_checks: NodeCheckRun) -> None:
    """0 grants missing per role on every path driven here, happy and failure, with the stand-in enforcing."""
    refused: dict[str, list[tuple[str, str, str]]] = {}
    for actor, refusals in [*acting.refusals().items(), *node_checks.acting.refusals().items()]:
        refused.setdefault(actor, []).extend(
            r for r in refusals
            if not any(actor == a and r[0] == act and fnmatch.fnmatchcase(r[1], res) for (a, act, res) in PROVOKED)
        )  # fmt: skip
    refused = {actor: refusals for actor, refusals in refused.items() if refusals}
    assert refused == {}, json.dumps(refused, indent=1)


@pytest.mark.parametrize(
    ("role", "handler"), [("ApprovalRole", "request_approval"), ("ReplaceRole", "replace"), ("PointerRole", "rewrite_pointer")]
)
def test_without_deleting_idempotency_records_a_named_error_is_lost(
    standin: LocalStandIn, world: pipeline.World, role: str, handler: str
) -> None:
    """One grant removed from one role: the handler's named error becomes powertools' persistence error on AWS."""
    from sdcguard.lambdas.handlers import record, resolve

    values = world_values(world)
    acting = ActingWithRoles(standin)
    acting.give("record", create_role(standin, TEMPLATE, "LedgerRole", values))
    acting.give("resolve", create_role(standin, TEMPLATE, "KubernetesReadRole", values))
    acting.give("whole", create_role(standin, TEMPLATE, role, values))
    acting.give("lacking", create_role(standin, TEMPLATE, role, values, leave_out=("ClearFailedIdempotencyRecords", "dynamodb:DeleteItem")))
    module = importlib.import_module(f"sdcguard.lambdas.handlers.{handler}")
    ended: dict[str, str] = {}
    with acting.installed():
        with Recorder.acting_as("record"):
            incident_id = record.handler(pipeline.alarm_event(world, 1), pipeline.CTX)["incident_id"]
        with Recorder.acting_as("resolve"):
            (instance_id, *_) = resolve.handler({"incident_id": incident_id}, pipeline.CTX)["instance_ids"]
        event = ONCE[handler]({"incident_id": incident_id, "instance_id": instance_id})
        # With the grant, then without it, then the state machine's retry with it: the in-progress record the
        # refused delete left behind blocks every retry until it expires.
        for attempt, actor in enumerate(("whole", "lacking", "whole")):
            with Recorder.acting_as(actor), pytest.raises(Exception) as caught:  # noqa: PT011 - the class is the outcome
                module.handler(event, pipeline.CTX)
            ended[f"{attempt}:{actor}"] = type(caught.value).__name__

    assert ended == {
        "0:whole": "IncidentNotWaiting",
        "1:lacking": "IdempotencyPersistenceLayerError",
        "2:whole": "IdempotencyAlreadyInProgressError",
    }
    assert [(a, r[0]) for a, refusals in acting.refusals().items() for r in refusals] == [("lacking", "dynamodb:DeleteItem")]
