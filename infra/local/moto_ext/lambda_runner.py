"""Gap: moto runs Lambda code only in Docker; without it, invoke echoes the payload.

Here an invocation runs the function's real handler from its deployed package
(the zip uploaded directly or the S3 object named by ``Code``) in a process of
its own, with the function's environment variables plus the stand-in's
endpoint and the credentials of the function's execution role (assumed
through STS, as Lambda does, while the stand-in enforces IAM; see
``iam_enforcement``). The process stays warm between invocations
and is replaced when the code, handler or configuration changes. A handler
exception comes back as Lambda reports it (``X-Amz-Function-Error:
Unhandled`` and ``{errorType, errorMessage, stackTrace}``), so a state
machine's ``Retry``/``Catch`` on the exception's class name works, and each
invocation's output lands in the function's log group.

Hooks: ``LambdaFunction._invoke_lambda`` (the call moto makes with its
default ``use_docker``) and ``LambdaFunction.invoke`` (for the ``Unhandled``
header and asynchronous ``Event`` invocations).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

from moto.awslambda.models import LambdaFunction

from sdcguard.infra.local.moto_ext import iam_enforcement

WORKER_SCRIPT = Path(__file__).with_name("lambda_worker.py")
# Lambda's own init phase is limited to 10 s; a shared laptop importing
# boto3 and powertools cold needs more headroom than that.
INIT_TIMEOUT_SECONDS = 60.0


class _Settings:
    """Where workers send their AWS calls; set by the stand-in at start."""

    endpoint_url: str | None = None
    extra_env: dict[str, str] = {}


settings = _Settings()


def configure(endpoint_url: str, extra_env: dict[str, str] | None = None) -> None:
    """Point every worker started from now on at ``endpoint_url``.

    ``extra_env`` is added to each function's environment (under the
    function's own variables, which win, and over nothing Lambda reserves).
    """
    settings.endpoint_url = endpoint_url
    settings.extra_env = dict(extra_env or {})


def _endpoint() -> str:
    if settings.endpoint_url:
        return settings.endpoint_url
    from moto import settings as moto_settings

    return f"http://127.0.0.1:{moto_settings.moto_server_port()}"


class _CodeCache:
    """Unpacks each distinct deployment package once, keyed by its sha256."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._lock = threading.Lock()

    def directory_for(self, code: bytes, digest: str) -> Path:
        """The folder holding ``code`` unpacked; ``digest`` is its hex sha256."""
        digest = digest[:24]
        with self._lock:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="sdcguard-lambda-"))
            target = self._root / digest
            if not target.exists():
                staging = Path(tempfile.mkdtemp(dir=self._root))
                with zipfile.ZipFile(io.BytesIO(code)) as archive:
                    archive.extractall(staging)
                staging.rename(target)
            return target

    def clear(self) -> None:
        with self._lock:
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None


_code_cache = _CodeCache()


