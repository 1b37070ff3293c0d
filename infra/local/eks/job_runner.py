"""The Job runner: a pod's container run for real, as a local process, with its node's identity.

There is no kubelet and no container runtime on the stand-in: the image is
not pulled and not used. What a Job's pod would run in its container runs
here as a process of this machine, in the stand-in's working directory,
with

- the container's ``command`` + ``args``, where ``sdcguard`` (and
  ``python``/``python3``) become this interpreter (``<python> -m sdcguard``),
  so the command runs the code of this checkout;
- an environment made of this process's own, less its AWS settings and any
  ``SDCGUARD_*`` variable but ``SDCGUARD_REPLAY_FACTORIES`` (the workload must
  not inherit the stand-in operator's identity or faults), then the container's ``env`` with the
  downward API resolved (``fieldRef`` ``spec.nodeName``, ``metadata.name``,
  ``metadata.namespace``, ``metadata.labels['...']``,
  ``spec.serviceAccountName``), then the workload identity (what a pod
  identity association would give it: the AWS endpoint, region and
  credentials), then the node's hardware fault as ``SDCGUARD_INJECT`` when the
  node has one (see ``node_faults``): the hardware is the node's, so a
  ``SDCGUARD_INJECT`` in the container's own env is dropped.

stdout and stderr are kept, together, for ``GET .../pods/NAME/log``.
Killing a run (a deadline, a deletion) kills its whole process group.

A ``sdcguard replay`` (a node check) is forked from the runner's zygote
(:mod:`sdcguard.infra.local.eks.zygote`), which imported torch once, instead of
starting an interpreter that imports it again; what the Kubernetes API shows
is the same. Every other command, and a replay the zygote cannot serve, runs
as a plain process. :meth:`JobRunner.stop_all` stops the zygote too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdcguard.infra.local.eks.zygote import ForkedProcess, Zygote

log = logging.getLogger(__name__)

MAX_LOG_BYTES = 8 * 1024 * 1024
"""A run's output kept for its log; beyond it, the oldest bytes go (the kubelet rotates logs too)."""
_DROPPED_PREFIXES = ("AWS_", "SDCGUARD_")
_DROPPED = ("NODE_NAME", "KUBECONFIG", "MOTO_PORT")
_PYTHONS = ("python", "python3")


class NotRunnable(ValueError):
    """A container the runner cannot start (no command, an unsupported env source); the message says why."""


def command_line(container: Mapping[str, Any]) -> list[str]:
    """The argv a container runs here: ``command`` + ``args``, ``sdcguard`` and ``python`` as this
    interpreter. Raises NotRunnable without a ``command`` (the image's entrypoint is unknown here)."""
    command = [str(part) for part in container.get("command") or []]
    args = [str(part) for part in container.get("args") or []]
    if not command:
        raise NotRunnable(
            f"container {container.get('name')!r} has no command: the stand-in does not use the image, "
            "so it cannot know the image's entrypoint"
        )
    if command[0] == "sdcguard":
        command = [sys.executable, "-m", "sdcguard", *command[1:]]
    elif command[0] in _PYTHONS:
        command = [sys.executable, *command[1:]]
    return command + args


def _field(pod: Mapping[str, Any], path: str) -> str:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    simple = {
        "spec.nodeName": spec.get("nodeName"),
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": "127.0.0.1",
        "status.podIP": "127.0.0.1",
    }
    if path in simple:
        return str(simple[path] or "")
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        if path.startswith(prefix + "['") and path.endswith("']"):
            return str((meta.get(source) or {}).get(path[len(prefix) + 2 : -2], ""))
    raise NotRunnable(f"fieldRef {path!r} is not a field the downward API offers here")


def container_env(container: Mapping[str, Any], pod: Mapping[str, Any]) -> dict[str, str]:
    """The container's ``env`` with ``valueFrom.fieldRef`` resolved against ``pod``. Raises NotRunnable for
    another source (secrets and config maps are not served here)."""
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        name = str(item.get("name", ""))
        if "valueFrom" in item and item["valueFrom"] is not None:
            ref = (item["valueFrom"] or {}).get("fieldRef")
            if not isinstance(ref, dict) or "fieldPath" not in ref:
                raise NotRunnable(f"env {name}: only valueFrom.fieldRef is served by the stand-in")
            env[name] = _field(pod, str(ref["fieldPath"]))
        else:
            env[name] = str(item.get("value", ""))
    return env


_KEPT = ("SDCGUARD_REPLAY_FACTORIES",)
"""Kept from this process's environment: the factories this machine's replays trust (the Jobs run this machine's
checkout, so its allow-list is theirs as an image's setting would be on a node); neither identity nor fault."""


def _without_operator(base: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in base.items()
            if k in _KEPT or (not k.startswith(_DROPPED_PREFIXES) and k not in _DROPPED)}


