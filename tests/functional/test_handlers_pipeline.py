"""Each handler called as a function against the local stand-in, asserting what changed (and what did not).

The handlers reach AWS and the EKS API exactly as in Lambda: boto3 clients from
the AWS_* environment (pointed at the stand-in), and a kubernetes client with
an EKS token against the endpoint and CA from ``eks.describe_cluster``.
"""

from __future__ import annotations

import copy
import json
import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client as k8s

from sdcguard.contract import CheckpointManifest, Decision, Incident, IncidentState
from sdcguard.infra.local.seed import seed
from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lambdas import clients
from sdcguard.lambdas.cordon import TAINT_KEY
from sdcguard.lambdas.decide import adopt_decision, note_decision
from sdcguard.lambdas.eks_token import kubernetes_client
from sdcguard.lambdas.errors import (
    ApprovalExpired,
    BlastRadiusExceeded,
    IncidentNotWaiting,
    LockLost,
    MalformedEvent,
    NotInCluster,
    StaleAlarm,
    SuspectMismatch,
    SuspectNotOperatorPod,
    SuspectUnresolvable,
    UnknownDecision,
    UnverifiedDecision,
)
from sdcguard.lambdas.handlers import (
    close,
    cordon,
    decide,
    evidence,
    fail,
    guard,
    needs_attention,
    record,
    release,
    replace,
    replacement_status,
    request_approval,
    resolve,
    resume_job,
    rewrite_pointer,
    suspend_job,
)
from sdcguard.lambdas.ledger import (
    OPEN_INDEX_ATTRIBUTES,
    OPEN_INDEX_DEFINITION,
    SUSPECT_INDEX_ATTRIBUTES,
    SUSPECT_INDEX_DEFINITION,
    Ledger,
)
from sdcguard.lambdas.settings import get_settings
from sdcguard.lambdas.task_tokens import TOKEN_TABLE_ATTRIBUTES, TOKEN_TABLE_KEY, TaskTokens
from sdcguard.lineage.commit import commit, put_object
from sdcguard.lineage.errors import NoSafeCheckpoint
from sdcguard.lineage.pointer import read_pointer
from sdcguard.lineage.pointer import rewrite_pointer as point_at
from sdcguard.lineage.store import open_store
from sdcguard.lineage.verify import RESUME_OBJECTS
from tests.events import load_event
from tests.functional.task_token import waiting_token

S = IncidentState


class FakeContext:
    """The parts of a Lambda context that powertools reads."""

    function_name = "sdcguard-test"
    memory_limit_in_mb = 256
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:sdcguard-test"
    aws_request_id = "test-request"

    def get_remaining_time_in_millis(self) -> int:
        return 60_000


CTX = FakeContext()


@dataclass
class World:
    standin: LocalStandIn
    seeded: dict[str, Any]
    ledger: Ledger
    queue_url: str

    @property
    def tokens(self) -> TaskTokens:
        """The approval task tokens of this world's pipeline (the table the fixture names in TOKEN_TABLE)."""
        return TaskTokens(get_settings().token_table, self.standin.client("dynamodb"))

    def node(self, index: int) -> dict[str, Any]:
        return dict(self.seeded["nodes"][index])

    def messages(self, wait: float = 5.0) -> list[dict[str, Any]]:
        sqs = self.standin.client("sqs")
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            got = sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0).get("Messages", [])
            for m in got:
                sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=m["ReceiptHandle"])
                out.append(json.loads(m["Body"]))
            if out and not got:
                break
            time.sleep(0.1)
        return out

    def kube(self) -> k8s.ApiClient:
        return kubernetes_client(self.seeded["eks_cluster"])


@pytest.fixture(scope="module")
def world(standin: LocalStandIn) -> Iterator[World]:
    suffix = uuid.uuid4().hex[:6]
    seeded = seed(standin, nodes=3, cluster=f"hp-{suffix}", job=f"job-{suffix}", minutes=20, faulty_node=1)
    ddb = standin.client("dynamodb")
    ledger_table, idem_table = f"ledger-{suffix}", f"idem-{suffix}"
    create_ledger_table(ddb, ledger_table)
    token_table = f"tokens-{suffix}"
    ddb.create_table(
        TableName=token_table, KeySchema=TOKEN_TABLE_KEY, AttributeDefinitions=TOKEN_TABLE_ATTRIBUTES,
        BillingMode="PAY_PER_REQUEST",
    )
    ddb.create_table(
        TableName=idem_table,
        KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    # A stand-in for the decide machine: its running executions are what the decide function confirms.
    decide_machine = standin.client("stepfunctions").create_state_machine(
        name=f"decide-{suffix}",
        definition=json.dumps({"StartAt": "Hold", "States": {"Hold": {"Type": "Wait", "Seconds": 600, "End": True}}}),
        roleArn="arn:aws:iam::123456789012:role/sfn",
    )["stateMachineArn"]
    topic = standin.client("sns").create_topic(Name=f"reviewers-{suffix}")["TopicArn"]
    sqs = standin.client("sqs")
    queue_url = sqs.create_queue(QueueName=f"inbox-{suffix}")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    standin.client("sns").subscribe(TopicArn=topic, Protocol="sqs", Endpoint=queue_arn)
    env = {
        **standin.env,
        "LEDGER_TABLE": ledger_table,
        "TOKEN_TABLE": token_table,
        "IDEMPOTENCY_TABLE": idem_table,
        "TOPIC_ARN": topic,
        "HYPERPOD_CLUSTER": seeded["hyperpod_cluster"],
        "EKS_CLUSTER": seeded["eks_cluster"],
        "JOB_NAMESPACE": seeded["namespace"],
        "JOB_NAME": seeded["job"],
        "CHECKPOINT_BUCKET": seeded["bucket"],
        "CHECKPOINT_PREFIX": seeded["job"],
        "MODE": "normal",
        "MAX_QUARANTINED_NODES": "3",
        "MAX_REPLACEMENTS_PER_DAY": "1000",  # incidents left waiting by earlier tests count as pending replacements
        "APPROVAL_TIMEOUT_SECONDS": "300",
        "DECIDE_STATE_MACHINE_ARN": decide_machine,
        "POWERTOOLS_TRACE_DISABLED": "true",
        "POWERTOOLS_METRICS_NAMESPACE": "sdcguard-test",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    get_settings.cache_clear()
    clients.forget()
    try:
        made = World(standin, seeded, Ledger(ledger_table, standin.client("dynamodb")), queue_url)
        write_checkpoints(made, [0])  # every alarm here has a safe checkpoint to roll back to, unless a test says otherwise
        yield made
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_settings.cache_clear()
        clients.forget()


def create_ledger_table(ddb: Any, name: str) -> None:
    """The ledger table as the template creates it: the key, the index of incidents that count, the index by instance."""
    ddb.create_table(
        TableName=name,
        KeySchema=[{"AttributeName": "incident_id", "KeyType": "HASH"}],
        AttributeDefinitions=[
            {"AttributeName": "incident_id", "AttributeType": "S"}, *OPEN_INDEX_ATTRIBUTES, *SUSPECT_INDEX_ATTRIBUTES
        ],
        GlobalSecondaryIndexes=[OPEN_INDEX_DEFINITION, SUSPECT_INDEX_DEFINITION],
        BillingMode="PAY_PER_REQUEST",
    )


_windows = iter(range(1000, 100_000, 100))


def alarm_event(world: World, node_index: int, *, ring_clean: int | None = None, **detail: Any) -> dict[str, Any]:
    """The stored ring-audit event, about this world's job and node ``node_index``, in a window of its own."""
    event = copy.deepcopy(load_event("alarm_ring_audit"))
    event["id"] = str(uuid.uuid4())
    node = world.node(node_index)
    clean = next(_windows) if ring_clean is None else ring_clean
    d = event["detail"]
    d["alarm_id"] = uuid.uuid4().hex
    d["time"] = datetime.now(UTC).isoformat()  # the seeded GPU metrics end now
    d["job"] = {
        "hyperpod_cluster": world.seeded["hyperpod_cluster"],
        "eks_cluster": world.seeded["eks_cluster"],
        "namespace": world.seeded["namespace"],
        "job_name": world.seeded["job"],
    }
    d["step"] = clean + 50
    d["last_clean"] = {"nonfinite_grad": clean + 49, "ring_audit": clean, "weight_fingerprint": clean + 40, "reduced_grad": clean + 49}
    d["checkpoint_prefix"] = f"s3://{world.seeded['bucket']}/{world.seeded['job']}"
    d["resume_pointer"] = f"s3://{world.seeded['bucket']}/{world.seeded['job']}/RESUME.json"
    d["suspects"] = [{"global_rank": node["ranks"][1], "local_rank": 1, "pod": node["pod"], "node": node["node_name"], "host": node["pod"]}]
    d.update(detail)
    return event


def drive(world: World, event: dict[str, Any], through: str) -> str:
    """Run the handlers of the forward path up to and including ``through``; returns the incident id."""
    incident_id = record.handler(event, CTX)["incident_id"]
    ref = {"incident_id": incident_id}
    steps = ["resolve", "guard", "suspend_job", "cordon", "evidence"]
    for step in steps:
        if step == "resolve":
            instance_ids = resolve.handler(ref, CTX)["instance_ids"]
        elif step == "guard":
            guard.handler(ref, CTX)
        elif step == "suspend_job":
            suspend_job.handler(ref, CTX)
        elif step == "cordon":
            for instance_id in instance_ids:
                cordon.handler({**ref, "instance_id": instance_id}, CTX)
        elif step == "evidence":
            evidence.handler(ref, CTX)
        if step == through:
            return incident_id
    raise AssertionError(f"unknown step {through}")


def read_node(world: World, name: str) -> Any:
    return k8s.CoreV1Api(world.kube()).read_node(name)


def read_job(world: World) -> dict[str, Any]:
    job: dict[str, Any] = k8s.CustomObjectsApi(world.kube()).get_namespaced_custom_object(
        "kubeflow.org", "v1", world.seeded["namespace"], "pytorchjobs", world.seeded["job"]
    )
    return job


def our_taints(node: Any) -> list[Any]:
    return [t for t in (node.spec.taints or []) if t.key == TAINT_KEY]


def states(incident: Incident) -> list[str]:
    return [t.state.value for t in incident.transitions]


# -- record ---------------------------------------------------------------------


def test_record_opens_one_incident_and_counts_duplicates(world: World) -> None:
    event = alarm_event(world, 0)
    first = record.handler(event, CTX)
    redelivered = record.handler(event, CTX)
    from_another_rank = copy.deepcopy(event)
    from_another_rank["id"] = str(uuid.uuid4())
    from_another_rank["detail"].update(alarm_id=uuid.uuid4().hex, publisher_rank=4)
    again = record.handler(from_another_rank, CTX)

    assert first["duplicate"] is False
    assert redelivered["duplicate"] is True
    assert again["duplicate"] is True
    assert first["incident_id"] == redelivered["incident_id"] == again["incident_id"]
    incident = world.ledger.get(first["incident_id"])
    assert incident.state == S.RECORDED
    assert incident.duplicate_alarms == 2
    assert states(incident) == ["RECORDED"]
    assert first["timeouts"]["approval_heartbeat_seconds"] == 300


def test_a_storm_of_concurrent_duplicates_opens_one_incident(world: World) -> None:
    event = alarm_event(world, 0)
    storm = []
    for rank in range(24):
        copy_of = copy.deepcopy(event)
        copy_of["id"] = str(uuid.uuid4())
        copy_of["detail"].update(alarm_id=uuid.uuid4().hex, publisher_rank=rank % 6)
        storm.append(copy_of)
    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(lambda e: record.handler(e, CTX), storm))

    assert len({r["incident_id"] for r in results}) == 1
    assert [r["duplicate"] for r in results].count(False) == 1
    incident = world.ledger.get(results[0]["incident_id"])
    assert incident.duplicate_alarms == 23
    assert states(incident) == ["RECORDED"]
    # the handlers' later writes keep the count
    resolve.handler({"incident_id": incident.incident_id}, CTX)
    assert world.ledger.get(incident.incident_id).duplicate_alarms == 23


def test_a_malformed_event_or_another_cluster_writes_nothing(world: World) -> None:
    before = len(world.ledger.list())
    malformed = alarm_event(world, 0)
    malformed["detail"]["step"] = -3
    with pytest.raises(MalformedEvent, match=r"detail\.step"):
        record.handler(malformed, CTX)
    elsewhere = alarm_event(world, 0)
    elsewhere["detail"]["job"]["hyperpod_cluster"] = "someone-elses-cluster"
    with pytest.raises(NotInCluster, match="someone-elses-cluster"):
        record.handler(elsewhere, CTX)
    assert len(world.ledger.list()) == before


# -- resolve and guard ---------------------------------------------------------------


def test_resolve_finds_the_instance_of_the_suspect_rank(world: World) -> None:
    incident_id = drive(world, alarm_event(world, 1), through="resolve")
    incident = world.ledger.get(incident_id)
    assert incident.state == S.RESOLVED
    assert incident.instance_ids == [world.node(1)["instance_id"]]
    assert incident.suspects[0].instance_group == world.seeded["instance_group"]


def plant(world: World, node: str, *, job: str | None = None, owner_uid: str | None = None) -> str:
    """A pod (of this world's job, unless ``job`` says another) running on a node ``node`` created for it.

    Its owner is the PyTorchJob as the training operator would set it: this world's job's uid, unless
    ``owner_uid`` says another.
    """
    core = k8s.CoreV1Api(world.kube())
    uid = owner_uid or read_job(world)["metadata"]["uid"]
    try:
        core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {}}, "spec": {}})
    except k8s.ApiException as exc:
        if exc.status != 409:
            raise
    pod = f"planted-{uuid.uuid4().hex[:8]}"
    labels = {"training.kubeflow.org/job-name": job or world.seeded["job"]}
    core.create_namespaced_pod(
        world.seeded["namespace"],
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": pod, "labels": labels, "ownerReferences": [
             {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": job or world.seeded["job"], "uid": uid,
              "controller": True}]},
         "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}},
    )  # fmt: skip
    return pod


