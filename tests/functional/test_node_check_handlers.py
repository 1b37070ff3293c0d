"""The node check handlers against the stand-in: real Jobs, run by the stand-in's EKS server as local
processes of ``sdcguard replay``, on a real capsule of a tiny model beside the checkpoints.

A node registered with a persistent fault reproduces it on every repetition; a
healthy node reproduces nothing and qualifies; a capsule with a flipped byte is
refused (inconclusive), never "reproduced"; a replacement that fails its
qualification is cordoned and rejected.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from sdcguard.agent import capsule as cap
from sdcguard.contract import IncidentState, Replacement
from sdcguard.infra.local.seed import seed
from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lambdas import clients
from sdcguard.lambdas.cordon import TAINT_KEY
from sdcguard.lambdas.handlers import node_check_status, reject_replacement, start_node_check
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lambdas.settings import get_settings
from sdcguard.lineage.store import open_store
from tests.capsules import RANK, STEP, recomputed
from tests.functional.test_handlers_pipeline import (
    CTX,
    World,
    alarm_event,
    create_ledger_table,
    drive,
    write_checkpoints,
)

S = IncidentState
REPEATS = 2
IMAGE = "registry.example/sdcguard/node-check@sha256:" + "5dc0" * 16
"""The stack's NodeCheckImage in these scenarios."""
FAULTY = (1, 3)
"""The seeded nodes whose GPU is faulty (persistently: every repetition of the capsule's step)."""


@contextlib.contextmanager
def node_check_world(standin: LocalStandIn) -> Iterator[World]:
    """The stand-in set up for the node check scenarios (also replayed by test_iam_inventory under the roles):
    4 nodes, faulty GPUs on nodes 1 and 3, the capsule of rank RANK's step STEP beside the checkpoints, the
    handlers' environment (restored afterwards)."""
    suffix = uuid.uuid4().hex[:6]
    seeded = seed(standin, nodes=4, cluster=f"hp-{suffix}", job=f"job-{suffix}", minutes=20)
    ddb = standin.client("dynamodb")
    ledger_table = f"ledger-{suffix}"
    create_ledger_table(ddb, ledger_table)
    ddb.create_table(
        TableName=f"idem-{suffix}", KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}], BillingMode="PAY_PER_REQUEST",
    )  # fmt: skip
    topic = standin.client("sns").create_topic(Name=f"reviewers-{suffix}")["TopicArn"]
    env = {
        **standin.env,
        "LEDGER_TABLE": ledger_table, "IDEMPOTENCY_TABLE": f"idem-{suffix}", "TOPIC_ARN": topic,
        "HYPERPOD_CLUSTER": seeded["hyperpod_cluster"], "EKS_CLUSTER": seeded["eks_cluster"],
        "JOB_NAMESPACE": seeded["namespace"], "JOB_NAME": seeded["job"], "CHECKPOINT_BUCKET": seeded["bucket"],
        "CHECKPOINT_PREFIX": seeded["job"], "MODE": "normal", "MAX_QUARANTINED_NODES": "4",
        "MAX_REPLACEMENTS_PER_DAY": "1000", "APPROVAL_TIMEOUT_SECONDS": "300",
        "NODE_CHECK_REPEATS": str(REPEATS), "NODE_CHECK_DEADLINE_SECONDS": "120", "MAX_REPLACEMENT_ROUNDS": "2",
        # The pipeline's replay image (the stand-in runs none), and its faulty GPUs are simulated by injection.
        "NODE_CHECK_IMAGE": IMAGE, "NODE_CHECK_ACCEPT_INJECTED_FAULTS": "true",
        "POWERTOOLS_TRACE_DISABLED": "true", "POWERTOOLS_METRICS_NAMESPACE": "sdcguard-test",
    }  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    get_settings.cache_clear()
    clients.forget()
    eks = standin.eks
    assert eks is not None
    if not eks.workload_env:
        eks.workload_env = {k: v for k, v in standin.env.items() if k.startswith("AWS_")}
    # The suspect's step 3 of rank 1, recomputed healthily, stored where the agent stores it.
    store = open_store(f"s3://{seeded['bucket']}/{seeded['job']}", client=standin.client("s3"))
    written = cap.write_capsule(store, **recomputed())
    assert written.written, written.reason
    # A persistent fault on the GPUs of nodes 1 and 3, bound to the node as a real faulty GPU is.
    nodes = seeded["nodes"]
    eks.node_faults.set({
        nodes[i]["node_name"]: f"kind=finite_activation,node={nodes[i]['node_name']},step={STEP},factor=1e4,repeat=50"
        for i in FAULTY
    })  # fmt: skip
    try:
        made = World(standin, seeded, Ledger(ledger_table, standin.client("dynamodb")), "")
        write_checkpoints(made, [0])
        yield made
    finally:
        eks.node_faults.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_settings.cache_clear()
        clients.forget()


