"""batch/v1 Jobs on the stand-in's EKS API server, run for real as local processes with their node's identity.

The pipeline's node checks create such a Job per node to replay an alarm's
capsule there (``sdcguard replay``): on a node with a registered hardware
fault it must reproduce, on a healthy one match, and the official client,
kubectl and RBAC must see the Job, its pod and its log as on a cluster.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import kubernetes.client as k8s
import pytest
import yaml

from sdcguard.infra.local.eks.bearer_token import eks_bearer_token, kubernetes_configuration
from sdcguard.infra.local.eks.hyperpod_node import hyperpod_node
from sdcguard.infra.local.eks.rbac import AccessEntries
from sdcguard.infra.local.eks.resources import NODES
from sdcguard.infra.local.eks.server import EksApiServer
from sdcguard.infra.local.seed import apply_namespace_rbac
from sdcguard.infra.local.standin import PIPELINE_GROUP, RBAC_MANIFEST, RBAC_NAMESPACE_MANIFEST
from tests.capsules import write

CLUSTER = "jobs"
NAMESPACE = "training"
QUARANTINE = [
    {"key": "sdcguard.io/quarantine", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
]


def _instance_id() -> str:
    return "i-" + uuid.uuid4().hex[:17]


def _sts(*, temporary: bool = False) -> Any:
    # Temporary credentials are the pipeline's access entry (a Lambda function's role), long-term ones an admin's.
    if temporary:
        return boto3.client("sts", region_name="us-east-1", aws_access_key_id="ASIATESTING",
                            aws_secret_access_key="testing", aws_session_token="session-token")
    return boto3.client("sts", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")


def _client(server: EksApiServer, *, temporary: bool = False) -> k8s.ApiClient:
    token = eks_bearer_token(CLUSTER, _sts(temporary=temporary), expires_in=900)
    return k8s.ApiClient(kubernetes_configuration(server.url, server.ca_data, token))


@pytest.fixture(scope="module")
def server() -> Iterator[EksApiServer]:
    manifest = [d for d in yaml.safe_load_all(RBAC_MANIFEST.read_text()) if d]
    with EksApiServer(access=AccessEntries((PIPELINE_GROUP,)), manifest=manifest) as running:
        running.workload_env = {"AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "workload"}
        admin = _client(running)
        k8s.CoreV1Api(admin).create_namespace({"metadata": {"name": NAMESPACE}})
        apply_namespace_rbac(k8s.RbacAuthorizationV1Api(admin), NAMESPACE)  # the Jobs are granted per namespace
        yield running


@pytest.fixture(scope="module")
def admin(server: EksApiServer) -> k8s.ApiClient:
    return _client(server)


@pytest.fixture(scope="module")
def pipeline(server: EksApiServer) -> k8s.ApiClient:
    return _client(server, temporary=True)


@pytest.fixture(scope="module")
def capsule(tmp_path_factory: pytest.TempPathFactory) -> str:
    result = write(tmp_path_factory.mktemp("ckpt"))
    assert result.written, result.reason
    return result.location


def _node(admin: k8s.ApiClient, *, cordoned: bool = False) -> str:
    node = hyperpod_node(_instance_id())
    if cordoned:
        node["spec"].update(unschedulable=True,
                            taints=[{"key": "sdcguard.io/quarantine", "value": "sdc", "effect": "NoSchedule"}])
    return str(k8s.CoreV1Api(admin).create_node(node).metadata.name)


def _job(node: str, command: list[str], *, deadline: int = 120, purpose: str = "reproduce") -> dict[str, Any]:
    """A node check's Job as CONTRACT.md has the Lambda build it."""
    name = f"sdcguard-{purpose}-{uuid.uuid4().hex[:8]}-{node[-6:]}"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "sdcguard", "sdcguard.io/purpose": purpose,
                                              "sdcguard.io/node": node}},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": deadline,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "tolerations": QUARANTINE,
                    "containers": [{
                        "name": "sdcguard-replay",
                        "image": "registry.example/train:1",
                        "resources": {"limits": {"nvidia.com/gpu": "8"}},
                        "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                                {"name": "SDCGUARD_INJECT", "value": "kind=nan_activation,rank=1,step=0,repeat=99"}],
                        "command": command,
                    }],
                }
            },
        },
    }


def _wait(check: Callable[[], Any], seconds: float = 120) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds} s")


def _finished(batch: k8s.BatchV1Api, name: str) -> Callable[[], k8s.V1Job | None]:
    def check() -> k8s.V1Job | None:
        job = batch.read_namespaced_job(name, NAMESPACE)
        conditions = job.status.conditions or []
        return job if any(c.type in ("Complete", "Failed") and c.status == "True" for c in conditions) else None

    return check