def naming(world: World, event: dict[str, Any], *, pod: str, node: str) -> dict[str, Any]:
    event["detail"]["suspects"][0].update(pod=pod, node=node, host=pod)
    return event


def test_an_unknown_node_or_an_instance_outside_the_cluster_touches_nothing(world: World) -> None:
    # Pods of the job that do run where the alarm says, on a node HyperPod does not know
    # (a plain EKS node) and on a node named like HyperPod's for an instance outside the cluster.
    unknown = naming(world, alarm_event(world, 0), pod=plant(world, "ip-10-9-9-9.ec2.internal"), node="ip-10-9-9-9.ec2.internal")
    unknown["detail"]["suspects"][0]["host"] = world.standin.client("sagemaker").list_cluster_nodes(
        ClusterName=world.seeded["hyperpod_cluster"]
    )["ClusterNodeSummaries"][0].get("PrivateDnsHostname", "nowhere")  # a host name that is another node's: ignored
    outside_node = "hyperpod-i-0aaaaaaaaaaaaaaa0"
    outside = naming(world, alarm_event(world, 0), pod=plant(world, outside_node), node=outside_node)
    for event, error in ((unknown, SuspectUnresolvable), (outside, NotInCluster)):
        incident_id = record.handler(event, CTX)["incident_id"]
        with pytest.raises(error):
            resolve.handler({"incident_id": incident_id}, CTX)
        incident = world.ledger.get(incident_id)
        assert incident.state == S.RECORDED
        assert incident.suspects == []


def test_a_suspect_the_cluster_contradicts_touches_nothing(world: World) -> None:
    # Given forged alarms (valid, for this cluster and job) naming a pod on another node,
    # a pod of another job, and a pod that does not exist,
    other = world.node(1)
    elsewhere = naming(world, alarm_event(world, 0), pod=other["pod"], node=world.node(0)["node_name"])
    not_of_job = naming(world, alarm_event(world, 0), pod=plant(world, world.node(0)["node_name"], job="someone-else"), node=world.node(0)["node_name"])
    missing = naming(world, alarm_event(world, 0), pod="no-such-pod", node=world.node(0)["node_name"])
    taints_before = {n["node_name"]: our_taints(read_node(world, n["node_name"])) for n in world.seeded["nodes"]}
    reasons = []
    for event in (elsewhere, not_of_job, missing):
        incident_id = record.handler(event, CTX)["incident_id"]
        # when resolve reads the cluster,
        with pytest.raises(SuspectMismatch) as caught:
            resolve.handler({"incident_id": incident_id}, CTX)
        reasons.append(str(caught.value))
        # nothing is recorded as resolved, so nothing downstream can act,
        incident = world.ledger.get(incident_id)
        assert (incident.state, incident.suspects) == (S.RECORDED, [])
    # the reasons name the mismatch,
    assert f"runs on node {other['node_name']!r}, not on node {world.node(0)['node_name']!r}" in reasons[0]
    assert "is not a pod of PyTorchJob" in reasons[1]
    assert "'someone-else'" in reasons[1]
    assert "does not exist in namespace" in reasons[2]
    # and no node changed.
    assert {n["node_name"]: our_taints(read_node(world, n["node_name"])) for n in world.seeded["nodes"]} == taints_before


def test_an_alarm_from_another_run_or_too_old_touches_nothing(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    node = world.node(0)
    taints_before = our_taints(read_node(world, node["node_name"]))
    # Given a pod of an earlier job of the same name (another uid), an alarm raised before its pod
    # was created (the pod restarted since: a later run), and an alarm older than the setting,
    earlier_job = naming(world, alarm_event(world, 0), pod=plant(world, node["node_name"], owner_uid=str(uuid.uuid4())), node=node["node_name"])
    before_restart = alarm_event(world, 0)
    before_restart["detail"]["time"] = datetime.fromtimestamp(time.time() - 1800, UTC).isoformat()
    too_old = alarm_event(world, 0)
    too_old["detail"]["time"] = datetime.fromtimestamp(time.time() - 7200, UTC).isoformat()
    reasons = []
    for event in (earlier_job, before_restart, too_old):
        incident_id = record.handler(event, CTX)["incident_id"]
        # resolve stops it (the machine's Catch sends StaleAlarm to NeedsAttention),
        with pytest.raises(StaleAlarm) as caught:
            resolve.handler({"incident_id": incident_id}, CTX)
        reasons.append(str(caught.value))
        assert (world.ledger.get(incident_id).state, world.ledger.get(incident_id).suspects) == (S.RECORDED, [])
    # naming why,
    assert "not to the job's current uid" in reasons[0]
    assert "after the alarm" in reasons[1]
    assert "more than MAX_ALARM_AGE_SECONDS=3600" in reasons[2]
    # and nothing is touched.
    assert our_taints(read_node(world, node["node_name"])) == taints_before
    # The same alarm within a longer setting is acted on: the pods seeded for the job are older than it.
    monkeypatch.setenv("MAX_ALARM_AGE_SECONDS", "86400")
    get_settings.cache_clear()
    try:
        fresh_enough = alarm_event(world, 0)
        fresh_enough["detail"]["time"] = datetime.fromtimestamp(time.time() - 7200, UTC).isoformat()
        kept = record.handler(fresh_enough, CTX)["incident_id"]
        with pytest.raises(StaleAlarm, match="after the alarm"):  # 2 h ago, before the pods were made
            resolve.handler({"incident_id": kept}, CTX)
    finally:
        get_settings.cache_clear()


def test_an_alarm_for_another_job_of_the_namespace_touches_nothing(world: World) -> None:
    # Given an alarm of another PyTorchJob in the guarded namespace, consistent with its own pod on a node of the cluster,
    node = world.node(0)
    event = naming(world, alarm_event(world, 0), pod=plant(world, node["node_name"], job="another-job"), node=node["node_name"])
    event["detail"]["job"]["job_name"] = "another-job"
    taints_before = our_taints(read_node(world, node["node_name"]))
    # it is recorded (it may be a true report about shared hardware),
    incident_id = record.handler(event, CTX)["incident_id"]
    # but resolve refuses it, naming the job the stack guards,
    with pytest.raises(NotInCluster, match=rf"another-job'; this pipeline guards {world.seeded['namespace']}/'{world.seeded['job']}'"):
        resolve.handler({"incident_id": incident_id}, CTX)
    # and nothing is resolved, so nothing downstream can act.
    assert (world.ledger.get(incident_id).state, world.ledger.get(incident_id).suspects) == (S.RECORDED, [])
    assert our_taints(read_node(world, node["node_name"])) == taints_before


def forge_operator_pod(world: World, node: str, *, status: dict[str, Any] | None = None) -> str:
    """A tenant's pod posing as the training operator's: the job-name label, a controller ownerReference to the
    PyTorchJob's uid (readable with ``get pytorchjob``) and ``spec.nodeName`` on ``node`` (an existing HyperPod node),
    and, when given, a ``status`` (the stand-in keeps what a create sends; a real API server resets it)."""
    core = k8s.CoreV1Api(world.kube())
    uid = read_job(world)["metadata"]["uid"]
    pod = f"evil-{uuid.uuid4().hex[:8]}"
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod, "labels": {"training.kubeflow.org/job-name": world.seeded["job"]},
                     "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                                          "name": world.seeded["job"], "uid": uid, "controller": True}]},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
    }  # fmt: skip
    if status is not None:
        body["status"] = status
    core.create_namespaced_pod(world.seeded["namespace"], body)
    return pod


