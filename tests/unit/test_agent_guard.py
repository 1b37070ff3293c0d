"""SDCGuard in a one-rank gloo world: the update is skipped on an alarm and each policy does what it says."""

from __future__ import annotations

import builtins
import contextlib
import os
import random
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sdcguard.agent import ALARM_EXIT_CODE, GuardAlarm, GuardConfig, SDCGuard, replay
from sdcguard.agent.checkpoint import CheckpointSaveFailed, CheckpointWriter
from sdcguard.agent.config import OnAlarm
from sdcguard.agent.decide import AlarmDecision, Context, Decision
from sdcguard.agent.detectors import StepDetector
from sdcguard.agent.findings import GatheredFindings, StepFindings
from sdcguard.agent.publisher import Publisher, PublishOutcome
from sdcguard.agent.testing.inject import Injection
from sdcguard.agent.testing.train import JobShape, SyntheticData, build, loss_fn
from sdcguard.agent.weights import state_fingerprint_hex
from sdcguard.contract import Alarm, Detector, ProductCheckEvidence, ProductSite
from sdcguard.lineage.store import ObjectStore, open_store
from tests.functional.product_scenarios import script_defaults


@pytest.fixture(scope="module", autouse=True)
def one_rank_world() -> Iterator[None]:
    threads = torch.get_num_threads()  # the guard pins 1; give the rest of the session its own back
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


class Recorder(Publisher):
    """Keeps what it was asked to publish instead of sending it."""

    def __init__(self, config: GuardConfig | None = None) -> None:
        super().__init__(config or GuardConfig())
        self.sent: list[Alarm] = []

    def publish(self, alarm: Alarm) -> PublishOutcome:
        self.sent.append(alarm)
        return PublishOutcome(delivered=True, event_id="recorded")

    def deliver(self, alarm: Alarm, *, deadline: float | None = None) -> PublishOutcome:
        return self.publish(alarm)


class Flaky(ObjectStore):
    """A local store whose first ``failures`` writes fail as an S3 outage would."""

    def __init__(self, inner: ObjectStore, failures: int) -> None:
        self.inner, self.failures, self.writes = inner, failures, 0

    def put_bytes(self, key: str, data: bytes, **kwargs: Any) -> str:
        self.writes += 1
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("Could not connect to the endpoint URL")
        return self.inner.put_bytes(key, data, **kwargs)

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        return self.inner.get_bytes(key)

    def digest(self, key: str) -> tuple[str, int]:
        return self.inner.digest(key)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list(prefix)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        return self.inner.list_dirs(prefix)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def uri(self, key: str = "") -> str:
        return self.inner.uri(key)


def guard_for(tmp_path: Path, on_alarm: OnAlarm, inject: str | None, recorder: Recorder | None = None,
              **kwargs: Any) -> tuple[SDCGuard, Recorder]:
    shape = JobShape(dim=16, layers=1, seq=8, batch=2)
    ddp, optimizer = build(shape, torch.device("cpu"))
    config = GuardConfig(on_alarm=on_alarm, audit_every=1, fingerprint_every=1, spool_dir=str(tmp_path),
                         checkpoint_prefix=str(tmp_path / "ckpt"), checkpoint_retry_delay_s=0.01,
                         **kwargs.pop("config", {}))
    # The guard's own spool: a default config would republish whatever another run left in ./sdcguard-spool.
    recorder = recorder or Recorder(config)
    guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=SyntheticData(shape, torch.device("cpu")),
                     config=config, publisher=recorder, injection=Injection.parse(inject) if inject else None,
                     **kwargs)
    return guard, recorder


def test_clean_steps_update_and_pass(tmp_path: Path) -> None:
    guard, recorder = guard_for(tmp_path, "raise", None)
    before = state_fingerprint_hex(guard.params, guard.optimizer)
    results = [guard.step(s) for s in range(3)]
    assert all(r.updated and r.alarm is None and r.weights_checked for r in results)
    # One rank is one node: nobody to audit.
    assert not any(r.audited for r in results)
    assert state_fingerprint_hex(guard.params, guard.optimizer) != before
    assert guard.last_clean["nonfinite_grad"] == 2
    assert guard.last_clean["weight_fingerprint"] == 2
    assert recorder.sent == []


def test_raise_carries_the_alarm_and_skips_the_update(tmp_path: Path) -> None:
    guard, recorder = guard_for(tmp_path, "raise", "kind=nan_activation,rank=0,step=1")
    guard.step(0)
    before = state_fingerprint_hex(guard.params, guard.optimizer)
    with pytest.raises(GuardAlarm) as caught:
        guard.step(1)
    assert caught.value.alarm.detector.value == "nonfinite_grad"
    assert caught.value.alarm.step == 1
    assert recorder.sent == [caught.value.alarm]
    assert state_fingerprint_hex(guard.params, guard.optimizer) == before