def _pod(core: k8s.CoreV1Api, job: str) -> k8s.V1Pod:
    [pod] = core.list_namespaced_pod(NAMESPACE, label_selector=f"job-name={job}").items
    return pod


def _log(core: k8s.CoreV1Api, pod: str) -> str:
    """The pod's log as text: read raw, as the pipeline does (client 36.0.0 returns a bytes repr otherwise)."""
    response = core.read_namespaced_pod_log(pod, NAMESPACE, _preload_content=False)
    return str(response.data.decode("utf-8"))


def _report(log: str) -> dict[str, Any]:
    """What the pipeline reads: the log's last line that is a JSON object with an "outcome"."""
    for line in reversed(log.strip().splitlines()):
        if line.startswith("{"):
            document = json.loads(line)
            if "outcome" in document:
                assert isinstance(document, dict)
                return document
    raise AssertionError(f"no report in the log:\n{log}")


def _replay_command(capsule: str) -> list[str]:
    return ["sdcguard", "replay", capsule, "--repeat", "2", "--json"]


def test_a_replay_job_on_a_faulty_node_reproduces_and_on_a_healthy_one_matches(
    server: EksApiServer, pipeline: k8s.ApiClient, admin: k8s.ApiClient, capsule: str
) -> None:
    # Given a node with a registered persistent fault and a healthy one
    faulty, healthy = _node(admin, cordoned=True), _node(admin)
    server.node_faults.add(faulty, f"kind=finite_activation,node={faulty},step=0,repeat=50")
    batch, core = k8s.BatchV1Api(pipeline), k8s.CoreV1Api(pipeline)
    # When the pipeline creates a replay Job on each (the suspect is cordoned and tainted: the Job tolerates it)
    names = {}
    for node in (faulty, healthy):
        created = batch.create_namespaced_job(NAMESPACE, _job(node, _replay_command(capsule)))
        names[node] = created.metadata.name
        assert created.spec.selector.match_labels  # defaulted as the API server does
    listed = k8s.BatchV1Api(admin).list_namespaced_job(NAMESPACE, label_selector=f"sdcguard.io/node={faulty}").items
    assert [j.metadata.name for j in listed] == [names[faulty]]
    # Then the faulty node's replay reproduces 2/2 and fails; the healthy node's matches and completes
    for node, outcome, code in ((faulty, "mismatch", 1), (healthy, "match", 0)):
        job = _wait(_finished(batch, names[node]))
        pod = _pod(core, names[node])
        assert pod.spec.node_name == node
        assert pod.metadata.labels["job-name"] == names[node]
        assert pod.status.container_statuses[0].state.terminated.exit_code == code
        report = _report(_log(core, pod.metadata.name))
        assert (report["outcome"], report["node"], report["exit_code"]) == (outcome, node, code)
        if code:
            assert (report["reproduced"], report["verdict"]) == (2, "reproduced 2/2: persistent")
            assert (pod.status.phase, job.status.failed) == ("Failed", 1)
            assert [c.type for c in job.status.conditions] == ["Failed"]
        else:
            assert (report["matched"], report["injection"]) == (2, None)  # the image's own SDCGUARD_INJECT is dropped
            assert (pod.status.phase, job.status.succeeded) == ("Succeeded", 1)
            assert [c.type for c in job.status.conditions] == ["Complete"]
        batch.delete_namespaced_job(names[node], NAMESPACE, propagation_policy="Background")
        assert core.list_namespaced_pod(NAMESPACE, label_selector=f"job-name={names[node]}").items == []


def _python(code: str) -> list[str]:
    return ["python", "-c", code]


def test_the_process_gets_its_nodes_identity_and_the_workload_identity_only(
    server: EksApiServer, admin: k8s.ApiClient
) -> None:
    node = _node(admin)
    batch, core = k8s.BatchV1Api(admin), k8s.CoreV1Api(admin)
    code = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
            "('NODE_NAME', 'AWS_REGION', 'AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY', 'SDCGUARD_INJECT')}))")
    name = batch.create_namespaced_job(NAMESPACE, _job(node, _python(code))).metadata.name
    _wait(_finished(batch, name), 30)
    env = json.loads(_log(core, _pod(core, name).metadata.name).strip().splitlines()[-1])
    assert env == {"NODE_NAME": node, "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "workload",
                   "AWS_SECRET_ACCESS_KEY": None, "SDCGUARD_INJECT": None}


