"""Node checks (sdcguard.lambdas.node_check) and the replace-once-more rule, against a tiny in-memory Kubernetes and ledger.

What a Job is made of, how its answer is read and summarised, what is recorded
when it cannot run, and that a replacement that fails qualification is never
the node the job resumes onto.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from botocore.exceptions import ClientError
from kubernetes import client as k8s

from sdcguard.agent.capsule import capsule_dir
from sdcguard.contract import Alarm, Incident, IncidentState, NodeCheck, Replacement, ResolvedSuspect
from sdcguard.contract.incident import ALLOWED, Transition
from sdcguard.lambdas import node_check
from sdcguard.lambdas.cordon import TAINT_KEY
from sdcguard.lambdas.errors import IncidentNotWaiting
from sdcguard.lambdas.replace import find_successors, reject_unqualified
from sdcguard.lambdas.resolve import ClusterNode
from tests.events import load_event

S = IncidentState
SUSPECT = "i-0123456789abcdef0"
NEW = "i-0aaaaaaaaaaaaaaa1"
NEWER = "i-0bbbbbbbbbbbbbbb2"
PREFIX = "s3://ckpt-bucket/jobs/gpt-pretrain"
CAPSULE = f"{PREFIX}/capsules/step-000000200-rank-00003"
IMAGE = "registry.example/sdcguard/node-check@sha256:" + "c0ffee00" * 8
"""The pipeline's replay image (NodeCheckImage)."""


# -- fakes ------------------------------------------------------------------------------------------


class FakeLedger:
    """The parts of sdcguard.lambdas.ledger.Ledger the node checks use, in memory."""

    def __init__(self, incident: Incident) -> None:
        self.incidents = {incident.incident_id: incident}
        self.writes = 0

    def get(self, incident_id: str) -> Incident:
        return self.incidents[incident_id]

    def update(self, incident_id: str, change: Callable[[Incident], Incident], **_: Any) -> Incident:
        current = self.incidents[incident_id]
        changed = change(current)
        if changed is not current:
            self.writes += 1
            self.incidents[incident_id] = Incident.model_validate(json.loads(changed.model_dump_json()))
        return self.incidents[incident_id]

    def counting(self, hyperpod_cluster: str, **_: Any) -> list[Incident]:
        return []


def api_error(status: int, reason: str = "", message: str = "") -> k8s.exceptions.ApiException:
    exc = k8s.exceptions.ApiException(status=status, reason=reason)
    exc.body = json.dumps({"message": message})
    return exc


class FakeCluster:
    """A Kubernetes API holding Jobs, pods, logs, nodes and one PyTorchJob: what the node checks call, no more."""

    def __init__(self, pytorchjob: dict[str, Any]) -> None:
        self.pytorchjob = pytorchjob
        self.jobs: dict[str, dict[str, Any]] = {}
        self.job_status: dict[str, Any] = {}
        self.pods: dict[str, Any] = {}
        self.extra_pods: list[Any] = []
        """Pods someone else created (a tenant's), listed beside the Jobs' own."""
        self.logs: dict[str, str] = {}
        self.nodes: dict[str, Any] = {}
        self.deleted: list[tuple[str, str | None]] = []
        self.refuse: k8s.exceptions.ApiException | None = None
        self.batch, self.core, self.custom = _Batch(self), _Core(self), _Custom(self)

    def finish(self, job: str, *, log: str = "", exit_code: int | None = 0, reason: str | None = None) -> None:
        """The Job's pod ran and exited (``reason`` DeadlineExceeded: killed at the deadline)."""
        failed = exit_code != 0 or reason is not None
        condition = SimpleNamespace(type="Failed" if failed else "Complete", status="True", reason=reason)
        self.job_status[job] = SimpleNamespace(succeeded=0 if failed else 1, failed=1 if failed else 0, conditions=[condition])
        terminated = None if exit_code is None else SimpleNamespace(exit_code=exit_code)
        self.pods[job] = self.pod(f"{job}-xbcdf", job, exit_code=exit_code)
        self.pods[job].status.container_statuses = [SimpleNamespace(state=SimpleNamespace(terminated=terminated))]
        self.logs[f"{job}-xbcdf"] = log

    def pod(self, name: str, job: str, *, exit_code: int | None = 0, owner_uid: str | None = None, node: str | None = None) -> Any:
        """A pod as the Job controller makes it (controlled by the Job's uid, on the Job's node), unless told otherwise."""
        uid = self.jobs[job]["metadata"]["uid"] if job in self.jobs else "gone"
        node = node or (self.jobs[job]["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"] if job in self.jobs else None)
        terminated = None if exit_code is None else SimpleNamespace(exit_code=exit_code)
        return SimpleNamespace(
            metadata=SimpleNamespace(
                name=name, creation_timestamp=datetime.now(UTC), labels={"job-name": job},
                owner_references=[SimpleNamespace(kind="Job", uid=owner_uid or uid, controller=True)],
            ),
            spec=SimpleNamespace(node_name=node),
            status=SimpleNamespace(container_statuses=[SimpleNamespace(state=SimpleNamespace(terminated=terminated))], conditions=[]),
        )  # fmt: skip

    def add_node(self, name: str) -> None:
        self.nodes[name] = SimpleNamespace(
            metadata=SimpleNamespace(name=name, resource_version="1", annotations={}, labels={}),
            spec=SimpleNamespace(unschedulable=False, taints=[]),
        )