def test_stop_exits_with_the_alarm_code(tmp_path: Path) -> None:
    guard, recorder = guard_for(tmp_path, "stop", "kind=nan_activation,rank=0,step=0")
    with pytest.raises(SystemExit) as caught:
        guard.step(0)
    assert caught.value.code == ALARM_EXIT_CODE == 87
    assert len(recorder.sent) == 1


def test_continue_returns_the_alarm_and_keeps_going(tmp_path: Path) -> None:
    guard, recorder = guard_for(tmp_path, "continue", "kind=nan_activation,rank=0,step=1")
    results = [guard.step(s) for s in range(3)]
    assert [r.alarm is not None for r in results] == [False, True, False]
    assert [r.updated for r in results] == [True, False, True]
    assert len(recorder.sent) == 1


def test_a_model_that_is_not_ddp_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^model:"):
        SDCGuard(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters()),
                 loss_fn=loss_fn, batch_for=lambda s, r: None, config=GuardConfig())


def test_deterministic_algorithms_follow_the_audit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One rank is one node: no audit, so the job's own setting is left alone.
    guard_for(tmp_path, "raise", None)
    assert not torch.are_deterministic_algorithms_enabled()
    # What the guard calls when the audit is on (the 3-node resume test checks it in real ranks).
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # unset, and restored after the test
    replay.use_deterministic_algorithms(torch.device("cpu"))
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ""
    replay.use_deterministic_algorithms(torch.device("cuda", 0))  # only sets the variable: no GPU needed
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == replay.CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the job's own choice is kept
    replay.use_deterministic_algorithms(torch.device("cuda", 0))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_a_restart_restores_the_last_clean_steps_from_its_manifest(tmp_path: Path) -> None:
    # Given: a checkpoint saved when the audit was last clean at step 2 and the weights at step 3.
    guard, _ = guard_for(tmp_path, "raise", None)
    for s in range(4):
        guard.step(s)
    guard.last_clean["ring_audit"] = 2
    guard.save_checkpoint(4)
    # When: a new start resumes from it.
    fresh, _ = guard_for(tmp_path, "raise", None)
    assert fresh.resume_step() == 4
    # Then: it claims no more than the manifest does, and nothing for the every-step detectors yet.
    assert fresh.last_clean == {"nonfinite_grad": None, "ring_audit": 2, "weight_fingerprint": 4,
                                "reduced_grad": None, "product_check": None, "magnitude_trigger": None}


def test_resume_gives_the_job_back_the_extra_it_saved(tmp_path: Path) -> None:
    # Given: a job that saves its own state (a loader's epoch) with a checkpoint, and an LR schedule.
    guard, _ = guard_for(tmp_path, "raise", None)
    guard.scheduler = torch.optim.lr_scheduler.StepLR(guard.optimizer, step_size=1)
    for s in range(2):
        guard.step(s)
    guard.save_checkpoint(2, extra={"epoch": 7, "seen": [1, 2]})
    # When: a new start resumes from it.
    fresh, _ = guard_for(tmp_path, "raise", None)
    fresh.scheduler = torch.optim.lr_scheduler.StepLR(fresh.optimizer, step_size=1)
    assert fresh.resumed_extra == {}
    assert fresh.resume_step() == 2
    # Then: the job's extra comes back as saved, without the guard's own loop state.
    assert fresh.resumed_extra == {"epoch": 7, "seen": [1, 2]}
    assert fresh.resumed is not None
    assert fresh.resumed.step == 2
    assert fresh.scheduler.last_epoch == 2  # the guard's own loop state went where it belongs


def test_a_spooled_alarm_is_republished_by_the_next_start_before_it_trains(tmp_path: Path) -> None:
    guard, _ = guard_for(tmp_path, "continue", "kind=nan_activation,rank=0,step=0")
    [alarm] = [r.alarm for r in [guard.step(0)] if r.alarm is not None]
    (tmp_path / f"alarm-{alarm.alarm_id}.json").write_text(alarm.model_dump_json())  # as a failed publish leaves it
    later = Recorder(GuardConfig(spool_dir=str(tmp_path), checkpoint_prefix=str(tmp_path / "ckpt")))  # the same job
    restarted, _ = guard_for(tmp_path, "raise", None, recorder=later)
    assert later.sent == [alarm]
    assert restarted.republished[alarm.alarm_id].delivered
    assert not (tmp_path / f"alarm-{alarm.alarm_id}.json").exists()


