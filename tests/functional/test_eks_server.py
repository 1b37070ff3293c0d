"""The local EKS API server, driven with the official kubernetes client and EKS-style tokens."""

from __future__ import annotations

import base64
import datetime as dt
import json
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import boto3
import pytest
import urllib3
import yaml
from kubernetes import client as k8s

from sdcguard.infra.local.eks.auth import TokenRejected, verify_token
from sdcguard.infra.local.eks.bearer_token import eks_bearer_token, kubernetes_configuration
from sdcguard.infra.local.eks.hyperpod_node import HEALTH_LABEL, INSTANCE_GROUP_LABEL, hyperpod_node
from sdcguard.infra.local.eks.patch import PatchError, json_patch, strategic_merge_patch
from sdcguard.infra.local.eks.rbac import AccessEntries
from sdcguard.infra.local.eks.resources import NAMESPACES, ROLES
from sdcguard.infra.local.eks.server import EksApiServer

CLUSTER = "sdcguard-test"
NAMESPACE = "training"


def _instance_id() -> str:
    return "i-" + uuid.uuid4().hex[:17]


@pytest.fixture(scope="module")
def server() -> Iterator[EksApiServer]:
    with EksApiServer() as running:
        yield running


@pytest.fixture(autouse=True)
def _no_faults(server: EksApiServer) -> Iterator[None]:
    yield
    server.faults.clear()


@pytest.fixture(scope="module")
def sts() -> Any:
    return boto3.client(
        "sts", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
    )


def _api(server: EksApiServer, token: str) -> k8s.ApiClient:
    return k8s.ApiClient(kubernetes_configuration(server.url, server.ca_data, token))


@pytest.fixture(scope="module")
def api(server: EksApiServer, sts: Any) -> k8s.ApiClient:
    return _api(server, eks_bearer_token(CLUSTER, sts, expires_in=900))


@pytest.fixture(scope="module")
def core(api: k8s.ApiClient) -> k8s.CoreV1Api:
    return k8s.CoreV1Api(api)


@pytest.fixture(scope="module")
def custom(api: k8s.ApiClient) -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(api)


@pytest.fixture(scope="module", autouse=True)
def _namespace(core: k8s.CoreV1Api) -> None:
    core.create_namespace({"metadata": {"name": NAMESPACE}})


def _node(core: k8s.CoreV1Api) -> tuple[str, str]:
    instance_id = _instance_id()
    created = core.create_node(hyperpod_node(instance_id, hyperpod_cluster="hp"))
    return instance_id, created.metadata.name


def _pod(core: k8s.CoreV1Api, name: str, node: str, job: str) -> k8s.V1Pod:
    return core.create_namespaced_pod(
        NAMESPACE,
        {
            "metadata": {"name": name, "labels": {"training.kubeflow.org/job-name": job, "rank": name[-1]}},
            "spec": {"nodeName": node, "containers": [{"name": "pytorch", "image": "trainer:1"}]},
            "status": {"phase": "Running"},
        },
    )


def _job(custom: k8s.CustomObjectsApi, name: str) -> dict[str, Any]:
    return custom.create_namespaced_custom_object(
        "kubeflow.org",
        "v1",
        NAMESPACE,
        "pytorchjobs",
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": name},
            "spec": {
                "runPolicy": {"suspend": False},
                "pytorchReplicaSpecs": {
                    "Worker": {
                        "replicas": 2,
                        "template": {"spec": {"containers": [{"name": "pytorch", "image": "trainer:1"}]}},
                    }
                },
            },
        },
    )


def _status_body(exc: k8s.ApiException) -> dict[str, Any]:
    body = json.loads(exc.body)
    assert body["kind"] == "Status"
    assert body["status"] == "Failure"
    assert body["code"] == exc.status
    return body


# --- nodes ---------------------------------------------------------------------------------


