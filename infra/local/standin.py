"""The local stand-in for AWS and EKS, as a context manager.

``LocalStandIn`` starts, on loopback, a moto server with the project's
extensions (``sdcguard.infra.local.moto_ext``) and the local EKS API server, and wires
them together: EKS ``DescribeCluster`` answers with the EKS server's endpoint
and CA, and a HyperPod node replacement swaps the Kubernetes node. Anything
that reads the usual ``AWS_*`` variables (``env``) reaches it exactly as it
would reach AWS.

The moto server runs in this process (its extensions patch moto here), so
one stand-in per process.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import boto3
import yaml

if TYPE_CHECKING:
    from werkzeug.serving import BaseWSGIServer

    from sdcguard.infra.local.eks.server import EksApiServer


REGION = "us-east-1"
# Dummy credentials: moto accepts any, and real AWS rejects these.
ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"

_active_lock = threading.Lock()
_active: LocalStandIn | None = None


HOST = "127.0.0.1"
# The repository's RBAC manifests, applied to the stand-in's cluster as an operator applies them to a real
# one: the cluster-scoped part at start-up, the namespaced part into the job's namespace (``seed`` does).
RBAC_MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "rbac.yaml"
RBAC_NAMESPACE_MANIFEST = RBAC_MANIFEST.with_name("rbac-namespace.yaml")
# The group the template's EKS access entries give the pipeline's roles (its KubernetesGroup default).
PIPELINE_GROUP = "sdcguard-pipeline"
# The group of the read-only role of resolve and guard (KubernetesReadRole; KubernetesReadGroup's default).
READ_ROLE = "KubernetesReadRole"
READ_GROUP = "sdcguard-pipeline-read"
# How long stop() waits for a server thread; past it the thread (a daemon) is left behind.
_STOP_SECONDS = 5.0


def _role_of(access_key_id: str) -> str | None:
    """The name of the role whose assumed-role credentials ``access_key_id`` is, as the EKS access entries see it."""
    from sdcguard.infra.local.moto_ext import iam_enforcement

    caller = iam_enforcement.caller_for(access_key_id)
    return caller.role_name if caller is not None else None


class StandInError(RuntimeError):
    """The stand-in could not start (a port in use, another stand-in in this process)."""


class PortInUse(StandInError):
    """A port the stand-in was asked to bind is taken; ``port`` and ``server`` ("moto" or "eks") say which."""

    def __init__(self, server: str, port: int) -> None:
        what = "the moto server" if server == "moto" else "the local EKS API server"
        super().__init__(
            f"port {port} on {HOST} is already in use, so {what} cannot start there "
            "(is a stand-in left running?); choose another port, or 0 for a free one"
        )
        self.server = server
        self.port = port


def _bind(server: str, port: int) -> socket.socket:
    """A listening socket on HOST:port; raises PortInUse at once when the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As socketserver does for HTTP servers: a port in TIME_WAIT after a stop can be bound again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(server, port) from exc
        raise StandInError(f"cannot bind {HOST}:{port} for the {server} server: {exc}") from exc
    return sock


