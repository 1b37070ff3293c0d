"""Transport: HTTPS on loopback, one thread per connection, and each request's way to an answer.

The server does the TLS handshake in the connection's own thread and keeps
connections alive (HTTP/1.1), as clients expect of a real endpoint. The
handler reads the whole body first, then: ``/_standin/`` paths go to the
stand-in's control, anonymous paths and discovery are answered, and every
other path is routed (``routing``), authenticated (an EKS bearer token,
``auth``, then impersonation), authorised (RBAC, ``rbac``), disturbed by the
fault knobs (``faults``) and answered by the REST layer (``rest``), or
streamed for a watch. Every answer is recorded (``RequestRecord``); errors
are Kubernetes ``Status`` bodies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from sdcguard.infra.local.eks import discovery, rbac, tables, watch
from sdcguard.infra.local.eks.auth import TokenRejected, verify_authorization
from sdcguard.infra.local.eks.control import READS_BODY
from sdcguard.infra.local.eks.errors import ApiError
from sdcguard.infra.local.eks.resources import SELF_SUBJECT_ACCESS_REVIEWS
from sdcguard.infra.local.eks.rest import Call, PlainText, as_table, json_body
from sdcguard.infra.local.eks.routing import (
    ANONYMOUS,
    DISCOVERY,
    Target,
    anonymous,
    discovery_document,
    route,
    verb,
)
from sdcguard.infra.local.eks.selectors import parse_field_selector, parse_label_selector

if TYPE_CHECKING:
    from sdcguard.infra.local.eks.server import EksApiServer

log = logging.getLogger(__name__)

MAX_BODY = 3 * 1024 * 1024
"""The API server's own request size limit."""


@dataclass(frozen=True)
class RequestRecord:
    """One request the server answered (kept for tests and the drill to inspect)."""

    method: str
    path: str
    resource: str
    name: str | None
    status: int


class HttpServer(ThreadingHTTPServer):
    """A threading HTTPS server for ``api``, whose kept-alive connections can all be hung up at once."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], api: EksApiServer, context: ssl.SSLContext) -> None:
        super().__init__(address, Handler)
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


class Handler(BaseHTTPRequestHandler):
    """One connection's requests, each taken from its bytes to its answer (see the module docstring)."""

    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections, as against a real endpoint
    # Headers and body leave in separate writes; with Nagle on, each kept-alive
    # request would wait ~40 ms for the client's delayed ACK.
    disable_nagle_algorithm = True
    timeout = 300  # idle kept-alive connections are dropped after this many seconds
    server: HttpServer

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
        self.server.api.record(RequestRecord(method, path, resource, name, status))
        if isinstance(body, PlainText):
            data, content_type = body.text.encode("utf-8"), "text/plain"
        else:
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
        if size > MAX_BODY:
            self.close_connection = True
            raise ApiError(413, "the request body is too large", reason="RequestEntityTooLarge")
        self._raw = self.rfile.read(size)

    def _dispatch(self, method: str) -> None:
        api = self.server.api
        split = urlsplit(self.path)
        path = split.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        self._current: tuple[str, str, str, str | None] = (method, path, "", None)
        try:
            self._read_body()
            if path.startswith("/_standin/"):
                status, body = api.control.handle(
                    method, path, json_body(self._raw) if method in READS_BODY else None
                )
                self._send(status, body)
                return
            if path in ANONYMOUS:
                self._send(200, anonymous(path))
                return
            discovered = DISCOVERY.match(path)
            if discovered:
                # Discovery is open to every authenticated user (system:discovery), as on a real cluster.
                self._identify()
                if method != "GET":
                    raise ApiError(405, f"{method} is not supported on {path}")
                body, content_type = discovery_document(
                    discovered, self.headers.get("Accept"), self.headers.get("Host") or ""
                )
                self._send(200, body, content_type=content_type)
                return
            target = route(path)
            resource_name, name = target.rbac_resource, target.name
            self._current = (method, path, resource_name, name)
            identity = self._identify()
            action = verb(method, target, query)
            if target.resource is not SELF_SUBJECT_ACCESS_REVIEWS and not rbac.allowed(
                api.store, identity, action, target.resource.group, resource_name, name, target.namespace
            ):
                raise rbac.forbidden(
                    identity, action, target.resource.group, resource_name, target.namespace, name
                )
            # Faults act only on authenticated requests, so a refused one never uses up a named failure.
            verdict = api.faults.decide(method, resource_name, name)
            if verdict.delay_seconds:
                time.sleep(verdict.delay_seconds)
            if verdict.fail_status is not None:
                raise ApiError(verdict.fail_status, f"injected fault ({verdict.why}) on {method} {path}")
            if action == "watch":
                self._stream(target, query)
                return
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            status, body = api.rest.handle(Call(method, target, query, identity, content_type, self._raw))
            table = tables.table_version(self.headers.get("Accept")) if method == "GET" else None
            if table is not None and status == 200 and not isinstance(body, PlainText):
                body = as_table(target.resource, body, table, query.get("includeObject", "Metadata"))
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

    def _stream(self, target: Target, query: dict[str, str]) -> None:
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
        api.record(RequestRecord(method, path, resource, name, 200))
        self.send_response(200)
        content_type = f"application/json;as=Table;v={table};g=meta.k8s.io" if table else "application/json"
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for kind, obj in watch.events(
            poll, api.stopping, resource_version=query.get("resourceVersion"), timeout_seconds=timeout
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
