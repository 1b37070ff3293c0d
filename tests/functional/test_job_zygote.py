"""Replay Jobs forked from the zygote: what a Job shows is what a plain process shows, and nothing outlives the stand-in.

A node check's ``sdcguard replay`` is forked from a process that imported
torch once (``infra/local/eks/zygote.py``). Its log, its exit status, a kill
and the stand-in's stop must read as they do for a plain process.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import kubernetes.client as k8s
import pytest

from sdcguard.infra.local.eks.bearer_token import eks_bearer_token, kubernetes_configuration
from sdcguard.infra.local.eks.hyperpod_node import hyperpod_node
from sdcguard.infra.local.eks.job_runner import JobRunner, process_env
from sdcguard.infra.local.eks.server import EksApiServer
from sdcguard.infra.local.eks.zygote import ForkedProcess, Zygote
from tests.capsules import write


@pytest.fixture(scope="module")
def capsule(tmp_path_factory: pytest.TempPathFactory) -> str:
    result = write(tmp_path_factory.mktemp("ckpt"))
    assert result.written, result.reason
    return result.location


@pytest.fixture(scope="module")
def runners() -> Iterator[tuple[JobRunner, JobRunner]]:
    # In the checkout, as the stand-in's Jobs: the capsule's factory (tests.capsules) imports from there.
    forked, plain = JobRunner(), JobRunner(zygote=False)
    yield forked, plain
    forked.stop_all()
    plain.stop_all()


def _env(node: str, fault: str | None = None) -> dict[str, str]:
    container = {
        "env": [{"name": "NODE_NAME", "value": node}, {"name": "SDCGUARD_INJECT", "value": "ignored"}]
    }
    return process_env(container, {}, {"AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "workload"}, fault)


def _replay(capsule: str, *more: str) -> list[str]:
    return [sys.executable, "-m", "sdcguard", "replay", capsule, *more]


def _run(runner: JobRunner, argv: list[str], env: dict[str, str]) -> tuple[int, str | None, str]:
    pod = f"p-{uuid.uuid4().hex[:8]}"
    ended: queue.Queue[tuple[int, str | None]] = queue.Queue()
    runner.start("ns", pod, argv, env, lambda code, killed: ended.put((code, killed)))
    code, killed = ended.get(timeout=120)
    return code, killed, runner.log("ns", pod) or ""


def _timeless(log: str) -> str:
    """The log without what differs from run to run: seconds taken, log records' times."""
    log = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", "TIME", log)
    log = re.sub(r'"seconds":[0-9.e-]+', '"seconds":0', log)
    return re.sub(r"\([0-9.]+ s\)", "(s)", log)


def test_a_forked_replay_logs_and_exits_as_a_plain_process(
    runners: tuple[JobRunner, JobRunner], capsule: str
) -> None:
    forked, plain = runners
    node = "hyperpod-i-0123456789abcdef0"
    faulty = _env(node, f"kind=finite_activation,node={node},step=0,repeat=50")
    # (Each plain run imports torch: a few cases. The faulty node's --json report, through the API, is
    # test_standin_jobs'.)
    cases = [
        (_replay(capsule, "--repeat", "2", "--json"), _env(node)),  # healthy: exit 0, progress and report
        (_replay(capsule, "--repeat", "2"), faulty),  # the fault reproduced: exit 1, the text report
        (_replay(capsule, "--repeat", "0"), _env(node)),  # refused by argparse: exit 2, usage on stderr
    ]
    codes = []
    for argv, env in cases:
        # When the same command runs forked from the zygote and as a plain process
        code, killed, log = _run(forked, argv, env)
        want_code, want_killed, want_log = _run(plain, argv, env)
        # Then both log the same lines and exit with the same status
        assert (code, killed) == (want_code, want_killed), (argv, log, want_log)
        assert _timeless(log) == _timeless(want_log), argv
        codes.append(code)
    assert codes == [0, 1, 2]
    assert all(isinstance(run.process, ForkedProcess) for run in forked._runs.values())  # the zygote ran them
    # Another command runs plainly
    code, _, log = _run(
        forked, [sys.executable, "-c", "import os; print(os.environ['NODE_NAME'])"], _env(node)
    )
    assert (code, log) == (0, node + "\n")


