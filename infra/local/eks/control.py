"""Stand-in control: the ``/_standin/`` endpoints beside the Kubernetes API.

On paths no Kubernetes client uses, and without a token (they act on the
stand-in, not on the cluster it simulates):

- ``GET|POST|DELETE /_standin/faults``: the API server's fault knobs (see ``faults``);
- ``POST /_standin/replace-node`` ``{"old_instance_id", "new_instance_id"}``:
  what a HyperPod replacement does to the cluster (``EksApiServer.replace_node``);
- ``GET|PUT|DELETE /_standin/node-faults`` ``{"faults": {node: spec}, "replacements_inherit": bool}``:
  the simulated faulty GPUs (see ``node_faults``); PUT replaces them all, DELETE heals every node;
- ``GET|PUT /_standin/workload-env`` ``{"env": {name: value}}``: the workload
  identity every Job's process gets (see ``jobs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sdcguard.infra.local.eks.errors import ApiError
from sdcguard.infra.local.eks.faults import Faults
from sdcguard.infra.local.eks.jobs import JobController
from sdcguard.infra.local.eks.node_faults import BadNodeFault, NodeFaults

READS_BODY = ("POST", "PUT")
"""The methods whose body a control endpoint reads."""


class StandinControl:
    """Answers the ``/_standin/`` endpoints over the server's fault knobs, node faults and Job controller."""

    def __init__(
        self,
        faults: Faults,
        node_faults: NodeFaults,
        jobs: JobController,
        replace_node: Callable[[str, str], dict[str, Any]],
    ) -> None:
        self.faults = faults
        self.node_faults = node_faults
        self.jobs = jobs
        self.replace_node = replace_node

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """Answer one control request (``body``: the decoded JSON of a POST or PUT, else None).

        Raises ApiError 404 for an unknown path, 405 for a method it does not
        take, 422 for a body it cannot apply.
        """
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
        elif path == "/_standin/node-faults":
            if method == "GET":
                return 200, self.node_faults.to_dict()
            if method == "DELETE":
                self.node_faults.clear()
                return 200, self.node_faults.to_dict()
            if method == "PUT":
                try:
                    self.node_faults.apply(body)
                except BadNodeFault as exc:
                    raise ApiError(422, f"bad node faults: {exc}") from exc
                return 200, self.node_faults.to_dict()
        elif path == "/_standin/workload-env":
            if method == "GET":
                return 200, {"env": dict(self.jobs.workload_env)}
            if method == "PUT":
                env = body.get("env") if isinstance(body, dict) else None
                if not isinstance(env, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in env.items()
                ):
                    raise ApiError(422, 'the body must be {"env": {"NAME": "value", ...}}')
                self.jobs.workload_env = dict(env)
                return 200, {"env": dict(env)}
        else:
            raise ApiError(404, f"no stand-in endpoint {path}")
        raise ApiError(405, f"{method} is not supported on {path}")