@pytest.fixture(scope="module")
def world(standin: LocalStandIn) -> Iterator[World]:
    with node_check_world(standin) as made:
        yield made


def suspect_rank(world: World, index: int) -> int:
    """The rank of node ``index`` whose capsule the scenarios replay: its own second rank, as the pod the training
    operator made for that rank is node ``index``'s (rank RANK is node 0's second rank)."""
    return int(world.seeded["nodes"][index]["ranks"][RANK])


def cordoned_suspect(world: World, index: int, window: int) -> str:
    """An incident about node ``index``'s rank :func:`suspect_rank` at step STEP (the capsule's), driven to
    CORDONED; that rank's capsule is rank RANK's as it is now (copied beside it)."""
    rank = suspect_rank(world, index)
    s3, bucket = world.standin.client("s3"), world.seeded["bucket"]
    source, target = (f"{world.seeded['job']}/{cap.capsule_dir(STEP, r)}/" for r in (RANK, rank))
    if rank != RANK:
        for item in s3.list_objects_v2(Bucket=bucket, Prefix=source).get("Contents", []):
            key = str(item["Key"])
            s3.copy_object(Bucket=bucket, Key=target + key.removeprefix(source), CopySource={"Bucket": bucket, "Key": key})
    event = alarm_event(world, index)
    event["detail"].update(
        step=STEP, last_clean={"nonfinite_grad": STEP - 1, "ring_audit": window, "weight_fingerprint": STEP - 1, "reduced_grad": STEP - 1},
    )  # fmt: skip
    event["detail"]["suspects"][0]["global_rank"] = rank
    event["detail"]["world_size"] = int(world.seeded["world_size"])
    incident_id = drive(world, event, through="cordon")
    assert world.ledger.get(incident_id).state == S.CORDONED
    return incident_id


def run_checks(world: World, incident_id: str, purpose: str, *, seconds: float = 90) -> dict[str, Any]:
    """start_node_check, then node_check_status until done (as the state machine's loop does)."""
    started = start_node_check.handler({"incident_id": incident_id, "purpose": purpose}, CTX)
    attempt, deadline = started["attempt"], time.monotonic() + seconds
    while True:
        polled = node_check_status.handler({"incident_id": incident_id, "purpose": purpose, "attempt": attempt}, CTX)
        if polled["done"] or polled["exhausted"] or time.monotonic() > deadline:
            return polled
        attempt = polled["attempt"]
        time.sleep(0.5)


def jobs_of(world: World, incident_id: str) -> list[Any]:
    return k8s.BatchV1Api(world.kube()).list_namespaced_job(
        world.seeded["namespace"], label_selector=f"sdcguard.io/incident={incident_id}"
    ).items


def replaced_by(world: World, incident_id: str, new_index: int) -> None:
    """The incident as replacement_status leaves it: its suspect replaced by seeded node ``new_index``."""
    new = world.seeded["nodes"][new_index]["instance_id"]

    def change(current: Any) -> Any:
        for state in (S.EVIDENCE_COLLECTED, S.AWAITING_APPROVAL, S.APPROVED, S.REPLACING):
            current = current.advance(state, actor="test")
        old = current.instance_ids[0]
        return current.advance(S.REPLACED, actor="test", replacements=[Replacement(old_instance_id=old, new_instance_id=new, status="Running")])

    world.ledger.update(incident_id, change)


@pytest.mark.slow  # a replay Job (forked from the stand-in's zygote: the first one waits for its torch import)
def test_a_persistent_fault_reproduces_on_the_suspect_every_time(world: World) -> None:
    incident_id = cordoned_suspect(world, FAULTY[0], window=0)
    polled = run_checks(world, incident_id, "reproduce")
    assert polled["done"], polled
    assert polled["summary"] == f"reproduced {REPEATS}/{REPEATS}: persistent"
    (check,) = world.ledger.get(incident_id).node_checks
    assert (check.state, check.reproduced, check.node) == ("failed", REPEATS, world.seeded["nodes"][FAULTY[0]]["node_name"])
    assert jobs_of(world, incident_id) == []  # finished Jobs are deleted


