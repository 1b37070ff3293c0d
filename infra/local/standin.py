"""The local stand-in for AWS and EKS, as a context manager.

``LocalStandIn`` starts, on loopback, a moto server with the project's
extensions (``infra.local.moto_ext``) and the local EKS API server, and wires
them together: EKS ``DescribeCluster`` answers with the EKS server's endpoint
and CA, and a HyperPod node replacement swaps the Kubernetes node. Anything
that reads the usual ``AWS_*`` variables (``env``) reaches it exactly as it
would reach AWS.

The moto server runs in this process (its extensions patch moto here), so
one stand-in per process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from types import TracebackType
from typing import TYPE_CHECKING, Any

import boto3

if TYPE_CHECKING:
    from moto.server import ThreadedMotoServer

    from infra.local.eks.server import EksApiServer


REGION = "us-east-1"
# Dummy credentials: moto accepts any, and real AWS rejects these.
ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"

_active_lock = threading.Lock()
_active: LocalStandIn | None = None


class StandInError(RuntimeError):
    """The stand-in could not start (a port in use, another stand-in in this process)."""


class LocalStandIn:
    """A moto server with the project's extensions plus the local EKS API server.

    ``port``/``eks_port`` 0 pick free ports. ``replace_seconds`` is how long
    each simulated HyperPod phase lasts (shut down, pending, reboot, deep
    health check); 0 makes them immediate.
    """

    def __init__(self, port: int = 0, eks_port: int = 0, replace_seconds: float = 0.0) -> None:
        if port < 0 or eks_port < 0:
            raise ValueError(f"port and eks_port must be >= 0, got {port} and {eks_port}")
        if replace_seconds < 0:
            raise ValueError(f"replace_seconds must be >= 0, got {replace_seconds}")
        self.region = REGION
        self.replace_seconds = replace_seconds
        self._requested_port = port
        self._eks_port = eks_port
        self._server: ThreadedMotoServer | None = None
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

    def client(self, service_name: str, **kwargs: Any) -> Any:
        """A boto3 client for ``service_name`` bound to this stand-in."""
        return self.session().client(service_name, endpoint_url=self.endpoint_url, **kwargs)

    def start(self) -> LocalStandIn:
        """Start both servers and wire them together; returns self.

        Raises ``StandInError`` when another stand-in runs in this process or
        a server cannot start.
        """
        global _active
        from moto.server import ThreadedMotoServer

        from infra.local import moto_ext
        from infra.local.moto_ext import eks_endpoint, hyperpod, lambda_runner

        with _active_lock:
            if _active is not None:
                raise StandInError("a LocalStandIn already runs in this process (moto's state is per process)")
            _active = self
        began = time.monotonic()
        # werkzeug logs every request at INFO; the stand-in's users want their own output.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        try:
            moto_ext.install()
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=self._requested_port, verbose=False)
            server.start()
            self._server = server
            self.port = int(server.get_host_and_port()[1])
            self.endpoint_url = f"http://127.0.0.1:{self.port}"
            # moto's Step Functions executor calls Lambda at localhost:$MOTO_PORT.
            self._saved_moto_port = os.environ.get("MOTO_PORT")
            os.environ["MOTO_PORT"] = str(self.port)
            self._post_config({"stepfunctions": {"execute_state_machine": True}})
            lambda_runner.configure(self.endpoint_url)
            for name in ("shutdown_seconds", "pending_seconds", "reboot_seconds", "health_check_seconds"):
                setattr(hyperpod.timings, name, self.replace_seconds)
            eks = self._start_eks()
            self.eks = eks
            eks_endpoint.point_at(eks.url, eks.ca_data)
            hyperpod.hooks.on_node_replaced = self._on_node_replaced
        except OSError as exc:
            self.stop()
            raise StandInError(f"cannot start the local stand-in: {exc}") from exc
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def _start_eks(self) -> EksApiServer:
        from infra.local.eks.server import EksApiServer

        server = EksApiServer(host="127.0.0.1", port=self._eks_port)
        server.start()
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
        from infra.local.moto_ext import eks_endpoint, hyperpod, lambda_runner

        if _active is not self:
            return
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
