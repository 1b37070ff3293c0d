"""EKS authentication: a bearer token from a presigned STS GetCallerIdentity, and a client.

The token is what ``aws eks get-token`` prints: ``k8s-aws-v1.`` followed by
the unpadded base64url of a presigned ``GetCallerIdentity`` URL that signs the
``x-k8s-aws-id: <cluster name>`` header, valid for 60 seconds. The API server
(or its authenticator) calls that URL to learn who we are.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import boto3
from kubernetes import client as k8s

TOKEN_PREFIX = "k8s-aws-v1."
CLUSTER_HEADER = "x-k8s-aws-id"
TOKEN_SECONDS = 60


def eks_token(cluster: str, sts: Any = None) -> str:
    """A bearer token for EKS cluster ``cluster``, signed with the caller's credentials."""
    sts = sts or boto3.client("sts")
    # The hooks move our header from the call's parameters into the signed
    # request; they are removed again so the client stays a plain STS client.
    events = sts.meta.events

    def carry_cluster(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        if CLUSTER_HEADER in params:
            context[CLUSTER_HEADER] = params.pop(CLUSTER_HEADER)

    def sign_cluster(request: Any, **_: Any) -> None:
        cluster_id = request.context.get(CLUSTER_HEADER)
        if cluster_id:
            request.headers[CLUSTER_HEADER] = cluster_id

    events.register("provide-client-params.sts.GetCallerIdentity", carry_cluster, unique_id="sdcguard-k8s-id")
    events.register("before-sign.sts.GetCallerIdentity", sign_cluster, unique_id="sdcguard-k8s-sign")
    try:
        url = sts.generate_presigned_url(
            "get_caller_identity",
            Params={CLUSTER_HEADER: cluster},
            ExpiresIn=TOKEN_SECONDS,
            HttpMethod="GET",
        )
    finally:
        events.unregister("provide-client-params.sts.GetCallerIdentity", unique_id="sdcguard-k8s-id")
        events.unregister("before-sign.sts.GetCallerIdentity", unique_id="sdcguard-k8s-sign")
    return TOKEN_PREFIX + base64.urlsafe_b64encode(url.encode()).decode().rstrip("=")


def kubernetes_client(cluster: str, *, eks: Any = None, sts: Any = None) -> k8s.ApiClient:
    """A kubernetes ``ApiClient`` for EKS cluster ``cluster``.

    The endpoint and CA come from ``eks.describe_cluster``; the bearer token
    from :func:`eks_token`. Make a new one per invocation: the token lives 60 s.
    Raises botocore's ``ClientError`` (``ResourceNotFoundException``) for an
    unknown cluster.
    """
    eks = eks or boto3.client("eks")
    described = eks.describe_cluster(name=cluster)["cluster"]
    ca_pem = base64.b64decode(described["certificateAuthority"]["data"])
    # The kubernetes client wants the CA as a file; a Lambda may write its
    # temporary directory. One file per CA, so warm invocations reuse it.
    ca_path = Path(tempfile.gettempdir()) / f"eks-ca-{hashlib.sha256(ca_pem).hexdigest()[:16]}.pem"
    if not ca_path.exists():
        partial = ca_path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(ca_pem)
        partial.replace(ca_path)
    config = k8s.Configuration()
    config.host = described["endpoint"]
    config.ssl_ca_cert = str(ca_path)
    config.verify_ssl = True
    config.api_key = {"BearerToken": eks_token(cluster, sts)}
    config.api_key_prefix = {"BearerToken": "Bearer"}
    config.retries = 2
    return k8s.ApiClient(config)
