"""Gap: moto authorizes nothing by default, and its own access control is too thin for the template's policies.

moto's access control (``INITIAL_NO_AUTH_ACTION_COUNT``) evaluates every
service except S3, SQS, IAM and STS against the resource ``*``, so a grant
scoped to a table, topic, function or state machine never matches; it
evaluates conditions only for trust policies (the training and pointer
roles' ``s3:prefix`` condition would always deny); it names actions by
moto's handler (``lambda:Invoke``, ``monitoring:GetMetricData``,
``dynamodb:TransactWriteItems``), not as IAM does; and it refuses every
caller without an IAM identity, so the stack could not even be deployed.

So the stand-in enforces IAM itself, in front of moto's server (``wrap``):
a request signed with credentials that STS issued for a role (``AssumeRole``,
which is how each Lambda function and the training job get theirs) is
turned into the IAM actions, resource ARNs and condition keys AWS
authorizes it as (:func:`requests_for`) and evaluated against that role's
identity policies, inline and attached, as moto's IAM holds them
(:mod:`sdcguard.infra.local.moto_ext.iam_policy`). A refusal answers as AWS does
(``AccessDenied``/``AccessDeniedException`` naming the session, the action
and the resource). Any other credentials are the stand-in's administrator:
deploying, seeding and the tests' own set-up. Every decision about a role
is kept in ``decisions`` so tests can say what each role used and was refused.
"""

from __future__ import annotations

import collections
import io
import json
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any
from urllib.parse import parse_qs, unquote

from sdcguard.infra.local.moto_ext.iam_policy import ContextValue, Request, evaluate

ACCOUNT = "123456789012"  # moto's default account
# Signing names whose IAM action prefix or botocore service name differs.
_IAM_PREFIX = {"monitoring": "cloudwatch"}
_BOTOCORE_NAME = {"states": "stepfunctions", "monitoring": "cloudwatch", "email": "ses"}


class _Settings:
    """Whether requests by roles are evaluated (the stand-in turns it on at start)."""

    enabled: bool = False


settings = _Settings()


@dataclass(frozen=True)
class Decision:
    """One authorization decision about a role's request."""

    role: str
    """The role's name."""
    action: str
    resource: str
    allowed: bool
    reason: str


decisions: collections.deque[Decision] = collections.deque(maxlen=200_000)
_decisions_lock = threading.Lock()


def record(decision: Decision) -> None:
    """Keep ``decision`` (the log is bounded; the oldest go first)."""
    with _decisions_lock:
        decisions.append(decision)


def snapshot() -> list[Decision]:
    """The decisions kept so far, oldest first."""
    with _decisions_lock:
        return list(decisions)


# -- who is calling -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """An assumed-role session: the role's name and ARN and the session's ARN (as AWS names it in refusals)."""

    role_name: str
    role_arn: str
    session_arn: str


def _credential(environ: dict[str, Any], query: dict[str, list[str]]) -> tuple[str, str, str] | None:
    """(access key id, region, signing service) of a SigV4-signed request, else None."""
    header = str(environ.get("HTTP_AUTHORIZATION") or "")
    scope = ""
    if "Credential=" in header:
        scope = header.partition("Credential=")[2].partition(",")[0]
    elif query.get("X-Amz-Credential"):
        scope = query["X-Amz-Credential"][0]
    parts = scope.strip().split("/")
    if len(parts) != 5:
        return None
    return parts[0], parts[2], parts[3]


def caller_for(access_key_id: str) -> Caller | None:
    """The assumed-role session that ``access_key_id`` belongs to; None for any other key (the administrator)."""
    from moto.sts.models import sts_backends

    for assumed in sts_backends[ACCOUNT]["aws"].assumed_roles:
        if assumed.access_key_id == access_key_id:
            name = assumed.role_arn.split("/")[-1]
            return Caller(name, assumed.role_arn, f"arn:aws:sts::{ACCOUNT}:assumed-role/{name}/{assumed.session_name}")
    return None


def role_policies(role_arn: str) -> list[Any]:
    """The identity policies of the role (inline documents and the default version of each attached policy)."""
    from moto.iam.models import iam_backends

    backend = iam_backends[ACCOUNT]["aws"]
    try:
        role = backend.get_role_by_arn(role_arn)
    except Exception:
        return []
    policies: list[Any] = list(role.policies.values())
    for managed in role.managed_policies.values():
        policies += [v.document for v in managed.versions if v.is_default]
    return policies


