"""A detector of the job's own, added as docs/adding-a-detector.md shows, run through guarded steps (one-rank gloo).

The detector is the page's ``LossCeiling``, written here as a job would write
it. The contract's ``Detector`` enum is closed (a detector of sdcguard's own
adds its value and its evidence to ``contract/alarm.py``), so this one borrows
the product checks' name and evidence.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sdcguard.agent import GuardConfig, SDCGuard
from sdcguard.agent.decide import AlarmDecision, Context, Decision
from sdcguard.agent.detectors import StepDetector
from sdcguard.agent.findings import GatheredFindings, StepFindings
from sdcguard.agent.publisher import Publisher, PublishOutcome
from sdcguard.agent.testing.train import JobShape, SyntheticData, build, loss_fn
from sdcguard.agent.weights import state_fingerprint_hex
from sdcguard.contract import Alarm, Detector, ProductCheckEvidence, ProductSite


class LossCeiling(StepDetector[list[int]]):
    """Flags every rank whose loss is above ``ceiling``; its verdict (those ranks) is an alarm at once."""

    detector = Detector.PRODUCT_CHECK  # borrowed: see the module's docstring
    flag_width = row_width = 1  # one flag, in found.marks[detector]

    def __init__(self, ceiling: float) -> None:
        self.ceiling = ceiling

    def observe(self, step: int, found: StepFindings) -> None:
        # On the device: nothing comes back to the host on a clean step.
        found.marks[self.detector] = found.loss.detach() > self.ceiling

    def judge(self, rows: GatheredFindings, found: StepFindings) -> list[int] | None:
        return torch.nonzero(rows.of(self)[:, 0]).reshape(-1).tolist() or None

    def final(self, verdict: list[int]) -> bool:
        return True  # no recomputation asked: the ranks it names are the suspects

    def at_once(self, verdict: list[int], context: Context) -> Decision:
        return Decision.raise_alarm(AlarmDecision(
            self.detector, verdict, True, ProductCheckEvidence(sites=[ProductSite(rank=r, site="loss") for r in verdict]),
            f"the loss of rank(s) {verdict} is above {self.ceiling}"))


class Recorder(Publisher):
    """Keeps what it was asked to publish instead of sending it."""

    def __init__(self, config: GuardConfig) -> None:
        super().__init__(config)
        self.sent: list[Alarm] = []

    def publish(self, alarm: Alarm) -> PublishOutcome:
        self.sent.append(alarm)
        return PublishOutcome(delivered=True, event_id="recorded")


@pytest.fixture(scope="module", autouse=True)
def one_rank_world() -> Iterator[None]:
    threads = torch.get_num_threads()  # the guard pins 1; give the rest of the session its own back
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


def _guard(tmp_path: Path, *detectors: StepDetector[list[int]]) -> tuple[SDCGuard, Recorder]:
    shape = JobShape(dim=16, layers=1, seq=8, batch=2)
    ddp, optimizer = build(shape, torch.device("cpu"))
    config = GuardConfig(on_alarm="continue", spool_dir=str(tmp_path), checkpoint_prefix=str(tmp_path / "ckpt"))
    recorder = Recorder(config)
    guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=SyntheticData(shape, torch.device("cpu")),
                     config=config, publisher=recorder, injection=None, detectors=detectors)
    return guard, recorder


def test_a_detector_of_the_jobs_own_fires_is_decided_and_raises_its_alarm(tmp_path: Path) -> None:
    # Given the job's own detector beside the built-in ones, and a ceiling no loss reaches
    ceiling = LossCeiling(1e9)
    guard, recorder = _guard(tmp_path, ceiling)
    assert guard.detectors[-1] is ceiling
    # Then clean steps stay silent and update
    clean = [guard.step(s) for s in range(2)]
    assert [(r.updated, r.alarm) for r in clean] == [(True, None), (True, None)]
    assert recorder.sent == []
    assert guard.last_clean[Detector.PRODUCT_CHECK.value] == 1
    # When every loss is above the ceiling
    ceiling.ceiling = 0.0
    before = state_fingerprint_hex(guard.params, guard.optimizer)
    fired = guard.step(2)
    # Then its verdict is decided at once: its alarm, published, the update skipped
    assert fired.alarm is not None
    assert fired.alarm.detector is Detector.PRODUCT_CHECK
    assert fired.alarm.suspect_ranks == [0]
    assert fired.alarm.message.startswith("the loss of rank(s) [0] is above 0.0")
    assert fired.alarm.evidence == ProductCheckEvidence(sites=[ProductSite(rank=0, site="loss")])
    assert not fired.updated
    assert recorder.sent == [fired.alarm]
    assert state_fingerprint_hex(guard.params, guard.optimizer) == before


def test_a_detector_that_is_not_one_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^detectors: 'ceiling' is not a sdcguard.agent.detectors.StepDetector"):
        _guard(tmp_path, "ceiling")  # type: ignore[arg-type]
