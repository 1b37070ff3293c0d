"""The agent in real process groups (gloo on CPU): every injected fault is caught by the right detector.

Given 3 simulated nodes of 2 ranks (world 6), one launch (process start-up
dominates on a small machine) runs a scenario per fault kind; each must be
caught at the expected step by the detector that should see it, name the right
ranks and nodes, skip the update, and publish an alarm that arrives on the
stand-in's EventBridge bus (read back through a rule that targets an SQS
queue). The same launch checks that a GradScaler's overflow is not an alarm,
that a 2-node world (a group of ranks 0-3) names both ranks of a failed audit,
that checkpoints saved through the guard resume bit-exactly and a corrupted one
is refused, and that clean runs over two seeds and 240 steps raise
nothing. A second launch runs the reference job's command line and checks the
exit code of on_alarm=stop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sdcguard.agent.config import ALARM_EXIT_CODE
from sdcguard.contract import Alarm
from sdcguard.infra.local.standin import LocalStandIn
from tests.forked import launch_forked
from tests.functional import agent_scenarios

# One launch of 6 ranks carries the whole matrix; on 2 busy cores its set-up alone
# has taken ~4 minutes, past the suite's default per-test timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
NODE_IDS = ["0aaaaaaaaaaaaaaa0", "0bbbbbbbbbbbbbbb1", "0ccccccccccccccc2"]


def node_name(node: int) -> str:
    return f"hyperpod-i-{NODE_IDS[node]}"


def rank_env(world: int, ranks_per_node: int) -> dict[str, str]:
    """Per-rank NODE_NAME/POD_NAME/HOSTNAME, as the downward API would set them."""
    env = {}
    for rank in range(world):
        env[f"NODE_NAME@{rank}"] = node_name(rank // ranks_per_node)
        env[f"POD_NAME@{rank}"] = env[f"HOSTNAME@{rank}"] = f"gpt-test-worker-{rank}"
    return env


@pytest.fixture(scope="module")
def alarm_bus(standin: LocalStandIn) -> tuple[str, str]:
    """A fresh bus whose rule sends every agent alarm to an SQS queue: (bus name, queue URL)."""
    suffix = uuid.uuid4().hex[:8]
    events, sqs = standin.client("events"), standin.client("sqs")
    bus = f"sdcguard-agent-{suffix}"
    events.create_event_bus(Name=bus)
    events.put_rule(Name=f"alarms-{suffix}", EventBusName=bus,
                    EventPattern=json.dumps({"source": ["sdcguard.agent"], "detail-type": ["SDC Alarm"]}))
    queue = sqs.create_queue(QueueName=f"alarms-{suffix}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_targets(Rule=f"alarms-{suffix}", EventBusName=bus, Targets=[{"Id": "q", "Arn": arn}])
    return bus, queue


def received(standin: LocalStandIn, queue: str, seen: dict[str, Alarm], done: Callable[[], bool],
             timeout: float = 10) -> None:
    """Drain the queue into ``seen`` (alarm_id -> Alarm, each validated) until ``done()`` or the timeout."""
    sqs = standin.client("sqs")
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        for message in sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages", []):
            event = json.loads(message["Body"])
            assert event["source"] == "sdcguard.agent"
            assert event["detail-type"] == "SDC Alarm"
            alarm = Alarm.model_validate(event["detail"])
            seen[alarm.alarm_id] = alarm
            sqs.delete_message(QueueUrl=queue, ReceiptHandle=message["ReceiptHandle"])


def run_world(tmp: Path, standin: LocalStandIn, bus: str, world: int, ranks_per_node: int,
              scenarios: list[dict[str, Any]], timeout: float = 200) -> list[dict[str, Any]]:
    env = {**standin.env, **rank_env(world, ranks_per_node), "SDCGUARD_EVENT_BUS": bus,
           "SDCGUARD_SPOOL_DIR": str(tmp / "spool")}
    codes = launch_forked(world, agent_scenarios.run, (str(tmp), scenarios, ranks_per_node), env=env, timeout=timeout)
    assert codes == [0] * world, f"ranks exited with {codes}"
    results = [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(world)]
    print("scenario seconds (rank 0):", {k: round(v["seconds"], 1) for k, v in results[0].items()})
    return results


# -- 3 nodes x 2 ranks --------------------------------------------------------------------------------

# name, injection, expected detector, step and suspects. repeat=2: a persistent fault, which also corrupts
# what the faulty rank recomputes for its neighbour, so both of its audits fail.
FAULTS = [
    ("nan_activation", "kind=nan_activation,rank=3,step=3", "nonfinite_grad", 3, [3]),
    ("finite_activation", "kind=finite_activation,rank=3,step=4,factor=1e4,repeat=2", "ring_audit", 4, [3]),
    ("grad_bitflip", "kind=grad_bitflip,rank=1,step=4,bit=22,repeat=2", "ring_audit", 4, [1]),
    ("reduced_grad_corrupt", "kind=reduced_grad_corrupt,rank=5,step=3,factor=2", "reduced_grad", 3, [5]),
    # The flip lands after step 3's update; the weight check at the start of step 4 sees it.
    ("weight_bitflip", "kind=weight_bitflip,rank=2,step=3,bit=22", "weight_fingerprint", 4, [2]),
    # A frozen parameter (no gradient, no optimizer state) is in the weight fingerprint too.
    ("frozen_bitflip", "kind=weight_bitflip,rank=2,step=3,bit=22,param=pos.weight", "weight_fingerprint", 4, [2]),
    ("node_fault", f"kind=finite_activation,node={node_name(2)},step=4,repeat=3", "ring_audit", 4, [4, 5]),
    ("scaler_nan", "kind=nan_activation,rank=4,step=3", "nonfinite_grad", 3, [4]),
]
SCALER = {"scaler_nan": 1024.0}
FROZEN = {"frozen_bitflip": ["pos.weight"]}

# Issue 13: faults between audits, data faults, and checking that changes nothing.
BETWEEN = {"audit_every": 10, "fingerprint_every": 5, "steps": 16}
# Bit 30 of an fp32 is the top exponent bit: a gradient of ~1e-2 becomes ~1e36, finite (the silent case).
TRIGGER_FAULT = "kind=grad_bitflip,rank=3,step=13,bit=30"
NEW_SCENARIOS: list[dict[str, Any]] = [
    {"name": "trigger_transient", **BETWEEN, "inject": TRIGGER_FAULT + ",repeat=1"},
    {"name": "trigger_persistent", **BETWEEN, "inject": TRIGGER_FAULT + ",repeat=4"},
    {"name": "data_inf", **BETWEEN, "poison": [[12, 4, float("inf")]], "stop_at_alarm": False},
    {"name": "fp16_one_rank", **BETWEEN, "poison": [[12, 1, 1e36]], "scaler_init": 1024.0, "stop_at_alarm": False},
    {"name": "data_limit", **BETWEEN, "poison": [[s, 0, float("inf")] for s in range(2, 16)], "max_data_faults": 2,
     "stop_at_alarm": False},
    # A trigger so sensitive that every step past its warm-up asks for a confirmation: clean steps reproduce.
    {"name": "clean_confirmed", "steps": 14, "audit_every": 10, "fingerprint_every": 5, "trigger_ratio": 1.000001,
     "track_weights": False, "stop_at_alarm": False},
    {"name": "bn_audited", "model": "bn", "steps": 12, "audit_every": 1, "fingerprint_every": 1,
     "track_weights": False, "stop_at_alarm": False},
    {"name": "bn_unchecked", "model": "bn", "steps": 12, "audit_every": 0, "fingerprint_every": 0,
     "trigger_ratio": 0.0, "track_weights": False, "stop_at_alarm": False},
]


CLEAN_SEEDS = (1, 2)
CLEAN_STEPS = 120  # (the coverage campaign soaks 100,002 clean rank-steps: docs/coverage.md)


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory, standin: LocalStandIn,
        alarm_bus: tuple[str, str]) -> list[dict[str, Any]]:
    """One launch of 6 ranks (3 nodes x 2) that runs every scenario; each rank's results."""
    tmp = tmp_path_factory.mktemp("six")
    scenarios: list[dict[str, Any]] = [
        {"name": name, "inject": inject, "steps": 6, "scaler_init": SCALER.get(name), "freeze": FROZEN.get(name)}
        for name, inject, *_ in FAULTS
    ]
    scenarios += NEW_SCENARIOS
    scenarios += [
        # A loss scale so large that every rank's gradients overflow until the scaler backs off.
        {"name": "scaler_overflow", "steps": 24, "scaler_init": 2.0**127, "loss_gain": 100.0,
         "track_weights": False},
        # ... and an overflow that outlasts the allowed backoff is an alarm.
        {"name": "scaler_persist", "steps": 6, "scaler_init": 2.0**127, "loss_gain": 100.0, "max_overflow": 1,
         "track_weights": False},
        # Ranks 0-3 alone: a world of 2 nodes.
        {"name": "two_nodes", "ranks": [0, 1, 2, 3], "steps": 4,
         "inject": "kind=finite_activation,rank=3,step=2,factor=1e4"},
        {"name": "checkpoint_ok", "checkpoint": True, "steps": 3, "prefix": str(tmp / "ckpt-ok")},
        # ... and in a sub-group: the checkpoint's collectives stay inside it (ranks 4-5 do not take part).
        {"name": "checkpoint_group", "ranks": [0, 1, 2, 3], "checkpoint": True, "steps": 3,
         "prefix": str(tmp / "ckpt-group")},
        {"name": "checkpoint_bad", "checkpoint": True, "steps": 3, "prefix": str(tmp / "ckpt-bad"),
         "inject": "kind=checkpoint_corrupt,rank=0,step=3"},
    ]
    scenarios += [
        {"name": f"clean-{seed}", "seed": seed, "steps": CLEAN_STEPS, "audit_every": 10, "fingerprint_every": 5,
         "track_weights": False, "stop_at_alarm": False}
        for seed in CLEAN_SEEDS
    ]
    return run_world(tmp, standin, alarm_bus[0], 6, 2, scenarios, timeout=400)