def test_a_pod_forged_as_the_operators_moves_no_node_and_the_incident_says_why(world: World) -> None:
    # Given pods forged as in the issue on node 0 (one even claiming to run there), each named by an alarm
    # with a rank of node 2, whose real pod runs on node 2,
    victim, real = world.node(0), world.node(2)
    victim_ip = next(a.address for a in read_node(world, victim["node_name"]).status.addresses if a.type == "InternalIP")
    plain = forge_operator_pod(world, victim["node_name"])
    claiming = forge_operator_pod(world, victim["node_name"], status={"phase": "Running", "hostIP": victim_ip})
    job_before, taints_before = read_job(world), {n["node_name"]: our_taints(read_node(world, n["node_name"])) for n in world.seeded["nodes"]}
    for pod in (plain, claiming):
        event = naming(world, alarm_event(world, 2), pod=pod, node=victim["node_name"])
        incident_id = record.handler(event, CTX)["incident_id"]
        # when resolve reads the cluster, it refuses the pod,
        with pytest.raises(SuspectNotOperatorPod) as caught:
            resolve.handler({"incident_id": incident_id}, CTX)
        reason = str(caught.value)
        assert f"pod {pod} is not the pod the training operator made for that rank" in reason
        assert f"runs in pod {real['pod']}" in reason
        assert (world.ledger.get(incident_id).state, world.ledger.get(incident_id).suspects) == (S.RECORDED, [])
        # the steps after it change nothing (the machine never reaches them; a direct invoke is refused),
        guard.handler({"incident_id": incident_id}, CTX)
        assert world.ledger.get(incident_id).state == S.RECORDED
        with pytest.raises(IncidentNotWaiting):
            suspend_job.handler({"incident_id": incident_id}, CTX)
        with pytest.raises(NotInCluster):
            cordon.handler({"incident_id": incident_id, "instance_id": victim["instance_id"]}, CTX)
        # and the stop the machine's Catch leads to records why.
        needs_attention.handler(
            {"incident_id": incident_id, "state": "Resolve", "error": {"Error": "SuspectNotOperatorPod", "Cause": reason}}, CTX
        )
        stopped = world.ledger.get(incident_id)
        assert stopped.state == S.NEEDS_ATTENTION
        assert stopped.failure is not None
        assert (stopped.failure.error, stopped.failure.state) == ("SuspectNotOperatorPod", "Resolve")
        assert "not the pod the training operator made" in stopped.failure.cause
    # No node was cordoned or tainted, and the job was not suspended.
    assert {n["node_name"]: our_taints(read_node(world, n["node_name"])) for n in world.seeded["nodes"]} == taints_before
    assert all(not read_node(world, n["node_name"]).spec.unschedulable for n in (victim, real))
    job_after = read_job(world)
    assert job_after["spec"]["runPolicy"].get("suspend") == job_before["spec"]["runPolicy"].get("suspend")
    assert (job_after["metadata"].get("annotations") or {}).get("sdcguard.io/suspended-by") == (
        job_before["metadata"].get("annotations") or {}
    ).get("sdcguard.io/suspended-by")


def test_a_second_incident_beyond_the_blast_radius_is_refused(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.lambdas.guard import quarantined_nodes

    held = quarantined_nodes(world.ledger.list(), exclude="")
    free = next(i for i in range(3) if world.node(i)["node_name"] not in held)
    incident_id = drive(world, alarm_event(world, free), through="resolve")
    monkeypatch.setenv("MAX_QUARANTINED_NODES", str(len(held)))
    get_settings.cache_clear()
    try:
        with pytest.raises(BlastRadiusExceeded, match=f"limit is {len(held)}"):
            guard.handler({"incident_id": incident_id}, CTX)
    finally:
        get_settings.cache_clear()
    assert world.ledger.get(incident_id).state == S.RESOLVED
    assert not our_taints(read_node(world, world.node(free)["node_name"]))


def moved_to(state: IncidentState) -> Any:
    return lambda i: i.advance(state, actor="test")


def resolved_to(suspect: Any) -> Any:
    return lambda i: i.advance(S.RESOLVED, actor="test", suspects=[suspect])


def test_concurrent_incidents_are_admitted_one_by_one(world: World) -> None:
    from sdcguard.contract import Alarm, ResolvedSuspect
    from sdcguard.lambdas.guard import guard_incident

    table = f"race-{uuid.uuid4().hex[:6]}"
    create_ledger_table(world.standin.client("dynamodb"), table)
    ledger = Ledger(table, world.standin.client("dynamodb"))
    ids = []
    for n in range(4):  # four incidents on four different nodes, resolved at once
        detail = copy.deepcopy(load_event("alarm_ring_audit")["detail"])
        node = f"hyperpod-i-0{n}23456789abcdef0"
        detail["suspects"][0]["node"] = node
        incident, _ = ledger.open(Alarm.model_validate(detail), mode="normal")
        suspect = ResolvedSuspect(global_rank=3, pod="p", node=node, instance_id=node.removeprefix("hyperpod-"))
        ledger.update(incident.incident_id, resolved_to(suspect))
        ids.append(incident.incident_id)

    def admit(incident_id: str) -> str:
        for _ in range(5):  # as the state machine retries a guard whose lock was taken over (LockLost)
            try:
                return guard_incident(
                    ledger, incident_id, mode="normal", max_quarantined_nodes=2, max_replacements_per_day=10
                ).state.value
            except BlastRadiusExceeded:
                return "refused"
            except LockLost:
                continue
        return "lock lost five times"

    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(admit, ids))

    assert sorted(outcomes) == ["GUARDED", "GUARDED", "refused", "refused"]
    assert sorted(ledger.get(i).state.value for i in ids) == ["GUARDED", "GUARDED", "RESOLVED", "RESOLVED"]


# -- containment -------------------------------------------------------------------


def test_suspend_and_cordon_contain_the_node_once(world: World) -> None:
    node = world.node(0)
    incident_id = drive(world, alarm_event(world, 0), through="cordon")
    patches_before = len([r for r in world.standin.eks.requests if r.method == "PATCH"])  # type: ignore[union-attr]

    suspend_job.handler({"incident_id": incident_id}, CTX)
    cordon.handler({"incident_id": incident_id, "instance_id": node["instance_id"]}, CTX)

    patches_after = len([r for r in world.standin.eks.requests if r.method == "PATCH"])  # type: ignore[union-attr]
    assert patches_after == patches_before  # the repeated calls did no second thing
    job = read_job(world)
    assert job["spec"]["runPolicy"]["suspend"] is True
    cordoned = read_node(world, node["node_name"])
    assert cordoned.spec.unschedulable is True
    assert [(t.effect, t.value) for t in our_taints(cordoned)] == [("NoSchedule", incident_id)]
    assert cordoned.metadata.annotations["sdcguard.io/incident"] == incident_id
    incident = world.ledger.get(incident_id)
    assert states(incident) == ["RECORDED", "RESOLVED", "GUARDED", "SUSPENDED", "CORDONED"]
    assert {t.actor for t in incident.transitions[1:]} == {"resolve", "guard", "suspend_job", "cordon"}


def test_cordon_refuses_an_instance_the_incident_does_not_name(world: World) -> None:
    incident_id = drive(world, alarm_event(world, 0), through="suspend_job")
    other = world.node(2)
    before = our_taints(read_node(world, other["node_name"]))
    with pytest.raises(NotInCluster):
        cordon.handler({"incident_id": incident_id, "instance_id": other["instance_id"]}, CTX)
    assert our_taints(read_node(world, other["node_name"])) == before
    assert world.ledger.get(incident_id).state == S.SUSPENDED


def test_evidence_reads_the_gpu_metrics_of_the_suspect(world: World) -> None:
    faulty = world.seeded["faulty_node"]["index"]
    incident_id = drive(world, alarm_event(world, faulty), through="evidence")
    incident = world.ledger.get(incident_id)
    assert incident.state == S.EVIDENCE_COLLECTED
    summary = incident.evidence
    assert "does not clear a node" in str(summary["note"])
    instances: list[dict[str, Any]] = summary["instances"]  # type: ignore[assignment]
    (entry,) = instances
    assert entry["instance_id"] == world.node(faulty)["instance_id"]
    names = {m["name"] for m in entry["metrics"] if m["points"]}
    assert "node_gpu_temperature" in names
    assert summary["verdict"] == "corroborated"  # the seeded faulty GPU reports Xid and ECC errors