@pytest.mark.slow  # a replay Job (forked from the stand-in's zygote: the first one waits for its torch import)
def test_a_healthy_suspect_reproduces_nothing_and_a_healthy_replacement_qualifies(world: World) -> None:
    incident_id = cordoned_suspect(world, 0, window=1)
    polled = run_checks(world, incident_id, "reproduce")
    assert polled["summary"] == f"reproduced 0/{REPEATS}"
    replaced_by(world, incident_id, 2)
    qualified = run_checks(world, incident_id, "qualify")
    new_node = world.seeded["nodes"][2]["node_name"]
    assert (qualified["done"], qualified["qualified"], qualified["failed_instance_ids"]) == (True, True, [])
    assert qualified["summary"] == f"qualified {REPEATS}/{REPEATS} on {new_node}"


@pytest.mark.slow  # a replay Job (forked from the stand-in's zygote: the first one waits for its torch import)
def test_a_faulty_replacement_fails_qualification_and_is_cordoned(world: World) -> None:
    incident_id = cordoned_suspect(world, 0, window=2)
    replaced_by(world, incident_id, FAULTY[1])
    faulty = world.seeded["nodes"][FAULTY[1]]
    polled = run_checks(world, incident_id, "qualify")
    assert (polled["done"], polled["qualified"], polled["failed_instance_ids"]) == (True, False, [faulty["instance_id"]])
    assert polled["summary"].startswith(f"not qualified on {faulty['node_name']}")

    rejected = reject_replacement.handler({"incident_id": incident_id}, CTX)
    assert (rejected["replace_again"], rejected["instance_ids"]) == (True, [faulty["instance_id"]])
    node = k8s.CoreV1Api(world.kube()).read_node(faulty["node_name"])
    assert node.spec.unschedulable
    assert [t.value for t in node.spec.taints or [] if t.key == TAINT_KEY] == [incident_id]
    assert [r.status for r in world.ledger.get(incident_id).replacements] == ["Rejected"]


@pytest.mark.slow  # a replay Job (forked from the stand-in's zygote: the first one waits for its torch import)
def test_a_flipped_byte_in_the_capsule_is_inconclusive_never_reproduced(world: World) -> None:
    s3 = world.standin.client("s3")
    bucket = world.seeded["bucket"]
    key = f"{world.seeded['job']}/{cap.capsule_dir(STEP, RANK)}/state.pt"
    original = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    flipped = bytearray(original)
    flipped[len(flipped) // 3] ^= 0x10
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(flipped))
    try:
        incident_id = cordoned_suspect(world, FAULTY[1], window=0)  # a faulty node: still not "reproduced"
        polled = run_checks(world, incident_id, "reproduce")
    finally:
        s3.put_object(Bucket=bucket, Key=key, Body=original)
    assert polled["done"], polled
    assert polled["summary"].startswith("inconclusive: capsule unusable"), polled["summary"]
    assert "corrupt" in polled["summary"]
    (check,) = world.ledger.get(incident_id).node_checks
    assert (check.state, check.reproduced) == ("inconclusive", 0)


def test_without_a_capsule_nothing_runs_and_the_flow_goes_on(world: World) -> None:
    incident_id = cordoned_suspect(world, 2, window=0)
    world.ledger.update(incident_id, lambda i: i.model_copy(update={"alarm": i.alarm.model_copy(update={"step": STEP + 1})}))
    started = start_node_check.handler({"incident_id": incident_id, "purpose": "reproduce"}, CTX)
    assert (started["started"], started["skipped"]) == (0, 1)
    polled = node_check_status.handler({"incident_id": incident_id, "purpose": "reproduce", "attempt": 0}, CTX)
    location = f"s3://{world.seeded['bucket']}/{world.seeded['job']}/{cap.capsule_dir(STEP + 1, suspect_rank(world, 2))}"
    assert (polled["done"], polled["summary"]) == (True, f"not run: no replay capsule at {location}")
    assert jobs_of(world, incident_id) == []


def tenants_reproduce_job(world: World, incident_id: str, node: str) -> str:
    """A Job a tenant of the namespace creates first under the name the suspect's reproduction will use, tolerating
    the quarantine, whose pod prints a replay report saying "reproduced" on every repetition."""
    from sdcguard.lambdas.node_check import job_name

    name = job_name("reproduce", incident_id, node)
    line = json.dumps({"outcome": "mismatch", "matched": 0, "reproduced": REPEATS, "repeats": REPEATS, "node": node})
    k8s.BatchV1Api(world.kube()).create_namespaced_job(world.seeded["namespace"], {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "sdcguard-replay", "image": "busybox", "command": ["python", "-c", f"print({line!r})"]}],
        }}},
    })  # fmt: skip
    return name


