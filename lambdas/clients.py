"""The clients a handler talks through, built once per cold start (per table, per cluster) and reused.

Every AWS client retries throttling and transient faults itself (botocore's
standard mode); what still fails after that comes out of a handler as a named
error: :func:`named_throttling` turns a throttling ``ClientError`` into
:class:`~sdcguard.lambdas.errors.Throttled`, which the state machine retries (every
handler is idempotent, and a throttled call took no effect).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, overload

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from sdcguard.lambdas.eks_token import kubernetes_client
from sdcguard.lambdas.errors import Throttled
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lambdas.settings import get_settings

if TYPE_CHECKING:
    from kubernetes import client as k8s
    from mypy_boto3_cloudwatch import CloudWatchClient
    from mypy_boto3_dynamodb import DynamoDBClient
    from mypy_boto3_eks import EKSClient
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_sagemaker import SageMakerClient
    from mypy_boto3_sns import SNSClient
    from mypy_boto3_stepfunctions import SFNClient
    from mypy_boto3_sts import STSClient

CONFIG = Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=5, read_timeout=30)
"""Five attempts with jittered backoff on throttling, 5xx and connection errors (botocore's standard mode)."""
THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "TooManyRequestsException",
        "RequestThrottled",
        "RequestThrottledException",
        "RequestLimitExceeded",
        "ProvisionedThroughputExceededException",
        "TransactionInProgressException",
        "SlowDown",
        "BandwidthLimitExceeded",
        "EC2ThrottledException",
    }
)
KUBERNETES_CLIENT_SECONDS = 45.0
"""How long one Kubernetes client is reused: its EKS token lives 60 s."""

_lock = threading.Lock()
_kubernetes: dict[str, tuple[float, k8s.ApiClient]] = {}


AwsService = Literal["cloudwatch", "dynamodb", "eks", "s3", "sagemaker", "sns", "stepfunctions", "sts"]
"""The AWS services a handler talks to."""


@overload
def aws(service: Literal["cloudwatch"]) -> CloudWatchClient: ...
@overload
def aws(service: Literal["dynamodb"]) -> DynamoDBClient: ...
@overload
def aws(service: Literal["eks"]) -> EKSClient: ...
@overload
def aws(service: Literal["s3"]) -> S3Client: ...
@overload
def aws(service: Literal["sagemaker"]) -> SageMakerClient: ...
@overload
def aws(service: Literal["sns"]) -> SNSClient: ...
@overload
def aws(service: Literal["stepfunctions"]) -> SFNClient: ...
@overload
def aws(service: Literal["sts"]) -> STSClient: ...
def aws(service: AwsService) -> Any:
    """The process's boto3 client for ``service``, with :data:`CONFIG`, typed by the service's stubs."""
    return _aws(service)


@functools.cache
def _aws(service: AwsService) -> Any:
    return boto3.client(service, config=CONFIG)


@functools.cache
def _ledger(table: str) -> Ledger:
    return Ledger(table, aws("dynamodb"))


def ledger() -> Ledger:
    """The incident ledger of the settings' table, one per cold start."""
    return _ledger(get_settings().ledger_table)


def kubernetes() -> k8s.ApiClient:
    """A Kubernetes client for the settings' EKS cluster, rebuilt (new token) every :data:`KUBERNETES_CLIENT_SECONDS`."""
    cluster = get_settings().eks_cluster
    now = time.monotonic()
    with _lock:
        cached = _kubernetes.get(cluster)
        if cached is not None and now - cached[0] < KUBERNETES_CLIENT_SECONDS:
            return cached[1]
    api = kubernetes_client(cluster, eks=aws("eks"), sts=aws("sts"))
    with _lock:
        _kubernetes[cluster] = (now, api)
    return api


def forget() -> None:
    """Drop every cached client (tests that point the process at another stand-in or table)."""
    _aws.cache_clear()
    _ledger.cache_clear()
    with _lock:
        _kubernetes.clear()


P = ParamSpec("P")
R = TypeVar("R")


def named_throttling(handler: Callable[P, R]) -> Callable[P, R]:
    """``handler`` with a throttling ``ClientError`` (after the client's retries) raised as :class:`Throttled`."""

    @functools.wraps(handler)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return handler(*args, **kwargs)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            if str(error.get("Code", "")) in THROTTLING_CODES:
                raise Throttled(f"{exc.operation_name}: {error.get('Code')}: {error.get('Message', '')}") from None
            raise

    return wrapper