def test_cordon_by_strategic_merge_sets_unschedulable_taint_and_annotations(core: k8s.CoreV1Api) -> None:
    _, name = _node(core)
    before = core.read_node(name)

    core.patch_node(
        name,
        {
            "metadata": {
                "labels": {HEALTH_LABEL: "Unschedulable"},
                "annotations": {"sdcguard.io/incident": "inc-123"},
            },
            "spec": {
                "unschedulable": True,
                "taints": [{"key": "sdcguard.io/quarantine", "value": "inc-123", "effect": "NoSchedule"}],
            },
        },
    )

    after = core.read_node(name)
    assert after.spec.unschedulable is True
    assert [(t.key, t.value, t.effect) for t in after.spec.taints] == [
        ("sdcguard.io/quarantine", "inc-123", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", None, "NoSchedule"),  # the node lifecycle controller's
    ]
    assert after.metadata.annotations["sdcguard.io/incident"] == "inc-123"
    assert after.metadata.labels[HEALTH_LABEL] == "Unschedulable"
    # the other HyperPod labels survive a merge
    assert after.metadata.labels[INSTANCE_GROUP_LABEL] == "worker-group"
    assert int(after.metadata.resource_version) > int(before.metadata.resource_version)
    assert after.metadata.uid == before.metadata.uid


def test_uncordon_with_null_and_json_patch_removes_what_cordon_added(core: k8s.CoreV1Api) -> None:
    _, name = _node(core)
    core.patch_node(
        name,
        {
            "metadata": {"annotations": {"sdcguard.io/incident": "inc-9"}},
            "spec": {"unschedulable": True, "taints": [{"key": "q", "effect": "NoSchedule"}]},
        },
    )

    core.patch_node(
        name, {"metadata": {"annotations": {"sdcguard.io/incident": None}}, "spec": {"taints": None}}
    )
    core.patch_node(name, [{"op": "replace", "path": "/spec/unschedulable", "value": False}])

    node = core.read_node(name)
    assert node.spec.unschedulable is False
    assert not node.spec.taints
    assert "sdcguard.io/incident" not in (node.metadata.annotations or {})


def test_the_node_lifecycle_controllers_taint_follows_unschedulable_on_every_node_write(
    core: k8s.CoreV1Api,
) -> None:
    controllers = ("node.kubernetes.io/unschedulable", "NoSchedule")

    def taints(name: str) -> list[tuple[str, str]]:
        return [(t.key, t.effect) for t in core.read_node(name).spec.taints or []]

    # A node created schedulable has no taint; one created unschedulable has the controller's.
    _, free = _node(core)
    assert taints(free) == []
    cordoned = hyperpod_node(_instance_id(), hyperpod_cluster="hp")
    cordoned["spec"] = {**cordoned.get("spec", {}), "unschedulable": True}
    created = core.create_node(cordoned).metadata.name
    assert taints(created) == [controllers]
    assert core.read_node(created).spec.taints[0].time_added is not None
    # A cordon by strategic merge, JSON merge or JSON patch adds it once, beside the taints written,
    core.patch_node(free, {"spec": {"unschedulable": True, "taints": [{"key": "q", "effect": "NoSchedule"}]}})
    assert taints(free) == [("q", "NoSchedule"), controllers]
    core.patch_node(free, {"spec": {"unschedulable": True}})  # already there: not added twice
    assert taints(free) == [("q", "NoSchedule"), controllers]
    # and an uncordon removes it, whether the write sent it back or not; other taints stay.
    core.patch_node(free, [{"op": "replace", "path": "/spec/unschedulable", "value": False}])
    assert taints(free) == [("q", "NoSchedule")]
    node = core.read_node(created)
    node.spec.unschedulable = False  # a PUT of the whole node, its taint still in it
    core.replace_node(created, node)
    assert (core.read_node(created).spec.unschedulable, taints(created)) == (False, [])


def test_list_nodes_by_label_selector(core: k8s.CoreV1Api) -> None:
    _, marked = _node(core)
    _, other = _node(core)
    core.patch_node(marked, {"metadata": {"labels": {"sdcguard.io/quarantined": "true"}}})

    equality = {n.metadata.name for n in core.list_node(label_selector="sdcguard.io/quarantined=true").items}
    exists = {n.metadata.name for n in core.list_node(label_selector="sdcguard.io/quarantined").items}
    not_in = {
        n.metadata.name
        for n in core.list_node(label_selector="sdcguard.io/quarantined notin (true),!sdcguard.io/x").items
    }

    assert marked in equality
    assert other not in equality
    assert equality == exists
    assert other in not_in
    assert marked not in not_in


def test_stale_resource_version_is_a_conflict_and_changes_nothing(core: k8s.CoreV1Api) -> None:
    _, name = _node(core)
    stale = core.read_node(name).metadata.resource_version
    core.patch_node(name, {"metadata": {"labels": {"step": "1"}}})

    with pytest.raises(k8s.ApiException) as caught:
        core.patch_node(name, {"metadata": {"resourceVersion": stale, "labels": {"step": "2"}}})

    assert caught.value.status == 409
    assert _status_body(caught.value)["reason"] == "Conflict"
    assert core.read_node(name).metadata.labels["step"] == "1"


def test_current_resource_version_is_accepted(core: k8s.CoreV1Api) -> None:
    _, name = _node(core)
    current = core.read_node(name).metadata.resource_version

    updated = core.patch_node(name, {"metadata": {"resourceVersion": current, "labels": {"step": "2"}}})

    assert updated.metadata.labels["step"] == "2"
    assert updated.metadata.resource_version != current


def test_concurrent_writers_with_the_same_version_one_wins(server: EksApiServer, sts: Any) -> None:
    setup = k8s.CoreV1Api(_api(server, eks_bearer_token(CLUSTER, sts)))
    _, name = _node(setup)
    version = setup.read_node(name).metadata.resource_version
    outcomes: list[int] = []

    def write(value: str) -> None:
        core = k8s.CoreV1Api(_api(server, eks_bearer_token(CLUSTER, sts)))
        try:
            core.patch_node(name, {"metadata": {"resourceVersion": version, "labels": {"writer": value}}})
            outcomes.append(200)
        except k8s.ApiException as exc:
            outcomes.append(exc.status)

    threads = [threading.Thread(target=write, args=(str(i),)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(outcomes) == [200, 409, 409, 409]


def test_missing_node_is_404_with_status_body(core: k8s.CoreV1Api) -> None:
    with pytest.raises(k8s.ApiException) as caught:
        core.patch_node("hyperpod-i-00000000000000000", {"spec": {"unschedulable": True}})

    assert caught.value.status == 404
    body = _status_body(caught.value)
    assert body["reason"] == "NotFound"
    assert body["details"]["name"] == "hyperpod-i-00000000000000000"


def test_creating_an_existing_node_is_409_already_exists(core: k8s.CoreV1Api) -> None:
    instance_id, _ = _node(core)

    with pytest.raises(k8s.ApiException) as caught:
        core.create_node(hyperpod_node(instance_id))

    assert caught.value.status == 409
    assert _status_body(caught.value)["reason"] == "AlreadyExists"


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"spec": {"taints": [{"key": "q", "effect": "NoScheduleTypo"}]}}, "spec.taints[0].effect"),
        ({"spec": {"unschedulable": "yes"}}, "spec.unschedulable"),
        ({"metadata": {"labels": {"bad key!": "x"}}}, "metadata.labels"),
        ({"metadata": {"labels": {"ok": "not a valid/value"}}}, "metadata.labels[ok]"),
    ],
)
def test_invalid_node_patch_is_422_naming_the_field_and_changes_nothing(
    core: k8s.CoreV1Api, patch: dict[str, Any], field: str
) -> None:
    _, name = _node(core)
    before = core.read_node(name)

    with pytest.raises(k8s.ApiException) as caught:
        core.patch_node(name, patch)

    assert caught.value.status == 422
    body = _status_body(caught.value)
    assert body["reason"] == "Invalid"
    assert field in [cause["field"] for cause in body["details"]["causes"]]
    assert core.read_node(name).metadata.resource_version == before.metadata.resource_version


# --- pods -------------------------------------------------------------------------------------


def test_list_pods_by_node_name_and_job_label(core: k8s.CoreV1Api) -> None:
    job = f"job-{uuid.uuid4().hex[:6]}"
    _, node_a = _node(core)
    _, node_b = _node(core)
    _pod(core, f"{job}-worker-0", node_a, job)
    _pod(core, f"{job}-worker-1", node_b, job)
    _pod(core, f"{job}-other-2", node_a, "another-job")

    on_a = core.list_namespaced_pod(NAMESPACE, field_selector=f"spec.nodeName={node_a}").items
    of_job = core.list_namespaced_pod(NAMESPACE, label_selector=f"training.kubeflow.org/job-name={job}").items
    both = core.list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={node_a}", label_selector=f"training.kubeflow.org/job-name={job}"
    ).items

    assert sorted(p.metadata.name for p in on_a) == [f"{job}-other-2", f"{job}-worker-0"]
    assert sorted(p.metadata.name for p in of_job) == [f"{job}-worker-0", f"{job}-worker-1"]
    assert [p.metadata.name for p in both] == [f"{job}-worker-0"]
    assert both[0].spec.node_name == node_a
    assert both[0].status.phase == "Running"


