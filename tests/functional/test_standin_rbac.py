"""A Lambda function on the stand-in reaches the EKS API as the pipeline: RBAC of the repository's manifests applies.

The function signs its token with the credentials Lambda gives it (temporary
ones, with a session token), exactly as the handlers do, so what it may do is
what ``infra/deploy/rbac.yaml`` (the nodes) and ``rbac-namespace.yaml`` (in
the job's namespace, where the seed applies it) grant its access entry's
group, and no more: the pipeline's group for most roles, the read-only group
for the role of resolve and guard (``KubernetesReadRole``).
"""

from __future__ import annotations

import io
import json
import uuid
import zipfile
from typing import Any

import pytest
from kubernetes import client as k8s

from sdcguard.infra.local.eks.bearer_token import cluster_api_client
from sdcguard.infra.local.seed import seed
from sdcguard.infra.local.standin import LocalStandIn

# Only boto3 and the standard library: the same token and HTTPS call a handler makes, spelt out.
HANDLER_SOURCE = '''
import base64, json, ssl, urllib.error, urllib.request

import boto3


def handler(event, context):
    cluster = boto3.client("eks").describe_cluster(name=event["cluster"])["cluster"]
    sts = boto3.client("sts")

    def add_cluster_header(request, **_):
        request.headers["x-k8s-aws-id"] = event["cluster"]

    sts.meta.events.register("before-sign.sts.GetCallerIdentity", add_cluster_header)
    url = sts.generate_presigned_url("get_caller_identity", Params={}, ExpiresIn=60, HttpMethod="GET")
    token = "k8s-aws-v1." + base64.urlsafe_b64encode(url.encode()).decode().rstrip("=")
    context_ = ssl.create_default_context(cadata=base64.b64decode(cluster["certificateAuthority"]["data"]).decode())
    answers = {}
    for key, method, path, body in event["requests"]:
        request = urllib.request.Request(
            cluster["endpoint"] + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": "Bearer " + token, "Content-Type": "application/merge-patch+json"},
        )
        try:
            with urllib.request.urlopen(request, context=context_, timeout=10) as response:
                answers[key] = response.status
        except urllib.error.HTTPError as exc:
            answers[key] = exc.code
    return answers
'''


def _package() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("sdcguard/__init__.py", "")
        archive.writestr("sdcguard/lambdas/__init__.py", "")
        archive.writestr("sdcguard/lambdas/handlers/__init__.py", "")
        archive.writestr("sdcguard/lambdas/handlers/kube_probe.py", HANDLER_SOURCE)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def seeded(standin: LocalStandIn) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    return seed(standin, nodes=1, ranks_per_node=1, cluster=f"rbac-{suffix}", job=f"llm-{suffix}")


def _function(standin: LocalStandIn, role_name: str) -> str:
    name = f"kube-probe-{uuid.uuid4().hex[:8]}"
    role = standin.client("iam").create_role(RoleName=role_name, AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    # The probe finds the cluster's endpoint with its role's credentials: the stand-in enforces IAM.
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "eks:DescribeCluster", "Resource": "*"}]}
    standin.client("iam").put_role_policy(RoleName=role_name, PolicyName="probe", PolicyDocument=json.dumps(policy))
    standin.client("lambda").create_function(
        FunctionName=name,
        Runtime="python3.11",
        Role=role,
        Handler="sdcguard.lambdas.handlers.kube_probe.handler",
        Code={"ZipFile": _package()},
        Timeout=60,
    )
    return name


