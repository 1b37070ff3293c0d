"""The Job controller and scheduler of the stand-in: a batch/v1 Job becomes a pod on a node and a process.

When a Job is created (through the REST API, so RBAC applies), this does in
one go what the Job controller, the scheduler and the kubelet do on a
cluster:

- defaults the Job as the API server does (``spec.selector`` on its
  controller uid, the ``job-name`` and ``controller-uid`` labels on its pod
  template) and sets ``status.startTime`` and ``status.active``;
- creates one pod ``<job>-<5 random characters>`` from the template, owned by
  the Job, and schedules it: on the node ``spec.nodeName`` names, else on a
  node whose labels match ``nodeSelector`` and whose NoSchedule/NoExecute
  taints (a cordon's ``node.kubernetes.io/unschedulable`` among them) the pod
  tolerates. With no such node the pod stays ``Pending`` with a
  ``PodScheduled`` condition ``False``/``Unschedulable`` (it is not
  retried when a node appears later);
- runs the pod's single container through the :class:`JobRunner`, with the
  node's hardware fault from :class:`NodeFaults` and the workload identity,
  and moves the pod ``Pending -> Running -> Succeeded|Failed`` with the
  container's exit code, and the Job to ``Complete`` or ``Failed``
  (``BackoffLimitExceeded``: one pod is run, there are no retries);
- enforces ``activeDeadlineSeconds`` from the Job's start (a Pending Job
  too): the process group is killed, the pod fails with reason
  ``DeadlineExceeded`` and so does the Job;
- deletes the Job after ``ttlSecondsAfterFinished``.

Deleting a Job kills its pod's process and, unless ``propagationPolicy`` is
``Orphan``, deletes its pods; deleting a pod kills its process.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from sdcguard.infra.local.eks.errors import ApiError
from sdcguard.infra.local.eks.job_runner import JobRunner, NotRunnable, command_line, process_env
from sdcguard.infra.local.eks.node_faults import NodeFaults
from sdcguard.infra.local.eks.objects import ObjectStore
from sdcguard.infra.local.eks.resources import JOBS, NODES, PODS, Resource
from sdcguard.infra.local.eks.selectors import parse_label_selector

log = logging.getLogger(__name__)

JOB_NAME_LABEL = "job-name"
CONTROLLER_UID_LABEL = "controller-uid"
_BATCH_JOB_NAME = "batch.kubernetes.io/job-name"
_BATCH_CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
_UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
# As Kubernetes' rand.String: no vowels, no easily confused characters.
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    """Whether one of ``tolerations`` tolerates ``taint``, by the scheduler's rules."""
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        operator = t.get("operator") or "Equal"
        if operator == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _blocking_taints(node: dict[str, Any]) -> list[dict[str, Any]]:
    spec = node.get("spec") or {}
    taints = [t for t in spec.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
    if spec.get("unschedulable") and not any(t.get("key") == _UNSCHEDULABLE_TAINT for t in taints):
        taints.append({"key": _UNSCHEDULABLE_TAINT, "effect": "NoSchedule"})
    return taints


def schedule(pod_spec: dict[str, Any], nodes: list[dict[str, Any]]) -> tuple[str | None, str]:
    """The node a pod goes to, or None and the scheduler's message for why none fits."""
    wanted = pod_spec.get("nodeName")
    selector = pod_spec.get("nodeSelector") or {}
    tolerations = pod_spec.get("tolerations") or []
    matching = [
        n
        for n in nodes
        if (not wanted or n["metadata"]["name"] == wanted)
        and all((n["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
    ]
    fitting = [n for n in matching if all(tolerates(tolerations, t) for t in _blocking_taints(n))]
    if fitting:
        return fitting[0]["metadata"]["name"], ""
    if not nodes:
        return None, "0/0 nodes are available: no nodes available to schedule pods."
    reasons = []
    if len(matching) < len(nodes):
        reasons.append(f"{len(nodes) - len(matching)} node(s) didn't match Pod's node affinity/selector")
    for node in matching:
        untolerated = next(t for t in _blocking_taints(node) if not tolerates(tolerations, t))
        reasons.append(f"1 node(s) had untolerated taint {{{untolerated.get('key')}: {untolerated.get('value', '')}}}")
    return None, f"0/{len(nodes)} nodes are available: " + ", ".join(reasons) + "."


@dataclass
class _JobRun:
    namespace: str
    name: str
    uid: str
    pod: str
    finished: bool = False
    timers: list[threading.Timer] = field(default_factory=list)


class JobController:
    """Runs batch/v1 Jobs stored in ``store`` (see the module docstring); a ``rest.Workloads``.

    ``workload_env`` is the workload identity every process gets (AWS
    endpoint, region, credentials); ``node_faults`` the simulated faulty
    hardware; ``runner`` starts the processes.
    """

    def __init__(self, store: ObjectStore, node_faults: NodeFaults, runner: JobRunner | None = None) -> None:
        self.store = store
        self.node_faults = node_faults
        self.runner = runner or JobRunner()
        self.workload_env: dict[str, str] = {}
        self._lock = threading.Lock()
        self._jobs: dict[str, _JobRun] = {}

    # rest.Workloads ------------------------------------------------------------------

    def created(self, resource: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        """A Job was stored: default it, make and schedule its pod, start it; returns the Job as now stored."""
        if resource is not JOBS:
            return obj
        return self._start_job(obj)

    def deleted(self, resource: Resource, obj: dict[str, Any], options: dict[str, Any]) -> None:
        """A Job was deleted: kill its process and delete its pods (not with ``propagationPolicy: Orphan``);
        a pod was deleted: kill its process."""
        meta = obj.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        if resource is PODS:
            self.runner.forget(namespace, name)
            return
        if resource is not JOBS:
            return
        with self._lock:
            run = self._jobs.pop(str(meta.get("uid")), None)
            if run is not None:
                run.finished = True
        if run is not None:
            for timer in run.timers:
                timer.cancel()
        pods, _ = self.store.list(PODS, namespace, parse_label_selector(f"{CONTROLLER_UID_LABEL}={meta.get('uid')}"))
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            if options.get("propagationPolicy") == "Orphan":
                self.runner.kill(namespace, pod_name, "Orphaned")  # the pod stays, failed
            else:
                self.runner.forget(namespace, pod_name)
                with contextlib.suppress(ApiError):  # deleted meanwhile
                    self.store.delete(PODS, namespace, pod_name)

    def log(self, namespace: str, name: str, query: dict[str, str]) -> str:
        """The pod's output; 400 as the API server answers while its container has not started."""
        text = self.runner.log(namespace, name)
        if text is None:
            pod = self.store.get(PODS, namespace, name)
            container = ((pod.get("spec") or {}).get("containers") or [{}])[0].get("name", "")
            raise ApiError(
                400, f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating', reason="BadRequest"
            )
        tail = query.get("tailLines")
        if tail:
            try:
                lines = int(tail)
            except ValueError as exc:
                raise ApiError(400, f"invalid tailLines {tail!r}") from exc
            kept = text.splitlines(keepends=True)
            text = "".join(kept[-lines:]) if lines > 0 else ""
        return text

    def stop(self) -> None:
        """Cancel every timer and kill every process (the server stops)."""
        with self._lock:
            runs = list(self._jobs.values())
            self._jobs.clear()
        for run in runs:
            run.finished = True
            for timer in run.timers:
                timer.cancel()
        self.runner.stop_all()

    # the Job's life -------------------------------------------------------------------

    def _start_job(self, job: dict[str, Any]) -> dict[str, Any]:
        meta = job["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        labels = {CONTROLLER_UID_LABEL: uid, _BATCH_CONTROLLER_UID: uid, JOB_NAME_LABEL: name, _BATCH_JOB_NAME: name}
        suffix = "".join(random.choices(_SUFFIX_ALPHABET, k=5))
        pod_name = f"{name}-{suffix}"
        started = _now()

        def defaulted(obj: dict[str, Any]) -> dict[str, Any]:
            spec = obj["spec"]
            spec.setdefault("selector", {"matchLabels": {_BATCH_CONTROLLER_UID: uid}})
            spec.setdefault("backoffLimit", 6)
            spec.setdefault("completions", 1)
            spec.setdefault("parallelism", 1)
            spec.setdefault("completionMode", "NonIndexed")
            spec.setdefault("suspend", False)
            template_meta = spec["template"].setdefault("metadata", {}) or {}
            spec["template"]["metadata"] = template_meta
            template_meta["labels"] = {**(template_meta.get("labels") or {}), **labels}
            obj["status"] = {"startTime": started, "active": 1, "ready": 0, "terminating": 0}
            return obj

        job = self.store.update(JOBS, namespace, name, defaulted)
        template = job["spec"]["template"]
        pod_spec = dict(template.get("spec") or {})
        node, why = schedule(pod_spec, self.store.list(NODES)[0])
        if node is not None:
            pod_spec["nodeName"] = node
        condition = {"type": "PodScheduled", "status": "True" if node else "False", "lastTransitionTime": started}
        if node is None:
            condition.update(reason="Unschedulable", message=why)
        pod = {
            "metadata": {
                "name": pod_name,
                "namespace": namespace,
                "labels": dict(template["metadata"]["labels"]),
                "annotations": dict((template.get("metadata") or {}).get("annotations") or {}),
                "ownerReferences": [
                    {"apiVersion": JOBS.api_version, "kind": JOBS.kind, "name": name, "uid": uid,
                     "controller": True, "blockOwnerDeletion": True}
                ],
            },
            "spec": pod_spec,
            "status": {"phase": "Pending", "conditions": [condition], "qosClass": "BestEffort"},
        }
        created = self.store.create(PODS, namespace, pod)
        run = _JobRun(namespace, name, uid, pod_name)
        with self._lock:
            self._jobs[uid] = run
        deadline = job["spec"].get("activeDeadlineSeconds")
        if isinstance(deadline, int | float) and deadline > 0:
            self._later(run, float(deadline), self._deadline)
        if node is None:
            log.info("job %s/%s: pod %s is Pending: %s", namespace, name, pod_name, why)
        else:
            self._run_pod(run, created, node)
        return self.store.get(JOBS, namespace, name)

    def _later(self, run: _JobRun, seconds: float, action: Any) -> None:
        timer = threading.Timer(seconds, action, args=(run,))
        timer.daemon = True
        run.timers.append(timer)
        timer.start()

    def _run_pod(self, run: _JobRun, pod: dict[str, Any], node: str) -> None:
        container = pod["spec"]["containers"][0]
        try:
            argv = command_line(container)
            env = process_env(container, pod, self.workload_env, self.node_faults.for_node(node))
        except NotRunnable as exc:
            self._pod_failed_to_start(run, container, str(exc))
            return
        started = _now()

        def running(obj: dict[str, Any]) -> dict[str, Any]:
            obj["status"] = {
                **obj.get("status", {}),
                "phase": "Running",
                "startTime": started,
                "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1",
                "conditions": [
                    *(obj.get("status", {}).get("conditions") or []),
                    {"type": "Initialized", "status": "True", "lastTransitionTime": started},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": started},
                    {"type": "Ready", "status": "True", "lastTransitionTime": started},
                ],
                "containerStatuses": [
                    _container_status(container, {"running": {"startedAt": started}}, ready=True)
                ],
            }
            return obj

        self._update(PODS, run.namespace, run.pod, running)
        try:
            self.runner.start(
                run.namespace, run.pod, argv, env, lambda code, killed: self._exited(run, container, started, code, killed)
            )
        except OSError as exc:
            self._pod_failed_to_start(run, container, f"cannot start {argv[0]}: {exc}")

    def _pod_failed_to_start(self, run: _JobRun, container: dict[str, Any], why: str) -> None:
        log.warning("job %s/%s: %s", run.namespace, run.name, why)
        now = _now()
        terminated = {"exitCode": 128, "reason": "StartError", "message": why, "startedAt": now, "finishedAt": now}
        self._update(PODS, run.namespace, run.pod, _terminated(container, terminated, "Failed"))
        self._finish(run, succeeded=False, reason="BackoffLimitExceeded", message=why)

    def _exited(self, run: _JobRun, container: dict[str, Any], started: str, code: int, killed: str | None) -> None:
        finished = _now()
        # A killed process reports -9 to Python; a container runtime reports 128 + the signal.
        exit_code = 128 - code if code < 0 else code
        terminated: dict[str, Any] = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": started,
            "finishedAt": finished,
        }
        if killed == "Deleted":
            return  # the pod and its Job are gone
        phase = "Succeeded" if exit_code == 0 and killed is None else "Failed"
        change = _terminated(container, terminated, phase)
        if killed == "DeadlineExceeded":
            change = _with_reason(change, "DeadlineExceeded", "Pod was active on the node longer than the Job's deadline")
        self._update(PODS, run.namespace, run.pod, change)
        if killed is None:
            if exit_code == 0:
                self._finish(run, succeeded=True, reason="Completed", message="")
            else:
                self._finish(run, succeeded=False, reason="BackoffLimitExceeded",
                             message="Job has reached the specified backoff limit")

    def _deadline(self, run: _JobRun) -> None:
        with self._lock:
            if run.finished:
                return
        killed = self.runner.kill(run.namespace, run.pod, "DeadlineExceeded")
        log.info("job %s/%s: deadline exceeded%s", run.namespace, run.name, " (process killed)" if killed else "")
        self._finish(run, succeeded=False, reason="DeadlineExceeded",
                     message="Job was active longer than specified deadline")

    def _finish(self, run: _JobRun, *, succeeded: bool, reason: str, message: str) -> None:
        with self._lock:
            if run.finished:
                return
            run.finished = True
        for timer in run.timers:
            timer.cancel()
        now = _now()
        condition = {
            "type": "Complete" if succeeded else "Failed",
            "status": "True",
            "reason": reason,
            "message": message,
            "lastProbeTime": now,
            "lastTransitionTime": now,
        }

        def finished(obj: dict[str, Any]) -> dict[str, Any]:
            status = obj.setdefault("status", {})
            status["active"] = 0
            status["ready"] = 0
            status["succeeded" if succeeded else "failed"] = 1
            status["conditions"] = [*(status.get("conditions") or []), condition]
            if succeeded:
                status["completionTime"] = now
            return obj

        job = self._update(JOBS, run.namespace, run.name, finished)
        log.info("job %s/%s: %s (%s)", run.namespace, run.name, condition["type"], reason)
        ttl = (job or {}).get("spec", {}).get("ttlSecondsAfterFinished")
        if isinstance(ttl, int) and ttl >= 0:
            timer = threading.Timer(ttl, self._expire, args=(run,))
            timer.daemon = True
            timer.start()

    def _expire(self, run: _JobRun) -> None:
        try:
            job = self.store.delete(JOBS, run.namespace, run.name)
        except ApiError:
            return
        self.deleted(JOBS, job, {"propagationPolicy": "Background"})

    def _update(self, resource: Resource, namespace: str, name: str, change: Any) -> dict[str, Any] | None:
        try:
            return self.store.update(resource, namespace, name, change)
        except ApiError as exc:
            if exc.code != 404:
                raise
            return None  # deleted meanwhile: nothing left to record on


def _container_status(container: dict[str, Any], state: dict[str, Any], *, ready: bool) -> dict[str, Any]:
    return {
        "name": container.get("name", ""),
        "image": container.get("image", ""),
        "imageID": "",
        "ready": ready,
        "started": ready,
        "restartCount": 0,
        "state": state,
    }


def _terminated(container: dict[str, Any], terminated: dict[str, Any], phase: str) -> Any:
    def change(obj: dict[str, Any]) -> dict[str, Any]:
        status = obj.setdefault("status", {})
        status["phase"] = phase
        status["conditions"] = [
            {**c, "status": "False"} if c.get("type") in ("Ready", "ContainersReady") else c
            for c in status.get("conditions") or []
        ]
        status["containerStatuses"] = [_container_status(container, {"terminated": terminated}, ready=False)]
        return obj

    return change


def _with_reason(change: Any, reason: str, message: str) -> Any:
    def with_reason(obj: dict[str, Any]) -> dict[str, Any]:
        obj = change(obj)
        obj["status"]["reason"] = reason
        obj["status"]["message"] = message
        return obj

    return with_reason