def test_pod_list_pages_with_limit_and_continue(core: k8s.CoreV1Api) -> None:
    job = f"page-{uuid.uuid4().hex[:6]}"
    _, node = _node(core)
    for i in range(5):
        _pod(core, f"{job}-worker-{i}", node, job)

    names: list[str] = []
    token = None
    pages = 0
    while True:
        page = core.list_namespaced_pod(
            NAMESPACE, label_selector=f"training.kubeflow.org/job-name={job}", limit=2, _continue=token
        )
        names += [p.metadata.name for p in page.items]
        pages += 1
        token = page.metadata._continue
        if not token:
            break

    assert pages == 3
    assert names == [f"{job}-worker-{i}" for i in range(5)]


def test_pod_in_missing_namespace_is_404(core: k8s.CoreV1Api) -> None:
    with pytest.raises(k8s.ApiException) as caught:
        core.create_namespaced_pod(
            "no-such-namespace",
            {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        )

    assert caught.value.status == 404
    assert "namespaces" in _status_body(caught.value)["message"]


# --- PyTorchJobs -----------------------------------------------------------------------------


def test_suspend_and_resume_a_pytorchjob(custom: k8s.CustomObjectsApi) -> None:
    name = f"llm-{uuid.uuid4().hex[:6]}"
    created = _job(custom, name)

    suspended = custom.patch_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name, {"spec": {"runPolicy": {"suspend": True}}}
    )
    read = custom.get_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name)
    custom.patch_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name, {"spec": {"runPolicy": {"suspend": False}}}
    )
    resumed = custom.get_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name)

    assert read["spec"]["runPolicy"]["suspend"] is True
    assert suspended["metadata"]["generation"] == created["metadata"]["generation"] + 1
    assert resumed["spec"]["runPolicy"]["suspend"] is False
    # the merge patch kept the replica specs
    assert resumed["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    listed = custom.list_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs")
    assert name in [item["metadata"]["name"] for item in listed["items"]]


def test_pytorchjob_suspend_must_be_boolean(custom: k8s.CustomObjectsApi) -> None:
    name = f"llm-{uuid.uuid4().hex[:6]}"
    _job(custom, name)

    with pytest.raises(k8s.ApiException) as caught:
        custom.patch_namespaced_custom_object(
            "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name, {"spec": {"runPolicy": {"suspend": "true"}}}
        )

    assert caught.value.status == 422
    job = custom.get_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name)
    assert job["spec"]["runPolicy"]["suspend"] is False


def test_strategic_merge_on_a_custom_resource_is_415(custom: k8s.CustomObjectsApi) -> None:
    name = f"llm-{uuid.uuid4().hex[:6]}"
    _job(custom, name)

    with pytest.raises(k8s.ApiException) as caught:
        custom.patch_namespaced_custom_object(
            "kubeflow.org",
            "v1",
            NAMESPACE,
            "pytorchjobs",
            name,
            {"spec": {"runPolicy": {"suspend": True}}},
            _content_type="application/strategic-merge-patch+json",
        )

    assert caught.value.status == 415


def test_missing_pytorchjob_is_404(custom: k8s.CustomObjectsApi) -> None:
    with pytest.raises(k8s.ApiException) as caught:
        custom.get_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs", "nope")

    assert caught.value.status == 404
    assert _status_body(caught.value)["message"] == 'pytorchjobs.kubeflow.org "nope" not found'


# --- authentication ----------------------------------------------------------------------------


def _presigned_url(token: str) -> str:
    encoded = token.removeprefix("k8s-aws-v1.")
    return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()


def _token_for(url: str) -> str:
    return "k8s-aws-v1." + base64.urlsafe_b64encode(url.encode()).decode().rstrip("=")


def _with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    query.update(changes)
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_token_made_like_aws_eks_get_token_signs_the_cluster_header(sts: Any) -> None:
    token = eks_bearer_token(CLUSTER, sts)

    url = _presigned_url(token)
    query = parse_qs(urlsplit(url).query)

    assert token.startswith("k8s-aws-v1.")
    assert "=" not in token
    assert query["Action"] == ["GetCallerIdentity"]
    assert "x-k8s-aws-id" in query["X-Amz-SignedHeaders"][0].split(";")
    assert verify_token(token).access_key_id == "testing"


def _unsigned_header_token(sts: Any) -> str:
    return _token_for(sts.generate_presigned_url("get_caller_identity", Params={}, ExpiresIn=60))


@pytest.mark.parametrize(
    "make_header",
    [
        pytest.param(lambda sts: None, id="missing"),
        pytest.param(lambda sts: "Basic dXNlcjpwYXNz", id="not-bearer"),
        pytest.param(lambda sts: "Bearer some-service-account-jwt", id="no-prefix"),
        pytest.param(lambda sts: "Bearer k8s-aws-v1.!!!notbase64", id="not-base64"),
        pytest.param(
            lambda sts: "Bearer " + _token_for("https://example.com/?Action=ListUsers"), id="not-sts"
        ),
        pytest.param(lambda sts: "Bearer " + _unsigned_header_token(sts), id="cluster-header-not-signed"),
        pytest.param(
            lambda sts: (
                "Bearer "
                + _token_for(
                    _with_query(
                        _presigned_url(eks_bearer_token(CLUSTER, sts)),
                        **{
                            "X-Amz-Date": (dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)).strftime(
                                "%Y%m%dT%H%M%SZ"
                            )
                        },
                    )
                )
            ),
            id="expired",
        ),
    ],
)
def test_requests_without_a_valid_eks_token_are_401(server: EksApiServer, sts: Any, make_header: Any) -> None:
    header = make_header(sts)
    request = urllib.request.Request(f"{server.url}/api/v1/nodes")
    if header:
        request.add_header("Authorization", header)
    context = ssl.create_default_context(cadata=server.ca_pem.decode())

    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, context=context, timeout=10)

    assert caught.value.code == 401
    body = json.loads(caught.value.read())
    assert body["reason"] == "Unauthorized"


def test_the_kubernetes_client_with_a_bad_token_gets_401(server: EksApiServer, sts: Any) -> None:
    core = k8s.CoreV1Api(_api(server, _unsigned_header_token(sts)))

    with pytest.raises(k8s.ApiException) as caught:
        core.list_node()

    assert caught.value.status == 401


def test_token_expiry_follows_x_amz_date_and_expires(sts: Any) -> None:
    token = eks_bearer_token(CLUSTER, sts, expires_in=60)
    now = dt.datetime.now(dt.UTC)

    assert verify_token(token, now=now + dt.timedelta(seconds=30))
    with pytest.raises(TokenRejected, match="expired"):
        verify_token(token, now=now + dt.timedelta(seconds=120))