def test_a_later_incident_on_the_same_instance_finds_the_earlier_one(world: World) -> None:
    # Given an incident that resolve traced to node 0's instance, that nobody approved,
    earlier = drive(world, alarm_event(world, 0), through="resolve")
    # when another fault on the same node (another window) reaches the evidence step,
    later = drive(world, alarm_event(world, 0), through="evidence")
    # the earlier incident is in the instance's history, found through the index resolve wrote,
    instances: list[dict[str, Any]] = world.ledger.get(later).evidence["instances"]  # type: ignore[assignment]
    (entry,) = instances
    assert earlier in entry["prior_incidents"]
    assert later not in entry["prior_incidents"]
    # but it corroborates nothing until a reviewer approved it.
    assert world.ledger.get(later).evidence["verdict"] == "no hardware signal"
    assert any("nobody approved (not counted)" in r and earlier in r for r in entry["reasons"])
    for state in (S.GUARDED, S.SUSPENDED, S.CORDONED, S.EVIDENCE_COLLECTED, S.AWAITING_APPROVAL):
        world.ledger.update(earlier, moved_to(state))
    approved_in_the_ledger(world, earlier)
    third = drive(world, alarm_event(world, 0), through="evidence")
    assert world.ledger.get(third).evidence["verdict"] == "corroborated"


def test_evidence_reads_only_the_incidents_of_its_instances(world: World) -> None:
    from sdcguard.contract import Alarm, ResolvedSuspect
    from sdcguard.lambdas.evidence import evidence_for_incident

    ledger = private_ledger(world)
    node = fresh_node(world)
    instance = node.removeprefix("hyperpod-")
    windows = iter(range(100, 100_000, 100))

    def incident_on(node: str, *, cluster: str = "ml-cluster", resolved: bool = True) -> str:
        detail = copy.deepcopy(load_event("alarm_ring_audit")["detail"])
        clean = next(windows)
        detail.update(step=clean + 50, last_clean={"ring_audit": clean, "weight_fingerprint": clean})
        detail["suspects"][0]["node"] = node
        detail["job"]["hyperpod_cluster"] = cluster
        incident, _ = ledger.open(Alarm.model_validate(detail), mode="normal")
        suspect = ResolvedSuspect(global_rank=3, pod="p", node=node, instance_id=node.removeprefix("hyperpod-"))
        ledger.index_suspects(incident.incident_id, [suspect.instance_id])  # as resolve does, before recording them
        if resolved:
            ledger.update(incident.incident_id, resolved_to(suspect))
        return incident.incident_id

    # Given 200 incidents of other instances, an earlier one of this instance, one whose resolve failed after
    # indexing it, and one of an instance of the same id in another cluster,
    for n in range(200):
        incident_on(f"hyperpod-i-0{n:016x}")
    earlier = incident_on(node)
    for state in (S.GUARDED, S.SUSPENDED, S.CORDONED, S.EVIDENCE_COLLECTED, S.AWAITING_APPROVAL, S.APPROVED):
        ledger.update(earlier, moved_to(state))  # a reviewer approved it: it corroborates
    incident_on(node, resolved=False)
    incident_on(node, cluster="another-cluster")
    mine = incident_on(node)
    for state in (S.GUARDED, S.SUSPENDED, S.CORDONED):
        ledger.update(mine, moved_to(state))
    calls: list[str] = []
    ledger.client.meta.events.register("before-call.dynamodb.*", lambda model, **_: calls.append(model.name))

    # when the evidence step runs,
    collected = evidence_for_incident(ledger, mine, dcgm_counters=[], cloudwatch=world.standin.client("cloudwatch"))

    # it finds exactly the earlier incident, with one query of the index and no scan.
    instances: list[dict[str, Any]] = collected.evidence["instances"]  # type: ignore[assignment]
    (entry,) = instances
    assert (entry["instance_id"], entry["prior_incidents"]) == (instance, [earlier])
    assert collected.evidence["verdict"] == "corroborated"
    assert "Scan" not in calls
    assert calls.count("Query") == 1


# -- approval and decision ---------------------------------------------------------------


def test_request_approval_stores_the_token_and_tells_the_reviewers_how_to_answer(world: World) -> None:
    world.messages(wait=0.5)  # drain
    incident_id = drive(world, alarm_event(world, 0), through="evidence")
    request = {"incident_id": incident_id, "task_token": "token-" + uuid.uuid4().hex, "timeout_seconds": 300}
    request_approval.handler(request, CTX)
    request_approval.handler(request, CTX)  # a retry

    incident = world.ledger.get(incident_id)
    assert incident.state == S.AWAITING_APPROVAL
    stored = world.tokens.get(incident_id)
    assert stored is not None
    assert stored[0] == request["task_token"]
    mine = [m for m in world.messages() if m.get("MessageAttributes", {}).get("incident_id", {}).get("Value") == incident_id]
    assert len(mine) == 1
    assert f"sdcguard approve {incident_id} --reason" in mine[0]["Message"]
    assert f"sdcguard reject {incident_id} --reason" in mine[0]["Message"]


def test_the_reviewers_see_the_rollback_before_they_decide(world: World) -> None:
    # Given checkpoints before and inside the suspect window, and the pointer on the newest,
    clean = 31_000
    write_checkpoints(world, [clean - 10, clean + 20])
    store = open_store(f"s3://{world.seeded['bucket']}/{world.seeded['job']}", client=world.standin.client("s3"))
    point_at(store, trusted_through_step=clean + 20, reason="latest", written_by="agent")
    world.messages(wait=0.5)  # drain
    incident_id = drive(world, alarm_event(world, 0, ring_clean=clean), through="evidence")
    # when approval is requested,
    request_approval.handler({"incident_id": incident_id, "task_token": "t-" + uuid.uuid4().hex, "timeout_seconds": 60}, CTX)
    # the request says where approving takes the job, and how much training it costs,
    (message,) = [m for m in world.messages() if m.get("MessageAttributes", {}).get("incident_id", {}).get("Value") == incident_id]
    assert f"Approving rolls the job back: pointer step-{clean + 20:09d} \u2192 step-{clean - 10:09d}, 60 steps lost" in message["Message"]
    incident = world.ledger.get(incident_id)
    assert incident.rollback is not None
    assert (incident.rollback.to_step, incident.rollback.steps_lost) == (clean - 10, 60)
    # and nothing moved yet.
    pointer, _ = read_pointer(store)
    assert pointer is not None
    assert pointer.step == clean + 20


def test_no_safe_checkpoint_stops_before_asking_and_replaces_nothing(world: World) -> None:
    # Given an alarm whose detectors were never clean (no checkpoint can be trusted),
    never_clean = {"nonfinite_grad": None, "ring_audit": None, "weight_fingerprint": None, "reduced_grad": None}
    incident_id = drive(world, alarm_event(world, 0, last_clean=never_clean), through="evidence")
    # requesting approval raises NoSafeCheckpoint (the machine's Catch stops for attention),
    with pytest.raises(NoSafeCheckpoint, match="nothing safe to resume from"):
        request_approval.handler({"incident_id": incident_id, "task_token": "t-" + uuid.uuid4().hex, "timeout_seconds": 60}, CTX)
    # before any token is stored or any reviewer asked: nobody can approve a replacement.
    incident = world.ledger.get(incident_id)
    assert (incident.state, incident.rollback) == (S.EVIDENCE_COLLECTED, None)
    assert world.tokens.get(incident_id) is None


def waiting_with_real_token(world: World) -> tuple[str, str]:
    """An incident waiting for approval whose token belongs to a real waiting execution."""
    incident_id = drive(world, alarm_event(world, 0), through="evidence")
    token, execution = waiting_token(world.standin)
    request_approval.handler({"incident_id": incident_id, "task_token": token, "timeout_seconds": 120}, CTX)
    return incident_id, execution


def wait_for_end(world: World, execution: str, timeout: float = 30) -> dict[str, Any]:
    sfn = world.standin.client("stepfunctions")
    deadline = time.monotonic() + timeout
    while True:
        described: dict[str, Any] = sfn.describe_execution(executionArn=execution)
        if described["status"] != "RUNNING" or time.monotonic() > deadline:
            return described
        time.sleep(0.2)


def decision_of(world: World, incident_id: str, decision: str, reason: str, reviewer: str) -> dict[str, Any]:
    """The decide function's input as the decide machine hands it: a running execution started for this decision."""
    started = {"incident_id": incident_id, "decision": decision, "reason": reason, "reviewer": reviewer}
    arn = world.standin.client("stepfunctions").start_execution(
        stateMachineArn=get_settings().decide_state_machine_arn, name=uuid.uuid4().hex, input=json.dumps(started)
    )["executionArn"]
    return {**started, "execution_arn": arn}


def approved_in_the_ledger(world: World, incident_id: str, decision: str = "approve") -> None:
    """Given: the decide function wrote ``decision`` to the ledger (and answered the token)."""
    world.ledger.update(
        incident_id,
        lambda i: adopt_decision(note_decision(i, Decision(decision=decision, reviewer="oncall", reason="as decided"))),
    )


def test_decide_answers_the_token_and_records_who_decided(world: World) -> None:
    incident_id, execution = waiting_with_real_token(world)
    result = decide.handler(
        decision_of(world, incident_id, "approve", "Xid 79 on GPU 1", "arn:aws:iam::123456789012:user/oncall"), CTX
    )
    assert result["state"] == "APPROVED"
    incident = world.ledger.get(incident_id)
    assert incident.decision is not None
    assert (incident.decision.decision, incident.decision.reviewer) == ("approve", "arn:aws:iam::123456789012:user/oncall")
    assert incident.transitions[-1].actor == "arn:aws:iam::123456789012:user/oncall"
    assert world.tokens.get(incident_id) is None
    ended = wait_for_end(world, execution)
    assert ended["status"] == "SUCCEEDED"
    assert json.loads(ended["output"])["decision"] == "approve"
    with pytest.raises(IncidentNotWaiting, match="APPROVED"):  # a second decision changes nothing
        decide.handler(decision_of(world, incident_id, "reject", "late", "someone"), CTX)
    assert world.ledger.get(incident_id).decision == incident.decision


def test_decide_refuses_unknown_decisions_and_expired_tokens(world: World) -> None:
    incident_id = drive(world, alarm_event(world, 0), through="evidence")
    request_approval.handler({"incident_id": incident_id, "task_token": "not-a-real-token", "timeout_seconds": 60}, CTX)
    with pytest.raises(UnknownDecision):
        decide.handler(decision_of(world, incident_id, "maybe", "r", "me"), CTX)
    with pytest.raises(ApprovalExpired):
        decide.handler(decision_of(world, incident_id, "approve", "r", "me"), CTX)
    incident = world.ledger.get(incident_id)
    assert incident.state == S.AWAITING_APPROVAL
    assert incident.decision is None