def assume(role_arn: str, session_name: str) -> dict[str, str]:
    """Temporary credentials for ``role_arn`` (``AWS_ACCESS_KEY_ID``, ``..._SECRET_...``, ``AWS_SESSION_TOKEN``).

    Raises ``LookupError`` when moto's IAM has no such role (Lambda refuses
    such a function on AWS).
    """
    from moto.iam.models import iam_backends
    from moto.sts.models import sts_backends

    try:
        iam_backends[ACCOUNT]["aws"].get_role_by_arn(role_arn)
    except Exception as exc:
        raise LookupError(f"the role {role_arn} does not exist") from exc
    session = re.sub(r"[^\w+=,.@-]", "-", session_name)[:64] or "session"
    assumed = sts_backends[ACCOUNT]["aws"].assume_role(
        region_name="us-east-1", role_session_name=session, role_arn=role_arn, policy="",
        duration=12 * 3600, external_id="",
    )  # fmt: skip
    return {
        "AWS_ACCESS_KEY_ID": assumed.access_key_id,
        "AWS_SECRET_ACCESS_KEY": assumed.secret_access_key,
        "AWS_SESSION_TOKEN": assumed.session_token,
    }


# -- what the request is --------------------------------------------------------------------------


@dataclass
class Call:
    """One API call as the server received it."""

    service: str  # the signing name (dynamodb, states, s3, monitoring, ...)
    operation: str
    params: dict[str, Any]
    region: str


@cache
def _service_model(signing_name: str) -> Any:
    import botocore.session

    return botocore.session.get_session().get_service_model(_BOTOCORE_NAME.get(signing_name, signing_name))


@cache
def _rest_routes(signing_name: str) -> list[tuple[str, re.Pattern[str], dict[str, str | None], int, str]]:
    """(method, path pattern, required query, specificity, operation) for each operation of a REST service."""
    model = _service_model(signing_name)
    routes = []
    for name in model.operation_names:
        http = model.operation_model(name).http
        path, _, query = str(http["requestUri"]).partition("?")
        regex = re.sub(
            r"\\\{(\w+)(\\\+)?\\\}",
            lambda m: f"(?P<{m.group(1)}>{'.+' if m.group(2) else '[^/]+'})",
            re.escape(path.rstrip("/") or "/"),
        )
        required: dict[str, str | None] = {}
        for item in filter(None, query.split("&")):
            key, eq, value = item.partition("=")
            required[key] = value if eq else None
        literal = len(re.sub(r"\{[^}]*\}", "", path))
        routes.append((str(http["method"]), re.compile(f"^{regex}/?$"), required, len(required) * 1000 + literal, name))
    return routes


def _rest_operation(signing_name: str, method: str, path: str, query: dict[str, list[str]]) -> tuple[str, dict[str, Any]]:
    best: tuple[int, str, dict[str, Any]] | None = None
    for route_method, pattern, required, score, name in _rest_routes(signing_name):
        if route_method != method:
            continue
        match = pattern.match(path)
        if match is None:
            continue
        if any(k not in query or (v is not None and query[k][0] != v) for k, v in required.items()):
            continue
        if best is None or score > best[0]:
            best = (score, name, {k: unquote(v) for k, v in match.groupdict().items()})
    if best is None:
        return f"{method} {path}", {}
    return best[1], best[2]


def parse_call(environ: dict[str, Any], body: bytes, signing_name: str, region: str) -> Call:
    """The operation and parameters of a request, read as the service's protocol writes them."""
    path = str(environ.get("PATH_INFO") or "/")
    query = parse_qs(str(environ.get("QUERY_STRING") or ""), keep_blank_values=True)
    target = str(environ.get("HTTP_X_AMZ_TARGET") or "")
    params: dict[str, Any] = {}
    if target:
        operation = target.rpartition(".")[2]
        try:
            params = json.loads(body or b"{}")
        except ValueError:
            params = {}
    elif "/operation/" in path:  # Smithy RPC v2 (CloudWatch): the body is CBOR; no parameter is needed
        operation = path.rpartition("/operation/")[2].strip("/")
    elif signing_name in ("s3", "lambda", "eks"):
        operation, params = _rest_operation(signing_name, str(environ.get("REQUEST_METHOD", "GET")), path, query)
        params.update({k: v[0] for k, v in query.items()})
    else:  # the query protocol: Action=... in the form body (or the query string)
        form = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True) if body else {}
        form = {**query, **form}
        operation = (form.get("Action") or [""])[0]
        params = {k: v[0] for k, v in form.items()}
    return Call(signing_name, operation, params, region)