def test_only_clients_that_trust_the_cluster_ca_connect(server: EksApiServer) -> None:
    untrusting = ssl.create_default_context()

    with pytest.raises(urllib.error.URLError) as caught:
        urllib.request.urlopen(f"{server.url}/version", context=untrusting, timeout=10)

    assert isinstance(caught.value.reason, ssl.SSLCertVerificationError)
    trusting = ssl.create_default_context(cadata=server.ca_pem.decode())
    with urllib.request.urlopen(f"{server.url}/version", context=trusting, timeout=10) as response:
        assert json.loads(response.read())["major"] == "1"


def test_a_stopped_server_serves_no_kept_alive_connection(sts: Any) -> None:
    temporary = EksApiServer().start()
    core = k8s.CoreV1Api(_api(temporary, eks_bearer_token(CLUSTER, sts)))
    core.list_namespace()  # opens a kept-alive connection

    temporary.stop()

    with pytest.raises(urllib3.exceptions.HTTPError):  # a connection error, not an answer
        k8s.CoreV1Api(core.api_client).list_namespace(_request_timeout=5)


# --- fault knobs -----------------------------------------------------------------------------------


def test_named_failure_hits_the_next_patch_of_that_node_once(
    server: EksApiServer, core: k8s.CoreV1Api
) -> None:
    _, name = _node(core)
    _, other = _node(core)
    server.faults.fail_next("PATCH", "nodes", name, status=500)

    core.patch_node(other, {"spec": {"unschedulable": True}})  # another node is not affected
    core.read_node(name)  # nor a GET of the same node
    with pytest.raises(k8s.ApiException) as caught:
        core.patch_node(name, {"spec": {"unschedulable": True}})
    assert core.read_node(name).spec.unschedulable is not True
    core.patch_node(name, {"spec": {"unschedulable": True}})

    assert caught.value.status == 500
    assert "injected fault" in _status_body(caught.value)["message"]
    assert core.read_node(name).spec.unschedulable is True


def test_error_rate_and_latency_apply_to_api_requests(server: EksApiServer, core: k8s.CoreV1Api) -> None:
    server.faults.set(error_rate=1.0, error_status=503)
    with pytest.raises(k8s.ApiException) as caught:
        core.list_node()
    assert caught.value.status == 503

    server.faults.set(error_rate=0.0, latency_seconds=0.3)
    began = time.monotonic()
    core.list_node()
    assert time.monotonic() - began >= 0.3


def _standin_post(server: EksApiServer, path: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{server.url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    context = ssl.create_default_context(cadata=server.ca_pem.decode())
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_fault_knobs_over_http(server: EksApiServer, core: k8s.CoreV1Api) -> None:
    _, name = _node(core)

    status, knobs = _standin_post(
        server,
        "/_standin/faults",
        {"fail_next": [{"method": "GET", "resource": "nodes", "name": name, "status": 500}]},
    )
    assert status == 200
    assert knobs["fail_next"][0]["name"] == name
    with pytest.raises(k8s.ApiException) as caught:
        core.read_node(name)

    assert caught.value.status == 500
    assert core.read_node(name).metadata.name == name
    assert server.faults.to_dict()["fail_next"] == []


def test_throttling_carries_retry_after_and_the_client_retries(
    server: EksApiServer, core: k8s.CoreV1Api
) -> None:
    _, name = _node(core)
    _standin_post(
        server, "/_standin/faults", {"fail_next": [{"resource": "nodes", "name": name, "status": 429}]}
    )

    node = core.read_node(name)  # urllib3 honours Retry-After on 429, as against a real API server

    assert node.metadata.name == name
    statuses = [r.status for r in server.requests if r.name == name and r.method == "GET"]
    assert statuses[-2:] == [429, 200]


@pytest.mark.parametrize(
    "body",
    [
        {"error_rate": 2},
        {"latency_seconds": -1},
        {"fail_next": [{"status": 200}]},
        {"fail_next": [{"times": 0}]},
        {"latency": 1},
    ],
)
def test_bad_fault_knobs_are_refused_and_change_nothing(server: EksApiServer, body: dict[str, Any]) -> None:
    server.faults.set(latency_seconds=0.0)

    status, answer = _standin_post(server, "/_standin/faults", {"latency_seconds": 0.5, **body})

    assert status == 422
    assert "bad fault knobs" in answer["message"]
    assert server.faults.to_dict() == {
        "latency_seconds": 0.0,
        "error_rate": 0.0,
        "error_status": 500,
        "fail_next": [],
    }


# --- HyperPod replacement -----------------------------------------------------------------------


def test_replace_node_swaps_the_node_and_moves_its_pods(server: EksApiServer, core: k8s.CoreV1Api) -> None:
    job = f"rep-{uuid.uuid4().hex[:6]}"
    old_id, old_name = _node(core)
    _, bystander = _node(core)
    core.patch_node(
        old_name, {"spec": {"unschedulable": True, "taints": [{"key": "q", "effect": "NoSchedule"}]}}
    )
    _pod(core, f"{job}-worker-0", old_name, job)
    _pod(core, f"{job}-worker-1", bystander, job)
    new_id = _instance_id()

    server.replace_node(old_id, new_id)

    with pytest.raises(k8s.ApiException) as caught:
        core.read_node(old_name)
    assert caught.value.status == 404
    new = core.read_node(f"hyperpod-{new_id}")
    assert not new.spec.unschedulable
    assert not new.spec.taints
    assert new.metadata.labels[HEALTH_LABEL] == "Schedulable"
    assert new.metadata.labels["sagemaker.amazonaws.com/cluster-name"] == "hp"
    pods = {
        p.metadata.name: p.spec.node_name
        for p in core.list_namespaced_pod(
            NAMESPACE, label_selector=f"training.kubeflow.org/job-name={job}"
        ).items
    }
    assert pods == {f"{job}-worker-0": f"hyperpod-{new_id}", f"{job}-worker-1": bystander}


def test_replace_node_over_http_refuses_a_malformed_instance_id(server: EksApiServer) -> None:
    status, answer = _standin_post(
        server, "/_standin/replace-node", {"old_instance_id": "gpu-0", "new_instance_id": _instance_id()}
    )

    assert status == 422
    assert "gpu-0" in answer["message"]


# --- patch semantics (pure) ---------------------------------------------------------------------


def test_strategic_merge_merges_keyed_lists_and_replaces_others() -> None:
    node = {
        "spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "DiskPressure", "status": "False"}]
        },
    }
    keys = {"status.conditions": "type"}

    merged = strategic_merge_patch(
        node,
        {
            "spec": {"taints": [{"key": "b", "effect": "NoExecute"}]},
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "False"},
                    {"type": "DiskPressure", "$patch": "delete"},
                ]
            },
        },
        keys,
    )

    assert merged["spec"]["taints"] == [{"key": "b", "effect": "NoExecute"}]
    assert merged["status"]["conditions"] == [{"type": "Ready", "status": "False"}]
    assert node["status"]["conditions"][0]["status"] == "True"  # the input is untouched