class FunctionWorker:
    """One warm process serving one function's invocations, one at a time (a Lambda sandbox)."""

    def __init__(self, fingerprint: str, code_dir: Path, handler: str, env: dict[str, str]) -> None:
        self.fingerprint = fingerprint
        self._code_dir = code_dir
        self._handler = handler
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the worker)
        self._buffer = b""
        self.lock = threading.Lock()

    def _start(self) -> dict[str, Any] | None:
        """Start the process; return the init error, or None when it is ready."""
        self._buffer = b""
        self._proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), str(self._code_dir), self._handler],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=self._code_dir,
            env=self._env,
        )
        reply = self._read_reply(time.monotonic() + INIT_TIMEOUT_SECONDS)
        if reply is None:
            self.stop()
            return _timeout_error(INIT_TIMEOUT_SECONDS, "init")
        if not reply.get("ok"):
            self.stop()
            return dict(reply["error"])
        return None

    def _read_reply(self, deadline: float) -> dict[str, Any] | None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return {
                    "ok": False,
                    "error": {
                        "errorType": "Runtime.ExitError",
                        "errorMessage": f"Runtime exited with status {self._proc.wait()}",
                        "stackTrace": [],
                    },
                }
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return dict(json.loads(line))

    def invoke(self, event: str, context: dict[str, Any], timeout: float) -> tuple[str, bool, str]:
        """Run one invocation; return (payload JSON, whether it failed, its log text)."""
        with self.lock:
            start = self._log.seek(0, os.SEEK_END)
            error: dict[str, Any] | None = None
            if self._proc is None or self._proc.poll() is not None:
                error = self._start()
            payload = ""
            if error is None:
                assert self._proc is not None
                assert self._proc.stdin is not None
                context = {**context, "deadline": time.time() + timeout}
                self._proc.stdin.write(json.dumps({"event": event, "context": context}).encode() + b"\n")
                self._proc.stdin.flush()
                reply = self._read_reply(time.monotonic() + timeout)
                if reply is None:
                    # Lambda ends a timed-out sandbox; so do we.
                    self.stop()
                    error = _timeout_error(timeout, "invoke")
                elif reply.get("ok"):
                    payload = str(reply["payload"])
                else:
                    error = dict(reply["error"])
                    if self._proc is not None and self._proc.poll() is not None:
                        self._proc = None
            self._log.seek(start)
            logs = self._log.read().decode("utf-8", errors="replace")
            if error is not None:
                return json.dumps(error), True, logs
            return payload, False, logs

    def stop(self) -> None:
        """End the process (the next invocation starts a fresh one)."""
        self.ask_to_stop()
        self.wait_stopped()

    def ask_to_stop(self) -> None:
        """Close the worker's stdin: it finishes and exits (without waiting for it)."""
        if self._proc is not None and self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()

    def wait_stopped(self, timeout: float = 5.0) -> None:
        """Wait for the process to exit after ``ask_to_stop``; kill it past ``timeout``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _timeout_error(seconds: float, phase: str) -> dict[str, Any]:
    return {
        "errorType": "Sandbox.Timedout",
        "errorMessage": f"Task timed out after {seconds:.2f} seconds ({phase})",
        "stackTrace": [],
    }


class WorkerPool:
    """The warm workers of one function configuration.

    Lambda runs concurrent invocations in separate sandboxes: an invocation
    takes an idle worker, or starts another while the pool is under its
    limit, or waits for one to come free.
    """

    def __init__(self, fingerprint: str, code_dir: Path, handler: str, env: dict[str, str], limit: int) -> None:
        self.fingerprint = fingerprint
        self._spec = (code_dir, handler, env)
        self._limit = max(1, limit)
        self._idle: list[FunctionWorker] = []
        self._all: list[FunctionWorker] = []
        self._retired = False
        self._cond = threading.Condition()

    def acquire(self) -> FunctionWorker:
        """An idle worker for this invocation (blocks while all ``limit`` are busy)."""
        with self._cond:
            while True:
                if self._idle:
                    return self._idle.pop()
                if len(self._all) < self._limit:
                    worker = FunctionWorker(self.fingerprint, *self._spec)
                    self._all.append(worker)
                    return worker
                self._cond.wait()

    def release(self, worker: FunctionWorker) -> None:
        """Give ``worker`` back; a retired pool stops it instead."""
        with self._cond:
            if not self._retired:
                self._idle.append(worker)
                self._cond.notify()
                return
        worker.stop()

    def retire(self) -> list[FunctionWorker]:
        """Take the pool out of service; returns its idle workers (busy ones stop on release)."""
        with self._cond:
            self._retired = True
            idle, self._idle = self._idle, []
            return idle

    @property
    def size(self) -> int:
        """How many workers the pool has started."""
        with self._cond:
            return len(self._all)


# Concurrent invocations of one function beyond this wait for a free worker:
# each worker is a Python process, and a laptop has only so many cores.
MAX_WORKERS_PER_FUNCTION = 4
_pools: dict[str, WorkerPool] = {}
_pools_lock = threading.Lock()


def stop_all() -> None:
    """Stop every warm worker and remove the unpacked packages."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    with _sessions_lock:
        _sessions.clear()
    workers = [worker for pool in pools for worker in pool.retire()]
    # All at once: each worker takes a moment to exit.
    for worker in workers:
        worker.ask_to_stop()
    for worker in workers:
        worker.wait_stopped()
    _code_cache.clear()


