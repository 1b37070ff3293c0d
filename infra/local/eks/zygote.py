"""The zygote: one process that imports torch and the replay once, then forks a child per replay Job.

Every node check is a Job running ``sdcguard replay``, and each such
process used to import torch from scratch (seconds, many more under load).
The zygote pays that once per stand-in: started on the first replay Job, it
imports :data:`PRELOAD` and waits. For each Job it forks a child that
becomes what ``<python> -m sdcguard ...`` would have been:

- its own session (so killing its process group reaches its children), the
  signal handlers of a fresh interpreter, stdin on ``/dev/null``, stdout and
  stderr on the pipe the stand-in reads the pod's log from, no other open
  file;
- the Job's working directory, environment (``os.environ`` replaced, the C
  environment with it), ``sys.argv``, torch's thread count from
  ``OMP_NUM_THREADS`` as a fresh process takes it, numpy's global generator
  reseeded;
- ``sdcguard/__main__.py`` run as ``python -m`` runs it, its exit status
  as the interpreter would report it.

No torch op runs in the zygote, so no thread pool and no device is set up
before a fork. It serves only a command line and an environment a fresh
interpreter would start the same way (:meth:`Zygote.serves`); anything else,
and every Job while the zygote cannot start, runs as a plain process. It
stops with :meth:`Zygote.stop` (its children killed), or when the stand-in's
process ends (the zygote sees its socket close).

Stand-in and zygote talk over a Unix socket pair, one JSON object per
message: the zygote sends ``{"ready": true}`` once imported; the stand-in
sends ``{"id", "argv", "env", "cwd"}`` with the pipe's write end attached;
the zygote answers ``{"id", "pid"}`` (or ``{"id", "error"}``) and, when the
child ends, ``{"id", "exit"}`` (negative: killed by that signal, as
``subprocess`` reports it).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

log = logging.getLogger(__name__)

PRELOAD: Final = (
    "torch",
    "torch._inductor",
    "sdcguard.agent.capsule_replay",
    "sdcguard.cli",
    "sdcguard.commands.replay",
)
"""What the zygote imports once: what ``sdcguard replay`` imports before it computes (``torch._inductor`` is
what ``torch.use_deterministic_algorithms`` imports on its first call, a second)."""
READY_SECONDS: Final = 300.0
"""How long the first replay Job waits for the zygote's imports before it runs as a plain process."""
STARTUP_PREFIXES: Final = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "MALLOC_")
"""Variables an interpreter or its libraries read when they start: a child gets the zygote's, so a Job is
forked only when its values are the zygote's."""
_MESSAGE_BYTES = 1 << 20


