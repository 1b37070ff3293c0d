"""The local EKS API server: Kubernetes REST over HTTPS for nodes, pods, Jobs and Kubeflow PyTorchJobs.

It serves

- ``/api/v1/nodes[/NAME]``: get, list, create, replace (PUT), patch, delete;
- ``/api/v1/namespaces[/NAME]``: get, list, create, delete;
- ``/api/v1/pods`` and ``/api/v1/namespaces/NS/pods[/NAME]``: get, list, create, replace, patch, delete,
  and ``pods/NAME/eviction``, ``pods/NAME/log``;
- ``/apis/batch/v1[/namespaces/NS]/jobs[/NAME]``: the same verbs; a created Job runs for real (``jobs``);
- ``/apis/kubeflow.org/v1[/namespaces/NS]/pytorchjobs[/NAME]``: the same verbs;
- ``/apis/rbac.authorization.k8s.io/v1/``: ClusterRoles and ClusterRoleBindings, and Roles and
  RoleBindings in a namespace (enforced by ``rbac``); ``/apis/authorization.k8s.io/v1/selfsubjectaccessreviews``;
- ``/version`` and ``/healthz`` without a token;

lists honour ``labelSelector``, ``fieldSelector``, ``limit`` and ``continue``;
writes honour ``dryRun=All``. Every Kubernetes request must carry an EKS
bearer token (see ``auth``); failures are Kubernetes ``Status`` bodies.
Beside the API, on ``/_standin/`` paths without a token, the stand-in's own
control (see ``control``).

The parts, one idea each: ``transport`` (HTTPS, connections, a request's way
to an answer), ``routing`` (paths to targets and verbs), ``rest`` (what each
verb does to the stored objects), ``control`` (the ``/_standin/``
endpoints), ``jobs`` and ``job_runner`` (Jobs run as local processes),
``node_faults`` (the simulated faulty GPUs), ``node_replacement`` (what a
HyperPod replacement does to the cluster). This module puts them together
and owns the server's life.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdcguard.infra.local.eks import node_replacement, rbac
from sdcguard.infra.local.eks.control import StandinControl
from sdcguard.infra.local.eks.faults import Faults
from sdcguard.infra.local.eks.hyperpod_node import node_name
from sdcguard.infra.local.eks.job_runner import JobRunner
from sdcguard.infra.local.eks.jobs import JobController
from sdcguard.infra.local.eks.node_faults import NodeFaults
from sdcguard.infra.local.eks.objects import ObjectStore
from sdcguard.infra.local.eks.resources import (
    CLUSTER_ROLE_BINDINGS,
    CLUSTER_ROLES,
    NAMESPACES,
    ROLE_BINDINGS,
    ROLES,
    Resource,
)
from sdcguard.infra.local.eks.rest import RestApi
from sdcguard.infra.local.eks.tls import issue_server_certificate
from sdcguard.infra.local.eks.transport import HttpServer, RequestRecord

__all__ = ["DEFAULT_NAMESPACES", "EksApiServer", "RequestRecord"]

log = logging.getLogger(__name__)

DEFAULT_NAMESPACES = ("default", "kube-system", "kubeflow")


class EksApiServer:
    """A Kubernetes API endpoint on loopback that stands in for an EKS cluster.

    ``start()`` binds and serves in a background thread; ``url`` and
    ``ca_data`` are what EKS ``DescribeCluster`` reports as the cluster's
    endpoint and certificate authority. ``store`` holds the objects,
    ``faults`` the fault knobs, ``requests`` the recent requests,
    ``node_faults`` the simulated faulty GPUs by node, ``workload_env`` the
    identity every Job's process gets. Jobs' processes run in ``workdir``
    (default: the current directory).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        access: rbac.AccessEntries | None = None,
        manifest: list[dict[str, Any]] | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.host = host
        self.access = access or rbac.AccessEntries()
        self._requested_port = port
        hosts = (host, "localhost") if host != "localhost" else ("localhost", "127.0.0.1")
        self._certificate = issue_server_certificate(hosts)
        self.store = ObjectStore()
        self.faults = Faults()
        self.node_faults = NodeFaults()
        self.jobs = JobController(self.store, self.node_faults, JobRunner(workdir))
        self.rest = RestApi(self.store, self.jobs)
        self.control = StandinControl(self.faults, self.node_faults, self.jobs, self.replace_node)
        self._requests: collections.deque[RequestRecord] = collections.deque(maxlen=10_000)
        self._requests_lock = threading.Lock()
        self._httpd: HttpServer | None = None
        self._thread: threading.Thread | None = None
        # Set while stopping, so open watches end instead of outliving the server.
        self.stopping = threading.Event()
        for namespace in DEFAULT_NAMESPACES:
            self.store.create(NAMESPACES, None, {"metadata": {"name": namespace}})
        self.apply(manifest or [])

    def apply(self, documents: list[dict[str, Any]], namespace: str | None = None) -> None:
        """Create or replace RBAC objects, as ``kubectl apply [-n NAMESPACE] -f`` of an RBAC manifest does.

        ClusterRoles and ClusterRoleBindings are cluster-scoped; Roles and
        RoleBindings go into their ``metadata.namespace`` or, without one, into
        ``namespace``. Raises ValueError (nothing is applied then) naming a
        document of any other kind, a namespaced one with no namespace or
        another than ``namespace``, or a namespace that does not exist;
        ApiError 422 for an invalid document.
        """
        kinds = {r.kind: r for r in (CLUSTER_ROLES, CLUSTER_ROLE_BINDINGS, ROLES, ROLE_BINDINGS)}
        placed: list[tuple[Resource, str | None, dict[str, Any]]] = []
        for i, document in enumerate(documents):
            if not isinstance(document, dict) or document.get("kind") not in kinds:
                kind = document.get("kind") if isinstance(document, dict) else type(document).__name__
                raise ValueError(
                    f"document {i} is a {kind}; only ClusterRole, ClusterRoleBinding, Role and RoleBinding apply here"
                )
            resource = kinds[document["kind"]]
            where = (document.get("metadata") or {}).get("namespace") if resource.namespaced else None
            if resource.namespaced:
                if where and namespace and where != namespace:
                    raise ValueError(f"document {i} is in namespace {where!r}, not {namespace!r}")
                where = where or namespace
                if not where:
                    raise ValueError(f"document {i} is a {resource.kind}: give the namespace to apply it into")
                if not self.store.exists(NAMESPACES, None, where):
                    raise ValueError(f"namespace {where!r} does not exist")
            placed.append((resource, where, document))
        with self.store.transaction():
            for resource, where, document in placed:
                name = str((document.get("metadata") or {}).get("name", ""))
                if self.store.exists(resource, where, name):
                    self.store.update(resource, where, name, _replacing(document))
                else:
                    self.store.create(resource, where, document)

    @property
    def workload_env(self) -> dict[str, str]:
        """The environment every Job's process gets as its workload identity (AWS endpoint, region,
        credentials); assign a new dict to change it."""
        return self.jobs.workload_env

    @workload_env.setter
    def workload_env(self, env: dict[str, str]) -> None:
        self.jobs.workload_env = dict(env)

    # lifecycle ---------------------------------------------------------------

    def start(self) -> EksApiServer:
        """Bind and start serving; returns self. Raises OSError when the port is taken, RuntimeError if started twice."""
        if self._httpd is not None:
            raise RuntimeError("the EKS API server is already running")
        httpd = HttpServer((self.host, self._requested_port), self, self._certificate.server_context())
        self.stopping.clear()
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="eks-api-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, kill every Job's process, and release the port; a no-op when not running."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self.stopping.set()
        self.jobs.stop()
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

    def record(self, record: RequestRecord) -> None:
        """Keep one answered request for ``requests``."""
        with self._requests_lock:
            self._requests.append(record)

    # what HyperPod does to the cluster ---------------------------------------------

    def replace_node(self, old_instance_id: str, new_instance_id: str) -> dict[str, Any]:
        """Apply a HyperPod node replacement to the cluster and return the new node.

        See ``node_replacement.replace_node``; besides, with
        ``node_faults.replacements_inherit``, the new node gets the old
        node's hardware fault. Raises ValueError for ids that are not ``i-``
        + 17 hex, ApiError 409 if the new node already exists.
        """
        created = node_replacement.replace_node(self.store, old_instance_id, new_instance_id)
        old_name, new_name = node_name(old_instance_id), created["metadata"]["name"]
        inherited = self.node_faults.replaced(old_name, new_name)
        if inherited is not None:
            log.warning("replacement node %s inherits the hardware fault of %s: %s", new_name, old_name, inherited)
        return created


def _replacing(document: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(_current: dict[str, Any]) -> dict[str, Any]:
        return dict(document)

    return change