# -- what IAM authorizes it as --------------------------------------------------------------------


def _arn(service: str, region: str, resource: str) -> str:
    return f"arn:aws:{service}:{region}:{ACCOUNT}:{resource}"


def _dynamodb(call: Call) -> Iterator[Request]:
    p, r = call.params, call.region

    def table(name: str) -> str:
        return name if name.startswith("arn:") else _arn("dynamodb", r, f"table/{name}")

    def context(request: dict[str, Any]) -> dict[str, ContextValue]:
        out: dict[str, ContextValue] = {}
        names = request.get("ExpressionAttributeNames") or {}
        if request.get("ProjectionExpression"):
            out["dynamodb:attributes"] = [
                names.get(part.strip(), part.strip()).split(".")[0].split("[")[0]
                for part in str(request["ProjectionExpression"]).split(",")
            ]
        elif request.get("AttributesToGet"):
            out["dynamodb:attributes"] = list(request["AttributesToGet"])
        if request.get("Select"):
            out["dynamodb:select"] = str(request["Select"])
        if request.get("ReturnValues"):
            out["dynamodb:returnvalues"] = str(request["ReturnValues"])
        return out

    op = call.operation
    if op in ("TransactWriteItems", "TransactGetItems"):
        kinds = {"Put": "PutItem", "Update": "UpdateItem", "Delete": "DeleteItem", "ConditionCheck": "ConditionCheckItem",
                 "Get": "GetItem"}  # fmt: skip
        for item in p.get("TransactItems") or []:
            for kind, request in item.items():
                yield Request(f"dynamodb:{kinds.get(kind, kind)}", table(request.get("TableName", "")), context(request))
    elif op in ("BatchGetItem", "BatchWriteItem"):
        for name, request in (p.get("RequestItems") or {}).items():
            yield Request(f"dynamodb:{op}", table(name), context(request if isinstance(request, dict) else {}))
    elif "TableName" in p or "TableArn" in p:
        resource = table(str(p.get("TableName") or p.get("TableArn")))
        if op in ("Query", "Scan") and p.get("IndexName"):
            resource += f"/index/{p['IndexName']}"
        yield Request(f"dynamodb:{op}", resource, context(p))
    else:
        yield Request(f"dynamodb:{op}", "*")


_S3_ACTIONS = {
    "HeadObject": ("GetObject", "GetObjectVersion"),
    "GetObject": ("GetObject", "GetObjectVersion"),
    "PutObject": ("PutObject", "PutObject"),
    "CopyObject": ("PutObject", "PutObject"),
    "CreateMultipartUpload": ("PutObject", "PutObject"),
    "UploadPart": ("PutObject", "PutObject"),
    "UploadPartCopy": ("PutObject", "PutObject"),
    "CompleteMultipartUpload": ("PutObject", "PutObject"),
    "AbortMultipartUpload": ("AbortMultipartUpload", "AbortMultipartUpload"),
    "DeleteObject": ("DeleteObject", "DeleteObjectVersion"),
    "DeleteObjects": ("DeleteObject", "DeleteObject"),
    "ListParts": ("ListMultipartUploadParts", "ListMultipartUploadParts"),
    "ListObjects": ("ListBucket", "ListBucket"),
    "ListObjectsV2": ("ListBucket", "ListBucket"),
    "HeadBucket": ("ListBucket", "ListBucket"),
    "ListObjectVersions": ("ListBucketVersions", "ListBucketVersions"),
    "ListMultipartUploads": ("ListBucketMultipartUploads", "ListBucketMultipartUploads"),
    "GetObjectTagging": ("GetObjectTagging", "GetObjectVersionTagging"),
    "PutObjectTagging": ("PutObjectTagging", "PutObjectVersionTagging"),
    "ListBuckets": ("ListAllMyBuckets", "ListAllMyBuckets"),
}


