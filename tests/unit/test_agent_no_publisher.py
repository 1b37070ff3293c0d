"""``SDCGuard(publisher=None)`` publishes nothing; left out, the guard publishes to EventBridge as before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import torch.distributed as dist

from sdcguard.agent import GuardConfig, SDCGuard
from sdcguard.agent.publisher import NoPublisher, Publisher
from sdcguard.agent.testing.inject import Injection
from sdcguard.agent.testing.train import JobShape, SyntheticData, build, loss_fn

FAULT = "kind=nan_activation,rank=0,step=0"


@pytest.fixture(scope="module", autouse=True)
def one_rank_world() -> Iterator[None]:
    threads = torch.get_num_threads()  # the guard pins 1; give the rest of the session its own back
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


class Bus:
    """Stands for boto3.client: records every client asked for and every event put."""

    def __init__(self) -> None:
        self.clients: list[str] = []
        self.events: list[dict[str, Any]] = []

    def client(self, service: str, **_: Any) -> Any:
        self.clients.append(service)
        return self

    def put_events(self, Entries: list[dict[str, Any]]) -> dict[str, Any]:
        self.events += Entries
        return {"FailedEntryCount": 0, "Entries": [{"EventId": f"event-{len(self.events)}"}]}


@pytest.fixture
def bus(monkeypatch: pytest.MonkeyPatch) -> Bus:
    recording = Bus()
    monkeypatch.setattr(boto3, "client", recording.client)
    return recording


def config(tmp_path: Path) -> GuardConfig:
    return GuardConfig(on_alarm="continue", audit_every=1, fingerprint_every=1, event_bus="sdcguard-test",
                       spool_dir=str(tmp_path / "spool"), checkpoint_prefix=str(tmp_path / "ckpt"))  # fmt: skip


def guard(cfg: GuardConfig, **publisher: Any) -> SDCGuard:
    shape = JobShape(dim=16, layers=1, seq=8, batch=2)
    ddp, optimizer = build(shape, torch.device("cpu"))
    return SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=SyntheticData(shape, torch.device("cpu")), config=cfg,
                    injection=Injection.parse(FAULT), **publisher)  # fmt: skip


def test_with_publisher_none_an_alarm_is_raised_but_sent_and_spooled_nowhere(
    tmp_path: Path, bus: Bus
) -> None:
    cfg = config(tmp_path)
    result = guard(cfg, publisher=None).step(0)
    assert result.alarm is not None  # the detectors and the policy still work
    assert not result.updated
    assert result.published is not None
    assert (result.published.delivered, result.published.spooled) == (False, [])
    assert bus.clients == []  # no EventBridge, no S3
    assert not Path(cfg.spool_dir).exists()


def test_with_publisher_none_an_earlier_spool_is_left_alone(tmp_path: Path, bus: Bus) -> None:
    cfg = config(tmp_path)
    spooled = Path(cfg.spool_dir) / "alarm-0123456789abcdef.json"
    spooled.parent.mkdir()
    spooled.write_text("{}")
    built = guard(cfg, publisher=None)
    assert isinstance(built.publisher, NoPublisher)
    assert built.republished == {}
    assert spooled.read_text() == "{}"
    assert bus.clients == []


def test_left_out_the_publisher_is_eventbridge_from_the_config(tmp_path: Path, bus: Bus) -> None:
    cfg = config(tmp_path)
    built = guard(cfg)
    assert type(built.publisher) is Publisher
    result = built.step(0)
    assert result.alarm is not None
    assert result.published is not None
    assert (result.published.delivered, result.published.event_id) == (True, "event-1")
    assert [e["EventBusName"] for e in bus.events] == ["sdcguard-test"]
    assert not Path(cfg.spool_dir).exists()  # delivered: nothing spooled