def test_json_patch_is_all_or_nothing() -> None:
    doc = {"metadata": {"labels": {"a": "1"}}}

    with pytest.raises(PatchError):
        json_patch(
            doc, [{"op": "add", "path": "/metadata/labels/b", "value": "2"}, {"op": "remove", "path": "/x"}]
        )

    assert doc == {"metadata": {"labels": {"a": "1"}}}
    assert json_patch(doc, [{"op": "test", "path": "/metadata/labels/a", "value": "1"}]) == doc


# --- discovery, tables, eviction: what kubectl needs ---------------------------------------------

_AGGREGATED_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
_TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


def _raw(
    server: EksApiServer, sts: Any, path: str, *, accept: str = "application/json", method: str = "GET",
    body: Any = None, token: bool = True,
) -> tuple[int, str, Any]:  # fmt: skip
    request = urllib.request.Request(
        f"{server.url}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Accept": accept, "Content-Type": "application/json"},
    )
    if token:
        request.add_header("Authorization", f"Bearer {eks_bearer_token(CLUSTER, sts)}")
    context = ssl.create_default_context(cadata=server.ca_pem.decode())
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status, response.headers["Content-Type"], json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], json.loads(exc.read())


def test_legacy_discovery_lists_groups_versions_and_resources(server: EksApiServer, sts: Any) -> None:
    _, _, versions = _raw(server, sts, "/api")
    _, _, groups = _raw(server, sts, "/apis")
    _, _, core = _raw(server, sts, "/api/v1")
    _, _, kubeflow = _raw(server, sts, "/apis/kubeflow.org/v1")
    _, _, group = _raw(server, sts, "/apis/kubeflow.org")

    assert versions["kind"] == "APIVersions"
    assert versions["versions"] == ["v1"]
    assert groups["kind"] == "APIGroupList"
    assert {g["name"] for g in groups["groups"]} == {
        "kubeflow.org", "rbac.authorization.k8s.io", "authorization.k8s.io", "batch"
    }  # fmt: skip
    assert group["preferredVersion"] == {"groupVersion": "kubeflow.org/v1", "version": "v1"}
    by_name = {r["name"]: r for r in core["resources"]}
    assert by_name["nodes"]["shortNames"] == ["no"]
    assert by_name["nodes"]["namespaced"] is False
    assert {"get", "list", "patch"} <= set(by_name["nodes"]["verbs"])
    assert by_name["pods"]["namespaced"] is True
    # kubectl drain evicts only when discovery lists pods/eviction with its group and version
    assert by_name["pods/eviction"] | {"verbs": ["create"]} == {
        "name": "pods/eviction", "singularName": "", "namespaced": True, "group": "policy",
        "version": "v1", "kind": "Eviction", "verbs": ["create"],
    }  # fmt: skip
    [jobs] = kubeflow["resources"]
    assert (jobs["name"], jobs["kind"], jobs["namespaced"]) == ("pytorchjobs", "PyTorchJob", True)


def test_aggregated_discovery_answers_in_the_form_asked_for(server: EksApiServer, sts: Any) -> None:
    status, content_type, core = _raw(server, sts, "/api", accept=f"{_AGGREGATED_V2},application/json")
    _, _, named = _raw(server, sts, "/apis", accept=_AGGREGATED_V2.replace("v=v2", "v=v2beta1"))

    assert status == 200
    assert content_type == _AGGREGATED_V2  # client-go parses the body by this header
    assert core["kind"] == "APIGroupDiscoveryList"
    assert core["apiVersion"] == "apidiscovery.k8s.io/v2"
    [core_group] = core["items"]
    resources = {r["resource"]: r for r in core_group["versions"][0]["resources"]}
    assert resources["nodes"]["scope"] == "Cluster"
    assert resources["nodes"]["responseKind"] == {"group": "", "version": "v1", "kind": "Node"}
    assert resources["pods"]["subresources"][0]["subresource"] == "eviction"
    assert named["apiVersion"] == "apidiscovery.k8s.io/v2beta1"
    [kubeflow] = [g for g in named["items"] if g["metadata"]["name"] == "kubeflow.org"]
    assert kubeflow["versions"][0]["resources"][0]["resource"] == "pytorchjobs"


def test_discovery_needs_a_token_and_unknown_versions_are_404(server: EksApiServer, sts: Any) -> None:
    assert _raw(server, sts, "/api", token=False)[0] == 401
    assert _raw(server, sts, "/apis/kubeflow.org/v2")[0] == 404
    assert _raw(server, sts, "/apis/apps")[0] == 404
    assert _raw(server, sts, "/apis/kubeflow.org/v2/namespaces/x/pytorchjobs")[0] == 404
    assert _raw(server, sts, "/openapi/v2")[0] == 404


def test_a_table_is_served_when_asked_for(server: EksApiServer, sts: Any, core: k8s.CoreV1Api) -> None:
    _, name = _node(core)
    core.patch_node(name, {"spec": {"unschedulable": True}})

    status, content_type, table = _raw(server, sts, "/api/v1/nodes", accept=f"{_TABLE},application/json")
    _, _, single = _raw(server, sts, f"/api/v1/nodes/{name}?includeObject=Object", accept=_TABLE)
    _, _, plain = _raw(server, sts, f"/api/v1/nodes/{name}")

    assert status == 200
    assert content_type == _TABLE
    assert table["kind"] == "Table"
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns[:5] == ["Name", "Status", "Roles", "Age", "Version"]
    assert {c["name"] for c in table["columnDefinitions"] if c["priority"] == 1} >= {"Internal-IP", "OS-Image"}
    row = next(r for r in table["rows"] if r["cells"][0] == name)
    assert row["cells"][1] == "Ready,SchedulingDisabled"
    assert row["object"]["kind"] == "PartialObjectMetadata"
    [only] = single["rows"]
    assert only["object"]["spec"]["unschedulable"] is True
    assert plain["kind"] == "Node"
    assert _raw(server, sts, "/api/v1/nodes?includeObject=Everything", accept=_TABLE)[0] == 400


def test_eviction_dry_run_keeps_the_pod_and_a_real_one_removes_it(
    server: EksApiServer, sts: Any, core: k8s.CoreV1Api
) -> None:
    _, node = _node(core)
    pod = f"evict-{uuid.uuid4().hex[:6]}"
    _pod(core, pod, node, "evict-job")
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": NAMESPACE}}
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}/eviction"

    dry = _raw(server, sts, f"{path}?dryRun=All", method="POST", body=eviction)
    assert dry[0] == 201
    assert core.read_namespaced_pod(pod, NAMESPACE).metadata.name == pod

    real = _raw(server, sts, path, method="POST", body=eviction)
    assert real[0] == 201
    with pytest.raises(k8s.ApiException) as caught:
        core.read_namespaced_pod(pod, NAMESPACE)
    assert caught.value.status == 404
    assert _raw(server, sts, path, method="POST", body=eviction)[0] == 404