def test_killing_a_forked_replay_kills_it_as_a_deadline_does(
    runners: tuple[JobRunner, JobRunner], capsule: str
) -> None:
    forked, _ = runners
    ended: queue.Queue[tuple[int, str | None]] = queue.Queue()
    # Given a replay that would run for minutes, under way
    forked.start(
        "ns",
        "long",
        _replay(capsule, "--repeat", "1000000"),
        _env("hyperpod-i-0123456789abcdef1"),
        lambda code, killed: ended.put((code, killed)),
    )
    deadline = time.monotonic() + 60
    while "repetition 2/" not in (forked.log("ns", "long") or "") and time.monotonic() < deadline:
        time.sleep(0.05)
    process = forked._runs[("ns", "long")].process
    assert isinstance(process, ForkedProcess)
    assert process.pid is not None
    # When its deadline kills it
    assert forked.kill("ns", "long", "DeadlineExceeded")
    # Then it ends killed, as a plain process does (SIGKILL: a container's exit code 137), and is gone
    assert ended.get(timeout=30) == (-9, "DeadlineExceeded")
    with pytest.raises(ProcessLookupError):
        os.kill(process.pid, 0)


def _children(pid: int) -> list[int]:
    found = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    )
    return [int(p) for p in found.stdout.split()]


def test_no_process_outlives_the_stand_in(capsule: str) -> None:
    # Given a stand-in whose replay Job is under way, forked from its zygote
    server = EksApiServer().start()
    token = eks_bearer_token("zygote", _sts(), expires_in=900)
    admin = k8s.ApiClient(kubernetes_configuration(server.url, server.ca_data, token))
    node = str(k8s.CoreV1Api(admin).create_node(hyperpod_node("i-" + uuid.uuid4().hex[:17])).metadata.name)
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "replay"},
        "spec": {
            "template": {
                "spec": {
                    "nodeName": node,
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "replay",
                            "image": "train:1",
                            "command": ["sdcguard", "replay", capsule, "--repeat", "1000000"],
                        }
                    ],
                }
            }
        },
    }
    k8s.BatchV1Api(admin).create_namespaced_job("default", job)
    deadline = time.monotonic() + 60
    zygote = server.jobs.runner.zygote
    while time.monotonic() < deadline and not (zygote and zygote.process and _children(zygote.process.pid)):
        time.sleep(0.05)
        zygote = server.jobs.runner.zygote
    assert zygote is not None
    assert zygote.process is not None
    [child] = _children(zygote.process.pid)
    # When the stand-in stops
    server.stop()
    # Then neither the zygote nor the Job's process is left
    assert zygote.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def _sts() -> Any:
    return boto3.client(
        "sts", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
    )


def test_a_replay_runs_plainly_when_the_zygote_cannot_start(capsule: str) -> None:
    # Given a runner whose zygote fails its imports
    runner = JobRunner()
    runner.zygote = Zygote(Path.cwd(), dict(os.environ), preload=("no_such_module_here",))
    try:
        # When a replay Job runs
        code, killed, log = _run(
            runner, _replay(capsule, "--repeat", "0"), _env("hyperpod-i-0123456789abcdef2")
        )
        # Then it ran as a plain process, with the command's own answer
        assert (code, killed) == (2, None)
        assert "--repeat: must be >= 1, got 0" in log
        assert runner.zygote.process is not None
        assert runner.zygote.process.poll() is not None
        assert all(
            isinstance(run.process, ForkedProcess) and run.process.pid for run in runner._runs.values()
        )
    finally:
        runner.stop_all()