@pytest.mark.parametrize(("name", "inject", "detector", "step", "suspects"), FAULTS, ids=[f[0] for f in FAULTS])
def test_every_fault_is_caught_named_skipped_and_published(
    six: list[dict[str, Any]], standin: LocalStandIn, alarm_bus: tuple[str, str],
    name: str, inject: str, detector: str, step: int, suspects: list[int],
) -> None:
    per_rank = [rank_results[name] for rank_results in six]
    alarms = [Alarm.model_validate(r["alarm"]) for r in per_rank if r["alarm"]]
    assert len(alarms) == 6, "every rank reaches the same verdict"
    alarm = alarms[0]
    assert {a.alarm_id for a in alarms} == {alarm.alarm_id}
    assert alarm.detector.value == detector
    assert alarm.step == step
    assert alarm.suspect_ranks == suspects
    assert alarm.localized
    assert alarm.suspect_nodes == sorted({node_name(r // 2) for r in suspects})
    assert [s.pod for s in alarm.suspects] == [f"gpt-test-worker-{r}" for r in suspects]
    assert [s.local_rank for s in alarm.suspects] == [r % 2 for r in suspects]
    assert alarm.job.job_name == "gpt-test"
    # The update of the alarm step was skipped on every rank: the weights did not move.
    assert all(r["alarm_step_updated"] is False and r["weights_unchanged"] for r in per_rank)
    # The lowest-ranked non-suspect published it, and it arrived on the bus.
    publisher = min(set(range(6)) - set(suspects))
    assert alarm.publisher_rank == publisher
    assert per_rank[publisher]["published"] is True
    assert all(r["published"] is None for i, r in enumerate(per_rank) if i != publisher)
    seen: dict[str, Alarm] = getattr(standin, "_agent_seen", {})
    standin._agent_seen = seen  # type: ignore[attr-defined]
    received(standin, alarm_bus[1], seen, lambda: alarm.alarm_id in seen)
    assert seen[alarm.alarm_id] == alarm
    # The firing detector was last clean before the fault, so the pipeline can pick a checkpoint.
    last_clean = getattr(alarm.last_clean, detector)
    assert last_clean is not None
    assert last_clean < step


def test_evidence_says_what_disagreed(six: list[dict[str, Any]]) -> None:
    def alarm(name: str) -> Alarm:
        return Alarm.model_validate(six[0][name]["alarm"])

    nan = alarm("nan_activation").evidence
    assert nan.kind == "nonfinite_grad"
    assert nan.local_ranks == [3]
    assert nan.reduced_nonfinite
    assert {b.rank for b in nan.buckets if b.phase == "local"} == {3}
    audit = alarm("finite_activation").evidence
    assert audit.kind == "ring_audit"
    assert {(p.auditor, p.audited) for p in audit.pairs} == {(1, 3), (3, 5)}
    assert all(not p.loss_match and p.mismatched_params for p in audit.pairs)
    flip = alarm("grad_bitflip").evidence
    assert flip.kind == "ring_audit"
    # A flipped gradient bit leaves the loss alone; the gradient fingerprints see it.
    assert all(p.loss_match for p in flip.pairs)
    assert all(len(p.mismatched_params) == 1 for p in flip.pairs)
    weights = alarm("weight_bitflip").evidence
    assert weights.kind == "weight_fingerprint"
    assert weights.majority is not None
    assert sorted(len(g.ranks) for g in weights.groups) == [1, 5]
    reduced = alarm("reduced_grad_corrupt").evidence
    assert reduced.kind == "reduced_grad"
    assert reduced.scope == "reduced_gradients"


def test_gradscaler_overflow_is_skipped_without_an_alarm(six: list[dict[str, Any]]) -> None:
    for rank_results in six:
        run = rank_results["scaler_overflow"]
        assert run["alarm"] is None
        assert run["overflow"] >= 1, "the huge loss scale overflowed"
        assert run["updated"] >= 1, "training went on once the scaler backed off"
        assert run["overflow"] + run["updated"] == 24


def test_gradscaler_overflow_past_its_backoff_is_an_alarm(six: list[dict[str, Any]]) -> None:
    alarm = Alarm.model_validate(six[0]["scaler_persist"]["alarm"])
    assert alarm.detector.value == "nonfinite_grad"
    assert alarm.step == 1
    # Every rank overflowed alike: real, but no rank to blame.
    assert alarm.suspects == []
    assert not alarm.localized
    assert alarm.evidence.kind == "nonfinite_grad"
    assert alarm.evidence.local_ranks == list(range(6))


def test_two_nodes_detect_and_name_both_ranks(six: list[dict[str, Any]]) -> None:
    assert "two_nodes" not in six[4]
    assert "two_nodes" not in six[5]
    alarm = Alarm.model_validate(six[0]["two_nodes"]["alarm"])
    assert alarm.detector.value == "ring_audit"
    assert alarm.step == 2
    # With 2 nodes each pair audits the other both ways: both are named, neither singled out.
    assert alarm.suspect_ranks == [1, 3]
    assert not alarm.localized
    assert alarm.suspect_nodes == [node_name(0), node_name(1)]


def test_clean_runs_raise_no_alarm(six: list[dict[str, Any]]) -> None:
    total = triggered = 0
    for seed in CLEAN_SEEDS:
        for rank_results in six:
            run = rank_results[f"clean-{seed}"]
            assert run["alarm_count"] == 0, run["alarm"]
            assert run["updated"] == CLEAN_STEPS
            assert run["losses_finite"]
            assert run["audits"] == CLEAN_STEPS // 10
            assert run["weight_checks"] == CLEAN_STEPS // 5
            assert run["data_faults"] == []
            triggered += run["triggered"]
        total += CLEAN_STEPS
    assert total == 240
    # The magnitude trigger's budget: at most 1% of a clean run's rank-steps ask for a confirmation.
    print(f"clean rank-steps {total * 6}, magnitude triggers {triggered}")
    assert triggered <= 0.01 * total * 6


def test_a_one_step_finite_fault_between_audits_is_caught_at_its_step_and_is_transient(
    six: list[dict[str, Any]],
) -> None:
    # Given: a gradient of rank 3 turned ~1e36 at step 13, no audit until step 20, the faulty
    # hardware right again on any recomputation (repeat=1).
    alarms = [Alarm.model_validate(r["trigger_transient"]["alarm"]) for r in six]
    # Then: the trigger asked, two other nodes recomputed, rank 3 alone is named, at that step.
    alarm = alarms[0]
    assert {a.alarm_id for a in alarms} == {alarm.alarm_id}
    assert alarm.detector.value == "magnitude_trigger"
    assert alarm.step == 13
    assert alarm.suspect_ranks == [3]
    assert alarm.localized
    assert alarm.evidence.kind == "magnitude_trigger"
    assert alarm.evidence.trigger == "magnitude"
    assert {(p.auditor, p.audited) for p in alarm.evidence.confirmation} == {(1, 3), (5, 3)}
    assert all(p.loss_match for p in alarm.evidence.confirmation)  # a gradient fault: the loss is right
    assert alarm.fault_persistence == "transient"
    assert all(r["trigger_transient"]["alarm_step_updated"] is False for r in six)
    assert all(r["trigger_transient"]["weights_unchanged"] for r in six)
    assert alarm.last_clean.ring_audit == 10


def test_a_fault_that_repeats_on_the_replay_is_persistent(six: list[dict[str, Any]]) -> None:
    alarm = Alarm.model_validate(six[0]["trigger_persistent"]["alarm"])
    assert (alarm.step, alarm.suspect_ranks, alarm.localized) == (13, [3], True)
    assert alarm.fault_persistence == "persistent"
    # ... and one the ring audit catches with a persistent fault is classified the same way.
    assert Alarm.model_validate(six[0]["finite_activation"]["alarm"]).fault_persistence == "persistent"
    assert Alarm.model_validate(six[0]["nan_activation"]["alarm"]).fault_persistence == "transient"
    assert Alarm.model_validate(six[0]["weight_bitflip"]["alarm"]).fault_persistence == "unknown"


def test_a_nan_reproduced_on_another_node_is_a_data_fault_not_an_alarm(six: list[dict[str, Any]]) -> None:
    for name in ("data_inf", "fp16_one_rank"):
        for rank_results in six:
            run = rank_results[name]
            assert run["alarm_count"] == 0, (name, run["alarm"])
            # data_fault on every rank, at the poisoned step only; the update skipped there; training goes on.
            assert run["data_faults"] == [12], name
            assert run["confirmed_steps"] == [12], name
            assert run["updated"] == 15, name
            assert run["error"] is None
    # Under a GradScaler the skip is the scaler's, with its backoff, on every rank alike.
    assert {r["fp16_one_rank"]["scale"] for r in six} == {512.0}
    assert all(r["fp16_one_rank"]["overflow"] == 1 for r in six)


def test_a_clean_step_confirmed_on_other_nodes_reproduces_bit_for_bit(six: list[dict[str, Any]]) -> None:
    for rank_results in six:
        run = rank_results["clean_confirmed"]
        assert run["confirmed_steps"] == [10, 11, 12, 13]
        assert run["alarm_count"] == 0, run["alarm"]
        assert run["data_faults"] == []
        assert run["updated"] == 14


def test_data_faults_past_the_limit_stop_the_run_with_a_clear_error(six: list[dict[str, Any]]) -> None:
    for rank_results in six:
        run = rank_results["data_limit"]
        assert run["alarm_count"] == 0
        assert run["data_faults"] == [2, 3]
        assert run["error"]["step"] == 4
        assert "not the hardware" in run["error"]["message"]
        assert "rank(s) [0]" in run["error"]["message"]


def test_auditing_every_step_changes_nothing(six: list[dict[str, Any]]) -> None:
    # A batch-norm model: an audit's forward in training mode would update the running statistics again.
    for rank_results in six:
        audited, unchecked = rank_results["bn_audited"], rank_results["bn_unchecked"]
        assert audited["audits"] == 12
        assert audited["alarm_count"] == unchecked["alarm_count"] == 0
        assert audited["updated"] == unchecked["updated"] == 12
        # Weights, optimizer state and every buffer, bit for bit.
        assert audited["everything"] == unchecked["everything"]
    assert len({r["bn_audited"]["everything"] for r in six}) > 1, "batch-norm statistics are per rank"


def test_checkpoint_saved_by_the_guard_resumes_bit_exact(six: list[dict[str, Any]]) -> None:
    for rank_results in six:
        run = rank_results["checkpoint_ok"]
        assert run["saved"]
        assert run["resume_step"] == 3
        assert run["before_resume"] != run["expected"]
        assert run["after_resume"] == run["expected"]


def test_a_checkpoint_in_a_sub_group_saves_and_resumes_within_it(six: list[dict[str, Any]]) -> None:
    assert all("checkpoint_group" not in r for r in six[4:])
    for rank_results in six[:4]:
        run = rank_results["checkpoint_group"]
        assert run["saved"]
        assert run["resume_step"] == 3
        assert run["after_resume"] == run["expected"] != run["before_resume"]
    assert six[0]["checkpoint_group"]["manifest_world_size"] == 4  # rank 0 of the group wrote the manifest


def test_corrupted_checkpoint_is_refused_on_every_rank(six: list[dict[str, Any]]) -> None:
    for rank_results in six:
        run = rank_results["checkpoint_bad"]
        assert run["saved"]
        assert run["resume_step"] is None
        assert run["refused"]


# -- the reference job's command line -------------------------------------------------------------------


def test_reference_job_stops_with_the_alarm_exit_code(tmp_path: Path, standin: LocalStandIn,
                                                      alarm_bus: tuple[str, str]) -> None:
    env = {**os.environ, **standin.env, "SDCGUARD_EVENT_BUS": alarm_bus[0],
           "SDCGUARD_INJECT": "kind=nan_activation,rank=1,step=3", "SDCGUARD_JOB_NAME": "gpt-stop",
           "SDCGUARD_SPOOL_DIR": str(tmp_path / "spool"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "sdcguard.agent.testing.train", "--nproc", "2", "--ranks-per-node", "1", "--steps", "6",
         "--audit-every", "2", "--fingerprint-every", "2", "--checkpoint-prefix", str(tmp_path / "ckpt"),
         "--node-names", f"{node_name(0)},{node_name(1)}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == ALARM_EXIT_CODE, done.stderr[-3000:]
    assert "SDCGUARD FAULT INJECTION IS ON" in done.stderr
    seen: dict[str, Alarm] = {}
    received(standin, alarm_bus[1], seen, lambda: any(a.job.job_name == "gpt-stop" for a in seen.values()))
    [alarm] = [a for a in seen.values() if a.job.job_name == "gpt-stop"]
    assert alarm.detector.value == "nonfinite_grad"
    assert alarm.step == 3
    assert alarm.suspect_ranks == [1]
    assert alarm.suspect_nodes == [node_name(1)]
    assert [s.pod for s in alarm.suspects] == ["gpt-stop-worker-1"]


def test_reference_job_refuses_node_names_that_do_not_fit() -> None:
    from sdcguard.agent.testing.train import main

    assert main(["--nproc", "4", "--ranks-per-node", "2", "--node-names", "a,b,c"]) == 2