def test_delete_with_dry_run_deletes_nothing(core: k8s.CoreV1Api) -> None:
    _, name = _node(core)

    core.delete_node(name, dry_run="All")

    assert core.read_node(name).metadata.name == name


# --- RBAC: the pipeline's identities under the repository's manifests ---------------------------------

RBAC_MANIFEST = Path(__file__).resolve().parents[2] / "infra" / "deploy" / "rbac.yaml"
RBAC_NAMESPACE_MANIFEST = RBAC_MANIFEST.with_name("rbac-namespace.yaml")
PIPELINE_GROUP = "sdcguard-pipeline"
READ_GROUP = "sdcguard-pipeline-read"
OTHER_NAMESPACE = "other-team"
# The access key of the read-only role's credentials (the stand-in finds roles by their keys, here a stub).
READ_KEY = "ASIAREADROLE"


def _docs(path: Path, without: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """A manifest's documents, optionally with one (resource, verb) taken out of every role."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if without is not None:
        resource, verb = without
        for doc in docs:
            for rule in doc.get("rules", []):
                if resource in rule["resources"]:
                    rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    return docs


def _manifest(without: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """The repository's cluster-scoped RBAC manifest, optionally with one (resource, verb) taken out."""
    return _docs(RBAC_MANIFEST, without)


def _access() -> AccessEntries:
    # The template's access entries: the read-only role's own, every other role the pipeline's.
    roles = {READ_KEY: "sdcguard-KubernetesReadRole-0A1B2C"}
    return AccessEntries((PIPELINE_GROUP,), role_groups={"KubernetesReadRole": (READ_GROUP,)}, role_of=roles.get)


def _role_sts(access_key_id: str = "ASIATESTING") -> Any:
    # Temporary credentials, as a Lambda function's role has: one of the pipeline's access entries.
    return boto3.client(
        "sts", region_name="us-east-1", aws_access_key_id=access_key_id, aws_secret_access_key="testing",
        aws_session_token="session-token",
    )  # fmt: skip


def _rbac_world(server: EksApiServer, namespaced: list[dict[str, Any]] | None = None) -> None:
    """The job's namespace with the namespaced manifest applied in it, and another namespace without it."""
    for namespace in (NAMESPACE, OTHER_NAMESPACE):
        server.store.create(NAMESPACES, None, {"metadata": {"name": namespace}})
    server.apply(_docs(RBAC_NAMESPACE_MANIFEST) if namespaced is None else namespaced, namespace=NAMESPACE)


@pytest.fixture(scope="module")
def rbac_server() -> Iterator[EksApiServer]:
    with EksApiServer(access=_access(), manifest=_manifest()) as running:
        _rbac_world(running)
        yield running


def _pipeline(server: EksApiServer) -> k8s.ApiClient:
    return _api(server, eks_bearer_token(CLUSTER, _role_sts(), expires_in=900))


def _reader(server: EksApiServer) -> k8s.ApiClient:
    return _api(server, eks_bearer_token(CLUSTER, _role_sts(READ_KEY), expires_in=900))


def _forbidden(call: Any) -> dict[str, Any]:
    with pytest.raises(k8s.ApiException) as caught:
        call()
    assert caught.value.status == 403
    return _status_body(caught.value)


def _in(namespace: str, core: k8s.CoreV1Api, name: str, node: str, job: str) -> None:
    core.create_namespaced_pod(
        namespace,
        {"metadata": {"name": name, "labels": {"training.kubeflow.org/job-name": job}},
         "spec": {"nodeName": node, "containers": [{"name": "pytorch", "image": "trainer:1"}]}},
    )  # fmt: skip


def _check_job(name: str, node: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"template": {"spec": {"nodeName": node, "restartPolicy": "Never",
                                       "containers": [{"name": "replay", "image": "trainer:1"}]}}},
    }  # fmt: skip


def test_the_pipeline_may_do_what_the_manifests_grant(rbac_server: EksApiServer, sts: Any) -> None:
    admin = k8s.CoreV1Api(_api(rbac_server, eks_bearer_token(CLUSTER, sts)))
    _, node = _node(admin)
    _pod(admin, "rbac-worker-0", node, "rbac-job")
    _job(k8s.CustomObjectsApi(_api(rbac_server, eks_bearer_token(CLUSTER, sts))), "rbac-job")
    core = k8s.CoreV1Api(_pipeline(rbac_server))
    custom = k8s.CustomObjectsApi(core.api_client)

    core.patch_node(node, {"spec": {"unschedulable": True}})
    custom.patch_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", "rbac-job", {"spec": {"runPolicy": {"suspend": True}}}
    )
    pods = core.list_namespaced_pod(NAMESPACE, label_selector="training.kubeflow.org/job-name=rbac-job")

    assert core.read_node(node).spec.unschedulable is True
    assert [p.metadata.name for p in pods.items] == ["rbac-worker-0"]
    job = custom.get_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs", "rbac-job")
    assert job["spec"]["runPolicy"]["suspend"] is True


def test_the_pipeline_is_refused_what_the_manifests_do_not_grant(rbac_server: EksApiServer, sts: Any) -> None:
    admin = k8s.CoreV1Api(_api(rbac_server, eks_bearer_token(CLUSTER, sts)))
    _, node = _node(admin)
    core = k8s.CoreV1Api(_pipeline(rbac_server))

    refused = _forbidden(lambda: core.delete_node(node))
    assert refused["reason"] == "Forbidden"
    assert refused["message"] == (
        f'nodes "{node}" is forbidden: User "sdcguard-pipeline" cannot delete resource "nodes" '
        'in API group "" at the cluster scope'
    )
    # pods: listed (the node checks find their Job's pod by its label), never deleted; nodes: never listed;
    # reading a pod by name is resolve's, of the read-only group.
    assert "in the namespace" in _forbidden(lambda: core.delete_namespaced_pod("any", NAMESPACE))["message"]
    _forbidden(lambda: core.read_namespaced_pod("any", NAMESPACE))
    _forbidden(core.list_node)
    _forbidden(lambda: core.create_namespace({"metadata": {"name": "not-allowed"}}))
    assert admin.read_node(node).metadata.name == node


