"""The stage a drill plays on: a seeded cluster with the pipeline deployed on a running stand-in.

:class:`Stage` hands out clients bound to the stand-in; :func:`aws_environment`
points this process's default clients at it for a while (the operator CLI
reads the environment); :data:`Operator` is how the drill runs ``sdcguard``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s

from sdcguard.infra.drill.chaos import DrillChaos

Operator = Callable[[list[str]], int]
"""The operator CLI, ``sdcguard ARGV``: prints what the command prints and returns its exit status."""


def cli_in_a_subprocess(argv: list[str]) -> int:
    """``python -m sdcguard ARGV`` in a child process with this process's environment (the default operator).

    ``sdcguard drill`` passes the CLI's own ``main`` instead, which runs in this
    process; the drill cannot import it (the CLI is above it)."""
    done = subprocess.run([sys.executable, "-m", "sdcguard", *argv], capture_output=True, text=True, check=False)
    sys.stdout.write(done.stdout + done.stderr)
    return done.returncode


@dataclass
class Stage:
    """A seeded cluster with the pipeline deployed on a running stand-in."""

    standin: Any
    seeded: dict[str, Any]
    stack_name: str
    outputs: dict[str, str]
    seconds: dict[str, float] = field(default_factory=dict)
    operator: Operator = cli_in_a_subprocess
    """How the drill runs ``sdcguard incidents``/``approve``/``reject``."""
    chaos: DrillChaos = field(init=False)
    """The stand-in's chaos knobs (off unless a drill turns them on)."""

    def __post_init__(self) -> None:
        self.chaos = DrillChaos(self.standin)

    def client(self, service: str) -> Any:
        """A boto3 client bound to the stand-in."""
        return self.standin.client(service)

    @property
    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables that reach the stand-in."""
        return dict(self.standin.env)

    def kube(self) -> k8s.ApiClient:
        """A Kubernetes client for the seeded EKS cluster (through EKS DescribeCluster and an STS token)."""
        from sdcguard.lambdas.eks_token import kubernetes_client

        return kubernetes_client(self.seeded["eks_cluster"], eks=self.client("eks"), sts=self.client("sts"))


@contextlib.contextmanager
def aws_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Point this process's default boto3 clients at ``env`` (as `sdcguard local up` tells a shell), then restore."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