def _function_env(fn: LambdaFunction, code_dir: Path, log_stream: str) -> dict[str, str]:
    env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "TMPDIR") if key in os.environ}
    env.update(settings.extra_env)
    env.update({str(k): str(v) for k, v in (fn.environment_vars or {}).items()})
    # Lambda reserves these: the function's own configuration cannot override them.
    env.update(
        {
            "_HANDLER": str(fn.handler),
            "LAMBDA_TASK_ROOT": str(code_dir),
            "AWS_EXECUTION_ENV": f"AWS_Lambda_{fn.run_time}",
            "AWS_LAMBDA_FUNCTION_NAME": fn.function_name,
            "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
            "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(fn.memory_size),
            "AWS_LAMBDA_LOG_GROUP_NAME": fn.logs_group_name,
            "AWS_LAMBDA_LOG_STREAM_NAME": log_stream,
            "AWS_REGION": fn.region,
            "AWS_DEFAULT_REGION": fn.region,
            **_role_credentials(fn),
            "AWS_ENDPOINT_URL": _endpoint(),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    # No X-Ray daemon listens locally; a function may still turn tracing on.
    env.setdefault("POWERTOOLS_TRACE_DISABLED", "true")
    return env


# One session per function and role, kept while the stand-in runs: the credentials are part of the
# worker's environment, so fresh ones per invocation would restart every warm worker.
_sessions: dict[tuple[str, str], dict[str, str]] = {}
_sessions_lock = threading.Lock()


def _role_credentials(fn: LambdaFunction) -> dict[str, str]:
    """The function's credentials: its execution role's (assumed, as Lambda does) while IAM is enforced."""
    if not iam_enforcement.settings.enabled:
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}
    key = (fn.function_arn, str(fn.role))
    with _sessions_lock:
        if key not in _sessions:
            try:
                _sessions[key] = iam_enforcement.assume(str(fn.role), fn.function_name)
            except LookupError as exc:
                raise _NoRole(
                    f"The role defined for the function {fn.function_name} cannot be assumed by Lambda: {exc} "
                    "in the stand-in's IAM (create it, with the policies the function needs)"
                ) from exc
        return dict(_sessions[key])


def _pool_for(fn: LambdaFunction) -> WorkerPool:
    code: bytes = fn.code_bytes
    if not code:
        raise _NoCode(f"function {fn.function_name} has no deployment package to run")
    # moto keeps the package's hex sha256: no need to hash megabytes per invocation.
    digest = str(getattr(fn, "code_digest", "") or hashlib.sha256(code).hexdigest())
    code_dir = _code_cache.directory_for(code, digest)
    env = _function_env(fn, code_dir, "local")
    fingerprint = hashlib.sha256(
        json.dumps([digest, fn.handler, env, fn.timeout], sort_keys=True).encode()
    ).hexdigest()
    reserved = fn.reserved_concurrency
    limit = min(MAX_WORKERS_PER_FUNCTION, int(reserved)) if reserved else MAX_WORKERS_PER_FUNCTION
    with _pools_lock:
        pool = _pools.get(fn.function_arn)
        if pool is not None and pool.fingerprint == fingerprint:
            return pool
        stale = pool.retire() if pool is not None else []
        pool = WorkerPool(fingerprint, code_dir, str(fn.handler), env, limit)
        _pools[fn.function_arn] = pool
    for worker in stale:
        worker.stop()
    return pool


class _NoCode(Exception):
    pass


class _NoRole(Exception):
    pass


def invoke_lambda(self: LambdaFunction, event: Any = None) -> tuple[str, bool, str]:
    """Replacement for ``LambdaFunction._invoke_lambda``: (payload, errored, logs)."""
    event_text = event if isinstance(event, str) else json.dumps({} if event is None else event)
    request_id = str(uuid.uuid4())
    try:
        pool = _pool_for(self)
    except (_NoCode, _NoRole, zipfile.BadZipFile) as exc:
        kind = "AccessDeniedException" if isinstance(exc, _NoRole) else "Runtime.InvalidEntrypoint"
        error = {"errorType": kind, "errorMessage": str(exc), "stackTrace": []}
        self.save_logs(f"{error['errorType']}: {exc}")
        return json.dumps(error), True, str(exc)
    context = {
        "function_name": self.function_name,
        "function_version": "$LATEST",
        "invoked_function_arn": self.function_arn,
        "memory_limit_in_mb": int(self.memory_size),
        "aws_request_id": request_id,
        "log_group_name": self.logs_group_name,
        "log_stream_name": "local",
    }
    started = time.monotonic()
    worker = pool.acquire()
    try:
        payload, errored, output = worker.invoke(event_text, context, float(self.timeout or 3))
    finally:
        pool.release(worker)
    elapsed_ms = (time.monotonic() - started) * 1000
    logs = (
        f"START RequestId: {request_id} Version: $LATEST\n"
        + output
        + ("" if not output or output.endswith("\n") else "\n")
        + f"END RequestId: {request_id}\n"
        + f"REPORT RequestId: {request_id}\tDuration: {elapsed_ms:.2f} ms"
    )
    self.logs_backend.ensure_log_group(self.logs_group_name)
    self.save_logs(logs)
    return payload, errored, logs


def invoke(self: LambdaFunction, body: Any, request_headers: Any, response_headers: Any) -> bytes:
    """Replacement for ``LambdaFunction.invoke`` with Lambda's response headers and async mode."""
    invocation_type = (request_headers or {}).get("x-amz-invocation-type") or "RequestResponse"
    if invocation_type == "DryRun":
        return b""
    event = body.decode() if isinstance(body, bytes) else (body or "{}")
    if invocation_type == "Event":
        threading.Thread(target=self._invoke_lambda, args=(event,), daemon=True).start()
        return b""
    payload, errored, logs = self._invoke_lambda(event)
    if errored:
        # A function error is "Unhandled" on Lambda's managed runtimes; moto says "Handled".
        response_headers["x-amz-function-error"] = "Unhandled"
    response_headers["x-amz-executed-version"] = "$LATEST"
    response_headers["x-amz-log-result"] = base64.b64encode(logs.encode()[-4096:]).decode()
    return payload.encode()


def install() -> None:
    """Route every Lambda invocation on this moto through the subprocess runner."""
    LambdaFunction._invoke_lambda = invoke_lambda  # type: ignore[method-assign]
    LambdaFunction.invoke = invoke  # type: ignore[method-assign]