class _MotoServer:
    """moto's server app on a socket bound in the caller's thread, served from a background thread.

    moto's own ThreadedMotoServer binds inside its thread: when the port is
    taken, werkzeug prints "Address already in use" and exits that thread,
    and ``start()`` waits for a ready signal that never comes, deaf to
    Ctrl-C. Binding here first turns that into an immediate PortInUse.
    """

    def __init__(self, port: int) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        from sdcguard.infra.local.moto_ext import iam_enforcement

        sock = _bind("moto", port)
        try:
            self._httpd: BaseWSGIServer = make_server(
                HOST,
                sock.getsockname()[1],
                iam_enforcement.wrap(DomainDispatcherApplication(create_backend_app)),
                threaded=True,
                request_handler=MotoRequestHandler,
                fd=sock.fileno(),
            )
        finally:
            sock.close()  # make_server holds its own duplicate of the descriptor
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="moto-server", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self._httpd.server_address[1])

    def stop(self) -> None:
        """Stop serving and release the port, waiting at most _STOP_SECONDS for the serving thread."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=_STOP_SECONDS)


class LocalStandIn:
    """A moto server with the project's extensions plus the local EKS API server.

    ``port``/``eks_port`` 0 pick free ports. ``replace_seconds`` is how long
    each simulated HyperPod phase lasts (shut down, pending, reboot, deep
    health check); 0 makes them immediate. ``rbac_manifest`` is applied to
    the EKS server, which then enforces it on the pipeline's identities (callers
    with temporary credentials, as the Lambda functions are: ``READ_GROUP`` for
    a role named after the template's ``READ_ROLE``, ``PIPELINE_GROUP`` for any
    other; see ``sdcguard.infra.local.eks.rbac``); None turns RBAC off (every caller is
    an admin). Its namespaced part (``RBAC_NAMESPACE_MANIFEST``) goes into each
    job's namespace as that namespace is made (``sdcguard.infra.local.seed``).
    ``enforce_iam`` evaluates every AWS call made with a role's credentials
    (each Lambda function runs with its execution role's; ``role_env`` gives
    any other code a role's) against that role's identity policies, and
    refuses what they do not allow, as AWS does (see
    ``sdcguard.infra.local.moto_ext.iam_enforcement``); the stand-in's own credentials
    (``env``) stay an administrator's.
    """

    def __init__(
        self,
        port: int = 0,
        eks_port: int = 0,
        replace_seconds: float = 0.0,
        rbac_manifest: Path | None = RBAC_MANIFEST,
        enforce_iam: bool = True,
    ) -> None:
        if port < 0 or eks_port < 0:
            raise ValueError(f"port and eks_port must be >= 0, got {port} and {eks_port}")
        if replace_seconds < 0:
            raise ValueError(f"replace_seconds must be >= 0, got {replace_seconds}")
        self.region = REGION
        self.replace_seconds = replace_seconds
        self.rbac_manifest = rbac_manifest
        self.enforce_iam = enforce_iam
        self._requested_port = port
        self._eks_port = eks_port
        self._server: _MotoServer | None = None
        self._saved_moto_port: str | None = None
        self.eks: EksApiServer | None = None
        self.endpoint_url = ""
        self.port = 0
        self.startup_seconds = 0.0

    @property
    def env(self) -> dict[str, str]:
        """The environment that points AWS SDKs and CLIs at this stand-in."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            "MOTO_PORT": str(self.port),
        }

    def session(self) -> boto3.Session:
        """A boto3 session with the stand-in's region and credentials (pass ``endpoint_url`` to clients)."""
        return boto3.Session(
            aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY, region_name=self.region
        )

    def role_env(self, role_arn: str, session_name: str = "stand-in") -> dict[str, str]:
        """``env`` with temporary credentials of ``role_arn`` (assumed through STS): what that role may do, no more.

        Raises ``LookupError`` when the stand-in's IAM has no such role.
        """
        from sdcguard.infra.local.moto_ext import iam_enforcement

        return {**self.env, **iam_enforcement.assume(role_arn, session_name)}

    def client(self, service_name: str, **kwargs: Any) -> Any:
        """A boto3 client for ``service_name`` bound to this stand-in."""
        session: Any = self.session()  # the service name is a runtime string: no typed overload applies
        return session.client(service_name, endpoint_url=self.endpoint_url, **kwargs)

    def start(self) -> LocalStandIn:
        """Start both servers and wire them together; returns self.

        Raises ``PortInUse`` at once when a requested port is taken, and
        ``StandInError`` when another stand-in runs in this process or a
        server cannot start; nothing is left running then.
        """
        global _active
        from sdcguard.infra.local import moto_ext
        from sdcguard.infra.local.moto_ext import eks_endpoint, hyperpod, iam_enforcement, lambda_runner

        with _active_lock:
            if _active is not None:
                raise StandInError("a LocalStandIn already runs in this process (moto's state is per process)")
            _active = self
        began = time.monotonic()
        # werkzeug logs every request at INFO; the stand-in's users want their own output.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        try:
            moto_ext.install()
            iam_enforcement.settings.enabled = self.enforce_iam
            server = _MotoServer(self._requested_port)
            self._server = server
            self.port = server.port
            self.endpoint_url = f"http://{HOST}:{self.port}"
            # moto's Step Functions executor calls Lambda at localhost:$MOTO_PORT.
            self._saved_moto_port = os.environ.get("MOTO_PORT")
            os.environ["MOTO_PORT"] = str(self.port)
            self._post_config({"stepfunctions": {"execute_state_machine": True}})
            lambda_runner.configure(self.endpoint_url)
            for name in ("shutdown_seconds", "pending_seconds", "reboot_seconds", "health_check_seconds"):
                setattr(hyperpod.timings, name, self.replace_seconds)
            eks = self._start_eks()
            self.eks = eks
            # What a pod identity association gives a workload: the Jobs the cluster runs reach this stand-in.
            eks.workload_env = {k: v for k, v in self.env.items() if k.startswith("AWS_")}
            eks_endpoint.point_at(eks.url, eks.ca_data)
            hyperpod.hooks.on_node_replaced = self._on_node_replaced
        except StandInError:
            self.stop()
            raise
        except OSError as exc:
            self.stop()
            raise StandInError(f"cannot start the local stand-in: {exc}") from exc
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def _start_eks(self) -> EksApiServer:
        from sdcguard.infra.local.eks.errors import ApiError
        from sdcguard.infra.local.eks.rbac import AccessEntries
        from sdcguard.infra.local.eks.server import EksApiServer

        manifest: list[dict[str, Any]] = []
        access = AccessEntries()
        if self.rbac_manifest is not None:
            try:
                manifest = [d for d in yaml.safe_load_all(self.rbac_manifest.read_text()) if d]
            except (OSError, yaml.YAMLError) as exc:
                raise StandInError(f"cannot read the RBAC manifest {self.rbac_manifest}: {exc}") from exc
            access = AccessEntries(
                pipeline_groups=(PIPELINE_GROUP,), role_groups={READ_ROLE: (READ_GROUP,)}, role_of=_role_of
            )
        try:
            server = EksApiServer(host=HOST, port=self._eks_port, access=access, manifest=manifest)
        except (ValueError, ApiError) as exc:
            raise StandInError(f"the RBAC manifest {self.rbac_manifest} cannot be applied: {exc}") from exc
        try:
            server.start()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse("eks", self._eks_port) from exc
            raise
        return server

    def _on_node_replaced(self, cluster: str, old_id: str, new_id: str) -> None:
        if self.eks is not None:
            self.eks.replace_node(old_id, new_id)

    def _post_config(self, config: dict[str, Any]) -> None:
        request = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/config",
            data=json.dumps(config).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def stop(self) -> None:
        """Stop both servers, the Lambda workers, and undo the process-wide settings."""
        global _active
        from sdcguard.infra.local.moto_ext import eks_endpoint, hyperpod, iam_enforcement, lambda_runner

        if _active is not self:
            return
        iam_enforcement.settings.enabled = False
        hyperpod.hooks.on_node_replaced = None
        eks_endpoint.target.endpoint = eks_endpoint.target.ca_data = None
        lambda_runner.stop_all()
        if self.eks is not None:
            self.eks.stop()
            self.eks = None
        if self._server is not None:
            self._server.stop()
            self._server = None
            if self._saved_moto_port is None:
                os.environ.pop("MOTO_PORT", None)
            else:
                os.environ["MOTO_PORT"] = self._saved_moto_port
        with _active_lock:
            if _active is self:
                _active = None

    def __enter__(self) -> LocalStandIn:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