def test_a_decision_in_a_handlers_input_is_ignored(world: World) -> None:
    # Given an incident waiting for approval on a real task token,
    node = world.node(0)
    incident_id, execution = waiting_with_real_token(world)
    instances_before = {
        n["InstanceId"]
        for n in world.standin.client("sagemaker").list_cluster_nodes(ClusterName=world.seeded["hyperpod_cluster"])["ClusterNodeSummaries"]
    }
    forged = {"decision": "approve", "reviewer": "mallory", "reason": "trust me"}
    # when someone invokes replace or release directly with a decision of their own,
    with pytest.raises(IncidentNotWaiting, match="no approved decision"):
        replace.handler({"incident_id": incident_id, "instance_id": node["instance_id"], "decision": forged}, CTX)
    with pytest.raises(IncidentNotWaiting, match="no rejected decision"):
        release.handler({"incident_id": incident_id, "decision": {**forged, "decision": "reject"}}, CTX)
    # nothing is replaced or released, and the incident keeps waiting on its token.
    instances_after = {
        n["InstanceId"]
        for n in world.standin.client("sagemaker").list_cluster_nodes(ClusterName=world.seeded["hyperpod_cluster"])["ClusterNodeSummaries"]
    }
    assert instances_after == instances_before
    incident = world.ledger.get(incident_id)
    assert (incident.state, incident.decision, incident.replacements) == (S.AWAITING_APPROVAL, None, [])
    assert read_node(world, node["node_name"]).spec.unschedulable is True
    assert world.tokens.get(incident_id) is not None
    described = world.standin.client("stepfunctions").describe_execution(executionArn=execution)
    assert described["status"] == "RUNNING"


def test_decide_refuses_an_execution_it_cannot_confirm(world: World) -> None:
    incident_id, execution = waiting_with_real_token(world)
    genuine = decision_of(world, incident_id, "reject", "r", "me")
    for forged in (
        {**genuine, "execution_arn": genuine["execution_arn"].replace(":decide-", ":other-")},  # made up
        {**genuine, "decision": "approve"},  # an execution started for another decision
        {**genuine, "execution_arn": execution},  # an execution of another machine
    ):
        with pytest.raises(UnverifiedDecision):
            decide.handler(forged, CTX)
    with pytest.raises(MalformedEvent, match="execution_arn"):  # no execution at all
        decide.handler({k: v for k, v in genuine.items() if k != "execution_arn"}, CTX)
    incident = world.ledger.get(incident_id)
    assert (incident.state, incident.decision) == (S.AWAITING_APPROVAL, None)
    assert world.standin.client("stepfunctions").describe_execution(executionArn=execution)["status"] == "RUNNING"


def test_a_decision_is_in_the_ledger_before_the_token_is_answered(world: World) -> None:
    incident_id, _execution = waiting_with_real_token(world)
    seen: list[Any] = []
    sfn = world.standin.client("stepfunctions")

    class Watching:
        def describe_execution(self, **kwargs: Any) -> Any:
            return sfn.describe_execution(**kwargs)

        def send_task_success(self, **kwargs: Any) -> Any:
            seen.append(world.ledger.get(incident_id).decision)
            return sfn.send_task_success(**kwargs)

    from sdcguard.lambdas.decide import decide as deliver

    request = decision_of(world, incident_id, "approve", "seen first", "oncall")
    deliver(
        world.ledger, world.tokens, incident_id, "approve", reviewer="oncall", reason="seen first",
        execution_arn=request["execution_arn"], decide_machine_arn=get_settings().decide_state_machine_arn, sfn=Watching(),
    )  # fmt: skip
    assert [d.reason if d else None for d in seen] == ["seen first"]
    assert world.ledger.get(incident_id).state == S.APPROVED


# -- the approve path: replace, wait, pointer, resume, close -----------------------------------


def write_checkpoints(world: World, steps: list[int]) -> None:
    store = open_store(f"s3://{world.seeded['bucket']}/{world.seeded['job']}", client=world.standin.client("s3"))
    for step in steps:
        digests = [put_object(store, step, name, f"{name} at {step}".encode()) for name in RESUME_OBJECTS]
        commit(store, CheckpointManifest(step=step, world_size=6, fingerprint="ab" * 24, objects=digests))


def test_the_approve_path_replaces_rolls_back_and_resumes(world: World) -> None:
    node = world.node(2)
    clean = 5000
    write_checkpoints(world, [clean - 1000, clean - 10, clean + 20])
    store = open_store(f"s3://{world.seeded['bucket']}/{world.seeded['job']}", client=world.standin.client("s3"))
    point_at(store, trusted_through_step=clean + 20, reason="latest", written_by="agent")
    custom = k8s.CustomObjectsApi(world.kube())
    custom.patch_namespaced_custom_object(  # given a running job that no other incident holds
        "kubeflow.org", "v1", world.seeded["namespace"], "pytorchjobs", world.seeded["job"],
        {"metadata": {"annotations": {"sdcguard.io/suspended-by": None}}, "spec": {"runPolicy": {"suspend": False}}},
    )
    incident_id = drive(world, alarm_event(world, 2, ring_clean=clean), through="evidence")
    assert read_job(world)["spec"]["runPolicy"]["suspend"] is True
    world.tokens.put(incident_id, "t", expires_at=time.time() + 60)
    world.ledger.update(incident_id, lambda i: i.advance(S.AWAITING_APPROVAL, actor="test"))
    approved_in_the_ledger(world, incident_id)

    requested = replace.handler({"incident_id": incident_id, "instance_id": node["instance_id"]}, CTX)
    again = replace.handler({"incident_id": incident_id, "instance_id": node["instance_id"]}, CTX)
    assert requested == again
    progress: dict[str, Any] = {}
    for attempt in range(50):
        progress = replacement_status.handler({"incident_id": incident_id, "attempt": attempt}, CTX)
        if progress["done"]:
            break
        time.sleep(0.1)
    assert progress["done"] is True

    incident = world.ledger.get(incident_id)
    (replacement,) = incident.replacements
    new_id = replacement.new_instance_id
    assert replacement.old_instance_id == node["instance_id"]
    assert new_id is not None
    assert new_id != node["instance_id"]
    listed = {
        n["InstanceId"]: n["InstanceStatus"]["Status"]
        for n in world.standin.client("sagemaker").list_cluster_nodes(ClusterName=world.seeded["hyperpod_cluster"])["ClusterNodeSummaries"]
    }
    assert listed[new_id] == "Running"
    assert node["instance_id"] not in listed
    assert read_node(world, f"hyperpod-{new_id}").spec.unschedulable in (None, False)

    pointed = rewrite_pointer.handler({"incident_id": incident_id}, CTX)
    assert pointed["checkpoint_after"] == f"checkpoints/step-{clean - 10:09d}"
    assert pointed["checkpoint_before"] == f"checkpoints/step-{clean + 20:09d}"
    pointer, _ = read_pointer(store)
    assert pointer is not None
    assert (pointer.step, pointer.incident_id) == (clean - 10, incident_id)
    assert pointer.history[0].step == clean + 20

    resume_job.handler({"incident_id": incident_id}, CTX)
    assert not read_job(world)["spec"]["runPolicy"].get("suspend")
    world.messages(wait=0.3)
    closed = close.handler({"incident_id": incident_id}, CTX)
    assert closed["state"] == "CLOSED"
    assert set(closed["timings"]) == {"alarm_to_cordon_s", "alarm_to_approval_s", "alarm_to_resumed_s"}
    incident = world.ledger.get(incident_id)
    assert states(incident)[-7:] == ["AWAITING_APPROVAL", "APPROVED", "REPLACING", "REPLACED", "POINTER_REWRITTEN", "RESUMED", "CLOSED"]
    assert incident.resumed_from_step == clean - 10
    assert any(m["Subject"].endswith("CLOSED") for m in world.messages())


# -- the reject path and the safe stops ------------------------------------------------------------


def test_release_uncordons_resumes_and_records_a_false_alarm(world: World) -> None:
    node = world.node(1)
    incident_id = drive(world, alarm_event(world, 1), through="evidence")
    assert read_node(world, node["node_name"]).spec.unschedulable is True
    world.ledger.update(incident_id, lambda i: i.advance(S.AWAITING_APPROVAL, actor="test"))
    world.ledger.update(
        incident_id,
        lambda i: note_decision(i, Decision(decision="reject", reviewer="oncall", reason="known flaky test data")),
    )  # written by decide, whose own last write was lost: release adopts it

    result = release.handler({"incident_id": incident_id}, CTX)

    assert result["state"] == "FALSE_ALARM"
    released = read_node(world, node["node_name"])
    assert [t for t in our_taints(released) if t.value == incident_id] == []
    incident = world.ledger.get(incident_id)
    assert incident.decision is not None
    assert incident.decision.reason == "known flaky test data"
    assert states(incident)[-3:] == ["AWAITING_APPROVAL", "REJECTED", "FALSE_ALARM"]


def test_needs_attention_and_fail_record_where_and_why(world: World) -> None:
    world.messages(wait=0.3)
    waiting = drive(world, alarm_event(world, 0), through="cordon")
    needs_attention.handler(
        {"incident_id": waiting, "state": "RequestApproval", "error": {"Error": "States.HeartbeatTimeout", "Cause": "no decision"}}, CTX
    )
    broken = drive(world, alarm_event(world, 0), through="resolve")
    lambda_error = json.dumps({"errorMessage": "pytorchjob training/job is gone", "errorType": "KubernetesObjectMissing",
                               "requestId": "r", "stackTrace": ['  File "/var/task/x.py", line 1, in f\n']})  # fmt: skip
    fail.handler({"incident_id": broken, "state": "Pipeline", "error": {"Error": "KubernetesObjectMissing", "Cause": lambda_error}}, CTX)

    stopped = world.ledger.get(waiting)
    assert stopped.state == S.NEEDS_ATTENTION
    assert stopped.failure is not None
    assert (stopped.failure.state, stopped.failure.error) == ("RequestApproval", "States.HeartbeatTimeout")
    assert read_node(world, world.node(0)["node_name"]).spec.unschedulable is True  # stays contained
    failed = world.ledger.get(broken)
    assert failed.state == S.FAILED
    assert failed.failure is not None
    # named by the state of the machine that ran, with the error's message and no Lambda JSON or stack trace
    assert (failed.failure.state, failed.failure.error, failed.failure.cause) == (
        "Guard", "KubernetesObjectMissing", "pytorchjob training/job is gone"
    )
    subjects = [m["Subject"] for m in world.messages()]
    assert any(waiting in s and "NEEDS_ATTENTION" in s for s in subjects)
    assert any(broken in s and "FAILED" in s for s in subjects)
    with pytest.raises(ApprovalExpired, match="timed out"):  # a decision after the timeout
        decide.handler(decision_of(world, waiting, "approve", "late", "me"), CTX)
    assert world.ledger.get(waiting).state == S.NEEDS_ATTENTION


