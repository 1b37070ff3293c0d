"""Record the AWS and Kubernetes calls code really makes, attributed to whoever made them.

Every botocore client goes through ``BaseClient._make_api_call`` and every
kubernetes client through ``ApiClient.call_api``, whenever and however the
client was made (cached per cold start, built by powertools, by a paginator
or by S3's multipart upload). The recorder wraps both for the duration of a
``with`` block and files each call under the *actor* set by
:meth:`Recorder.acting_as` in the calling thread (a thread started inside
the block inherits it: the agent spools alarms from one); calls with no actor (the
test's own set-up and assertions, moto's Step Functions executor in its server
threads) are counted apart and never attributed.

:func:`iam_actions` maps an AWS call to the IAM actions the service
authorizes it against (the Service Authorization Reference), and
:func:`rbac_request` a Kubernetes call to the (API group, resource, verb) the
API server authorizes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import botocore.client
from kubernetes.client import ApiClient

_actor: contextvars.ContextVar[str | None] = contextvars.ContextVar("recorded_actor", default=None)

# boto3 service names whose IAM prefix differs.
_IAM_PREFIX = {"stepfunctions": "states"}

# S3 operations are authorized as other actions (and a VersionId makes them the version's action).
_S3 = {
    "GetObject": ("s3:GetObject", "s3:GetObjectVersion"),
    "HeadObject": ("s3:GetObject", "s3:GetObjectVersion"),
    "PutObject": ("s3:PutObject", "s3:PutObject"),
    "CreateMultipartUpload": ("s3:PutObject", "s3:PutObject"),
    "UploadPart": ("s3:PutObject", "s3:PutObject"),
    "CompleteMultipartUpload": ("s3:PutObject", "s3:PutObject"),
    "AbortMultipartUpload": ("s3:AbortMultipartUpload", "s3:AbortMultipartUpload"),
    "DeleteObject": ("s3:DeleteObject", "s3:DeleteObjectVersion"),
    "ListObjectsV2": ("s3:ListBucket", "s3:ListBucket"),
    "ListObjects": ("s3:ListBucket", "s3:ListBucket"),
    "HeadBucket": ("s3:ListBucket", "s3:ListBucket"),
    "ListObjectVersions": ("s3:ListBucketVersions", "s3:ListBucketVersions"),
    "ListParts": ("s3:ListMultipartUploadParts", "s3:ListMultipartUploadParts"),
}
# S3 authorizes GetObjectAttributes as the object read plus the attributes read (their Version
# counterparts on a versioned bucket, which the stand-in does not tell apart).
_S3_PAIRS = {"GetObjectAttributes": ({"s3:GetObject", "s3:GetObjectAttributes"},
                                     {"s3:GetObjectVersion", "s3:GetObjectVersionAttributes"})}  # fmt: skip
# TransactWriteItems has no action of its own: each item is authorized as its own write.
_TRANSACT_ITEM = {"Put": "dynamodb:PutItem", "Update": "dynamodb:UpdateItem", "Delete": "dynamodb:DeleteItem",
                  "ConditionCheck": "dynamodb:ConditionCheckItem"}  # fmt: skip
# Calls IAM never authorizes.
_UNAUTHORIZED = {("sts", "GetCallerIdentity")}


@dataclass(frozen=True)
class AwsCall:
    service: str
    operation: str
    params: dict[str, Any] = field(compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class KubeCall:
    method: str
    path: str
    query: tuple[tuple[str, str], ...] = ()


@dataclass
class Recorder:
    """What each actor called, while installed (``with Recorder() as rec:``)."""

    aws: dict[str, list[AwsCall]] = field(default_factory=lambda: defaultdict(list))
    kube: dict[str, list[KubeCall]] = field(default_factory=lambda: defaultdict(list))
    unattributed: int = 0
    scenarios: dict[str, str] = field(default_factory=dict)
    """What the caller ran while recording, and how each ended (for its report)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _undo: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> Recorder:
        recorder = self
        original_aws = botocore.client.BaseClient._make_api_call  # type: ignore[attr-defined]  # private, so botocore-stubs leave it out
        original_kube = ApiClient.call_api

        @functools.wraps(original_aws)
        def make_api_call(client: Any, operation_name: str, api_params: dict[str, Any]) -> Any:
            recorder._file("aws", AwsCall(client.meta.service_model.service_name, operation_name, dict(api_params)))
            return original_aws(client, operation_name, api_params)

        @functools.wraps(original_kube)
        def call_api(api: Any, resource_path: str, method: str, path_params: Any = None, query_params: Any = None,
                     *args: Any, **kwargs: Any) -> Any:  # fmt: skip
            path = resource_path
            for key, value in dict(path_params or {}).items():
                path = path.replace("{" + key + "}", str(value))
            query = tuple((str(k), str(v)) for k, v in (query_params or []))
            recorder._file("kube", KubeCall(method.upper(), path, query))
            return original_kube(api, resource_path, method, path_params, query_params, *args, **kwargs)

        original_start = threading.Thread.start

        @functools.wraps(original_start)
        def start(thread: threading.Thread) -> None:
            actor = _actor.get()
            if actor is not None:
                run = thread.run

                def run_as_actor() -> None:
                    with recorder.acting_as(actor):
                        run()

                thread.run = run_as_actor  # type: ignore[method-assign]
            original_start(thread)

        patches = [
            (botocore.client.BaseClient, "_make_api_call", make_api_call, original_aws),
            (ApiClient, "call_api", call_api, original_kube),
            (threading.Thread, "start", start, original_start),
        ]
        for owner, name, patched, _ in patches:
            setattr(owner, name, patched)

        def restore() -> None:
            for owner, name, _, original in patches:
                setattr(owner, name, original)

        self._undo.callback(restore)
        return self

    def __exit__(self, *exc: object) -> None:
        self._undo.close()

    def _file(self, kind: str, call: AwsCall | KubeCall) -> None:
        actor = _actor.get()
        with self._lock:
            if actor is None:
                self.unattributed += 1
            elif isinstance(call, AwsCall):
                self.aws[actor].append(call)
            else:
                self.kube[actor].append(call)

    @staticmethod
    @contextlib.contextmanager
    def acting_as(actor: str) -> Iterator[None]:
        """Attribute the calls this thread makes inside the block to ``actor``."""
        token = _actor.set(actor)
        try:
            yield
        finally:
            _actor.reset(token)

    @classmethod
    def attributing(cls, actor: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` wrapped so that the calls it makes are ``actor``'s (in whichever thread it runs)."""

        @functools.wraps(function)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with cls.acting_as(actor):
                return function(*args, **kwargs)

        return wrapped


def iam_actions(call: AwsCall) -> set[str]:
    """The IAM actions the service authorizes ``call`` against (none for calls IAM never authorizes)."""
    if (call.service, call.operation) in _UNAUTHORIZED:
        return set()
    if call.service == "s3" and call.operation in _S3_PAIRS:
        plain_pair, versioned_pair = _S3_PAIRS[call.operation]
        return set(versioned_pair if call.params.get("VersionId") else plain_pair)
    if call.service == "s3":
        plain, versioned = _S3[call.operation]
        return {versioned if call.params.get("VersionId") else plain}
    if call.service == "dynamodb" and call.operation == "TransactWriteItems":
        return {_TRANSACT_ITEM[kind] for item in call.params["TransactItems"] for kind in item}
    return {f"{_IAM_PREFIX.get(call.service, call.service)}:{call.operation}"}


def dynamodb_resource(call: AwsCall) -> list[tuple[str, str | None]]:
    """The (table, index) pairs a DynamoDB call reads or writes."""
    if call.operation == "TransactWriteItems":
        return [(part["TableName"], None) for item in call.params["TransactItems"] for part in item.values()]
    return [(call.params["TableName"], call.params.get("IndexName"))]


_CORE = re.compile(r"^/api/v1/(?:namespaces/[^/]+/)?(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$")
_GROUP = re.compile(
    r"^/apis/(?P<group>[^/]+)/[^/]+/(?:namespaces/[^/]+/)?(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$"
)


def rbac_request(call: KubeCall) -> tuple[str, str, str]:
    """(API group, resource[/subresource], verb) of a Kubernetes request, as the API server authorizes it."""
    match = _CORE.match(call.path)
    group = ""
    if match is None:
        match = _GROUP.match(call.path)
        if match is None:
            raise ValueError(f"not a resource request: {call.method} {call.path}")
        group = match["group"]
    resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
    if call.method == "GET":
        verb = "get" if match["name"] else ("watch" if dict(call.query).get("watch") in ("true", "True") else "list")
    elif call.method == "DELETE" and not match["name"]:
        verb = "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[call.method]
    return group, resource, verb