def process_env(
    container: Mapping[str, Any],
    pod: Mapping[str, Any],
    identity: Mapping[str, str],
    fault: str | None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of a pod's process (see the module docstring for the layers and their order)."""
    base = os.environ if base is None else base
    env = _without_operator(base)
    env.update(container_env(container, pod))
    env.update(identity)
    env.pop("SDCGUARD_INJECT", None)
    if fault:
        env["SDCGUARD_INJECT"] = fault
    return env


@dataclass
class Run:
    """One pod's process and its output so far."""

    namespace: str
    pod: str
    process: subprocess.Popen[bytes] | ForkedProcess
    output: bytearray = field(default_factory=bytearray)
    killed: str | None = None
    """Why it was killed (a reason such as ``DeadlineExceeded``), None while not."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def text(self) -> str:
        """The output as text (undecodable bytes replaced)."""
        with self.lock:
            return bytes(self.output).decode("utf-8", errors="replace")


Exited = Callable[[int, "str | None"], None]
"""Told a run's exit code and why it was killed (None when it ended by itself)."""


class JobRunner:
    """Runs pods' containers as local processes in ``workdir`` (default: the current directory); replays
    forked from a zygote unless ``zygote`` is False."""

    def __init__(self, workdir: Path | None = None, *, zygote: bool = True) -> None:
        self.workdir = workdir or Path.cwd()
        self._runs: dict[tuple[str, str], Run] = {}
        self._lock = threading.Lock()
        self._use_zygote = zygote
        self.zygote: Zygote | None = None
        """The zygote, once the first replay asked for it."""

    def start(self, namespace: str, pod: str, argv: list[str], env: dict[str, str], on_exit: Exited) -> Run:
        """Start ``argv`` for pod ``namespace/pod`` and return its run; ``on_exit`` is called from a
        background thread when it ends. Raises OSError when the program cannot be started."""
        process: subprocess.Popen[bytes] | ForkedProcess | None = self._forked(argv, env)
        if process is None:
            process = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so a kill reaches its children too
            )
        run = Run(namespace, pod, process)
        with self._lock:
            self._runs[(namespace, pod)] = run
        how = f"pid {process.pid}" if isinstance(process, subprocess.Popen) else "from the zygote"
        log.info("pod %s/%s: started %s (%s)", namespace, pod, " ".join(argv), how)
        threading.Thread(
            target=self._follow, args=(run, on_exit), name=f"pod-{namespace}-{pod}", daemon=True
        ).start()
        return run

    def _forked(self, argv: list[str], env: dict[str, str]) -> ForkedProcess | None:
        """``argv`` forked from the zygote (started on the first replay), or None: run it plainly."""
        if not self._use_zygote:
            return None
        with self._lock:
            if self.zygote is None:
                if not Zygote.runs(argv):
                    return None
                self.zygote = Zygote(self.workdir, _without_operator(os.environ))
            zygote = self.zygote
        return zygote.spawn(argv, env) if zygote.serves(argv, env) else None

    def _follow(self, run: Run, on_exit: Exited) -> None:
        stream = run.process.stdout
        assert stream is not None
        # os.read returns what the pipe holds (up to the size) at once, so the log follows the process.
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            with run.lock:
                run.output += chunk
                if len(run.output) > MAX_LOG_BYTES:
                    del run.output[: len(run.output) - MAX_LOG_BYTES]
        code = run.process.wait()
        stream.close()
        log.info("pod %s/%s: exited %d%s", run.namespace, run.pod, code, f" ({run.killed})" if run.killed else "")
        try:
            on_exit(code, run.killed)
        except Exception:  # a failed status update must not kill the thread silently
            log.exception("pod %s/%s: recording its exit failed", run.namespace, run.pod)

    def kill(self, namespace: str, pod: str, reason: str) -> bool:
        """Kill the pod's process group (SIGKILL, as a kubelet does after the grace period); False when
        nothing runs for it."""
        with self._lock:
            run = self._runs.get((namespace, pod))
        if run is None or run.process.poll() is not None:
            return False
        run.killed = reason
        if isinstance(run.process, ForkedProcess):
            run.process.kill_group()
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run.process.pid, signal.SIGKILL)
        return True

    def log(self, namespace: str, pod: str) -> str | None:
        """The pod's output so far, or None when nothing was started for it."""
        with self._lock:
            run = self._runs.get((namespace, pod))
        return None if run is None else run.text()

    def forget(self, namespace: str, pod: str) -> None:
        """Drop a deleted pod's run (kill it first)."""
        self.kill(namespace, pod, "Deleted")
        with self._lock:
            self._runs.pop((namespace, pod), None)

    def stop_all(self) -> None:
        """Kill every run still going and stop the zygote (the server stops)."""
        with self._lock:
            runs = list(self._runs.values())
            zygote, self.zygote = self.zygote, None
        for run in runs:
            self.kill(run.namespace, run.pod, "Stopped")
        if zygote is not None:
            zygote.stop()