@pytest.fixture(scope="module")
def function(standin: LocalStandIn) -> str:
    """A function whose role is any of the pipeline's but the read-only one."""
    return _function(standin, f"kube-probe-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def reading_function(standin: LocalStandIn) -> str:
    """A function whose role is named as CloudFormation names the template's KubernetesReadRole."""
    return _function(standin, f"stack-KubernetesReadRole-{uuid.uuid4().hex[:8].upper()}")


def _invoke(standin: LocalStandIn, function: str, cluster: str, requests: list[Any]) -> dict[str, int]:
    response = standin.client("lambda").invoke(
        FunctionName=function, Payload=json.dumps({"cluster": cluster, "requests": requests})
    )
    answers = json.loads(response["Payload"].read())
    assert "FunctionError" not in response, answers
    return dict(answers)


@pytest.mark.slow
def test_a_lambda_function_gets_exactly_what_the_manifests_grant(
    standin: LocalStandIn, seeded: dict[str, Any], function: str
) -> None:
    node, pod, ns, job = (
        seeded["nodes"][0]["node_name"], seeded["nodes"][0]["pod"], seeded["namespace"], seeded["job"]
    )  # fmt: skip
    requests = [
        ("get node", "GET", f"/api/v1/nodes/{node}", None),
        ("patch node", "PATCH", f"/api/v1/nodes/{node}", {"metadata": {"annotations": {"sdcguard.io/probe": "1"}}}),
        ("delete pod", "DELETE", f"/api/v1/namespaces/{ns}/pods/{pod}", None),
        ("patch job", "PATCH", f"/apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/{job}",
         {"spec": {"runPolicy": {"suspend": True}}}),
        ("list pods", "GET", f"/api/v1/namespaces/{ns}/pods", None),
        ("get pod", "GET", f"/api/v1/namespaces/{ns}/pods/{pod}", None),
        ("list pods elsewhere", "GET", "/api/v1/namespaces/default/pods", None),
        ("list jobs elsewhere", "GET", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs", None),
        ("delete node", "DELETE", f"/api/v1/nodes/{node}", None),
        ("create namespace", "POST", "/api/v1/namespaces", {"metadata": {"name": "not-granted"}}),
    ]  # fmt: skip

    answers = _invoke(standin, function, seeded["eks_cluster"], requests)

    # Reading a pod by name is resolve's (the read-only group); nothing outside the job's namespace.
    assert answers == {
        "get node": 200, "patch node": 200, "delete pod": 403, "patch job": 200, "list pods": 200,
        "get pod": 403, "list pods elsewhere": 403, "list jobs elsewhere": 403, "delete node": 403,
        "create namespace": 403,
    }  # fmt: skip
    admin = cluster_api_client(seeded["eks_cluster"], standin.client("eks"), standin.client("sts"))
    assert k8s.CoreV1Api(admin).read_node(node).metadata.annotations["sdcguard.io/probe"] == "1"
    assert k8s.CoreV1Api(admin).read_node(node).metadata.name == node  # not deleted
    custom = k8s.CustomObjectsApi(admin)
    assert custom.get_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", job)["spec"]["runPolicy"][
        "suspend"
    ] is True
    custom.patch_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", job,
                                          {"spec": {"runPolicy": {"suspend": False}}})  # fmt: skip
    admin.close()


@pytest.mark.slow
def test_the_read_roles_function_reads_and_changes_nothing(
    standin: LocalStandIn, seeded: dict[str, Any], reading_function: str
) -> None:
    node, pod, ns, job = (
        seeded["nodes"][0]["node_name"], seeded["nodes"][0]["pod"], seeded["namespace"], seeded["job"]
    )  # fmt: skip
    requests = [
        ("get node", "GET", f"/api/v1/nodes/{node}", None),
        ("get pod", "GET", f"/api/v1/namespaces/{ns}/pods/{pod}", None),
        ("get job", "GET", f"/apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/{job}", None),
        ("patch node", "PATCH", f"/api/v1/nodes/{node}", {"metadata": {"annotations": {"sdcguard.io/read": "1"}}}),
        ("patch job", "PATCH", f"/apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/{job}",
         {"spec": {"runPolicy": {"suspend": True}}}),
        ("list pods", "GET", f"/api/v1/namespaces/{ns}/pods", None),
        ("get pod elsewhere", "GET", f"/api/v1/namespaces/default/pods/{pod}", None),
    ]  # fmt: skip

    answers = _invoke(standin, reading_function, seeded["eks_cluster"], requests)

    assert answers == {
        "get node": 200, "get pod": 200, "get job": 200,
        "patch node": 403, "patch job": 403, "list pods": 403, "get pod elsewhere": 403,
    }  # fmt: skip
    admin = cluster_api_client(seeded["eks_cluster"], standin.client("eks"), standin.client("sts"))
    assert "sdcguard.io/read" not in (k8s.CoreV1Api(admin).read_node(node).metadata.annotations or {})
    admin.close()
