"""The local EKS API server: Kubernetes REST over HTTPS for nodes, pods and Kubeflow PyTorchJobs.

It serves

- ``/api/v1/nodes[/NAME]``: get, list, create, replace (PUT), patch, delete;
- ``/api/v1/namespaces[/NAME]``: get, list, create, delete;
- ``/api/v1/pods`` and ``/api/v1/namespaces/NS/pods[/NAME]``: get, list, create, replace, patch, delete;
- ``/apis/kubeflow.org/v1[/namespaces/NS]/pytorchjobs[/NAME]``: the same verbs;
- ``/version`` and ``/healthz`` without a token;

lists honour ``labelSelector``, ``fieldSelector``, ``limit`` and ``continue``;
writes honour ``dryRun=All``. Every Kubernetes request must carry an EKS
bearer token (see ``auth``); failures are Kubernetes ``Status`` bodies.

Beside the API, on paths no Kubernetes client uses and without a token:
``GET|POST|DELETE /_standin/faults`` (the fault knobs, see ``faults``) and
``POST /_standin/replace-node`` (what a HyperPod replacement does to the
cluster, see ``EksApiServer.replace_node``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from infra.local.eks import discovery, rbac, tables, watch
from infra.local.eks import patch as patches
from infra.local.eks.auth import TokenRejected, verify_authorization
from infra.local.eks.errors import ApiError, not_found
from infra.local.eks.faults import Faults
from infra.local.eks.hyperpod_node import (
    CLUSTER_NAME_LABEL,
    INSTANCE_GROUP_LABEL,
    INSTANCE_TYPE_LABEL,
    hyperpod_node,
    node_name,
)
from infra.local.eks.objects import ObjectStore
from infra.local.eks.resources import (
    CLUSTER_ROLE_BINDINGS,
    CLUSTER_ROLES,
    NAMESPACES,
    NODES,
    PODS,
    RESOURCES,
    SELF_SUBJECT_ACCESS_REVIEWS,
    Resource,
)
from infra.local.eks.selectors import parse_field_selector, parse_label_selector
from infra.local.eks.tls import issue_server_certificate

log = logging.getLogger(__name__)

DEFAULT_NAMESPACES = ("default", "kube-system", "kubeflow")
_CORE = "|".join(sorted(r.plural for r in RESOURCES.values() if not r.group))
_CORE_NAMESPACED = "|".join(sorted(r.plural for r in RESOURCES.values() if not r.group and r.namespaced))
_GROUPS = "|".join(sorted({re.escape(r.group) for r in RESOURCES.values() if r.group}))
_SUBRESOURCES = "|".join(sorted({sub for _parent, sub, *_rest in discovery.SUBRESOURCES}))
_ROUTES = (
    re.compile(
        rf"^/api/(?P<version>v1)/namespaces/(?P<ns>[^/]+)/(?P<plural>{_CORE_NAMESPACED})"
        rf"(?:/(?P<name>[^/]+)(?:/(?P<sub>{_SUBRESOURCES}))?)?$"
    ),
    re.compile(rf"^/api/(?P<version>v1)/(?P<plural>{_CORE})(?:/(?P<name>[^/]+))?$"),
    re.compile(
        rf"^/apis/(?P<group>{_GROUPS})/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
        r"(?:/(?P<name>[^/]+))?$"
    ),
    re.compile(rf"^/apis/(?P<group>{_GROUPS})/(?P<version>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$"),
)
_DISCOVERY = re.compile(r"^/(?:api(?:/(?P<core_version>[^/]+))?|apis(?:/(?P<group>[^/]+)(?:/(?P<version>[^/]+))?)?)$")
_ANONYMOUS = ("/version", "/healthz", "/livez", "/readyz")
_MAX_BODY = 3 * 1024 * 1024  # the API server's own request size limit


@dataclass(frozen=True)
class RequestRecord:
    """One request the server answered (kept for tests and the drill to inspect)."""

    method: str
    path: str
    resource: str
    name: str | None
    status: int


@dataclass(frozen=True)
class _Target:
    resource: Resource
    namespace: str | None
    name: str | None
    subresource: str | None = None


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], api: EksApiServer, context: ssl.SSLContext) -> None:
        super().__init__(address, _Handler)
        self.api = api
        self.context = context
        self._connections: set[Any] = set()
        self._connections_lock = threading.Lock()

    def close_connections(self) -> None:
        """Hang up every kept-alive connection, so nothing is served after a stop."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up mid-request are normal; log them quietly instead of printing tracebacks.
        log.debug("error serving %s", client_address, exc_info=True)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake runs in the connection's own thread, so a slow or
        # broken client never stalls the accept loop.
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake with %s failed: %s", client_address, exc)
            return
        with self._connections_lock:
            self._connections.add(tls)
        try:
            super().finish_request(tls, client_address)
        finally:
            with self._connections_lock:
                self._connections.discard(tls)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections, as against a real endpoint
    # Headers and body leave in separate writes; with Nagle on, each kept-alive
    # request would wait ~40 ms for the client's delayed ACK.
    disable_nagle_algorithm = True
    timeout = 300  # idle kept-alive connections are dropped after this many seconds
    server: _HttpServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _send(
        self,
        status: int,
        body: Any,
        extra_headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        # Recorded before the answer leaves, so whoever reads the log after a response sees it.
        method, path, resource, name = self._current
        self.server.api._record(RequestRecord(method, path, resource, name, status))
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (extra_headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> None:
        # Read the whole body before anything can fail, so a refused request
        # never leaves bytes on a kept-alive connection.
        self._raw: bytes | None = None
        length = self.headers.get("Content-Length")
        if length is None:
            return
        try:
            size = int(length)
        except ValueError:
            self.close_connection = True
            raise ApiError(400, f"Content-Length {length!r} is not a number") from None
        if size > _MAX_BODY:
            self.close_connection = True
            raise ApiError(413, "the request body is too large", reason="RequestEntityTooLarge")
        self._raw = self.rfile.read(size)

    def _body(self) -> Any:
        if self._raw is None:
            raise ApiError(400, "the request has no body (Content-Length is missing)")
        try:
            return json.loads(self._raw or b"null")
        except ValueError as exc:
            raise ApiError(400, f"couldn't decode the request body as JSON: {exc}") from exc

    def _dispatch(self, method: str) -> None:
        api = self.server.api
        split = urlsplit(self.path)
        path = split.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        self._current: tuple[str, str, str, str | None] = (method, path, "", None)
        try:
            self._read_body()
            if path.startswith("/_standin/"):
                status, body = api._standin(method, path, self._body() if method == "POST" else None)
                self._send(status, body)
                return
            if path in _ANONYMOUS:
                self._send(200, _anonymous(path))
                return
            discovered = _DISCOVERY.match(path)
            if discovered:
                # Discovery is open to every authenticated user (system:discovery), as on a real cluster.
                self._identify()
                if method != "GET":
                    raise ApiError(405, f"{method} is not supported on {path}")
                body, content_type = _discovery_document(
                    discovered, self.headers.get("Accept"), self.headers.get("Host") or ""
                )
                self._send(200, body, content_type=content_type)
                return
            target = _route(path)
            resource_name, name = target.resource.plural, target.name
            if target.subresource:
                resource_name = f"{resource_name}/{target.subresource}"
            self._current = (method, path, resource_name, name)
            identity = self._identify()
            verb = _verb(method, target, query)
            if target.resource is not SELF_SUBJECT_ACCESS_REVIEWS and not rbac.allowed(
                api.store, identity, verb, target.resource.group, resource_name, name
            ):
                raise rbac.forbidden(
                    identity, verb, target.resource.group, resource_name, target.namespace, name
                )
            # Faults act only on authenticated requests, so a refused one never uses up a named failure.
            verdict = api.faults.decide(method, resource_name, name)
            if verdict.delay_seconds:
                time.sleep(verdict.delay_seconds)
            if verdict.fail_status is not None:
                raise ApiError(verdict.fail_status, f"injected fault ({verdict.why}) on {method} {path}")
            if verb == "watch":
                self._stream(target, query)
                return
            status, body = api._handle(method, target, query, self, identity)
            table = tables.table_version(self.headers.get("Accept")) if method == "GET" else None
            if table is not None and status == 200:
                body = _as_table(target.resource, body, table, query.get("includeObject", "Metadata"))
                self._send(status, body, content_type=f"application/json;as=Table;v={table};g=meta.k8s.io")
                return
            self._send(status, body)
        except ApiError as exc:
            headers = {"Retry-After": "1"} if exc.code == 429 else None
            self._send(exc.code, exc.body(), headers)
        except (ConnectionError, ssl.SSLError) as exc:
            log.debug("client went away: %s", exc)
        except Exception as exc:  # a bug here must answer 500, never hang the client
            log.exception("unexpected error serving %s %s", method, path)
            self._send(500, ApiError(500, f"internal error: {exc}").body())


    def _stream(self, target: _Target, query: dict[str, str]) -> None:
        """Answer a watch: chunked watch events, one JSON object a line, until the client leaves or the server stops."""
        api = self.server.api
        if target.name is not None or target.resource.plural not in discovery.watchable():
            raise ApiError(405, f"watch is not supported on {self.path}")
        predicates = (
            parse_label_selector(query.get("labelSelector")),
            parse_field_selector(query.get("fieldSelector")),
        )
        timeout: float | None = None
        if query.get("timeoutSeconds"):
            try:
                timeout = float(query["timeoutSeconds"])
            except ValueError as exc:
                raise ApiError(400, f"invalid timeoutSeconds {query['timeoutSeconds']!r}") from exc
        table = tables.table_version(self.headers.get("Accept"))
        include_object = query.get("includeObject", "Metadata")
        if include_object not in ("None", "Metadata", "Object"):
            raise ApiError(400, f"includeObject must be None, Metadata or Object, got {include_object!r}")

        def poll() -> list[dict[str, Any]]:
            return api.store.list(target.resource, target.namespace, *predicates)[0]

        method, path, resource, name = self._current
        api._record(RequestRecord(method, path, resource, name, 200))
        self.send_response(200)
        content_type = f"application/json;as=Table;v={table};g=meta.k8s.io" if table else "application/json"
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for kind, obj in watch.events(
            poll, api._stopping, resource_version=query.get("resourceVersion"), timeout_seconds=timeout
        ):
            body: Any = obj
            if table is not None:
                version = obj["metadata"].get("resourceVersion", "")
                body = tables.to_table(
                    target.resource, [obj], {"resourceVersion": version}, version=table, include_object=include_object
                )
            line = json.dumps({"type": kind, "object": body}).encode("utf-8") + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _identify(self) -> rbac.Identity:
        """Who the request is from: its token's caller through the access entries, then any impersonation."""
        try:
            caller = verify_authorization(self.headers.get("Authorization"))
        except TokenRejected as exc:
            raise ApiError(401, f"Unauthorized: {exc}") from exc
        return rbac.impersonate(
            self.server.api.access.identity(caller),
            self.headers.get("Impersonate-User"),
            self.headers.get_all("Impersonate-Group") or [],
        )


def _verb(method: str, target: _Target, query: dict[str, str]) -> str:
    """The RBAC verb of a request, as the API server derives it."""
    if method == "GET":
        if target.name is not None:
            return "get"
        return "watch" if query.get("watch") in ("true", "1") else "list"
    if method == "DELETE" and target.name is None:
        return "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())


def _discovery_document(match: re.Match[str], accept: str | None, host: str) -> tuple[Any, str]:
    """The discovery answer for a matched discovery path and its Content-Type; raises ApiError 404 for what is not served."""
    core_version, group, version = match.group("core_version"), match.group("group"), match.group("version")
    if core_version is None and group is None:
        aggregated = discovery.aggregated_version(accept)
        core = match.group(0) == "/api"
        if aggregated is not None:
            return discovery.aggregated(core, aggregated), discovery.aggregated_content_type(aggregated)
        return (discovery.api_versions(host) if core else discovery.api_group_list()), "application/json"
    if core_version is not None:
        document = discovery.api_resource_list("", core_version)
    elif version is None:
        document = discovery.api_group(group)
    else:
        document = discovery.api_resource_list(group, version)
    if document is None:
        raise ApiError(404, "the server could not find the requested resource", details={})
    return document, "application/json"


def _as_table(resource: Resource, body: dict[str, Any], version: str, include_object: str) -> dict[str, Any]:
    """A GET answer (one object or a list) as a Table; raises ApiError 400 for a bad ``includeObject``."""
    if body.get("kind", "").endswith("List") and "items" in body:
        objects, metadata = body["items"], body.get("metadata", {})
    else:
        objects, metadata = [body], {"resourceVersion": body.get("metadata", {}).get("resourceVersion", "")}
    try:
        return tables.to_table(resource, objects, metadata, version=version, include_object=include_object)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


def _anonymous(path: str) -> Any:
    if path == "/version":
        return {
            "major": "1",
            "minor": "31",
            "gitVersion": "v1.31.0-eks-sdcguard-local",
            "platform": "linux/amd64",
        }
    return "ok"


def _route(path: str) -> _Target:
    for pattern in _ROUTES:
        match = pattern.match(path)
        if match:
            groups = match.groupdict()
            resource = RESOURCES.get((groups.get("group") or "", groups["plural"]))
            if resource is None or resource.version != groups["version"]:
                break
            namespace = unquote(groups["ns"]) if groups.get("ns") else None
            name = unquote(groups["name"]) if groups.get("name") else None
            if resource.namespaced and namespace is None and name is not None:
                break
            if not resource.namespaced and namespace is not None:
                break
            subresource = groups.get("sub")
            if subresource and (resource.plural, subresource) not in {
                (parent, sub) for parent, sub, *_rest in discovery.SUBRESOURCES
            }:
                break
            return _Target(resource, namespace, name, subresource)
    raise ApiError(404, "the server could not find the requested resource", details={})


class EksApiServer:
    """A Kubernetes API endpoint on loopback that stands in for an EKS cluster.

    ``start()`` binds and serves in a background thread; ``url`` and
    ``ca_data`` are what EKS ``DescribeCluster`` reports as the cluster's
    endpoint and certificate authority. ``store`` holds the objects,
    ``faults`` the fault knobs, ``requests`` the recent requests.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        access: rbac.AccessEntries | None = None,
        manifest: list[dict[str, Any]] | None = None,
    ) -> None:
        self.host = host
        self.access = access or rbac.AccessEntries()
        self._requested_port = port
        hosts = (host, "localhost") if host != "localhost" else ("localhost", "127.0.0.1")
        self._certificate = issue_server_certificate(hosts)
        self.store = ObjectStore()
        self.faults = Faults()
        self._requests: collections.deque[RequestRecord] = collections.deque(maxlen=10_000)
        self._requests_lock = threading.Lock()
        self._httpd: _HttpServer | None = None
        self._thread: threading.Thread | None = None
        # Set while stopping, so open watches end instead of outliving the server.
        self._stopping = threading.Event()
        for namespace in DEFAULT_NAMESPACES:
            self.store.create(NAMESPACES, None, {"metadata": {"name": namespace}})
        self.apply(manifest or [])

    def apply(self, documents: list[dict[str, Any]]) -> None:
        """Create or replace ClusterRoles and ClusterRoleBindings, as ``kubectl apply -f`` of an RBAC manifest does.

        Raises ValueError naming a document of any other kind (nothing is
        applied then), ApiError 422 for an invalid one.
        """
        kinds = {CLUSTER_ROLES.kind: CLUSTER_ROLES, CLUSTER_ROLE_BINDINGS.kind: CLUSTER_ROLE_BINDINGS}
        for i, document in enumerate(documents):
            if not isinstance(document, dict) or document.get("kind") not in kinds:
                kind = document.get("kind") if isinstance(document, dict) else type(document).__name__
                raise ValueError(f"document {i} is a {kind}; only ClusterRole and ClusterRoleBinding apply here")
        with self.store.transaction():
            for document in documents:
                resource = kinds[document["kind"]]
                name = str((document.get("metadata") or {}).get("name", ""))
                if self.store.exists(resource, None, name):
                    self.store.update(resource, None, name, _replacing(document))
                else:
                    self.store.create(resource, None, document)

    # lifecycle ---------------------------------------------------------------

    def start(self) -> EksApiServer:
        """Bind and start serving; returns self. Raises OSError when the port is taken, RuntimeError if started twice."""
        if self._httpd is not None:
            raise RuntimeError("the EKS API server is already running")
        httpd = _HttpServer((self.host, self._requested_port), self, self._certificate.server_context())
        self._stopping.clear()
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="eks-api-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port; a no-op when not running."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.server_close()
        httpd.close_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> EksApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound port; raises RuntimeError before start()."""
        if self._httpd is None:
            raise RuntimeError("the EKS API server is not running")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """``https://HOST:PORT``, the cluster endpoint."""
        return f"https://{self.host}:{self.port}"

    @property
    def ca_data(self) -> str:
        """Base64 of the CA's PEM, as ``certificateAuthority.data`` in DescribeCluster."""
        return self._certificate.ca_data

    @property
    def ca_pem(self) -> bytes:
        """The CA certificate in PEM."""
        return self._certificate.ca_pem

    @property
    def requests(self) -> list[RequestRecord]:
        """The most recent requests (up to 10,000), oldest first."""
        with self._requests_lock:
            return list(self._requests)

    def _record(self, record: RequestRecord) -> None:
        with self._requests_lock:
            self._requests.append(record)

    # what HyperPod does to the cluster ---------------------------------------------

    def replace_node(self, old_instance_id: str, new_instance_id: str) -> dict[str, Any]:
        """Apply a HyperPod node replacement to the cluster and return the new node.

        Node ``hyperpod-<old>`` disappears; ``hyperpod-<new>`` appears Ready
        and schedulable (no taints, health label Schedulable) with the old
        node's instance group, type, zone and cluster labels; pods bound to
        the old node are bound to the new one. Tolerates an old node that
        the cluster never had. Raises ValueError for ids that are not
        ``i-`` + 17 hex, ApiError 409 if the new node already exists.
        """
        old_name, new_name = node_name(old_instance_id), node_name(new_instance_id)
        with self.store.transaction():
            if self.store.exists(NODES, None, new_name):
                raise ApiError(409, f'nodes "{new_name}" already exists', reason="AlreadyExists")
            old: dict[str, Any] = {}
            if self.store.exists(NODES, None, old_name):
                old = self.store.delete(NODES, None, old_name)
            labels = old.get("metadata", {}).get("labels", {})
            capacity = old.get("status", {}).get("capacity", {})
            node = hyperpod_node(
                new_instance_id,
                instance_group=labels.get(INSTANCE_GROUP_LABEL, "worker-group"),
                instance_type=labels.get(INSTANCE_TYPE_LABEL, "ml.p5.48xlarge"),
                hyperpod_cluster=labels.get(CLUSTER_NAME_LABEL, ""),
                gpus=int(capacity.get("nvidia.com/gpu", 8)),
                zone=labels.get("topology.kubernetes.io/zone", "us-east-1a"),
            )
            created = self.store.create(NODES, None, node)
            bound, _ = self.store.list(PODS, None, parse_field_selector(f"spec.nodeName={old_name}"))
            for pod in bound:

                def rebind(obj: dict[str, Any]) -> dict[str, Any]:
                    obj["spec"]["nodeName"] = new_name
                    return obj

                self.store.update(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], rebind)
        log.info("replaced node %s by %s (%d pods moved)", old_name, new_name, len(bound))
        return created

    # request handling -----------------------------------------------------------------

    def _standin(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/_standin/faults":
            if method == "GET":
                return 200, self.faults.to_dict()
            if method == "DELETE":
                self.faults.clear()
                return 200, self.faults.to_dict()
            if method == "POST":
                try:
                    self.faults.apply(body)
                except ValueError as exc:
                    raise ApiError(422, f"bad fault knobs: {exc}") from exc
                return 200, self.faults.to_dict()
        elif path == "/_standin/replace-node" and method == "POST":
            if not isinstance(body, dict) or not {"old_instance_id", "new_instance_id"} <= set(body):
                raise ApiError(422, 'the body must be {"old_instance_id": ..., "new_instance_id": ...}')
            try:
                return 200, self.replace_node(str(body["old_instance_id"]), str(body["new_instance_id"]))
            except ValueError as exc:
                raise ApiError(422, str(exc)) from exc
        else:
            raise ApiError(404, f"no stand-in endpoint {path}")
        raise ApiError(405, f"{method} is not supported on {path}")

    def _handle(
        self, method: str, target: _Target, query: dict[str, str], request: _Handler, identity: rbac.Identity
    ) -> tuple[int, Any]:
        resource, namespace, name = target.resource, target.namespace, target.name
        dry_run = query.get("dryRun") == "All"
        if resource is SELF_SUBJECT_ACCESS_REVIEWS:
            if method != "POST" or name is not None:
                raise ApiError(405, f"{method} is not supported on {resource.plural}")
            return 201, rbac.access_review(self.store, identity, request._body())
        if target.subresource == "eviction":
            if method != "POST" or name is None:
                raise ApiError(405, f"{method} is not supported on pods/eviction")
            return self._evict(namespace, name, request._body(), dry_run)
        if (
            resource.namespaced
            and namespace is not None
            and method in ("POST", "PUT", "PATCH")
            and not self.store.exists(NAMESPACES, None, namespace)
        ):
            raise not_found("namespaces", namespace)
        if name is None:
            if method == "GET":
                return 200, self._list(resource, namespace, query)
            if method == "POST":
                if resource.namespaced and namespace is None:
                    raise ApiError(405, f"create {resource.plural} in a namespace")
                return 201, self.store.create(resource, namespace, request._body(), dry_run=dry_run)
            raise ApiError(405, f"{method} is not supported on a collection of {resource.plural}")
        if method == "GET":
            return 200, self.store.get(resource, namespace, name)
        if method == "PUT":
            body = request._body()
            return 200, self.store.update(resource, namespace, name, lambda _current: body, dry_run=dry_run)
        if method == "PATCH":
            content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            body = request._body()
            return 200, self.store.update(
                resource,
                namespace,
                name,
                lambda current: _apply_patch(resource, content_type, current, body),
                dry_run=dry_run,
            )
        if method == "DELETE":
            deleted = (
                self.store.get(resource, namespace, name)
                if dry_run
                else self.store.delete(resource, namespace, name)
            )
            if resource.group:
                return 200, {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": {
                        "name": name,
                        "group": resource.group,
                        "kind": resource.plural,
                        "uid": deleted["metadata"]["uid"],
                    },
                }
            return 200, deleted
        raise ApiError(405, f"{method} is not supported on {resource.plural}")

    def _evict(self, namespace: str | None, name: str, body: Any, dry_run: bool) -> tuple[int, Any]:
        """``pods/eviction``: what ``kubectl drain`` posts. Nothing guards a pod here (no PodDisruptionBudgets), so the pod goes."""
        if not isinstance(body, dict) or body.get("kind", "Eviction") != "Eviction":
            raise ApiError(400, "the body of a pods/eviction request must be an Eviction")
        meta = body.get("metadata") or {}
        if meta.get("name", name) != name:
            raise ApiError(400, f"name in URL does not match name in Eviction object: {meta.get('name')} != {name}")
        dry_run = dry_run or "All" in ((body.get("deleteOptions") or {}).get("dryRun") or [])
        if dry_run:
            self.store.get(PODS, namespace, name)
        else:
            self.store.delete(PODS, namespace, name)
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _list(self, resource: Resource, namespace: str | None, query: dict[str, str]) -> dict[str, Any]:
        items, revision = self.store.list(
            resource,
            namespace,
            parse_label_selector(query.get("labelSelector")),
            parse_field_selector(query.get("fieldSelector")),
        )
        metadata: dict[str, Any] = {"resourceVersion": revision}
        start = 0
        if query.get("continue"):
            try:
                start = int(query["continue"])
            except ValueError as exc:
                raise ApiError(400, f"invalid continue token {query['continue']!r}") from exc
        if query.get("limit"):
            try:
                limit = int(query["limit"])
            except ValueError as exc:
                raise ApiError(400, f"invalid limit {query['limit']!r}") from exc
            if limit > 0 and start + limit < len(items):
                metadata["continue"] = str(start + limit)
                metadata["remainingItemCount"] = len(items) - start - limit
                items = items[start : start + limit]
            else:
                items = items[start:]
        else:
            items = items[start:]
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": metadata,
            "items": items,
        }


def _replacing(document: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(_current: dict[str, Any]) -> dict[str, Any]:
        return dict(document)

    return change


def _apply_patch(resource: Resource, content_type: str, current: dict[str, Any], body: Any) -> dict[str, Any]:
    accepted = [patches.JSON_PATCH, patches.MERGE] + (
        [patches.STRATEGIC_MERGE] if resource.strategic_merge else []
    )
    if content_type not in accepted:
        raise ApiError(
            415,
            f"the body of the request was in an unknown format - accepted media types include: {', '.join(accepted)}",
        )
    try:
        if content_type == patches.JSON_PATCH:
            return patches.json_patch(current, body)
        if content_type == patches.MERGE:
            if not isinstance(body, dict):
                raise patches.PatchError("a merge patch must be a JSON object", code=400)
            result = patches.merge_patch(current, body)
            assert isinstance(result, dict)
            return result
        return patches.strategic_merge_patch(current, body, resource.merge_keys)
    except patches.PatchError as exc:
        raise ApiError(exc.code, str(exc)) from exc