def test_dry_run_decides_and_records_but_touches_nothing(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    node = world.node(1)
    taints_before = our_taints(read_node(world, node["node_name"]))
    monkeypatch.setenv("MODE", "dry_run")
    get_settings.cache_clear()
    try:
        incident_id = drive(world, alarm_event(world, 1), through="resolve")
        result = guard.handler({"incident_id": incident_id}, CTX)
    finally:
        get_settings.cache_clear()
    assert result["action"] == "dry_run"
    incident = world.ledger.get(incident_id)
    assert incident.state == S.DRY_RUN
    assert incident.mode == "dry_run"
    assert "nothing will be touched" in incident.transitions[-1].note
    assert our_taints(read_node(world, node["node_name"])) == taints_before


def test_a_contained_incident_whose_notification_failed_sends_it_on_the_retry(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    from botocore.exceptions import ClientError

    from sdcguard.lambdas.close import close_incident

    monkeypatch.setenv("MODE", "cordon_only")
    get_settings.cache_clear()
    try:
        incident_id = drive(world, alarm_event(world, 0), through="evidence")
    finally:
        get_settings.cache_clear()
    world.messages(wait=0.3)  # drain

    class Down:
        def publish(self, **_: Any) -> Any:
            raise ClientError({"Error": {"Code": "InternalError", "Message": "SNS is down"}}, "Publish")

    # Given a close whose ledger write went through but whose notification did not,
    with pytest.raises(ClientError):
        close_incident(world.ledger, incident_id, topic_arn=get_settings().topic_arn, sns=Down())
    assert world.ledger.get(incident_id).state == S.CONTAINED
    # the retry (the state machine's) still sends it, once,
    sns = world.standin.client("sns")
    close_incident(world.ledger, incident_id, topic_arn=get_settings().topic_arn, sns=sns)
    close_incident(world.ledger, incident_id, topic_arn=get_settings().topic_arn, sns=sns)
    mine = [m for m in world.messages() if m.get("MessageAttributes", {}).get("incident_id", {}).get("Value") == incident_id]
    assert [m["Subject"] for m in mine] == [f"sdcguard: incident {incident_id} CONTAINED"]
    assert world.ledger.get(incident_id).notified == ["CONTAINED"]


def test_cordon_only_contains_and_stops_for_a_human(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    node = world.node(0)
    monkeypatch.setenv("MODE", "cordon_only")
    get_settings.cache_clear()
    try:
        incident_id = drive(world, alarm_event(world, 0), through="evidence")
        result = close.handler({"incident_id": incident_id}, CTX)
    finally:
        get_settings.cache_clear()
    assert result["state"] == "CONTAINED"
    incident = world.ledger.get(incident_id)
    assert incident.mode == "cordon_only"
    assert states(incident)[-2:] == ["EVIDENCE_COLLECTED", "CONTAINED"]
    assert read_node(world, node["node_name"]).spec.unschedulable is True
    assert read_job(world)["spec"]["runPolicy"]["suspend"] is True


def test_steps_out_of_order_change_nothing(world: World) -> None:
    incident_id = drive(world, alarm_event(world, 0), through="guard")
    with pytest.raises(IncidentNotWaiting):
        resume_job.handler({"incident_id": incident_id}, CTX)
    with pytest.raises(IncidentNotWaiting):
        close.handler({"incident_id": incident_id}, CTX)
    with pytest.raises(MalformedEvent):
        resolve.handler({"incident": incident_id}, CTX)
    assert world.ledger.get(incident_id).state == S.GUARDED


# -- record retried by its own execution ----------------------------------------------------------------


def test_the_same_fault_after_a_rejection_contains_again_and_tells_the_reviewer(world: World) -> None:
    # Given an alarm of one run of the job (its id starts with the agent's run id), rejected and released,
    node = world.node(1)
    first = alarm_event(world, 1)
    first["detail"]["alarm_id"] = f"{uuid.uuid4().int >> 64:016x}-{first['detail']['step']}-ring_audit"
    rejected = drive(world, first, through="evidence")
    world.ledger.update(rejected, lambda i: i.advance(S.AWAITING_APPROVAL, actor="test"))
    approved_in_the_ledger(world, rejected, "reject")
    release.handler({"incident_id": rejected}, CTX)
    assert world.ledger.get(rejected).state == S.FALSE_ALARM
    assert [t for t in our_taints(read_node(world, node["node_name"])) if t.value == rejected] == []
    # a late copy of that alarm (raised before the rejection: another rank, a re-delivery) counts into it,
    late = copy.deepcopy(first)
    late["id"] = str(uuid.uuid4())
    assert record.handler(late, CTX) | {"duplicate": True} == record.handler(late, CTX)
    assert record.handler(late, CTX)["incident_id"] == rejected
    world.messages(wait=0.3)  # drain

    # when the same fault alarms again on the same node after that,
    again = copy.deepcopy(first)
    again["id"] = str(uuid.uuid4())
    again["detail"]["time"] = datetime.now(UTC).isoformat()
    repeat = drive(world, again, through="evidence")

    # it is a new incident, linked to the rejected one, that contains the node again,
    assert repeat != rejected
    incident = world.ledger.get(repeat)
    assert incident.repeat_of is not None
    assert (incident.repeat_of.incident_id, incident.repeat_of.state, incident.repeat_of.decided_by) == (rejected, S.FALSE_ALARM, "oncall")
    assert read_node(world, node["node_name"]).spec.unschedulable is True
    assert world.ledger.get(rejected).duplicate_alarms == 3  # the late copies only
    # and the reviewers are told it is a repeat, and of what.
    request_approval.handler({"incident_id": repeat, "task_token": "t-" + uuid.uuid4().hex, "timeout_seconds": 60}, CTX)
    (message,) = [m for m in world.messages() if m.get("MessageAttributes", {}).get("incident_id", {}).get("Value") == repeat]
    assert f"The same fault again: repeat of {rejected}, rejected by oncall at " in message["Message"]


def test_a_retried_record_recognises_its_own_write(world: World) -> None:
    event = alarm_event(world, 0)
    execution = f"arn:aws:states:us-east-1:123456789012:execution:incident:{uuid.uuid4().hex}"
    first = record.handler({"event": event, "execution_id": execution}, CTX)
    # the state's Retry (or botocore resending after a lost reply) records the same event again
    retried = record.handler({"event": event, "execution_id": execution}, CTX)
    # while another execution (a re-delivery of the event) is a duplicate
    other = record.handler({"event": event, "execution_id": execution + "-2"}, CTX)

    assert (first["duplicate"], retried["duplicate"], other["duplicate"]) == (False, False, True)
    assert first["incident_id"] == retried["incident_id"] == other["incident_id"]
    assert first["topic_arn"] == get_settings().topic_arn
    incident = world.ledger.get(first["incident_id"])
    assert incident.opened_by == execution
    assert incident.duplicate_alarms == 1
    assert states(incident) == ["RECORDED"]


# -- the blast radius: stopped incidents, the lease, the index ----------------------------------------------


def private_ledger(world: World) -> Ledger:
    table = f"guard-{uuid.uuid4().hex[:6]}"
    create_ledger_table(world.standin.client("dynamodb"), table)
    return Ledger(table, world.standin.client("dynamodb"))


def resolved_incident(ledger: Ledger, node: str, *, cluster: str = "ml-cluster") -> str:
    from sdcguard.contract import Alarm, ResolvedSuspect

    detail = copy.deepcopy(load_event("alarm_ring_audit")["detail"])
    detail["suspects"][0]["node"] = node
    detail["job"]["hyperpod_cluster"] = cluster
    incident, _ = ledger.open(Alarm.model_validate(detail), mode="normal")
    suspect = ResolvedSuspect(global_rank=3, pod="p", node=node, instance_id=node.removeprefix("hyperpod-"))
    ledger.update(incident.incident_id, resolved_to(suspect))
    return incident.incident_id


def fresh_node(world: World) -> str:
    name = f"hyperpod-i-0{uuid.uuid4().hex[:16]}"
    k8s.CoreV1Api(world.kube()).create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {}})
    return name


def test_a_failed_incident_holds_its_quota_until_its_node_is_released(world: World) -> None:
    from sdcguard.lambdas.cordon import cordon_node, uncordon_node
    from sdcguard.lambdas.guard import guard_incident

    ledger = private_ledger(world)
    limits = {"mode": "normal", "max_quarantined_nodes": 1, "max_replacements_per_day": 10, "kubernetes": world.kube}
    # Given an incident that cordoned its node and then failed,
    held, other = fresh_node(world), fresh_node(world)
    failed = resolved_incident(ledger, held)
    assert guard_incident(ledger, failed, **limits).state == S.GUARDED  # type: ignore[arg-type]
    cordon_node(world.kube(), held, failed)
    for state in (S.SUSPENDED, S.CORDONED, S.FAILED):
        ledger.update(failed, moved_to(state))
    # a second incident on another node is refused while the node stays cordoned,
    second = resolved_incident(ledger, other)
    with pytest.raises(BlastRadiusExceeded, match="limit is 1"):
        guard_incident(ledger, second, **limits)  # type: ignore[arg-type]
    assert ledger.get(second).state == S.RESOLVED
    # and admitted once a human released it; the failed incident then stops counting.
    uncordon_node(world.kube(), held, failed)
    assert guard_incident(ledger, second, **limits).state == S.GUARDED  # type: ignore[arg-type]
    released = ledger.get(failed)
    assert released.state == S.FAILED
    assert released.nodes_released_at is not None
    assert [i.incident_id for i in ledger.counting("ml-cluster")] == [second]


def test_a_guard_whose_lease_ran_out_writes_nothing(world: World) -> None:
    ledger = private_ledger(world)
    incident_id = resolved_incident(ledger, fresh_node(world))
    with ledger.locked("guard:ml-cluster", owner=incident_id, lease_seconds=0.2) as lease:
        time.sleep(0.3)
        # another guard takes the expired lock and admits something
        with ledger.locked("guard:ml-cluster", owner="someone-else"):
            pass
        with pytest.raises(LockLost, match="expired"):
            ledger.update(incident_id, lambda i: i.advance(S.GUARDED, actor="guard"), lease=lease)
    assert ledger.get(incident_id).state == S.RESOLVED


def test_an_admission_the_index_does_not_show_yet_still_counts(world: World) -> None:
    from sdcguard.lambdas.guard import guard_incident

    ledger = private_ledger(world)
    first = resolved_incident(ledger, fresh_node(world))
    guard_incident(ledger, first, mode="normal", max_quarantined_nodes=1, max_replacements_per_day=10)
    # Given the index lags behind the table (DynamoDB's global indexes are eventually consistent),
    ledger.client.update_item(
        TableName=ledger.table, Key={"incident_id": {"S": first}}, UpdateExpression="REMOVE open_cluster, open_until"
    )
    assert ledger.counting("ml-cluster") == []
    # the next guard still sees the admission through the lock's memory of it.
    second = resolved_incident(ledger, fresh_node(world))
    with pytest.raises(BlastRadiusExceeded, match="would hold 2 nodes"):
        guard_incident(ledger, second, mode="normal", max_quarantined_nodes=1, max_replacements_per_day=10)


CLOSED_INCIDENTS = int(os.environ.get("SDCGUARD_LEDGER_SCALE", "2000"))
"""More than one page of a scan: a guard that scanned the ledger would show it. ``SDCGUARD_LEDGER_SCALE=10000``
runs the issue's size (the calls and the items read are the same; moto's seconds are printed)."""


def test_the_guard_reads_only_the_open_incidents_of_thousands(world: World) -> None:
    from sdcguard.contract import Alarm, Transition
    from sdcguard.lambdas.guard import guard_incident

    ledger = private_ledger(world)
    base = copy.deepcopy(load_event("alarm_ring_audit")["detail"])
    items = []
    for n in range(CLOSED_INCIDENTS):  # closed long ago, or false alarms
        detail = {**base, "alarm_id": f"closed{n:010d}", "last_clean": {"ring_audit": n, "weight_fingerprint": n}}
        state = S.CLOSED if n % 2 else S.FALSE_ALARM
        incident = Incident(
            incident_id=f"sdc-closed-{n:06d}", idempotency_key=f"k{n}", alarm=Alarm.model_validate(detail), state=state,
            transitions=[Transition(state=S.REPLACING, at=datetime(2026, 1, 1, tzinfo=UTC), actor="t")] if n % 2 else [],
        )  # fmt: skip
        items.append({"PutRequest": {"Item": Ledger._item(incident, 1)}})
    ddb = world.standin.client("dynamodb")
    for i in range(0, len(items), 25):
        ddb.batch_write_item(RequestItems={ledger.table: items[i : i + 25]})
    mine = resolved_incident(ledger, fresh_node(world))

    calls: list[str] = []
    timing: list[tuple[str, float]] = []
    ledger.client.meta.events.register("before-call.dynamodb.*", lambda model, **_: calls.append(model.name))
    ledger.client.meta.events.register("before-call.dynamodb.*", lambda model, **_: timing.append((model.name, time.perf_counter())))
    ledger.client.meta.events.register("after-call.dynamodb.*", lambda model, **_: timing.append((model.name, time.perf_counter())))
    read_by_query: list[int] = []
    ledger.client.meta.events.register(
        "after-call.dynamodb.Query", lambda parsed, **_: read_by_query.append(parsed.get("ScannedCount", -1))
    )
    # (On the stand-in, moto's Query walks every item and its transaction copies the table to roll back;
    # DynamoDB reads only the index's matching keys and writes two items. The calls are the outcome; the
    # seconds, printed beside a scan's, are a measurement.)
    started = time.perf_counter()
    admitted = guard_incident(ledger, mine, mode="normal", max_quarantined_nodes=1, max_replacements_per_day=1)
    seconds = time.perf_counter() - started
    guard_calls, calls[:] = list(calls), []
    per_call = [(timing[i][0], round(timing[i + 1][1] - timing[i][1], 3)) for i in range(0, len(timing) - 1, 2)]
    started = time.perf_counter()
    scanned = len(ledger.list())
    scan_seconds = time.perf_counter() - started
    print(
        f"\nguard with {CLOSED_INCIDENTS:,} closed incidents: {seconds:.3f} s, calls {per_call}; "
        f"a full scan instead: {scan_seconds:.3f} s, {len(calls)} calls"
    )

    assert admitted.state == S.GUARDED
    assert scanned == CLOSED_INCIDENTS + 1
    assert calls.count("Scan") > 1  # the ledger is more than one page: a scanning guard would have paged
    assert "Scan" not in guard_calls
    assert guard_calls.count("Query") == 1
    assert read_by_query == [1]  # of all the incidents, the query read the one open one: what DynamoDB bills
    assert guard_calls.count("GetItem") <= 4  # the incident (twice), itself from the index, and the write's re-read
    assert [i.incident_id for i in ledger.counting("ml-cluster")] == [mine]  # none of the closed ones


# -- two incidents on one job ------------------------------------------------------------------------------


def to_pointer_rewritten(world: World, incident_id: str) -> None:
    for state in (S.CORDONED, S.EVIDENCE_COLLECTED, S.AWAITING_APPROVAL, S.APPROVED, S.REPLACING, S.REPLACED, S.POINTER_REWRITTEN):
        world.ledger.update(incident_id, moved_to(state))


def test_the_job_resumes_only_when_no_incident_that_suspended_it_is_open(world: World) -> None:
    custom = k8s.CustomObjectsApi(world.kube())
    custom.patch_namespaced_custom_object(  # given a running job that no incident holds
        "kubeflow.org", "v1", world.seeded["namespace"], "pytorchjobs", world.seeded["job"],
        {"metadata": {"annotations": {"sdcguard.io/suspended-by": None}}, "spec": {"runPolicy": {"suspend": False}}},
    )  # fmt: skip
    # when two incidents (two faults, one job) each suspend it,
    first = drive(world, alarm_event(world, 0), through="suspend_job")
    second = drive(world, alarm_event(world, 1), through="suspend_job")  # (node 2 was replaced above)
    annotations = read_job(world)["metadata"]["annotations"]
    assert annotations["sdcguard.io/suspended-by"] == f"{first},{second}", (first, second)
    to_pointer_rewritten(world, first)
    to_pointer_rewritten(world, second)

    # the first to finish leaves it suspended for the other,
    held = resume_job.handler({"incident_id": first}, CTX)
    assert (held["changed"], held["held_by"]) == (False, [second])
    assert read_job(world)["spec"]["runPolicy"]["suspend"] is True
    assert "stays suspended" in world.ledger.get(first).transitions[-1].note
    # and the last one resumes it.
    resumed = resume_job.handler({"incident_id": second}, CTX)
    assert resumed["changed"] is True
    job = read_job(world)
    assert not job["spec"]["runPolicy"].get("suspend")
    assert not (job["metadata"].get("annotations") or {}).get("sdcguard.io/suspended-by")


def test_an_operator_releases_a_stopped_incident_and_aborts_a_running_one(world: World) -> None:
    from sdcguard.contract import Alarm, ResolvedSuspect
    from sdcguard.lambdas.abort import abort_incident, release_stopped
    from sdcguard.lambdas.cordon import cordon_node
    from sdcguard.lambdas.guard import guard_incident
    from sdcguard.lambdas.job import holders, suspend_job

    ledger = private_ledger(world)
    limits = {"mode": "normal", "max_quarantined_nodes": 1, "max_replacements_per_day": 10, "kubernetes": world.kube}
    namespace, job = world.seeded["namespace"], world.seeded["job"]

    def contained(node: str, *, opened_by: str | None = None) -> str:
        """An incident of this world's job that suspended the job and cordoned ``node``."""
        detail = copy.deepcopy(alarm_event(world, 0)["detail"])
        detail["suspects"][0]["node"] = node
        incident, _ = ledger.open(Alarm.model_validate(detail), mode="normal", opened_by=opened_by)
        suspect = ResolvedSuspect(global_rank=3, pod="p", node=node, instance_id=node.removeprefix("hyperpod-"))
        ledger.update(incident.incident_id, resolved_to(suspect))
        assert guard_incident(ledger, incident.incident_id, **limits).state == S.GUARDED  # type: ignore[arg-type]
        suspend_job(world.kube(), namespace, job, incident.incident_id)
        cordon_node(world.kube(), node, incident.incident_id)
        for state in (S.SUSPENDED, S.CORDONED):
            ledger.update(incident.incident_id, moved_to(state))
        return incident.incident_id

    # Given an incident that stopped for attention holding its node and the job,
    held, later = fresh_node(world), fresh_node(world)
    stopped = contained(held)
    ledger.update(stopped, moved_to(S.NEEDS_ATTENTION))
    assert stopped in holders(read_job(world))
    # when an operator releases it,
    released = release_stopped(ledger, world.kube, stopped, operator="arn:aws:iam::123456789012:user/oncall", reason="looked at it")
    # its node is uncordoned, its hold on the job gone, and it is recorded as RELEASED by the operator,
    assert read_node(world, held).spec.unschedulable in (None, False)
    assert our_taints(read_node(world, held)) == []
    assert stopped not in holders(read_job(world))
    assert (released.state, released.transitions[-1].actor) == (S.RELEASED, "arn:aws:iam::123456789012:user/oncall")
    assert stopped not in [i.incident_id for i in ledger.counting(released.alarm.job.hyperpod_cluster)]
    with pytest.raises(IncidentNotWaiting, match="still running: abort it"):  # release is for stopped incidents
        release_stopped(ledger, world.kube, resolved_incident(ledger, fresh_node(world)), operator="me", reason="r")

    # Given a running incident whose execution is still running,
    _token, execution = waiting_token(world.standin)
    running = contained(later, opened_by=execution)
    # when an operator aborts it,
    sfn = world.standin.client("stepfunctions")
    stops: list[dict[str, Any]] = []

    class Recording:  # moto's executor does not end a task-token wait on StopExecution: record the call
        def describe_execution(self, **kwargs: Any) -> Any:
            return sfn.describe_execution(**kwargs)

        def stop_execution(self, **kwargs: Any) -> Any:
            stops.append(kwargs)
            return sfn.stop_execution(**kwargs)

    aborted = abort_incident(ledger, world.kube, running, operator="oncall", reason="wrong job", sfn=Recording())
    # its execution is stopped, its node uncordoned and the job freed, and it no longer counts.
    assert [(c["executionArn"], c["error"]) for c in stops] == [(execution, "AbortedByOperator")]
    assert our_taints(read_node(world, later)) == []
    assert running not in holders(read_job(world))
    assert (aborted.state, aborted.transitions[-1].actor) == (S.ABORTED, "oncall")
    assert running not in [i.incident_id for i in ledger.counting(aborted.alarm.job.hyperpod_cluster)]
    with pytest.raises(IncidentNotWaiting, match="already ended"):
        abort_incident(ledger, world.kube, stopped, operator="me", reason="r", sfn=world.standin.client("stepfunctions"))


def test_a_record_that_wrote_then_failed_is_not_reported_as_nothing_opened(world: World) -> None:
    from sdcguard.contract import Alarm

    execution = f"arn:aws:states:us-east-1:123456789012:execution:sdcguard-incident:{uuid.uuid4().hex}"
    event = alarm_event(world, 0)
    world.messages(wait=0.3)  # drain
    # Given a record that opened the incident and then failed (its Catch sends the refusal to fail),
    opened, _ = world.ledger.open(Alarm.model_validate(event["detail"]), mode="normal", opened_by=execution)
    caught = {"Error": "Sandbox.Timedout", "Cause": "the function timed out after its write"}
    ended = fail.handler({"state": "Record", "error": caught, "execution_id": execution, "event": event}, CTX)
    # the incident it opened is found and recorded as FAILED, and the reviewers are told about it,
    assert ended == {"incident_id": opened.incident_id, "state": "FAILED"}
    subjects = [m["Subject"] for m in world.messages()]
    assert any(opened.incident_id in s and "FAILED" in s for s in subjects)
    assert not any("refused" in s for s in subjects)
    # while a refusal of an execution that wrote nothing still says nothing was opened.
    other = f"arn:aws:states:us-east-1:123456789012:execution:sdcguard-incident:{uuid.uuid4().hex}"
    refused = fail.handler({"state": "Record", "error": caught, "execution_id": other, "event": alarm_event(world, 0)}, CTX)
    assert refused == {"incident_id": None, "state": "REFUSED"}


def test_a_redelivery_after_record_failed_opens_a_linked_incident_not_a_silent_duplicate(world: World) -> None:
    executions = [f"arn:aws:states:us-east-1:123456789012:execution:sdcguard-incident:{uuid.uuid4().hex}" for _ in range(4)]
    event = alarm_event(world, 0)
    # Given a record that opened the incident, a re-delivery counted into it while it was alive,
    first = record.handler({"event": event, "execution_id": executions[0]}, CTX)
    assert record.handler({"event": event, "execution_id": executions[1]}, CTX)["duplicate"] is True
    # and its record failed after the write (the fail handler recorded it FAILED, nothing touched),
    caught = {"Error": "Sandbox.Timedout", "Cause": "the function timed out after its write"}
    assert fail.handler({"state": "Record", "error": caught, "execution_id": executions[0], "event": event}, CTX)["state"] == "FAILED"
    # when the same alarm is delivered again (raised before the failure),
    again = record.handler({"event": event, "execution_id": executions[2]}, CTX)
    # it is not swallowed: a new incident, linked to the failed one, is opened by this execution,
    assert again["duplicate"] is False
    assert again["incident_id"] != first["incident_id"]
    repeat = world.ledger.get(again["incident_id"])
    assert repeat.repeat_of is not None
    assert (repeat.repeat_of.incident_id, repeat.repeat_of.state) == (first["incident_id"], S.FAILED)
    assert (repeat.opened_by, states(repeat)) == (executions[2], ["RECORDED"])
    # and while that one is alive, a further delivery is its duplicate, as before.
    assert record.handler({"event": event, "execution_id": executions[3]}, CTX) == {**again, "duplicate": True}
    assert world.ledger.get(first["incident_id"]).duplicate_alarms == 1


def test_an_alarm_raised_before_an_incident_failed_after_acting_is_still_its_duplicate(world: World) -> None:
    from sdcguard.contract import Alarm, ResolvedSuspect

    event = alarm_event(world, 0)
    node = world.node(0)
    # Given an incident that failed after it had resolved its suspect (not at Record),
    opened, _ = world.ledger.open(Alarm.model_validate(event["detail"]), mode="normal")
    suspect = ResolvedSuspect(global_rank=3, pod=node["pod"], node=node["node_name"], instance_id=node["instance_id"])
    world.ledger.update(opened.incident_id, resolved_to(suspect))
    world.ledger.update(opened.incident_id, moved_to(S.FAILED))
    # a delivery of an alarm raised before it failed counts into it (only a later alarm is a repeat).
    again = record.handler(event, CTX)
    assert (again["incident_id"], again["duplicate"]) == (opened.incident_id, True)


def test_uncordon_leaves_a_cordon_someone_else_set_during_the_incident(world: World) -> None:
    from sdcguard.lambdas.cordon import cordon_node, uncordon_node

    node = fresh_node(world)
    incident_id = f"sdc-{uuid.uuid4().hex[:20]}"
    cordon_node(world.kube(), node, incident_id)
    # Given someone else cordoned the node for their own reasons while the incident held it,
    core = k8s.CoreV1Api(world.kube())
    taints = [{"key": t.key, "value": t.value or "", "effect": t.effect} for t in (core.read_node(node).spec.taints or [])]
    core.patch_node(node, {"spec": {"taints": [*taints, {"key": "ops/maintenance", "value": "disk", "effect": "NoSchedule"}]}})
    # when the incident releases it,
    assert uncordon_node(world.kube(), node, incident_id).changed
    # only sdcguard's taint goes: theirs stays, and so does the cordon (with the taint Kubernetes mirrors it as).
    after = core.read_node(node)
    assert sorted((t.key, t.value or "") for t in after.spec.taints) == [
        ("node.kubernetes.io/unschedulable", ""),
        ("ops/maintenance", "disk"),
    ]
    assert after.spec.unschedulable is True


# -- the daily limit at the moment of replacing (issue #27) ------------------------------------------------
# Last in the file: it replaces node 0 of this world's cluster.


def test_the_daily_limit_is_checked_again_at_replace(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.contract import Replacement
    from sdcguard.lambdas import replace as replace_module
    from sdcguard.lambdas.abort import release_stopped
    from sdcguard.lambdas.blast_radius import DAY, replacements_since

    asked: list[str] = []

    def asking(incident: Any, instance_id: str, cluster: str, sagemaker: Any) -> Any:
        # HyperPod is asked nothing for real: the world's nodes stay as they are for the tests that run after
        # (test_iam_inventory runs every test of this file in one world).
        asked.append(instance_id)
        return Replacement(old_instance_id=instance_id, status="Requested")

    monkeypatch.setattr(replace_module, "_ask_hyperpod", asking)
    # Given two incidents on two nodes, both admitted and approved,
    first, second = world.node(0), world.node(1)
    ids = []
    for index in (0, 1):
        incident_id = drive(world, alarm_event(world, index), through="evidence")
        world.tokens.put(incident_id, "t", expires_at=time.time() + 60)
        world.ledger.update(incident_id, lambda i: i.advance(S.AWAITING_APPROVAL, actor="test"))
        approved_in_the_ledger(world, incident_id)
        ids.append(incident_id)
    # and a daily limit with room for one more replacement (earlier tests' replacements count),
    cluster = world.seeded["hyperpod_cluster"]
    earlier = replacements_since(world.ledger.counting(cluster), datetime.now(UTC) - DAY, exclude="")
    monkeypatch.setenv("MAX_REPLACEMENTS_PER_DAY", str(earlier + 1))
    get_settings.cache_clear()
    try:
        # the first replaces its node,
        replace.handler({"incident_id": ids[0], "instance_id": first["instance_id"]}, CTX)
        # and the second is refused under the lock: nothing is asked of HyperPod.
        with pytest.raises(BlastRadiusExceeded, match=f"exceed the limit of {earlier + 1} per day"):
            replace.handler({"incident_id": ids[1], "instance_id": second["instance_id"]}, CTX)
    finally:
        get_settings.cache_clear()
    assert asked == [first["instance_id"]]
    assert world.ledger.get(ids[0]).state == S.REPLACING
    refused = world.ledger.get(ids[1])
    assert (refused.state, refused.replacements) == (S.APPROVED, [])
    sagemaker = world.standin.client("sagemaker")
    summaries = sagemaker.list_cluster_nodes(ClusterName=cluster)["ClusterNodeSummaries"]
    listed = {n["InstanceId"]: n["InstanceStatus"]["Status"] for n in summaries}
    assert listed[second["instance_id"]] == "Running"
    # The machine's Catch stops it for a human; its node stays cordoned.
    error = {"Error": "BlastRadiusExceeded", "Cause": "the daily limit"}
    needs_attention.handler({"incident_id": ids[1], "state": "Pipeline", "error": error}, CTX)
    stopped = world.ledger.get(ids[1])
    assert stopped.state == S.NEEDS_ATTENTION
    assert stopped.failure is not None
    assert stopped.failure.error == "BlastRadiusExceeded"
    assert stopped.replacements == []
    assert read_node(world, second["node_name"]).spec.unschedulable is True
    # Both released by an operator: this test holds nothing of the world any more.
    needs_attention.handler({"incident_id": ids[0], "state": "Pipeline", "error": error}, CTX)
    for incident_id in ids:
        assert release_stopped(world.ledger, world.kube, incident_id, operator="test", reason="over").state == S.RELEASED