def test_an_s3_outage_at_checkpoint_time_is_retried_then_the_policy_applies(tmp_path: Path) -> None:
    # A short outage: the first two writes fail, the third attempt goes through.
    store = Flaky(open_store(str(tmp_path / "ckpt")), failures=2)
    guard, _ = guard_for(tmp_path, "raise", None, checkpoints=CheckpointWriter(store))
    guard.step(0)
    saved = guard.save_checkpoint(1)
    assert saved is not None
    assert saved.step == 1
    # A long one: "continue" (the default) logs it and returns None, "raise" raises CheckpointSaveFailed.
    store.failures = 100
    assert guard.save_checkpoint(2) is None
    strict, _ = guard_for(tmp_path, "raise", None, checkpoints=CheckpointWriter(Flaky(store.inner, 100)),
                          config={"on_checkpoint_failure": "raise", "checkpoint_retries": 2})
    with pytest.raises(CheckpointSaveFailed):
        strict.save_checkpoint(1)


class HookFailed(RuntimeError):
    """What a model's state-dict hook raised (torchtitan's FusedQKVLinear tripped DCP's get_state_dict so)."""


def failing_hook(*_: Any) -> None:
    raise HookFailed("the fused weight cannot be split")


def test_a_state_dict_that_raises_stops_the_save_with_its_traceback_and_is_never_retried(tmp_path: Path) -> None:
    # Given: a guard under the default on_checkpoint_failure ("continue"), whose model's state-dict hook raises.
    store = Flaky(open_store(str(tmp_path / "ckpt")), failures=0)
    guard, _ = guard_for(tmp_path, "raise", None, checkpoints=CheckpointWriter(store))
    guard.step(0)
    guard.model.module.register_state_dict_post_hook(failing_hook)
    # When / then: the save raises the hook's own error at once, its traceback reaching into the hook.
    with pytest.raises(HookFailed) as caught:
        guard.save_checkpoint(1)
    assert "failing_hook" in [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    # Not retried, nothing stored, nothing committed.
    assert store.writes == 0
    assert store.list() == []


def test_the_run_id_does_not_follow_pythons_random_seed(tmp_path: Path) -> None:
    random.seed(1234)
    first, _ = guard_for(tmp_path, "raise", None)
    random.seed(1234)
    second, _ = guard_for(tmp_path, "raise", None)
    assert first.run_id != second.run_id


_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
"""The ways a tensor's value comes back to the host (each a wait on a GPU)."""


@pytest.mark.parametrize("product_checks", [False, True], ids=["defaults", "product-checks"])
def test_a_clean_step_under_the_defaults_waits_on_the_host_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 product_checks: bool) -> None:
    # Given: a guard with GuardConfig's defaults (trigger on, confirmation on), past the weight-check step;
    # and the same with every matrix product checked (their flags travel in the same copy).
    shape = JobShape(dim=16, layers=1, seq=8, batch=2)
    ddp, optimizer = build(shape, torch.device("cpu"))
    config = GuardConfig(spool_dir=str(tmp_path), checkpoint_prefix=str(tmp_path / "ckpt"),
                         product_checks=product_checks)
    guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=SyntheticData(shape, torch.device("cpu")),
                     config=config, publisher=Recorder(config), injection=None)
    guard.step(0)
    # When: a clean step runs with every read of a tensor's value counted (the optimizer's own left out).
    reads: list[str] = []
    counting = [True]
    for name in _HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            if counting[0]:
                reads.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    optimizer.register_step_pre_hook(lambda *_: counting.__setitem__(0, False))
    optimizer.register_step_post_hook(lambda *_: counting.__setitem__(0, True))
    result = guard.step(1)
    # Then: one read brought the loss, the norm, the trigger's flag and the ranks' agreement back.
    assert result.updated
    if product_checks:
        assert guard.products is not None
        assert guard.products.checked > 0
    assert not result.weights_checked
    assert reads == ["tolist"]


def test_a_resumed_guard_s_trigger_watches_from_its_first_step(tmp_path: Path) -> None:
    # Given: a job past the trigger's warm-up, checkpointed through the guard.
    guard, _ = guard_for(tmp_path, "raise", None, config={"trigger_warmup": 3, "trigger_window": 8})
    for s in range(5):
        guard.step(s)
    assert guard.trigger is not None
    assert not guard.trigger.warming_up
    saved_history, saved_seen = guard.trigger.state()
    guard.save_checkpoint(5)
    # When: a new start resumes from it.
    fresh, _ = guard_for(tmp_path, "raise", None, config={"trigger_warmup": 3, "trigger_window": 8})
    assert fresh.trigger is not None
    assert fresh.trigger.warming_up
    assert fresh.resume_step() == 5
    # Then: its trigger holds the saved history and fires from the first resumed step on.
    assert not fresh.trigger.warming_up
    history, seen = fresh.trigger.state()
    assert seen == saved_seen
    assert torch.equal(history[:seen].isnan(), saved_history[:seen].isnan())
    assert torch.allclose(history[:seen].nan_to_num(), saved_history[:seen].nan_to_num(), rtol=0, atol=0)
    assert fresh.resumed_extra == {}
    fresh.step(5)
    loss = torch.tensor(1e30, dtype=torch.float64)
    assert bool(fresh.trigger.fires(loss, torch.tensor(1.0, dtype=torch.float64)))