def _s3(call: Call) -> Iterator[Request]:
    p = call.params
    bucket, key = p.get("Bucket"), p.get("Key")
    versioned = bool(p.get("versionId"))
    if bucket is None:
        resource = "*"
    elif key is not None and call.operation != "DeleteObjects":
        resource = f"arn:aws:s3:::{bucket}/{key}"
    elif call.operation == "DeleteObjects":
        resource = f"arn:aws:s3:::{bucket}/*"  # the keys are in the body; judged as the bucket's objects
    else:
        resource = f"arn:aws:s3:::{bucket}"
    context: dict[str, ContextValue] = {}
    if call.operation in ("ListObjects", "ListObjectsV2", "ListObjectVersions"):
        context["s3:prefix"] = str(p.get("prefix", ""))
        if "delimiter" in p:
            context["s3:delimiter"] = str(p["delimiter"])
        if "max-keys" in p:
            context["s3:max-keys"] = str(p["max-keys"])
    if versioned:
        context["s3:versionid"] = str(p["versionId"])
    if call.operation == "GetObjectAttributes":
        pair = ("GetObjectVersion", "GetObjectVersionAttributes") if versioned else ("GetObject", "GetObjectAttributes")
        for action in pair:
            yield Request(f"s3:{action}", resource, context)
        return
    plain, version = _S3_ACTIONS.get(call.operation, (call.operation, call.operation))
    yield Request(f"s3:{version if versioned else plain}", resource, context)
    if call.operation in ("CopyObject", "UploadPartCopy"):
        source = unquote(str(p.get("x-amz-copy-source") or "")).lstrip("/").partition("?")[0]
        if source:
            yield Request("s3:GetObject", f"arn:aws:s3:::{source}")


def _states(call: Call) -> Iterator[Request]:
    p = call.params
    arn = p.get("executionArn") or p.get("stateMachineArn") or p.get("mapRunArn") or "*"
    yield Request(f"states:{call.operation}", str(arn))


def _lambda(call: Call) -> Iterator[Request]:
    name = str(call.params.get("FunctionName") or "")
    action = {"Invoke": "InvokeFunction", "InvokeAsync": "InvokeFunction"}.get(call.operation, call.operation)
    if not name:
        yield Request(f"lambda:{action}", "*")
        return
    if name.startswith("arn:"):
        resource = name
    else:
        resource = _arn("lambda", call.region, f"function:{name}")
    qualifier = call.params.get("Qualifier")
    if qualifier:
        resource += f":{qualifier}"
    yield Request(f"lambda:{action}", resource)


def _events(call: Call) -> Iterator[Request]:
    def bus(name: str) -> str:
        return name if name.startswith("arn:") else _arn("events", call.region, f"event-bus/{name}")

    if call.operation == "PutEvents":
        for entry in call.params.get("Entries") or [{}]:
            context: dict[str, ContextValue] = {}
            if entry.get("Source"):
                context["events:source"] = str(entry["Source"])
            if entry.get("DetailType"):
                context["events:detail-type"] = str(entry["DetailType"])
            yield Request("events:PutEvents", bus(str(entry.get("EventBusName") or "default")), context)
        return
    name = call.params.get("EventBusName")
    yield Request(f"events:{call.operation}", bus(str(name)) if name else "*")


def _sagemaker(call: Call) -> Iterator[Request]:
    name = call.params.get("ClusterName")
    if name:
        resource = str(name) if str(name).startswith("arn:") else _arn("sagemaker", call.region, f"cluster/{name}")
    else:
        resource = "*"
    yield Request(f"sagemaker:{call.operation}", resource)


def _eks(call: Call) -> Iterator[Request]:
    name = call.params.get("name") or call.params.get("clusterName")
    yield Request(f"eks:{call.operation}", _arn("eks", call.region, f"cluster/{name}") if name else "*")


def _sns(call: Call) -> Iterator[Request]:
    arn = call.params.get("TopicArn") or call.params.get("TargetArn") or "*"
    yield Request(f"sns:{call.operation}", str(arn))


def _sqs(call: Call) -> Iterator[Request]:
    url = str(call.params.get("QueueUrl") or "")
    name = url.rstrip("/").rpartition("/")[2] if url else call.params.get("QueueName")
    yield Request(f"sqs:{call.operation}", _arn("sqs", call.region, str(name)) if name else "*")


def _sts(call: Call) -> Iterator[Request]:
    yield Request(f"sts:{call.operation}", str(call.params.get("RoleArn") or "*"))


def _default(call: Call) -> Iterator[Request]:
    yield Request(f"{_IAM_PREFIX.get(call.service, call.service)}:{call.operation}", "*")


_BY_SERVICE: dict[str, Callable[[Call], Iterator[Request]]] = {
    "dynamodb": _dynamodb, "s3": _s3, "states": _states, "lambda": _lambda, "events": _events,
    "sagemaker": _sagemaker, "eks": _eks, "sns": _sns, "sqs": _sqs, "sts": _sts,
}  # fmt: skip


