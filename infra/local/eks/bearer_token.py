"""EKS bearer tokens and Kubernetes API clients for a cluster, made exactly as EKS clients make them.

This is what ``aws eks get-token`` does: presign STS ``GetCallerIdentity``
with the header ``x-k8s-aws-id: <cluster name>`` and wrap the URL as
``k8s-aws-v1.<unpadded base64url>``. The seed and the tests use it to reach
the EKS stand-in through ``DescribeCluster``'s endpoint and CA, the same path
a client takes to a real cluster.
"""

from __future__ import annotations

import base64
import os
import tempfile
import uuid
import weakref
from typing import TYPE_CHECKING, Any

import boto3
from kubernetes import client as k8s

if TYPE_CHECKING:
    from mypy_boto3_eks import EKSClient
    from mypy_boto3_sts import STSClient

TOKEN_PREFIX = "k8s-aws-v1."


def eks_bearer_token(cluster_name: str, sts_client: STSClient | None = None, expires_in: int = 60) -> str:
    """A ``k8s-aws-v1.`` token for ``cluster_name`` signed with the STS client's credentials.

    Raises botocore's errors when there are no credentials.
    """
    sts = sts_client or boto3.client("sts")
    handler_id = f"sdcguard-k8s-aws-id-{uuid.uuid4()}"

    def add_cluster_header(request: Any, **_: Any) -> None:
        request.headers["x-k8s-aws-id"] = cluster_name

    # before-sign puts the header under the signature (X-Amz-SignedHeaders), which is what EKS checks.
    sts.meta.events.register("before-sign.sts.GetCallerIdentity", add_cluster_header, unique_id=handler_id)
    try:
        url = sts.generate_presigned_url(
            "get_caller_identity", Params={}, ExpiresIn=expires_in, HttpMethod="GET"
        )
    finally:
        sts.meta.events.unregister("before-sign.sts.GetCallerIdentity", unique_id=handler_id)
    return TOKEN_PREFIX + base64.urlsafe_b64encode(url.encode("utf-8")).decode("ascii").rstrip("=")


def kubernetes_configuration(endpoint: str, ca_data: str, token: str) -> k8s.Configuration:
    """A kubernetes client configuration for an endpoint, its base64 PEM CA (as DescribeCluster gives it) and a token."""
    ca_file = tempfile.NamedTemporaryFile(prefix="sdcguard-eks-ca-", suffix=".pem", delete=False)  # noqa: SIM115
    with ca_file:
        ca_file.write(base64.b64decode(ca_data))
    configuration = k8s.Configuration(host=endpoint)
    configuration.ssl_ca_cert = ca_file.name
    configuration.verify_ssl = True
    configuration.api_key = {"BearerToken": token}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    # urllib3 reads the CA file on every new connection, so it lives as long as the configuration.
    weakref.finalize(configuration, os.unlink, ca_file.name)
    return configuration


def cluster_api_client(
    cluster_name: str, eks_client: EKSClient | None = None, sts_client: STSClient | None = None
) -> k8s.ApiClient:
    """A kubernetes ApiClient for an EKS cluster: endpoint and CA from DescribeCluster, a fresh bearer token.

    Raises the EKS client's ResourceNotFoundException for an unknown cluster.
    """
    eks = eks_client or boto3.client("eks")
    cluster = eks.describe_cluster(name=cluster_name)["cluster"]
    token = eks_bearer_token(cluster_name, sts_client, expires_in=900)
    return k8s.ApiClient(
        kubernetes_configuration(cluster["endpoint"], cluster["certificateAuthority"]["data"], token)
    )
