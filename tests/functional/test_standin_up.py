"""``sdcguard local up`` from a shell: exports first, a working stand-in, a clean stop on Ctrl-C."""

from __future__ import annotations

import os
import shlex
import signal
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