def test_the_deadline_kills_the_process_and_fails_the_job(server: EksApiServer, admin: k8s.ApiClient) -> None:
    node = _node(admin)
    batch, core = k8s.BatchV1Api(admin), k8s.CoreV1Api(admin)
    name = batch.create_namespaced_job(
        NAMESPACE, _job(node, _python("import time; print('started', flush=True); time.sleep(60)"), deadline=1)
    ).metadata.name
    began = time.monotonic()
    job = _wait(_finished(batch, name), 20)
    assert time.monotonic() - began < 10
    [condition] = job.status.conditions
    assert (condition.type, condition.reason, job.status.failed, job.status.active) == (
        "Failed", "DeadlineExceeded", 1, 0)
    pod = _wait(lambda: (p := _pod(core, name)).status.container_statuses[0].state.terminated and p, 10)
    assert (pod.status.phase, pod.status.reason) == ("Failed", "DeadlineExceeded")
    assert pod.status.container_statuses[0].state.terminated.exit_code == 137


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_deleting_a_running_job_kills_its_process_and_its_pod(server: EksApiServer, admin: k8s.ApiClient) -> None:
    node = _node(admin)
    batch, core = k8s.BatchV1Api(admin), k8s.CoreV1Api(admin)
    name = batch.create_namespaced_job(
        NAMESPACE, _job(node, _python("import os, time; print(os.getpid(), flush=True); time.sleep(60)"))
    ).metadata.name
    pod = _pod(core, name).metadata.name
    pid = int(_wait(lambda: _log(core, pod).strip(), 20))
    assert _alive(pid)
    assert batch.read_namespaced_job(name, NAMESPACE).status.active == 1
    batch.delete_namespaced_job(name, NAMESPACE, propagation_policy="Background")
    _wait(lambda: not _alive(pid), 10)
    assert core.list_namespaced_pod(NAMESPACE, label_selector=f"job-name={name}").items == []


def test_a_job_pinned_to_an_unknown_node_stays_pending(server: EksApiServer, admin: k8s.ApiClient) -> None:
    batch, core = k8s.BatchV1Api(admin), k8s.CoreV1Api(admin)
    name = batch.create_namespaced_job(NAMESPACE, _job("hyperpod-i-00000000000000000", _python("print(1)"))).metadata.name
    time.sleep(0.5)
    pod = _pod(core, name)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None
    [scheduled] = pod.status.conditions
    assert (scheduled.type, scheduled.status, scheduled.reason) == ("PodScheduled", "False", "Unschedulable")
    job = batch.read_namespaced_job(name, NAMESPACE)
    assert (job.status.active, job.status.conditions) == (1, None)
    with pytest.raises(k8s.ApiException) as caught:
        core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE)
    assert caught.value.status == 400
    batch.delete_namespaced_job(name, NAMESPACE, propagation_policy="Background")


def test_a_cordoned_node_takes_only_a_pod_that_tolerates_the_cordon(server: EksApiServer, admin: k8s.ApiClient) -> None:
    node = _node(admin, cordoned=True)
    batch, core = k8s.BatchV1Api(admin), k8s.CoreV1Api(admin)
    job = _job(node, _python("print(1)"))
    job["spec"]["template"]["spec"]["tolerations"] = []
    name = batch.create_namespaced_job(NAMESPACE, job).metadata.name
    [scheduled] = _pod(core, name).status.conditions
    assert scheduled.reason == "Unschedulable"
    assert "untolerated taint {sdcguard.io/quarantine: sdc}" in scheduled.message