class _Batch:
    def __init__(self, cluster: FakeCluster) -> None:
        self.c = cluster

    def create_namespaced_job(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.c.refuse is not None:
            raise self.c.refuse
        name = body["metadata"]["name"]
        if name in self.c.jobs:
            raise api_error(409, "Conflict")
        self.c.jobs[name] = copy.deepcopy(body)
        self.c.jobs[name]["metadata"]["uid"] = str(uuid.uuid4())
        self.c.job_status[name] = SimpleNamespace(succeeded=0, failed=0, conditions=[])
        return copy.deepcopy(self.c.jobs[name])

    def read_namespaced_job(self, name: str, namespace: str) -> Any:
        if name not in self.c.jobs:
            raise api_error(404, "Not Found")
        body = self.c.jobs[name]
        containers = [
            SimpleNamespace(image=c.get("image"), env=[SimpleNamespace(name=e["name"]) for e in c.get("env") or []])
            for c in body["spec"]["template"]["spec"]["containers"]
        ]
        return SimpleNamespace(
            metadata=SimpleNamespace(name=name, uid=body["metadata"].get("uid"), annotations=body["metadata"].get("annotations")),
            spec=SimpleNamespace(template=SimpleNamespace(spec=SimpleNamespace(containers=containers))),
            status=self.c.job_status[name],
        )

    def delete_namespaced_job(self, name: str, namespace: str, propagation_policy: str | None = None) -> None:
        if self.c.jobs.pop(name, None) is None:
            raise api_error(404, "Not Found")
        self.c.deleted.append((name, propagation_policy))


class _Core:
    def __init__(self, cluster: FakeCluster) -> None:
        self.c = cluster

    def list_namespaced_pod(self, namespace: str, label_selector: str = "", field_selector: str = "") -> Any:
        job = label_selector.removeprefix("job-name=")
        node = field_selector.removeprefix("spec.nodeName=") if field_selector else None
        pods = [p for p in [self.c.pods.get(job), *self.c.extra_pods] if p is not None and p.metadata.labels.get("job-name") == job]
        return SimpleNamespace(items=[p for p in pods if node is None or p.spec.node_name == node])

    def read_namespaced_pod_log(self, name: str, namespace: str, **kwargs: Any) -> Any:
        assert kwargs["_preload_content"] is False  # the client's own decoding garbles a text log
        return SimpleNamespace(data=self.c.logs[name].encode())

    def read_node(self, name: str) -> Any:
        if name not in self.c.nodes:
            raise api_error(404, "Not Found")
        return self.c.nodes[name]

    def patch_node(self, name: str, body: dict[str, Any]) -> None:
        node = self.c.nodes[name]
        node.spec.unschedulable = body["spec"]["unschedulable"]
        node.spec.taints = [SimpleNamespace(key=t["key"], value=t.get("value"), effect=t["effect"]) for t in body["spec"]["taints"]]


class _Custom:
    def __init__(self, cluster: FakeCluster) -> None:
        self.c = cluster

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.c.pytorchjob)