def test_a_reproduce_job_a_tenant_made_first_is_neither_adopted_nor_read_nor_deleted(world: World) -> None:
    # Given a healthy suspect, and a tenant's Job under the reproduction's name that prints "reproduced 2/2",
    incident_id = cordoned_suspect(world, 0, window=0)  # windows above STEP - 1 are all the same window
    node = world.seeded["nodes"][0]["node_name"]
    name = tenants_reproduce_job(world, incident_id, node)
    # when the reproduction starts and is polled,
    polled = run_checks(world, incident_id, "reproduce")
    # the reviewer reads that it did not run, and why, never "reproduced",
    assert polled["done"], polled
    assert "reproduced" not in polled["summary"].split(":")[0]
    assert polled["summary"].startswith(f"not run: a Job {world.seeded['namespace']}/{name} exists that the pipeline did not create")
    (check,) = world.ledger.get(incident_id).node_checks
    assert (check.state, check.reproduced, check.job_uid) == ("skipped", 0, "")
    # and the tenant's Job is left as it was.
    jobs = k8s.BatchV1Api(world.kube()).list_namespaced_job(world.seeded["namespace"]).items
    assert name in [j.metadata.name for j in jobs]
    k8s.BatchV1Api(world.kube()).delete_namespaced_job(name, world.seeded["namespace"], propagation_policy="Background")


@pytest.mark.slow  # two replay Jobs (forked from the stand-in's zygote)
def test_a_tenants_pod_posing_as_the_checks_pod_is_not_read_and_the_pipelines_image_runs(world: World) -> None:
    # Given a healthy suspect whose reproduction runs,
    incident_id = cordoned_suspect(world, 2, window=1)
    node = world.seeded["nodes"][2]["node_name"]
    started = start_node_check.handler({"incident_id": incident_id, "purpose": "reproduce"}, CTX)
    assert started["started"] == 1
    (job,) = jobs_of(world, incident_id)
    (check,) = world.ledger.get(incident_id).node_checks
    assert check.job_uid == job.metadata.uid  # the created Job's uid is recorded
    # it runs the pipeline's image as the pipeline's account, with none of the training's environment,
    pod_spec = job.spec.template.spec
    assert (pod_spec.containers[0].image, pod_spec.service_account_name) == (IMAGE, "sdcguard-node-check")
    assert [e.name for e in pod_spec.containers[0].env] == ["NODE_NAME", "AWS_REGION"]
    # and a tenant's pod with the Job's label on the node, finished with exit code 1, made after the Job's own pod,
    core = k8s.CoreV1Api(world.kube())
    core.create_namespaced_pod(world.seeded["namespace"], {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{check.job}-posing", "labels": {"job-name": check.job}},
        "spec": {"nodeName": node, "containers": [{"name": "sdcguard-replay", "image": "busybox"}]},
        "status": {"phase": "Failed", "containerStatuses": [{"name": "sdcguard-replay", "ready": False, "restartCount": 0,
                   "image": "busybox", "imageID": "", "state": {"terminated": {"exitCode": 1}}}]},
    })  # fmt: skip
    attempt, deadline = started["attempt"], time.monotonic() + 90
    while True:
        polled = node_check_status.handler({"incident_id": incident_id, "purpose": "reproduce", "attempt": attempt}, CTX)
        if polled["done"] or time.monotonic() > deadline:
            break
        attempt = polled["attempt"]
        time.sleep(0.5)
    # changes nothing the reviewer reads: the answer is the Job's own pod's.
    assert polled["summary"] == f"reproduced 0/{REPEATS}", polled
    # The replacement's qualification runs the pipeline's image too.
    replaced_by(world, incident_id, 0)
    qualified = run_checks(world, incident_id, "qualify")
    assert qualified["qualified"] is True, qualified
    assert [(c.purpose, c.image) for c in world.ledger.get(incident_id).node_checks] == [("reproduce", IMAGE), ("qualify", IMAGE)]
    core.delete_namespaced_pod(f"{check.job}-posing", world.seeded["namespace"])


def test_a_direct_invoke_with_a_made_up_incident_creates_no_job(world: World) -> None:
    from sdcguard.lambdas.errors import IncidentNotFound

    before = k8s.BatchV1Api(world.kube()).list_namespaced_job(world.seeded["namespace"]).items
    for handler, payload in (
        (start_node_check.handler, {"incident_id": "sdc-madeup0000000000000", "purpose": "reproduce"}),
        (start_node_check.handler, {"incident_id": "sdc-madeup0000000000000", "purpose": "qualify"}),
        (node_check_status.handler, {"incident_id": "sdc-madeup0000000000000", "purpose": "reproduce", "attempt": 0}),
    ):
        with pytest.raises(IncidentNotFound):
            handler(payload, CTX)
    after = k8s.BatchV1Api(world.kube()).list_namespaced_job(world.seeded["namespace"]).items
    assert [j.metadata.name for j in after] == [j.metadata.name for j in before]
