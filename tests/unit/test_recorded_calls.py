"""The inventory's maps from a recorded call to what IAM and RBAC authorize it as."""

from __future__ import annotations

import pytest

from tests.functional.recorded_calls import AwsCall, KubeCall, Recorder, iam_actions, rbac_request


@pytest.mark.parametrize(
    ("service", "operation", "params", "actions"),
    [
        ("s3", "HeadObject", {}, {"s3:GetObject"}),
        ("s3", "GetObject", {"VersionId": "v1"}, {"s3:GetObjectVersion"}),
        ("s3", "UploadPart", {}, {"s3:PutObject"}),
        ("s3", "AbortMultipartUpload", {}, {"s3:AbortMultipartUpload"}),
        ("s3", "ListObjectsV2", {}, {"s3:ListBucket"}),
        ("s3", "GetObjectAttributes", {}, {"s3:GetObject", "s3:GetObjectAttributes"}),
        ("dynamodb", "TransactWriteItems", {"TransactItems": [{"Update": {}}, {"ConditionCheck": {}}]},
         {"dynamodb:UpdateItem", "dynamodb:ConditionCheckItem"}),
        ("stepfunctions", "SendTaskSuccess", {}, {"states:SendTaskSuccess"}),
        ("sts", "GetCallerIdentity", {}, set()),
        ("sagemaker", "ListClusterNodes", {}, {"sagemaker:ListClusterNodes"}),
    ],
)  # fmt: skip
def test_a_call_maps_to_the_actions_iam_checks(service: str, operation: str, params: dict[str, object], actions: set[str]) -> None:
    assert iam_actions(AwsCall(service, operation, params)) == actions


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/api/v1/nodes/n1", (), ("", "nodes", "get")),
        ("GET", "/api/v1/nodes", (), ("", "nodes", "list")),
        ("GET", "/api/v1/nodes", (("watch", "true"),), ("", "nodes", "watch")),
        ("PATCH", "/api/v1/nodes/n1", (), ("", "nodes", "patch")),
        ("GET", "/api/v1/namespaces/training/pods/p", (), ("", "pods", "get")),
        ("POST", "/api/v1/namespaces/training/pods/p/eviction", (), ("", "pods/eviction", "create")),
        ("PATCH", "/apis/kubeflow.org/v1/namespaces/training/pytorchjobs/j", (), ("kubeflow.org", "pytorchjobs", "patch")),
        ("DELETE", "/api/v1/namespaces/training/pods", (), ("", "pods", "deletecollection")),
    ],
)  # fmt: skip
def test_a_request_maps_to_the_rbac_verb_the_api_server_checks(
    method: str, path: str, query: tuple[tuple[str, str], ...], expected: tuple[str, str, str]
) -> None:
    assert rbac_request(KubeCall(method, path, query)) == expected


def test_calls_outside_an_actor_are_not_attributed() -> None:
    import threading

    from kubernetes.client import ApiClient

    original = ApiClient.call_api
    with Recorder() as recorder:
        with recorder.acting_as("a"):
            worker = threading.Thread(target=lambda: recorder._file("kube", KubeCall("GET", "/api/v1/nodes")))
            worker.start()
            worker.join()
        recorder._file("kube", KubeCall("GET", "/api/v1/nodes/x"))
        assert ApiClient.call_api.__name__ == "call_api"
        assert ApiClient.call_api is not original
    assert [c.path for c in recorder.kube["a"]] == ["/api/v1/nodes"]  # the thread started as "a" inherits it
    assert recorder.unattributed == 1
    assert ApiClient.call_api is original  # restored on exit