def _control(server: EksApiServer, path: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{server.url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with tempfile.NamedTemporaryFile(suffix=".pem") as ca:
        ca.write(base64.b64decode(server.ca_data))
        ca.flush()
        context = ssl.create_default_context(cafile=ca.name)
        try:
            with urllib.request.urlopen(request, context=context, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


def test_node_faults_over_http_and_a_replacement_that_inherits_its_nodes_fault(server: EksApiServer) -> None:
    old, new = _instance_id(), _instance_id()
    old_node, new_node = f"hyperpod-{old}", f"hyperpod-{new}"
    spec = f"kind=finite_activation,node={old_node},step=30,repeat=50"
    status, body = _control(server, "/_standin/node-faults", "PUT",
                            {"faults": {old_node: spec}, "replacements_inherit": True})
    assert (status, body) == (200, {"faults": {old_node: spec}, "replacements_inherit": True})
    assert _control(server, "/_standin/node-faults", "PUT", {"faults": {old_node: "nonsense"}})[0] == 422
    server.store.create(NODES, None, hyperpod_node(old))
    server.replace_node(old, new)
    status, body = _control(server, "/_standin/node-faults")
    assert body["faults"][new_node] == f"kind=finite_activation,node={new_node},step=30,repeat=50"
    assert body["faults"][old_node] == spec
    # Without replacements_inherit a replacement is healthy.
    _control(server, "/_standin/node-faults", "PUT", {"faults": {new_node: spec}})
    newer = _instance_id()
    server.replace_node(new, newer)
    assert f"hyperpod-{newer}" not in _control(server, "/_standin/node-faults")[1]["faults"]
    assert _control(server, "/_standin/node-faults", "DELETE") == (200, {"faults": {}, "replacements_inherit": False})
    assert _control(server, "/_standin/workload-env", "PUT", {"env": {"AWS_REGION": "eu-west-1"}})[0] == 200
    assert server.workload_env == {"AWS_REGION": "eu-west-1"}
    server.workload_env = {"AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "workload"}


def _namespaced_without(resource: str) -> list[dict[str, Any]]:
    """The repository's namespaced RBAC manifest with every rule on ``resource`` taken out."""
    docs = [d for d in yaml.safe_load_all(RBAC_NAMESPACE_MANIFEST.read_text()) if d]
    for doc in docs:
        if "rules" in doc:
            doc["rules"] = [r for r in doc["rules"] if resource not in r["resources"]]
    return docs


def test_rbac_covers_jobs_and_pod_logs_as_for_other_resources(
    server: EksApiServer, pipeline: k8s.ApiClient, admin: k8s.ApiClient
) -> None:
    # The repository's manifests grant the pipeline what the node checks need, in the job's namespace, and no more.
    node = _node(admin)
    batch, core = k8s.BatchV1Api(pipeline), k8s.CoreV1Api(pipeline)
    name = batch.create_namespaced_job(NAMESPACE, _job(node, _python("print('hello')"))).metadata.name
    _wait(_finished(batch, name), 30)
    pod = _pod(core, name).metadata.name
    assert _log(core, pod).strip() == "hello"
    for refused in (
        lambda: batch.patch_namespaced_job(name, NAMESPACE, {"metadata": {"labels": {"x": "y"}}}),
        lambda: core.delete_namespaced_pod(pod, NAMESPACE),
    ):
        with pytest.raises(k8s.ApiException) as caught:
            refused()
        assert caught.value.status == 403
    batch.delete_namespaced_job(name, NAMESPACE, propagation_policy="Background")
    # Only in the job's namespace: a node check's Job anywhere else is refused.
    k8s.CoreV1Api(admin).create_namespace({"metadata": {"name": "elsewhere"}})
    with pytest.raises(k8s.ApiException) as caught:
        batch.create_namespaced_job("elsewhere", _job(node, _python("print('elsewhere')")))
    assert caught.value.status == 403
    assert k8s.BatchV1Api(admin).list_namespaced_job("elsewhere").items == []
    # Without the rules, Jobs and logs are refused as any other resource is.
    for taken, call, message in (
        ("jobs", lambda api: k8s.BatchV1Api(api).create_namespaced_job(NAMESPACE, _job(node, _python("1"))),
         'cannot create resource "jobs" in API group "batch" in the namespace "training"'),
        ("pods/log", lambda api: k8s.CoreV1Api(api).read_namespaced_pod_log("any", NAMESPACE),
         'cannot get resource "pods" with subresource "log" in API group "" in the namespace "training"'),
    ):
        manifest = [d for d in yaml.safe_load_all(RBAC_MANIFEST.read_text()) if d]
        with EksApiServer(access=AccessEntries((PIPELINE_GROUP,)), manifest=manifest) as narrow:
            k8s.CoreV1Api(_client(narrow)).create_namespace({"metadata": {"name": NAMESPACE}})
            narrow.apply(_namespaced_without(taken), namespace=NAMESPACE)
            with pytest.raises(k8s.ApiException) as caught:
                call(_client(narrow, temporary=True))
            assert caught.value.status == 403
            assert message in json.loads(caught.value.body)["message"]


def test_kubectl_gets_jobs_and_reads_logs(server: EksApiServer, admin: k8s.ApiClient, tmp_path: Path) -> None:
    node = _node(admin)
    batch = k8s.BatchV1Api(admin)
    name = batch.create_namespaced_job(NAMESPACE, _job(node, _python("print('from the job')"))).metadata.name
    _wait(_finished(batch, name), 30)
    ca = tmp_path / "ca.pem"
    ca.write_bytes(base64.b64decode(server.ca_data))
    token = eks_bearer_token(CLUSTER, _sts(), expires_in=900)
    base = ["kubectl", f"--server={server.url}", f"--certificate-authority={ca}", f"--token={token}", "-n", NAMESPACE]
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    got = subprocess.run([*base, "get", "jobs"], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert got.returncode == 0, got.stderr
    [row] = [line.split() for line in got.stdout.splitlines() if line.startswith(name)]
    assert row[1:3] == ["Complete", "1/1"]  # STATUS, COMPLETIONS, as the API server prints a Job
    logs = subprocess.run([*base, "logs", f"job/{name}"], capture_output=True, text=True, timeout=60, env=env,
                          check=False)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.strip() == "from the job"
