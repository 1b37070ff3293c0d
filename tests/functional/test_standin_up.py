"""``sdcguard local up`` from a shell: exports first, a working stand-in, a clean stop on Ctrl-C."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid

import boto3
import pytest

from sdcguard.commands.local import export_lines

EXPECTED = {"AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def parse_exports(lines: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in lines:
        assert line.startswith("export "), line
        name, _, value = line[len("export ") :].partition("=")
        [env[name]] = shlex.split(value)
    return env


def test_export_lines_are_quoted_for_the_shell() -> None:
    lines = export_lines({"A": "plain", "B": "with space", "C": "it's"})

    assert parse_exports(lines) == {"A": "plain", "B": "with space", "C": "it's"}


@pytest.mark.slow
def test_up_prints_exports_first_serves_and_stops_on_ctrl_c() -> None:
    command = [sys.executable, "-m", "sdcguard", "local", "up", "--port", "0", "--replace-seconds", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        first = [proc.stdout.readline().rstrip("\n") for _ in range(6)]
        ready_after = time.monotonic() - started
        exports = parse_exports([line for line in first if line.startswith("export ")])

        assert first[0].startswith("export ")
        assert set(exports) >= EXPECTED
        assert exports["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        assert ready_after < 60
        s3 = boto3.client(
            "s3",
            endpoint_url=exports["AWS_ENDPOINT_URL"],
            region_name=exports["AWS_REGION"],
            aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"],
        )
        bucket = f"up-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(Bucket=bucket)
        assert bucket in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    assert code == 0


def test_up_refuses_a_bad_port() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sdcguard", "local", "up", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 2
    assert "port must be between 0 and 65535" in result.stderr


# --- start or fail, never hang; stop on a signal in every state ------------------------------------

UP = [sys.executable, "-m", "sdcguard", "local", "up", "--replace-seconds", "0"]
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}


def _taken_port() -> socket.socket:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    return holder


def _up(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*UP, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLEAN_ENV
    )


def _finish(proc: subprocess.Popen[str], within: float) -> tuple[int, str]:
    """The exit status and stderr; fails the test (and kills the process) if it has not exited ``within`` seconds."""
    try:
        _, stderr = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"sdcguard local up still running {within} s later")
    return proc.returncode, stderr


@pytest.mark.slow
@pytest.mark.parametrize(("option", "other"), [("--port", "--eks-port"), ("--eks-port", "--port")])
def test_a_taken_port_fails_at_once_naming_the_port_and_the_way_out(option: str, other: str) -> None:
    holder = _taken_port()
    port = holder.getsockname()[1]
    try:
        code, stderr = _finish(_up(option, str(port), other, "0"), within=60)
    finally:
        holder.close()

    assert code == 1
    assert f"port {port} on 127.0.0.1 is already in use" in stderr
    assert f"sdcguard local up {option} 0" in stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_sigterm_while_serving_stops_it() -> None:
    proc = _up("--port", "0")
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("export ")  # serving

    proc.send_signal(signal.SIGTERM)

    code, stderr = _finish(proc, within=30)
    assert code == 0
    assert "local stand-in stopped" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 1.5, 3.0])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_starting_stops_it(delay: float, signum: int) -> None:
    # Wherever the signal lands (interpreter start, imports, binding, the first exports), the process ends.
    proc = _up("--port", "0")
    time.sleep(delay)

    proc.send_signal(signum)

    # (A Ctrl-C inside the interpreter's own imports prints Python's KeyboardInterrupt traceback: still a stop.)
    code, stderr = _finish(proc, within=30)
    assert code in (0, 1, 130, -signum), stderr


@pytest.mark.slow
def test_a_second_signal_while_stopping_ends_it_at_once() -> None:
    proc = _up("--port", "0")
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("export ")

    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)

    # Both usually arrive before the process runs either handler; the SIGTERM still ends it, by SIGTERM
    # (it used to be taken as a second request to stop, and the process ran on through its teardown).
    code, _ = _finish(proc, within=30)
    assert code == -signal.SIGTERM