class FakeS3:
    """head_object answering for the keys it holds."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def head_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        if f"s3://{Bucket}/{Key}" not in self.keys:
            raise ClientError({"Error": {"Code": "404", "Message": "Not Found"}}, "HeadObject")
        return {}


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> FakeCluster:
    made = FakeCluster(pytorchjob())
    monkeypatch.setattr(k8s, "BatchV1Api", lambda api: api.batch)
    monkeypatch.setattr(k8s, "CoreV1Api", lambda api: api.core)
    monkeypatch.setattr(k8s, "CustomObjectsApi", lambda api: api.custom)
    return made


def pytorchjob(service_account: str | None = "trainer") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "pytorch",
                "image": "registry.example/trainer:1.2",
                "env": [
                    {"name": "NODE_NAME", "value": "stale"},
                    {"name": "SDCGUARD_CHECKPOINT_URI", "value": PREFIX},
                ],
                "resources": {"limits": {"nvidia.com/gpu": "8"}},
            }
        ]
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    return {"spec": {"pytorchReplicaSpecs": {"Master": {"template": {"spec": {"containers": [{"image": "other"}]}}},
                                             "Worker": {"template": {"spec": spec}}}}}  # fmt: skip


def make_incident(state: IncidentState = S.CORDONED, **changes: Any) -> Incident:
    alarm = Alarm.model_validate(load_event("alarm_ring_audit")["detail"])
    suspect = alarm.suspects[0]
    incident = Incident(
        incident_id="sdc-0123456789abcdef0123",
        idempotency_key="k",
        alarm=alarm,
        suspects=[ResolvedSuspect(global_rank=suspect.global_rank, pod=suspect.pod, node=suspect.node, instance_id=SUSPECT, instance_group="workers")],
    )
    path = [S.RESOLVED, S.GUARDED, S.SUSPENDED, S.CORDONED, S.EVIDENCE_COLLECTED, S.AWAITING_APPROVAL, S.APPROVED, S.REPLACING, S.REPLACED]
    for step in path[: path.index(state) + 1]:
        incident = incident.advance(step, actor="test")
    return incident.model_copy(update=changes)


def report(*, outcome: str, matched: int, reproduced: int, node: str | None, repeats: int = 5, **more: Any) -> str:
    return json.dumps({"outcome": outcome, "matched": matched, "reproduced": reproduced, "repeats": repeats, "node": node,
                       "capsule": CAPSULE, **more})  # fmt: skip


def start(ledger: FakeLedger, cluster: FakeCluster, purpose: node_check.Purpose, keys: set[str] | None = None) -> node_check.Started:
    incident_id = next(iter(ledger.incidents))
    s3 = FakeS3({f"{CAPSULE}/CAPSULE.json"} if keys is None else keys)
    return node_check.start_checks(ledger, cluster, incident_id, purpose, repeats=5, deadline_seconds=900, s3=s3, image=IMAGE)  # type: ignore[arg-type]


def poll(ledger: FakeLedger, cluster: FakeCluster, purpose: node_check.Purpose, give_up: bool = False) -> node_check.Progress:
    return node_check.poll_checks(ledger, cluster, next(iter(ledger.incidents)), purpose, give_up=give_up)  # type: ignore[arg-type]


# -- naming and the Job ---------------------------------------------------------------------------------


def test_the_capsule_location_is_the_agents_naming() -> None:
    assert node_check.capsule_location(PREFIX + "/", 200, 3) == f"{PREFIX}/{capsule_dir(200, 3)}" == CAPSULE


def test_job_names_are_dns_labels_of_at_most_63_characters_and_distinct_per_node() -> None:
    short = node_check.job_name("reproduce", "sdc-0123456789abcdef0123", f"hyperpod-{SUSPECT}")
    assert short == f"sdcguard-reproduce-0123456789-{SUSPECT}"
    long_a = node_check.job_name("qualify", "sdc-0123456789abcdef0123", "ip-10-0-0-1." + "a" * 60 + ".ec2.internal")
    long_b = node_check.job_name("qualify", "sdc-0123456789abcdef0123", "ip-10-0-0-1." + "a" * 60 + ".ec2.internal2")
    for name in (short, long_a, long_b):
        assert len(name) <= 63, name
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    assert long_a != long_b


def test_the_job_runs_the_pipelines_image_and_account_pinned_to_the_node_with_only_the_trainings_gpu_request() -> None:
    container, _ = node_check.worker_container(pytorchjob())
    manifest = node_check.job_manifest(
        name="sdcguard-reproduce-x-n", namespace="ml", purpose="reproduce", incident_id="sdc-1", node="node-a",
        capsule=CAPSULE, repeats=5, deadline_seconds=900, image=IMAGE, nonce="n0nce", resources=container["resources"],
        region="us-west-2",
    )  # fmt: skip
    spec, pod = manifest["spec"], manifest["spec"]["template"]["spec"]
    assert manifest["metadata"]["labels"] == {
        "app.kubernetes.io/name": "sdcguard", "sdcguard.io/incident": "sdc-1", "sdcguard.io/purpose": "reproduce",
        "sdcguard.io/node": "node-a",
    }  # fmt: skip
    assert manifest["metadata"]["annotations"] == {"sdcguard.io/nonce": "n0nce"}
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) == (0, 900, 3600)
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "node-a"}
    assert {t["key"] for t in pod["tolerations"]} == {TAINT_KEY, "node.kubernetes.io/unschedulable"}
    assert all(t["operator"] == "Exists" and t["effect"] == "NoSchedule" for t in pod["tolerations"])
    # the pipeline's service account and image, not the training's ("trainer", registry.example/trainer:1.2)
    assert pod["serviceAccountName"] == node_check.SERVICE_ACCOUNT == "sdcguard-node-check"
    assert pod["automountServiceAccountToken"] is False
    (replay,) = pod["containers"]
    assert replay["name"] == "sdcguard-replay"
    assert replay["image"] == IMAGE
    assert replay["resources"] == {"limits": {"nvidia.com/gpu": "8"}}  # the Worker's GPU request
    assert replay["command"] == ["sdcguard", "replay", CAPSULE, "--repeat", "5", "--json"]  # no factory allowed
    # and none of the training's environment (a tenant's SDCGUARD_INJECT would ride along)
    assert replay["env"] == [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "AWS_REGION", "value": "us-west-2"},
    ]


def test_the_replay_may_import_only_the_pipelines_factories() -> None:
    # A capsule is untrusted input: its replay imports a factory only from the pipeline's NodeCheckFactories,
    # handed over as --allow-factory (the training's SDCGUARD_CAPSULE_FACTORY is not passed on).
    manifest = node_check.job_manifest(
        name="sdcguard-qualify-x-n", namespace="ml", purpose="qualify", incident_id="sdc-1", node="node-a",
        capsule=CAPSULE, repeats=2, deadline_seconds=900, image=IMAGE, nonce="n0nce",
        factories=("mypkg.model:replay", "mypkg.other:replay"),
    )  # fmt: skip
    (replay,) = manifest["spec"]["template"]["spec"]["containers"]
    assert replay["command"] == ["sdcguard", "replay", CAPSULE, "--repeat", "2", "--json",
                                 "--allow-factory", "mypkg.model:replay", "--allow-factory", "mypkg.other:replay"]
    assert "SDCGUARD_CAPSULE_FACTORY" not in {e["name"] for e in replay["env"]}


def test_the_trainings_image_env_and_account_never_reach_the_job(cluster: FakeCluster) -> None:
    cluster.pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "SDCGUARD_INJECT", "value": "kind=finite_activation,factor=1e4"}
    )
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    (job,) = cluster.jobs.values()
    (replay,) = job["spec"]["template"]["spec"]["containers"]
    assert replay["image"] == IMAGE
    assert [e["name"] for e in replay["env"]] == ["NODE_NAME"]
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "sdcguard-node-check"
    (check,) = ledger.get("sdc-0123456789abcdef0123").node_checks
    assert (check.image, check.job_uid) == (IMAGE, job["metadata"]["uid"])


def test_without_a_pipeline_image_nothing_is_run(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    s3 = FakeS3({f"{CAPSULE}/CAPSULE.json"})
    started = node_check.start_checks(ledger, cluster, "sdc-0123456789abcdef0123", "reproduce", repeats=5,  # type: ignore[arg-type]
                                      deadline_seconds=900, s3=s3, image="")  # fmt: skip
    assert (started.started, started.skipped) == (0, 1)
    assert cluster.jobs == {}
    (check,) = ledger.get("sdc-0123456789abcdef0123").node_checks
    assert check.summary == "not run: no NodeCheckImage is configured (the pipeline's replay image)"


# -- reading and summarising an answer ------------------------------------------------------------------


def test_the_report_is_the_last_json_line_with_an_outcome() -> None:
    log = "\n".join([
        "sdcguard: SDCGUARD_INJECT is set: a fault will be injected", '{"not": "a report"}',
        report(outcome="match", matched=5, reproduced=0, node="a"), "{broken json", "trailing words",
    ])  # fmt: skip
    parsed = node_check.parse_report(log)
    assert parsed is not None
    assert parsed["outcome"] == "match"
    assert node_check.parse_report("Traceback...\nValueError: boom") is None


@pytest.mark.parametrize(
    ("purpose", "line", "state", "summary"),
    [
        ("reproduce", report(outcome="mismatch", matched=0, reproduced=5, node="a"), "failed", "reproduced 5/5: persistent"),
        ("reproduce", report(outcome="mismatch", matched=3, reproduced=2, node="a"), "failed", "reproduced 2/5: intermittent"),
        ("reproduce", report(outcome="match", matched=5, reproduced=0, node="a"), "passed", "reproduced 0/5"),
        ("reproduce", report(outcome="unusable", matched=0, reproduced=0, repeats=5, node="a", problem="corrupt",
                             reasons=["model.pt: sha256 differs"]), "inconclusive",
         "inconclusive: capsule unusable on a: corrupt: model.pt: sha256 differs"),
        ("reproduce", report(outcome="mismatch", matched=0, reproduced=5, node="b"), "inconclusive",
         "inconclusive: the replay reports node b, not a"),
        ("reproduce", report(outcome="match", matched=5, reproduced=3, node="a"), "inconclusive",
         "inconclusive: the replay report does not add up"),
        ("qualify", report(outcome="match", matched=5, reproduced=0, node="a"), "passed", "qualified 5/5 on a"),
        ("qualify", report(outcome="mismatch", matched=4, reproduced=1, node="a"), "failed", "not qualified on a: 1/5 repetitions wrong"),
    ],
)  # fmt: skip
def test_a_report_becomes_a_state_and_a_summary(purpose: Any, line: str, state: str, summary: str) -> None:
    check = NodeCheck(purpose=purpose, node="a", repeats=5)
    done = node_check.finish(check, node_check.answer_from_report(json.loads(line), node="a", repeats=5))
    assert done.state == state
    assert done.summary.startswith(summary), done.summary
    assert done.finished_at is not None


def test_without_a_report_only_exit_code_0_counts_and_a_crash_is_never_reproduced() -> None:
    check = NodeCheck(purpose="reproduce", node="a", repeats=5)
    crashed = node_check.finish(check, node_check.answer_from_exit_code(1, repeats=5))
    assert (crashed.state, crashed.reproduced) == ("inconclusive", 0)
    assert crashed.summary == "inconclusive: exit code 1 and no report in the log (a crash exits 1 too)"
    passed = node_check.finish(check, node_check.answer_from_exit_code(0, repeats=5))
    assert (passed.state, passed.matched, passed.summary) == ("passed", 5, "reproduced 0/5")
    assert node_check.finish(check, node_check.answer_from_exit_code(2, repeats=5)).state == "inconclusive"
    killed = node_check.finish(check, node_check.answer_from_exit_code(137, repeats=5))
    assert (killed.state, killed.summary) == ("inconclusive", "inconclusive: exit code 137 and no report in the log")


def test_a_job_is_finished_by_its_counts_or_conditions() -> None:
    def job(succeeded: int = 0, failed: int = 0, conditions: list[Any] | None = None) -> Any:
        return SimpleNamespace(status=SimpleNamespace(succeeded=succeeded, failed=failed, conditions=conditions or []))

    deadline = SimpleNamespace(type="Failed", status="True", reason="DeadlineExceeded")
    assert node_check.job_state(job()) is None
    assert node_check.job_state(SimpleNamespace(status=None)) is None
    assert node_check.job_state(job(succeeded=1)) == "Complete"
    assert node_check.job_state(job(failed=1)) == "Failed"
    assert node_check.job_state(job(conditions=[deadline])) == "DeadlineExceeded"


# -- reproduce: start and poll ---------------------------------------------------------------------------


def test_reproduce_starts_one_job_per_suspect_node_and_records_it_running(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    started = start(ledger, cluster, "reproduce")
    assert (started.started, started.skipped) == (1, 0)
    (name,) = cluster.jobs
    assert cluster.jobs[name]["metadata"]["namespace"] == "training"
    (check,) = ledger.get("sdc-0123456789abcdef0123").node_checks
    assert (check.purpose, check.node, check.instance_id, check.job, check.capsule, check.state, check.repeats) == (
        "reproduce", f"hyperpod-{SUSPECT}", SUSPECT, name, CAPSULE, "running", 5,
    )  # fmt: skip
    # A retry (the state machine's, or a lost reply) starts nothing more and answers the same.
    again = start(ledger, cluster, "reproduce")
    assert (again.started, again.skipped) == (1, 0)
    assert len(cluster.jobs) == 1


def test_no_capsule_means_not_run_and_nothing_created(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    started = start(ledger, cluster, "reproduce", keys=set())
    assert (started.started, started.skipped) == (0, 1)
    assert cluster.jobs == {}
    progress = poll(ledger, cluster, "reproduce")
    assert progress.done
    assert progress.summary == f"not run: no replay capsule at {CAPSULE}"


def test_a_refused_job_is_recorded_as_not_run_with_the_apis_reason(cluster: FakeCluster) -> None:
    cluster.refuse = api_error(403, "Forbidden", 'jobs.batch is forbidden: User "sdcguard" cannot create')
    ledger = FakeLedger(make_incident())
    assert start(ledger, cluster, "reproduce").skipped == 1
    progress = poll(ledger, cluster, "reproduce")
    assert progress.done
    assert progress.summary.startswith("not run: the Job was refused: HTTP 403")
    assert "cannot create" in progress.summary


def test_a_job_that_must_be_retried_is_not_recorded(cluster: FakeCluster) -> None:
    cluster.refuse = api_error(503, "Service Unavailable")
    ledger = FakeLedger(make_incident())
    with pytest.raises(Exception, match="HTTP 503"):
        start(ledger, cluster, "reproduce")
    assert ledger.get("sdc-0123456789abcdef0123").node_checks == []


def test_reproduce_is_only_started_after_the_cordon(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident(S.SUSPENDED))
    with pytest.raises(IncidentNotWaiting, match="CORDONED"):
        start(ledger, cluster, "reproduce")
    assert cluster.jobs == {}


def test_a_poll_records_the_finished_job_and_deletes_it(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    (name,) = cluster.jobs
    running = poll(ledger, cluster, "reproduce")
    assert not running.done
    assert cluster.deleted == []
    cluster.finish(name, log="replaying...\n" + report(outcome="mismatch", matched=0, reproduced=5, node=f"hyperpod-{SUSPECT}"), exit_code=1)
    done = poll(ledger, cluster, "reproduce")
    assert done.done
    assert done.summary == "reproduced 5/5: persistent"
    assert done.qualified is None
    assert cluster.deleted == [(name, "Background")]
    (check,) = ledger.get("sdc-0123456789abcdef0123").node_checks
    assert (check.state, check.reproduced, check.matched) == ("failed", 5, 0)
    writes = ledger.writes
    assert poll(ledger, cluster, "reproduce").summary == "reproduced 5/5: persistent"  # a later poll changes nothing
    assert ledger.writes == writes


def test_a_job_past_its_deadline_is_inconclusive(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    (name,) = cluster.jobs
    cluster.finish(name, exit_code=None, reason="DeadlineExceeded")
    progress = poll(ledger, cluster, "reproduce")
    assert progress.done
    assert progress.summary.startswith("inconclusive: deadline")


def test_giving_up_records_the_running_check_inconclusive_and_deletes_its_job(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    (name,) = cluster.jobs
    progress = poll(ledger, cluster, "reproduce", give_up=True)
    assert progress.gave_up
    assert progress.done
    assert progress.summary == "inconclusive: the Job did not finish within the wait loop's bound"
    assert cluster.deleted == [(name, "Background")]


def test_a_vanished_job_is_inconclusive(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    cluster.jobs.clear()
    progress = poll(ledger, cluster, "reproduce")
    assert progress.done
    assert progress.summary.startswith("inconclusive: the Job")


# -- qualify and reject ----------------------------------------------------------------------------------


def replaced(*replacements: Replacement) -> Incident:
    return make_incident(S.REPLACED, replacements=list(replacements))


def test_qualify_checks_the_new_node_with_the_suspects_capsule(cluster: FakeCluster) -> None:
    ledger = FakeLedger(replaced(Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Running")))
    assert start(ledger, cluster, "qualify").started == 1
    (name,) = cluster.jobs
    assert cluster.jobs[name]["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/hostname": f"hyperpod-{NEW}"}
    cluster.finish(name, log=report(outcome="match", matched=5, reproduced=0, node=f"hyperpod-{NEW}"))
    progress = poll(ledger, cluster, "qualify")
    assert (progress.done, progress.qualified, progress.failed_instance_ids) == (True, True, [])
    assert progress.summary == f"qualified 5/5 on hyperpod-{NEW}"


def test_qualify_fails_on_any_mismatch_or_an_unusable_capsule(cluster: FakeCluster) -> None:
    for line in (
        report(outcome="mismatch", matched=4, reproduced=1, node=f"hyperpod-{NEW}"),
        report(outcome="unusable", matched=0, reproduced=0, node=f"hyperpod-{NEW}", problem="corrupt", reasons=["x"]),
    ):
        ledger = FakeLedger(replaced(Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Running")))
        start(ledger, cluster, "qualify")
        (name,) = cluster.jobs
        cluster.finish(name, log=line, exit_code=1)
        progress = poll(ledger, cluster, "qualify")
        assert (progress.done, progress.qualified, progress.failed_instance_ids) == (True, False, [NEW])
        assert progress.summary.startswith(f"not qualified on hyperpod-{NEW}")
        cluster.jobs.clear()


def test_qualify_without_a_capsule_is_neither_passed_nor_failed(cluster: FakeCluster) -> None:
    ledger = FakeLedger(replaced(Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Running")))
    assert start(ledger, cluster, "qualify", keys=set()).skipped == 1
    progress = poll(ledger, cluster, "qualify")
    assert (progress.done, progress.qualified) == (True, None)
    assert progress.summary == f"not qualified on hyperpod-{NEW}: not run: no replay capsule at {CAPSULE}"


def reject(ledger: FakeLedger, cluster: FakeCluster, *, max_rounds: int, per_day: int) -> Any:
    return reject_unqualified(
        ledger, cluster, "sdc-0123456789abcdef0123", hyperpod_cluster="hp", max_rounds=max_rounds,  # type: ignore[arg-type]
        max_replacements_per_day=per_day,
    )  # fmt: skip


def qualified_badly(cluster: FakeCluster, incident: Incident) -> FakeLedger:
    ledger = FakeLedger(incident)
    start(ledger, cluster, "qualify")
    for name in list(cluster.jobs):
        node = cluster.jobs[name]["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"]
        cluster.finish(name, log=report(outcome="mismatch", matched=0, reproduced=5, node=node), exit_code=1)
    poll(ledger, cluster, "qualify")
    return ledger


def test_a_node_that_fails_qualification_is_cordoned_rejected_and_replaced_once_more(cluster: FakeCluster) -> None:
    ledger = qualified_badly(cluster, replaced(Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Running")))
    cluster.add_node(f"hyperpod-{NEW}")
    rejection = reject(ledger, cluster, max_rounds=2, per_day=4)
    assert rejection.replace_again
    assert rejection.instance_ids == [NEW]
    assert "round 2 of 2" in rejection.reason
    node = cluster.nodes[f"hyperpod-{NEW}"]
    assert node.spec.unschedulable
    assert [t.key for t in node.spec.taints] == [TAINT_KEY]
    incident = ledger.get("sdc-0123456789abcdef0123")
    assert [r.status for r in incident.replacements] == ["Rejected"]
    # Nothing left to resume onto: the rejected node is no current replacement and no qualify target.
    assert node_check.current_replacements(incident) == []
    assert node_check.qualify_targets(incident) == []
    assert S.REPLACING in ALLOWED[S.REPLACED]


def test_no_further_round_past_the_limit_or_the_daily_limit(cluster: FakeCluster) -> None:
    cluster.add_node(f"hyperpod-{NEW}")
    ledger = qualified_badly(cluster, replaced(Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Running")))
    one_round = reject(ledger, cluster, max_rounds=1, per_day=4)
    assert not one_round.replace_again
    assert "the limit is 1" in one_round.reason
    assert cluster.nodes[f"hyperpod-{NEW}"].spec.unschedulable

    cluster.jobs.clear()
    ledger = qualified_badly(cluster, replaced(Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Running")))
    daily = reject(ledger, cluster, max_rounds=2, per_day=1)
    assert not daily.replace_again
    assert "would exceed the limit of 1 per day" in daily.reason


def test_the_second_rounds_node_is_found_and_qualified_not_the_rejected_one(cluster: FakeCluster) -> None:
    first = Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Rejected")
    second = Replacement(old_instance_id=NEW, status="Requested")
    incident = make_incident(S.REPLACED, replacements=[first, second])
    again = incident.advance(S.REPLACING, actor="replace")
    later = datetime.now(UTC) + timedelta(seconds=30)

    def cluster_node(instance_id: str, launched: datetime, group: str = "workers") -> ClusterNode:
        return ClusterNode(instance_id=instance_id, instance_group=group, status="Running", launch_time=launched.timestamp(),
                           private_dns="")  # fmt: skip

    nodes = {
        NEW: cluster_node(NEW, datetime.now(UTC) - timedelta(minutes=5)),
        "i-0ccccccccccccccc3": cluster_node("i-0ccccccccccccccc3", later, group="other-group"),
        NEWER: cluster_node(NEWER, later),
    }
    successors = find_successors(again, nodes)
    assert list(successors) == [NEW]  # the rejected replacement waits for nothing
    successor = successors[NEW]
    assert successor is not None
    assert successor.instance_id == NEWER
    done = again.advance(S.REPLACED, actor="t", replacements=[first, second.model_copy(update={"new_instance_id": NEWER, "status": "Running"})])
    assert [t.node for t in node_check.qualify_targets(done)] == [f"hyperpod-{NEWER}"]
    assert node_check.origin_of(done, NEWER) == SUSPECT


def test_reject_acts_only_once_the_replacement_runs(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident(S.APPROVED))
    with pytest.raises(IncidentNotWaiting):
        reject(ledger, cluster, max_rounds=2, per_day=4)


def test_the_transitions_record_a_second_round() -> None:
    incident = replaced(Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Rejected")).advance(S.REPLACING, actor="replace")
    assert [t.state for t in incident.transitions if t.state == S.REPLACING] == [S.REPLACING, S.REPLACING]
    assert isinstance(incident.transitions[-1], Transition)


def test_reject_answers_a_retry_the_same_and_a_second_round_only_for_its_own_node(cluster: FakeCluster) -> None:
    cluster.add_node(f"hyperpod-{NEW}")
    cluster.add_node(f"hyperpod-{NEWER}")
    ledger = qualified_badly(cluster, replaced(Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Running")))
    first = reject(ledger, cluster, max_rounds=3, per_day=10)
    retried = reject(ledger, cluster, max_rounds=3, per_day=10)
    assert (retried.replace_again, retried.instance_ids) == (first.replace_again, first.instance_ids) == (True, [NEW])

    # ReplaceUnqualified asked for NEW's replacement; NEWER came up and failed too.
    incident = ledger.get("sdc-0123456789abcdef0123")
    second = Replacement(old_instance_id=NEW, new_instance_id=NEWER, status="Running")
    incident = incident.advance(S.REPLACING, actor="replace", replacements=[*incident.replacements, second])
    ledger.incidents[incident.incident_id] = incident.advance(S.REPLACED, actor="replacement_status")
    assert start(ledger, cluster, "qualify").started == 1  # the new node, not the rejected one again
    (name,) = [n for n in cluster.jobs if n.endswith(NEWER)]
    cluster.finish(name, log=report(outcome="mismatch", matched=0, reproduced=5, node=f"hyperpod-{NEWER}"), exit_code=1)
    assert poll(ledger, cluster, "qualify").failed_instance_ids == [NEWER]
    again = reject(ledger, cluster, max_rounds=2, per_day=10)
    assert (again.replace_again, again.instance_ids) == (False, [NEWER])
    assert "2 replacement round(s) made, the limit is 2" in again.reason


# -- what the reviewers and operators see ---------------------------------------------------------------


def checked(incident: Incident) -> Incident:
    reproduce = NodeCheck(purpose="reproduce", node=f"hyperpod-{SUSPECT}", instance_id=SUSPECT, job="sdcguard-reproduce-x",
                          repeats=5, state="failed", reproduced=5, summary="reproduced 5/5: persistent")  # fmt: skip
    qualify = NodeCheck(purpose="qualify", node=f"hyperpod-{NEW}", instance_id=NEW, repeats=5, state="passed", matched=5,
                        summary=f"qualified 5/5 on hyperpod-{NEW}")  # fmt: skip
    return incident.model_copy(update={"node_checks": [reproduce, qualify]})


def test_the_notifications_say_what_the_replays_found() -> None:
    from sdcguard.lambdas.approval import approval_message
    from sdcguard.lambdas.notify import describe

    incident = checked(make_incident(S.EVIDENCE_COLLECTED))
    text = describe(incident)
    assert f'Reproduction on the suspect: "hyperpod-{SUSPECT}": "reproduced 5/5: persistent"' in text
    assert f'Qualification of the replacement: "hyperpod-{NEW}": "qualified 5/5 on hyperpod-{NEW}"' in text
    message = approval_message(incident)
    assert "reproduced 5/5: persistent" in message
    assert "Reproduction: the step's capsule was replayed" in message
    assert "Reproduction:" not in approval_message(make_incident(S.EVIDENCE_COLLECTED))


def test_incidents_show_prints_the_node_checks(capsys: pytest.CaptureFixture[str]) -> None:
    from sdcguard.commands.incidents import _show

    incident = checked(make_incident(S.REPLACED, replacements=[Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Running")]))
    assert _show(FakeLedger(incident), incident.incident_id, as_json=False) == 0  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert f"reproduce  hyperpod-{SUSPECT}: reproduced 5/5: persistent  (Job sdcguard-reproduce-x)" in out
    assert f"qualify    hyperpod-{NEW}: qualified 5/5 on hyperpod-{NEW}" in out
    assert out.index("reproduce  ") < out.index("replaced   ") < out.index("qualify    ")


def test_the_evidence_carries_the_reproduction(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.lambdas import evidence

    incident = checked(make_incident(S.CORDONED))
    ledger = FakeLedger(incident)
    ledger.naming = lambda instance_id: []  # type: ignore[attr-defined]
    monkeypatch.setattr(evidence, "instance_metrics", lambda *a, **k: [])
    recorded = evidence.evidence_for_incident(ledger, incident.incident_id, dcgm_counters=[])  # type: ignore[arg-type]
    assert recorded.evidence["reproduction"] == "reproduced 5/5: persistent"


def test_a_rejected_replacement_node_counts_as_quarantined() -> None:
    from sdcguard.lambdas.blast_radius import quarantined_nodes

    rejected = Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Rejected")
    failed = NodeCheck(purpose="qualify", node=f"hyperpod-{NEW}", instance_id=NEW, state="failed", repeats=5, reproduced=5)
    open_incident = make_incident(S.REPLACED, replacements=[rejected], node_checks=[failed])
    assert quarantined_nodes([open_incident], exclude="other") == {f"hyperpod-{NEW}"}
    stopped = open_incident.advance(S.NEEDS_ATTENTION, actor="t")
    assert f"hyperpod-{NEW}" in quarantined_nodes([stopped], exclude="other")
    assert f"hyperpod-{NEW}" not in quarantined_nodes([stopped], exclude="other", released=[f"hyperpod-{NEW}"])
    passed = failed.model_copy(update={"state": "passed"})
    running = make_incident(S.REPLACED, replacements=[rejected.model_copy(update={"status": "Running"})], node_checks=[passed])
    assert quarantined_nodes([running], exclude="other") == set()


# -- what a tenant of the namespace can make ------------------------------------------------------------


def tenants_job(cluster: FakeCluster, name: str, *, nonce: str | None = None) -> None:
    """A Job of the name the pipeline will use, created first by someone else (carrying ``nonce`` if given)."""
    body = node_check.job_manifest(
        name=name, namespace="training", purpose="reproduce", incident_id="sdc-0123456789abcdef0123",
        node=f"hyperpod-{SUSPECT}", capsule=CAPSULE, repeats=5, deadline_seconds=900, image="evil/replay:latest",
        nonce=nonce or "guessed",
    )  # fmt: skip
    cluster.batch.create_namespaced_job("training", body)


def test_a_job_a_tenant_made_first_is_not_adopted_read_or_deleted(cluster: FakeCluster) -> None:
    name = node_check.job_name("reproduce", "sdc-0123456789abcdef0123", f"hyperpod-{SUSPECT}")
    tenants_job(cluster, name)
    cluster.finish(name, log=report(outcome="mismatch", matched=0, reproduced=5, node=f"hyperpod-{SUSPECT}"), exit_code=1)
    ledger = FakeLedger(make_incident())
    started = start(ledger, cluster, "reproduce")
    assert (started.started, started.skipped) == (0, 1)
    (check,) = ledger.get("sdc-0123456789abcdef0123").node_checks
    assert check.state == "skipped"
    assert "exists that the pipeline did not create" in check.summary
    assert "not adopted, not read, not deleted" in check.summary
    progress = poll(ledger, cluster, "reproduce")
    assert progress.summary != "reproduced 5/5: persistent"
    assert cluster.jobs[name]["spec"]["template"]["spec"]["containers"][0]["image"] == "evil/replay:latest"
    assert cluster.deleted == []


def test_a_retry_adopts_the_job_that_carries_the_nonce_the_ledger_stored_first(cluster: FakeCluster) -> None:
    # Given an attempt that stored its nonce and created the Job, then died before recording the check,
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    (name,) = cluster.jobs
    uid = cluster.jobs[name]["metadata"]["uid"]
    incident = ledger.get("sdc-0123456789abcdef0123")
    assert incident.node_check_nonces[name] == cluster.jobs[name]["metadata"]["annotations"]["sdcguard.io/nonce"]
    ledger.incidents[incident.incident_id] = incident.model_copy(update={"node_checks": []})
    # the retry's create meets a 409 and adopts its own Job, uid and all.
    again = start(ledger, cluster, "reproduce")
    assert (again.started, again.skipped) == (1, 0)
    (check,) = ledger.get("sdc-0123456789abcdef0123").node_checks
    assert (check.state, check.job, check.job_uid) == ("running", name, uid)
    assert len(cluster.jobs) == 1


def test_a_tenants_pod_posing_as_the_jobs_pod_changes_nothing_the_reviewer_reads(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    (name,) = cluster.jobs
    cluster.finish(name, log=report(outcome="match", matched=5, reproduced=0, node=f"hyperpod-{SUSPECT}"))
    # A pod with the Job's label on the node, but not controlled by the Job, saying "reproduced 5/5",
    posing = cluster.pod("posing", name, owner_uid="not-the-jobs-uid", exit_code=1)
    cluster.extra_pods.append(posing)
    cluster.logs["posing"] = report(outcome="mismatch", matched=0, reproduced=5, node=f"hyperpod-{SUSPECT}")
    # is not read: the answer is the Job's own pod's.
    assert poll(ledger, cluster, "reproduce").summary == "reproduced 0/5"


def test_a_second_pod_claiming_the_job_is_refused_not_believed(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    (name,) = cluster.jobs
    cluster.finish(name, log=report(outcome="match", matched=5, reproduced=0, node=f"hyperpod-{SUSPECT}"))
    cluster.extra_pods.append(cluster.pod("claiming", name, exit_code=1))  # a forged controller ownerReference
    cluster.logs["claiming"] = report(outcome="mismatch", matched=0, reproduced=5, node=f"hyperpod-{SUSPECT}")
    summary = poll(ledger, cluster, "reproduce").summary
    assert summary.startswith("inconclusive: refused: 2 pods claim to be the Job's one pod")
    # A pod of the Job on another node is not read either.
    elsewhere = cluster.pod("elsewhere", name, node="hyperpod-i-0999999999999999f")
    assert node_check._node_of(elsewhere) != f"hyperpod-{SUSPECT}"


def test_a_job_replaced_under_the_checks_name_is_refused_and_left_alone(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    (name,) = cluster.jobs
    del cluster.jobs[name]  # deleted and made again by someone else: another uid
    tenants_job(cluster, name)
    cluster.finish(name, log=report(outcome="mismatch", matched=0, reproduced=5, node=f"hyperpod-{SUSPECT}"), exit_code=1)
    progress = poll(ledger, cluster, "reproduce")
    assert progress.done
    assert progress.summary.startswith("inconclusive: refused: the Job")
    assert "is not the one the pipeline created" in progress.summary
    assert cluster.deleted == []


@pytest.mark.parametrize("accept", [False, True])
def test_a_report_that_says_a_fault_was_injected_is_refused_unless_the_stand_in_simulates_one(accept: bool) -> None:
    line = json.loads(report(outcome="mismatch", matched=0, reproduced=5, node="a", injection="finite_activation x1e4"))
    answer = node_check.answer_from_report(line, node="a", repeats=5, accept_injected=accept)
    if accept:
        assert (answer.state, answer.reproduced) == ("failed", 5)
    else:
        assert answer.state == "inconclusive"
        assert answer.why.startswith("refused: the replay reports an injected fault (finite_activation x1e4)")


def test_a_job_with_an_injection_in_its_environment_is_refused(cluster: FakeCluster) -> None:
    ledger = FakeLedger(make_incident())
    start(ledger, cluster, "reproduce")
    (name,) = cluster.jobs
    cluster.jobs[name]["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "SDCGUARD_INJECT", "value": "x"})
    cluster.finish(name, log=report(outcome="mismatch", matched=0, reproduced=5, node=f"hyperpod-{SUSPECT}"), exit_code=1)
    summary = poll(ledger, cluster, "reproduce").summary
    assert summary.startswith("inconclusive: refused: the Job")
    assert "SDCGUARD_INJECT in its environment" in summary


def test_the_notification_and_incidents_show_say_which_image_ran(capsys: pytest.CaptureFixture[str]) -> None:
    from sdcguard.commands.incidents import _show
    from sdcguard.lambdas.notify import describe

    incident = checked(make_incident(S.REPLACED, replacements=[Replacement(old_instance_id=SUSPECT, new_instance_id=NEW, status="Running")]))
    incident = incident.model_copy(update={"node_checks": [c.model_copy(update={"image": IMAGE}) for c in incident.node_checks]})
    text = describe(incident)
    assert f'Reproduction on the suspect: "hyperpod-{SUSPECT}": ran image "{IMAGE}"' in text
    assert f'Qualification of the replacement: "hyperpod-{NEW}": ran image "{IMAGE}"' in text
    assert _show(FakeLedger(incident), incident.incident_id, as_json=False) == 0  # type: ignore[arg-type]
    out = capsys.readouterr().out.splitlines()
    reproduce = next(i for i, line in enumerate(out) if line.startswith("reproduce  "))
    qualify = next(i for i, line in enumerate(out) if line.startswith("qualify    "))
    assert out[reproduce + 1] == out[qualify + 1] == f"           image {IMAGE}"