def requests_for(call: Call, caller: Caller) -> list[Request]:
    """The (action, resource, context) requests IAM authorizes ``call`` as, with the global context keys."""
    found = list(_BY_SERVICE.get(call.service, _default)(call))
    common: dict[str, ContextValue] = {
        "aws:principalarn": caller.role_arn,
        "aws:principalaccount": ACCOUNT,
        "aws:requestedregion": call.region,
        "aws:principaltype": "AssumedRole",
    }
    return [Request(r.action, r.resource, {**common, **r.context}) for r in found]


# -- the server side ------------------------------------------------------------------------------

# Calls IAM never authorizes.
_ALWAYS = {("sts", "GetCallerIdentity")}


def authorize(environ: dict[str, Any], body: bytes) -> tuple[Call, Caller, str] | None:
    """None when the request may proceed; else (the call, the caller, AWS's refusal message)."""
    query = parse_qs(str(environ.get("QUERY_STRING") or ""), keep_blank_values=True)
    credential = _credential(environ, query)
    if credential is None:
        return None
    caller = caller_for(credential[0])
    if caller is None:
        return None  # the administrator
    call = parse_call(environ, body, credential[2], credential[1])
    if (call.service, call.operation) in _ALWAYS:
        return None
    policies = role_policies(caller.role_arn)
    for request in requests_for(call, caller):
        verdict = evaluate(policies, request)
        record(Decision(caller.role_name, request.action, request.resource, verdict.allowed, verdict.reason))
        if not verdict.allowed:
            message = (
                f"User: {caller.session_arn} is not authorized to perform: {request.action} on resource: "
                f"{request.resource} {verdict.reason}"
            )
            return call, caller, message
    return None


def _protocol(signing_name: str) -> str:
    if signing_name == "monitoring":
        return "smithy-rpc-v2-cbor"
    try:
        return str(_service_model(signing_name).protocol)
    except Exception:
        return "json"


def _cbor_text(text: str) -> bytes:
    data = text.encode()
    n = len(data)
    head = bytes([0x60 | n]) if n < 24 else bytes([0x78, n]) if n < 256 else bytes([0x79]) + n.to_bytes(2, "big")
    return head + data


def refusal(call: Call, message: str) -> tuple[str, list[tuple[str, str]], bytes]:
    """(status, headers, body) of AWS's AccessDenied answer in the service's protocol."""
    protocol = _protocol(call.service)
    if protocol == "json":
        body = json.dumps({"__type": "AccessDeniedException", "message": message}).encode()
        return "400 Bad Request", [("Content-Type", "application/x-amz-json-1.0")], body
    if protocol == "rest-json":
        body = json.dumps({"message": message, "Message": message}).encode()
        headers = [("Content-Type", "application/json"), ("x-amzn-ErrorType", "AccessDeniedException")]
        return "403 Forbidden", headers, body
    if protocol == "smithy-rpc-v2-cbor":
        body = bytes([0xA2]) + _cbor_text("__type") + _cbor_text("AccessDenied") + _cbor_text("message") + _cbor_text(message)
        return "403 Forbidden", [("Content-Type", "application/cbor"), ("smithy-protocol", "rpc-v2-cbor")], body
    escaped = message.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    if protocol == "rest-xml":
        text = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code><Message>{escaped}</Message></Error>"
    else:
        text = (
            f"<ErrorResponse><Error><Type>Sender</Type><Code>AccessDenied</Code><Message>{escaped}</Message></Error>"
            "<RequestId>stand-in</RequestId></ErrorResponse>"
        )
    return "403 Forbidden", [("Content-Type", "text/xml")], text.encode()


def wrap(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """A WSGI app that authorizes each request to ``app`` while ``settings.enabled``."""

    def enforcing(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not settings.enabled or (not environ.get("HTTP_AUTHORIZATION") and "X-Amz-Credential" not in str(
            environ.get("QUERY_STRING") or ""
        )):
            return app(environ, start_response)
        body = b""
        service = str(environ.get("HTTP_AUTHORIZATION") or "").partition("Credential=")[2].split("/")[3:4]
        # S3 bodies (checkpoints, possibly chunked) are never needed to authorize: leave the stream alone.
        if service != ["s3"]:
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(length) if length > 0 else b""
            environ["wsgi.input"] = io.BytesIO(body)
        refused = authorize(environ, body)
        if refused is None:
            return app(environ, start_response)
        call, _caller, message = refused
        status, headers, payload = refusal(call, message)
        start_response(status, [*headers, ("Content-Length", str(len(payload)))])
        return [payload]

    return enforcing