def test_the_pipeline_may_not_touch_another_namespace(rbac_server: EksApiServer, sts: Any) -> None:
    admin = k8s.CoreV1Api(_api(rbac_server, eks_bearer_token(CLUSTER, sts)))
    _, node = _node(admin)
    _in(OTHER_NAMESPACE, admin, "theirs-0", node, "theirs")
    core = k8s.CoreV1Api(_pipeline(rbac_server))
    batch = k8s.BatchV1Api(core.api_client)
    custom = k8s.CustomObjectsApi(core.api_client)

    refused = _forbidden(lambda: batch.create_namespaced_job(OTHER_NAMESPACE, _check_job("check-x", node)))
    assert refused["message"] == (
        'jobs.batch is forbidden: User "sdcguard-pipeline" cannot create resource "jobs" '
        f'in API group "batch" in the namespace "{OTHER_NAMESPACE}"'
    )
    _forbidden(lambda: core.list_namespaced_pod(OTHER_NAMESPACE))
    _forbidden(lambda: core.read_namespaced_pod_log("theirs-0", OTHER_NAMESPACE))
    _forbidden(lambda: custom.list_namespaced_custom_object("kubeflow.org", "v1", OTHER_NAMESPACE, "pytorchjobs"))
    # Nor every namespace at once: a list across namespaces is at the cluster scope.
    _forbidden(core.list_pod_for_all_namespaces)
    _forbidden(batch.list_job_for_all_namespaces)

    assert admin.list_namespaced_pod(OTHER_NAMESPACE).items[0].metadata.name == "theirs-0"
    assert k8s.BatchV1Api(admin.api_client).list_namespaced_job(OTHER_NAMESPACE).items == []
    assert core.list_namespaced_pod(NAMESPACE).kind == "PodList"  # its own namespace still answers


def test_the_read_group_reads_and_changes_nothing(rbac_server: EksApiServer, sts: Any) -> None:
    admin = k8s.CoreV1Api(_api(rbac_server, eks_bearer_token(CLUSTER, sts)))
    _, node = _node(admin)
    _pod(admin, "read-worker-0", node, "read-job")
    _job(k8s.CustomObjectsApi(_api(rbac_server, eks_bearer_token(CLUSTER, sts))), "read-job")
    _in(OTHER_NAMESPACE, admin, "read-theirs-0", node, "theirs")
    core = k8s.CoreV1Api(_reader(rbac_server))
    custom = k8s.CustomObjectsApi(core.api_client)

    # What resolve and guard read: the suspect's pod, the job, the node.
    assert core.read_namespaced_pod("read-worker-0", NAMESPACE).spec.node_name == node
    job = custom.get_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs", "read-job")
    assert job["metadata"]["name"] == "read-job"
    assert core.read_node(node).metadata.name == node

    refused = _forbidden(lambda: core.patch_node(node, {"spec": {"unschedulable": True}}))
    assert refused["message"] == (
        f'nodes "{node}" is forbidden: User "sdcguard-pipeline-read" cannot patch resource "nodes" '
        'in API group "" at the cluster scope'
    )
    _forbidden(lambda: custom.patch_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", "read-job", {"spec": {"runPolicy": {"suspend": True}}}
    ))  # fmt: skip
    _forbidden(lambda: k8s.BatchV1Api(core.api_client).create_namespaced_job(NAMESPACE, _check_job("check-r", node)))
    _forbidden(lambda: core.list_namespaced_pod(NAMESPACE))
    _forbidden(lambda: core.read_namespaced_pod("read-theirs-0", OTHER_NAMESPACE))

    assert not admin.read_node(node).spec.unschedulable
    assert not k8s.CustomObjectsApi(admin.api_client).get_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", "read-job"
    )["spec"]["runPolicy"]["suspend"]


def test_a_verb_taken_out_of_the_manifest_is_refused(sts: Any) -> None:
    with EksApiServer(access=_access(), manifest=_manifest(("nodes", "patch"))) as server:
        admin = k8s.CoreV1Api(_api(server, eks_bearer_token(CLUSTER, sts)))
        _, node = _node(admin)
        core = k8s.CoreV1Api(_pipeline(server))

        _forbidden(lambda: core.patch_node(node, {"spec": {"unschedulable": True}}))

        assert not admin.read_node(node).spec.unschedulable
        assert core.read_node(node).metadata.name == node  # get is still granted


def test_without_the_namespaced_manifest_the_job_namespace_is_closed(sts: Any) -> None:
    with EksApiServer(access=_access(), manifest=_manifest()) as server:
        _rbac_world(server, namespaced=[])
        admin = k8s.CoreV1Api(_api(server, eks_bearer_token(CLUSTER, sts)))
        _, node = _node(admin)
        _pod(admin, "closed-0", node, "closed")
        core = k8s.CoreV1Api(_pipeline(server))

        _forbidden(lambda: k8s.BatchV1Api(core.api_client).create_namespaced_job(NAMESPACE, _check_job("c", node)))
        _forbidden(lambda: core.list_namespaced_pod(NAMESPACE))
        _forbidden(lambda: k8s.CoreV1Api(_reader(server)).read_namespaced_pod("closed-0", NAMESPACE))
        assert core.read_node(node).metadata.name == node  # the nodes come from the cluster-scoped part

        server.apply(_docs(RBAC_NAMESPACE_MANIFEST), namespace=NAMESPACE)

        assert core.list_namespaced_pod(NAMESPACE).items[0].metadata.name == "closed-0"
        assert k8s.CoreV1Api(_reader(server)).read_namespaced_pod("closed-0", NAMESPACE).metadata.name == "closed-0"


def test_a_role_binding_grants_a_cluster_role_in_its_namespace_only(sts: Any) -> None:
    # As in Kubernetes: a RoleBinding may name a ClusterRole, whose rules then hold in the binding's namespace.
    reader = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "pod-reader"},
              "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]}  # fmt: skip
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "pod-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "pod-reader"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": PIPELINE_GROUP}],
    }  # fmt: skip
    with EksApiServer(access=_access(), manifest=[reader]) as server:
        _rbac_world(server, namespaced=[binding])
        core = k8s.CoreV1Api(_pipeline(server))

        assert core.list_namespaced_pod(NAMESPACE).kind == "PodList"
        _forbidden(lambda: core.list_namespaced_pod(OTHER_NAMESPACE))
        _forbidden(core.list_pod_for_all_namespaces)