def _send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors it carries; None at the end of the stream."""
    data, fds, _flags, _address = socket.recv_fds(sock, _MESSAGE_BYTES, 1)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    message = json.loads(data)
    assert isinstance(message, dict)
    return message, fds


# the stand-in's side ------------------------------------------------------------------


class ForkedProcess:
    """A Job's process that the zygote forks, seen as a ``subprocess.Popen``: ``pid`` (None until forked),
    ``stdout`` (its output and its errors), ``poll()``, ``wait()``, and :meth:`kill_group`."""

    def __init__(self, number: int, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.number, self.argv, self.env, self.cwd = number, argv, env, cwd
        read, self._write = os.pipe()
        self.stdout = open(read, "rb", buffering=0)  # noqa: SIM115 - closed by the Job runner, as Popen's
        self.pid: int | None = None
        self.returncode: int | None = None
        self._sent = False
        self._kill_asked = False
        self._done = threading.Event()
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self) -> int:
        self._done.wait()
        assert self.returncode is not None
        return self.returncode

    def kill_group(self) -> None:
        """SIGKILL its process group now, or as soon as it is forked; a process never sent ends as killed."""
        with self._lock:
            self._kill_asked = True
            pid, sent = self.pid, self._sent
        if pid is not None:
            _kill_group(pid)
        elif not sent:
            self.exited(-signal.SIGKILL)

    def _request(self) -> dict[str, Any] | None:
        """The zygote's request for it, marked as sent; None when it was killed before."""
        with self._lock:
            if self._kill_asked:
                return None
            self._sent = True
        return {"id": self.number, "argv": self.argv, "env": self.env, "cwd": str(self.cwd)}

    def forked(self, pid: int) -> None:
        with self._lock:
            self.pid = pid
            kill = self._kill_asked
        self._close_write()
        if kill:
            _kill_group(pid)

    def exited(self, code: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            self.returncode = code
        self._close_write()
        self._done.set()

    def run_plainly(self) -> None:
        """Run it as a plain process instead (the zygote is unavailable); its exit comes from a thread."""
        with self._lock:
            killed = self._kill_asked
        if killed:
            self.exited(-signal.SIGKILL)
            return
        try:
            process = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=self._write,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.write(self._write, f"cannot start {self.argv[0]}: {exc}\n".encode())
            self.exited(127)
            return
        self.forked(process.pid)
        threading.Thread(
            target=lambda: self.exited(process.wait()), name=f"plain-{process.pid}", daemon=True
        ).start()

    def _close_write(self) -> None:
        with self._lock:
            fd, self._write = self._write, -1
        if fd >= 0:
            os.close(fd)


def _kill_group(pid: int) -> None:
    # A child forked a moment ago may not have its own group yet: then the process itself.
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    except PermissionError:
        pass


class Zygote:
    """The stand-in's handle on its zygote: started by the first :meth:`spawn`, ended by :meth:`stop`.

    ``env`` is the zygote's environment (a Job's, less its own variables);
    children run in ``workdir`` unless asked otherwise.
    """

    def __init__(self, workdir: Path, env: Mapping[str, str], preload: Sequence[str] = PRELOAD) -> None:
        self.workdir = workdir
        self.env = dict(env)
        self.preload = tuple(preload)
        self.process: subprocess.Popen[bytes] | None = None
        self._state = "idle"  # -> starting -> ready -> failed | stopped
        self._sock: socket.socket | None = None
        self._waiting: list[ForkedProcess] = []
        self._running: dict[int, ForkedProcess] = {}
        self._count = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @staticmethod
    def runs(argv: Sequence[str]) -> bool:
        """Whether ``argv`` is a command the zygote runs: ``<python> -m sdcguard replay ...`` (this
        interpreter; options before ``replay`` allowed)."""
        if list(argv[:3]) != [sys.executable, "-m", "sdcguard"]:
            return False
        return next((a for a in argv[3:] if not a.startswith("-")), None) == "replay"

    def serves(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether a child of the zygote would be what ``argv`` with ``env`` starts: a command it
        :meth:`runs`, with the zygote's startup variables (:data:`STARTUP_PREFIXES`)."""
        return self.runs(argv) and _startup(env) == _startup(self.env)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> ForkedProcess | None:
        """A process for ``argv``, forked as soon as the zygote is ready; None when the zygote cannot serve
        (it failed to start, it died, or it was stopped): run it plainly."""
        with self._lock:
            if self._state in ("failed", "stopped"):
                return None
            self._count += 1
            process = ForkedProcess(self._count, argv, env, cwd or self.workdir)
            if self._state == "ready":
                self._submit(process)
            else:
                self._waiting.append(process)
            if self._state == "idle":
                self._state = "starting"
                self._thread = threading.Thread(target=self._serve, name="zygote", daemon=True)
                self._thread.start()
        return process

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the zygote and kill its children; processes not yet forked end as killed."""
        with self._lock:
            self._state = "stopped"
            waiting, self._waiting = self._waiting, []
            sock, process = self._sock, self.process
        for forked in waiting:
            forked.exited(-signal.SIGKILL)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the zygote sees the end, kills its children, exits
        elif process is not None:
            process.kill()  # still importing
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # the thread that starts the zygote and follows what it says ---------------------------------------

    def _submit(self, process: ForkedProcess) -> None:
        """Send ``process``'s request (the lock held)."""
        request = process._request()
        if request is None:
            return
        assert self._sock is not None
        self._running[process.number] = process
        try:
            _send(self._sock, request, [process._write])
        except OSError as exc:
            log.warning("zygote: cannot send a request (%s); the Job runs as a plain process", exc)
            self._running.pop(process.number, None)
            process.run_plainly()

    def _serve(self) -> None:
        sock = self._start()
        with self._lock:
            stopped = self._state == "stopped"
            plain: list[ForkedProcess] = []
            if sock is not None and not stopped:
                self._state = "ready"
                self._sock = sock
                for process in self._waiting:
                    self._submit(process)
            elif not stopped:
                self._state = "failed"
                plain = self._waiting
            self._waiting = []
        for process in plain:
            process.run_plainly()
        if sock is None:
            return
        if stopped:  # stopped while it imported: it ends when its socket does
            sock.close()
            if self.process is not None:
                self.process.wait()
            return
        try:
            self._follow(sock)
        finally:
            sock.close()

    def _start(self) -> socket.socket | None:
        """Start the zygote and wait for its imports; None (a warning logged) when it cannot."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock:
                if self._state == "stopped":
                    ours.close()
                    return None
                self.process = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno()), *self.preload],
                    cwd=self.workdir,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    pass_fds=[theirs.fileno()],
                )
        except OSError as exc:
            log.warning("zygote: cannot start (%s); replay Jobs run as plain processes", exc)
            ours.close()
            return None
        finally:
            theirs.close()
        ours.settimeout(READY_SECONDS)
        try:
            ready, _ = _receive(ours)
        except (OSError, ValueError) as exc:
            ready = {"error": str(exc)}
        ours.settimeout(None)
        if not ready or not ready.get("ready"):
            if self._state == "stopped":
                ready = {"error": "stopped"}
            log.warning("zygote: not ready (%s); replay Jobs run as plain processes", ready or "it exited")
            ours.close()
            self.process.kill()
            self.process.wait()
            return None
        log.info("zygote: ready (pid %d)", self.process.pid)
        return ours

    def _follow(self, sock: socket.socket) -> None:
        while True:
            try:
                message, fds = _receive(sock)
            except OSError:
                message, fds = None, []
            for fd in fds:
                os.close(fd)
            if message is None:
                break
            with self._lock:
                process = self._running.get(int(message["id"]))
                if process is not None and "pid" not in message:
                    del self._running[process.number]
            if process is None:
                continue
            if "pid" in message:
                process.forked(int(message["pid"]))
            elif "exit" in message:
                process.exited(int(message["exit"]))
            else:
                log.warning("zygote: cannot fork (%s); the Job runs as a plain process", message.get("error"))
                process.run_plainly()
        # The zygote is gone (stopped, or it died): it killed its children, or they are orphans now.
        with self._lock:
            if self._state != "stopped":
                self._state = "failed"
                log.warning("zygote: ended unexpectedly; replay Jobs run as plain processes")
            running, self._running = list(self._running.values()), {}
        for process in running:
            if process.pid is not None:
                _kill_group(process.pid)
            process.exited(-signal.SIGKILL)


def _startup(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


# the zygote's side --------------------------------------------------------------------


def serve(sock: socket.socket, preload: Sequence[str]) -> None:
    """Import ``preload``, say ready, then fork a child per request until the socket ends."""
    for module in preload:
        importlib.import_module(module)
    touched = _device_touched()
    if touched:
        _send(sock, {"ready": False, "error": touched})
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stand-in stops it, by closing the socket
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(sock, {"ready": True})
    children: dict[int, int] = {}  # pid -> request id
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    serving = True
    while serving:
        for key, _events in selector.select():
            if key.fileobj == wake_read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_read, 512):
                        pass
                continue
            try:
                request, fds = _receive(sock)
            except OSError:
                request, fds = None, []
            if request is None:
                serving = False
                break
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
            except OSError as exc:
                _send(sock, {"id": request["id"], "error": str(exc)})
                for fd in fds:
                    os.close(fd)
                continue
            if pid == 0:
                _become(request, fds[0])  # never returns
            for fd in fds:
                os.close(fd)
            children[pid] = request["id"]
            with contextlib.suppress(OSError):
                _send(sock, {"id": request["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                with contextlib.suppress(OSError):
                    _send(sock, {"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)})
    for pid in children:
        _kill_group(pid)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _device_touched() -> str | None:
    """Why a fork would not be a fresh process's start on a GPU machine (the CUDA driver set up by the
    imports), or None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch initialised CUDA while importing"
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        if "libcuda.so" in maps.read():
            return "the CUDA driver was loaded while importing"
    return None


def _become(request: Mapping[str, Any], output: int) -> None:
    """In the forked child: become ``request``'s command (see the module docstring) and exit with its status."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = list(request["argv"])
        sys.argv = ["-m", *argv[3:]]  # runpy puts the module's path first, as `python -m` does
        _as_a_fresh_process()
        code = _run_main(str(argv[2]))
    except BaseException:  # whatever happened, the child must not return into the zygote's loop
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _as_a_fresh_process() -> None:
    """What a fresh interpreter's libraries would differ in: torch's threads, numpy's global generator."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run_main(module: str) -> int:
    """Run ``module``'s ``__main__`` as ``python -m`` does; the exit status the interpreter would report."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code & 0xFF
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 128 + signal.SIGINT
    except BaseException:  # an uncaught exception: the traceback, status 1, as the interpreter
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    # A broken pipe: the stand-in went away.
    with socket.socket(fileno=int(sys.argv[1])) as channel, contextlib.suppress(BrokenPipeError):
        serve(channel, sys.argv[2:])
