"""A process whose guard talks over gloo waits a moment at exit for gloo's workers (sdcguard.agent.exit_grace)."""

from __future__ import annotations

import atexit
from collections.abc import Callable

import pytest
import torch.distributed as dist

from sdcguard.agent import exit_grace


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], None]]:
    """What ``atexit.register`` was given, from a process that has registered nothing yet."""
    calls: list[Callable[[], None]] = []
    monkeypatch.setattr(exit_grace, "_registered", False)
    monkeypatch.setattr(atexit, "register", calls.append)
    return calls


def test_a_gloo_group_registers_the_wait_once(registered: list[Callable[[], None]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert exit_grace.settle_gloo_at_exit(None)
    assert exit_grace.settle_gloo_at_exit(None)  # a second guard in the same process adds nothing
    assert registered == [exit_grace._settle]
    slept: list[float] = []
    monkeypatch.setattr(exit_grace.time, "sleep", slept.append)
    registered[0]()
    assert slept == [exit_grace.GRACE_S]


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_only_a_group_with_gloo_waits(registered: list[Callable[[], None]], monkeypatch: pytest.MonkeyPatch,
                                      backend: str) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert exit_grace.settle_gloo_at_exit(None) is ("gloo" in backend)
    assert len(registered) == ("gloo" in backend)