def test_a_role_patched_through_the_api_applies_at_once(rbac_server: EksApiServer, sts: Any) -> None:
    rbac_api = k8s.RbacAuthorizationV1Api(_api(rbac_server, eks_bearer_token(CLUSTER, sts)))
    core = k8s.CoreV1Api(_pipeline(rbac_server))
    admin = k8s.CoreV1Api(_api(rbac_server, eks_bearer_token(CLUSTER, sts)))
    _, node = _node(admin)
    role = rbac_api.read_namespaced_role("sdcguard-pipeline", NAMESPACE)
    original = [{"apiGroups": r.api_groups, "resources": r.resources, "verbs": r.verbs} for r in role.rules]
    narrowed = [{**r, "verbs": [v for v in r["verbs"] if v != "list"]} for r in original]

    rbac_api.patch_namespaced_role("sdcguard-pipeline", NAMESPACE, {"rules": narrowed})
    try:
        _forbidden(lambda: core.list_namespaced_pod(NAMESPACE))
    finally:
        rbac_api.patch_namespaced_role("sdcguard-pipeline", NAMESPACE, {"rules": original})
    assert core.list_namespaced_pod(NAMESPACE).kind == "PodList"
    cluster_role = rbac_api.read_cluster_role("sdcguard-pipeline")
    assert [r.resources for r in cluster_role.rules] == [["nodes"]]
    assert core.read_node(node).metadata.name == node


def test_the_rbac_objects_are_served_per_namespace(rbac_server: EksApiServer, sts: Any) -> None:
    rbac_api = k8s.RbacAuthorizationV1Api(_api(rbac_server, eks_bearer_token(CLUSTER, sts)))

    roles = rbac_api.list_namespaced_role(NAMESPACE).items
    bindings = rbac_api.list_namespaced_role_binding(NAMESPACE).items

    assert sorted(r.metadata.name for r in roles) == ["sdcguard-pipeline", "sdcguard-pipeline-read"]
    assert {b.metadata.name: (b.role_ref.kind, b.subjects[0].name) for b in bindings} == {
        "sdcguard-pipeline": ("Role", PIPELINE_GROUP), "sdcguard-pipeline-read": ("Role", READ_GROUP),
    }  # fmt: skip
    assert all(r.metadata.namespace == NAMESPACE for r in roles)
    assert rbac_api.list_namespaced_role(OTHER_NAMESPACE).items == []


def test_access_reviews_answer_for_the_caller_and_for_whom_an_admin_impersonates(
    rbac_server: EksApiServer, sts: Any
) -> None:
    def review(
        api: k8s.ApiClient, verb: str, resource: str, group: str = "", namespace: str = "", **headers: str
    ) -> bool:
        authz = k8s.AuthorizationV1Api(api)
        for key, value in headers.items():
            api.set_default_header(key.replace("_", "-"), value)
        attributes = {"verb": verb, "resource": resource, "group": group, "namespace": namespace}
        return bool(authz.create_self_subject_access_review({"spec": {"resourceAttributes": attributes}}).status.allowed)

    pipeline = _pipeline(rbac_server)
    reader = _reader(rbac_server)
    admin = _api(rbac_server, eks_bearer_token(CLUSTER, sts))
    impersonating = _api(rbac_server, eks_bearer_token(CLUSTER, sts))

    assert review(pipeline, "patch", "nodes")
    assert review(pipeline, "patch", "pytorchjobs", "kubeflow.org", NAMESPACE)
    assert not review(pipeline, "patch", "pytorchjobs", "kubeflow.org", OTHER_NAMESPACE)
    assert not review(pipeline, "patch", "pytorchjobs", "kubeflow.org")  # in every namespace: no
    assert not review(pipeline, "delete", "nodes")
    assert review(pipeline, "list", "pods", namespace=NAMESPACE)
    assert review(pipeline, "create", "jobs", "batch", NAMESPACE)
    assert not review(pipeline, "create", "jobs", "batch", OTHER_NAMESPACE)
    assert not review(pipeline, "delete", "pods", namespace=NAMESPACE)
    assert review(reader, "get", "nodes")
    assert review(reader, "get", "pods", namespace=NAMESPACE)
    assert not review(reader, "patch", "nodes")
    assert not review(reader, "get", "pods", namespace=OTHER_NAMESPACE)
    assert review(admin, "delete", "nodes")
    assert review(impersonating, "patch", "nodes", Impersonate_User="x", Impersonate_Group=PIPELINE_GROUP)
    assert not review(impersonating, "delete", "nodes")
    pipeline.set_default_header("Impersonate-User", "kubernetes-admin")
    _forbidden(lambda: k8s.CoreV1Api(pipeline).delete_node("any"))


def test_a_namespaced_document_needs_a_namespace_that_exists() -> None:
    with EksApiServer() as server:
        with pytest.raises(ValueError, match="give the namespace"):
            server.apply(_docs(RBAC_NAMESPACE_MANIFEST))
        with pytest.raises(ValueError, match="namespace 'nowhere' does not exist"):
            server.apply(_docs(RBAC_NAMESPACE_MANIFEST), namespace="nowhere")
        assert server.store.list(ROLES)[0] == []


def test_a_manifest_with_other_kinds_is_refused() -> None:
    with pytest.raises(ValueError, match="document 0 is a Namespace"):
        EksApiServer(manifest=[{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}])


# --- watches -----------------------------------------------------------------------------------------


def test_a_watch_streams_what_changes_and_ends_on_its_timeout(server: EksApiServer, sts: Any, core: k8s.CoreV1Api) -> None:
    _, name = _node(core)
    revision = core.list_node().metadata.resource_version
    request = urllib.request.Request(
        f"{server.url}/api/v1/nodes?watch=true&timeoutSeconds=3&resourceVersion={revision}"
        f"&fieldSelector=metadata.name%3D{name}",
        headers={"Authorization": f"Bearer {eks_bearer_token(CLUSTER, sts)}"},
    )
    context = ssl.create_default_context(cadata=server.ca_pem.decode())
    lines: list[dict[str, Any]] = []

    def read() -> None:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            lines.extend(json.loads(line) for line in response if line.strip())

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)
    core.patch_node(name, {"spec": {"unschedulable": True}})
    time.sleep(1)  # more than a poll: a change and the next one within a poll read as the last
    core.delete_node(name)
    reader.join(timeout=15)

    assert not reader.is_alive()  # the watch ended by itself after timeoutSeconds
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [("MODIFIED", name), ("DELETED", name)]
    assert lines[0]["object"]["spec"]["unschedulable"] is True


def test_a_stopping_server_ends_its_watches(sts: Any) -> None:
    temporary = EksApiServer().start()
    request = urllib.request.Request(
        f"{temporary.url}/api/v1/nodes?watch=1", headers={"Authorization": f"Bearer {eks_bearer_token(CLUSTER, sts)}"}
    )
    context = ssl.create_default_context(cadata=temporary.ca_pem.decode())
    response = urllib.request.urlopen(request, context=context, timeout=10)

    began = time.monotonic()
    temporary.stop()

    assert response.read() == b""  # the stream ended (no events), rather than hanging
    assert time.monotonic() - began < 10