def third_forward_product_flipped() -> Any:
    """Around a step: one exponent flip (bit 26) in element 1 of the output of its third forward matrix product
    (the campaign's product fault: a dispatch mode below the checks' interception, as a faulty kernel is)."""
    from sdcguard.campaign.injectors import ProductMode, flip

    count = [0]

    def corrupt(out: torch.Tensor, direction: str) -> None:
        if direction == "fwd":
            if count[0] == 2:
                flip(out, 1, 26)
            count[0] += 1

    return ProductMode(corrupt)


def test_without_another_node_a_product_mismatch_alone_is_the_alarm(tmp_path: Path) -> None:
    # Given: one rank (no other node to recompute on) with product checks on, and one exponent flip in the
    # output of the third forward product of step 2.
    guard, recorder = guard_for(tmp_path, "continue", None, config={"product_checks": True})
    results = []
    for step in range(4):
        with third_forward_product_flipped() if step == 2 else contextlib.nullcontext():
            results.append(guard.step(step))
    # Then: that step alone raised a product-check alarm naming rank 0 and the product, and skipped the update.
    assert [r.alarm is not None for r in results] == [False, False, True, False]
    alarm = results[2].alarm
    assert alarm is not None
    assert alarm.detector.value == "product_check"
    assert alarm.suspect_ranks == [0]
    assert isinstance(alarm.evidence, ProductCheckEvidence)
    assert guard.products is not None
    assert [(s.rank, s.site) for s in alarm.evidence.sites] == [(0, guard.products.sites[2])]
    assert alarm.evidence.sites[0].site.endswith(" forward")
    assert not results[2].updated
    assert recorder.sent == [alarm]


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_script_s_default_device_and_dtype_change_nothing_the_guard_does(tmp_path: Path, dtype: str) -> None:
    # Given: a guard with product checks and the weight check on every step; then the training script sets
    # torch's default device and dtype (on a GPU: torch.set_default_device("cuda"); meta here, where no data
    # can be read: a host tensor that followed it would crash the compiled kernels).
    guard, recorder = guard_for(tmp_path, "continue", "kind=nan_activation,rank=0,step=1",
                                config={"product_checks": True})
    with script_defaults({"default_device": "meta", "default_dtype": dtype}):
        # When: it trains through a non-finite gradient, a product fault and clean steps, and checkpoints.
        results = []
        for step in range(5):
            with third_forward_product_flipped() if step == 3 else contextlib.nullcontext():
                results.append(guard.step(step))
        saved = guard.save_checkpoint(5)
    # Then: each finding at its own step, by its own detector, every clean step updated, and the checkpoint
    # resumes (a fresh start, under torch's own defaults).
    assert [r.alarm.detector.value if r.alarm else None for r in results] == [
        None, "nonfinite_grad", None, "product_check", None]
    assert [r.updated for r in results] == [True, False, True, False, True]
    assert all(r.weights_checked for r in results if r.updated)
    assert saved is not None
    fresh, _ = guard_for(tmp_path, "continue", None, config={"product_checks": True})
    assert fresh.resume_step() == 5
    assert fresh.step(5).updated
    assert len(recorder.sent) == 2


# -- a detector of the job's own ---------------------------------------------------------------------------
# docs/adding-a-detector.md's LossCeiling, written here as a job would write it. The contract's Detector enum is
# closed (a detector of sdcguard's own adds its value and its evidence to contract/alarm.py), so this one borrows
# the product checks' name and evidence.


class LossCeiling(StepDetector[list[int]]):
    """Flags every rank whose loss is above ``ceiling``; its verdict (those ranks) is an alarm at once."""

    detector = Detector.PRODUCT_CHECK  # borrowed: see above
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


def test_a_detector_of_the_jobs_own_fires_is_decided_and_raises_its_alarm(tmp_path: Path) -> None:
    # Given the job's own detector beside the built-in ones, and a ceiling no loss reaches
    ceiling = LossCeiling(1e9)
    guard, recorder = guard_for(tmp_path, "continue", None, detectors=[ceiling])
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
        guard_for(tmp_path, "continue", None, detectors=["ceiling"])
