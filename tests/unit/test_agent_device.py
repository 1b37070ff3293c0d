"""Device discipline of the agent's pieces outside the step: the checkpoint collectives run on the rank's GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from sdcguard.agent import checkpoint
from sdcguard.agent.checkpoint import CheckpointWriter

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


class Stop(Exception):
    """Raised by the recorded collective: what the test wanted has been seen."""


@pytest.fixture
def nccl_rank_1(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Rank 1 of an NCCL job on a 2-GPU node whose current device is still GPU 0; the devices collectives saw."""
    seen: list[torch.device] = []

    def collective(tensor: Any, *_: Any, **__: Any) -> None:
        seen.append(tensor.device)
        raise Stop

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", collective)
    monkeypatch.setattr(dist, "broadcast", collective)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    return seen


def test_checkpoint_collectives_run_on_the_ranks_gpu_not_the_current_one(nccl_rank_1: list[torch.device]) -> None:
    with FakeTensorMode():  # fake CUDA tensors on a CPU build
        with pytest.raises(Stop):
            checkpoint._status_all(True)
        with pytest.raises(Stop):
            checkpoint._status_all(True, None, CUDA0)
    # By default LOCAL_RANK's GPU; the device the guard passes wins.
    assert nccl_rank_1 == [CUDA1, CUDA0]


def test_checkpoint_falls_back_to_the_current_gpu_only_where_local_rank_cannot_say(
        monkeypatch: pytest.MonkeyPatch, nccl_rank_1: list[torch.device]) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU visible to this process: it is cuda:0
    assert checkpoint._collective_device() == CUDA0
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert checkpoint._collective_device() == torch.device("cpu")


def test_a_checkpoint_writer_hands_its_device_to_every_collective(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Any) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda store, **kw: calls.append(kw["device"]))
    monkeypatch.setattr(checkpoint, "read_pointer", lambda store: (None, None))
    writer = CheckpointWriter(str(tmp_path), device=CUDA1)
    writer.load(model=torch.nn.Linear(1, 1))
    assert calls == [CUDA1]
    assert CheckpointWriter(str(tmp_path)).device is None
