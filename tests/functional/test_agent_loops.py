"""The guard in the loops people run: accumulation, clipping, bf16 autocast, an LR schedule, a GradScaler,
frozen parameters and parameters without a gradient (issue 14), in real process groups (gloo).

Given 3 simulated nodes of 2 ranks (world 6), one launch runs every scenario
(loop_scenarios.py): a run stopped at step 3, checkpointed and resumed into a
differently initialised job ends bit-identical to one that never stopped,
weights, optimizer state and learning rate included; clipping bounds an SGD
run's displacement by steps x lr x max_norm (and the same run unclipped goes
past it); every forward the guard runs is under autocast; a model with frozen,
rarely used and never used parameters is audited every step without an alarm;
and every injected fault kind is still caught, at its step, with the right
suspects, with K = 3 micro-batches.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from sdcguard.contract import Alarm
from sdcguard.infra.local.standin import LocalStandIn
from tests.forked import launch_forked
from tests.functional import loop_scenarios

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORLD, PER_NODE, K = 6, 2, 3
# The whole loop: K micro-batches, clipping, bf16 autocast and a warm-up/cosine schedule.
LOOP = {"accum": K, "max_grad_norm": 0.05, "autocast": "bfloat16", "schedule": 6}
SGD_STEPS, SGD_LR, TINY_NORM = 5, 0.1, 1e-3
# ... and at step 2 of "autocast", rank 1's sample makes its gradients infinite: the same local rank on the
# previous and the next node recompute rank 1's whole step (K more forwards each) to confirm it.
CONFIRMERS = {(1 - PER_NODE) % WORLD, 1 + PER_NODE}

FAULTS = [
    ("nan_activation", "kind=nan_activation,rank=3,step=3", "nonfinite_grad", 3, [3]),
    ("finite_activation", "kind=finite_activation,rank=3,step=4,factor=1e4,repeat=2", "ring_audit", 4, [3]),
    ("grad_bitflip", "kind=grad_bitflip,rank=1,step=4,bit=22,repeat=2", "ring_audit", 4, [1]),
    ("reduced_grad_corrupt", "kind=reduced_grad_corrupt,rank=5,step=3,factor=2", "reduced_grad", 3, [5]),
    ("weight_bitflip", "kind=weight_bitflip,rank=2,step=3,bit=22", "weight_fingerprint", 4, [2]),
]
# Between audits: bit 30 of one gradient element of micro-batch 0 (~1e-2 -> ~1e36), caught by the trigger.
TRIGGER = ("trigger", "kind=grad_bitflip,rank=3,step=13,bit=30", "magnitude_trigger", 13, [3])


def node_name(node: int) -> str:
    return f"hyperpod-i-0{node:x}{'a' * 14}{node}"


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory, standin: LocalStandIn) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("loops")
    bus = f"sdcguard-loops-{uuid.uuid4().hex[:8]}"
    standin.client("events").create_event_bus(Name=bus)
    scenarios: list[dict[str, Any]] = [
        {"name": "resume", "kind": "resume", **LOOP, "steps": 6, "stop": 3, "prefix": str(tmp / "ckpt")},
        {"name": "resume_scaler", "kind": "resume", "accum": K, "max_grad_norm": 1.0, "schedule": 6,
         "scaler_init": 1024.0, "steps": 6, "stop": 3, "prefix": str(tmp / "ckpt-scaler")},
        {"name": "clipped", "accum": K, "optimizer": "sgd", "lr": SGD_LR, "max_grad_norm": TINY_NORM,
         "steps": SGD_STEPS},
        {"name": "unclipped", "accum": K, "optimizer": "sgd", "lr": SGD_LR, "steps": SGD_STEPS},
        # Audits and weight checks every step, and a sample that breaks any GPU (a confirmation's recomputations).
        {"name": "autocast", **LOOP, "steps": 4, "audit_every": 1, "fingerprint_every": 1,
         "poison": [[2, 1, float("inf")]]},
        {"name": "branchy", "model": "branchy", "accum": K, "max_grad_norm": 1.0, "steps": 4, "audit_every": 1,
         "fingerprint_every": 1},
    ]
    scenarios += [{"name": name, **LOOP, "steps": 6, "inject": inject} for name, inject, *_ in FAULTS]
    scenarios += [{"name": TRIGGER[0], **LOOP, "schedule": 16, "steps": 16, "audit_every": 10,
                   "fingerprint_every": 5, "inject": TRIGGER[1]},
                  {"name": "checkpoint_bad", "kind": "checkpoint_bad", **LOOP, "steps": 3,
                   "prefix": str(tmp / "ckpt-bad"), "inject": "kind=checkpoint_corrupt,rank=0,step=3"}]
    env = {**standin.env, "SDCGUARD_EVENT_BUS": bus, "SDCGUARD_SPOOL_DIR": str(tmp / "spool")}
    for rank in range(WORLD):
        env[f"NODE_NAME@{rank}"] = node_name(rank // PER_NODE)
        env[f"POD_NAME@{rank}"] = env[f"HOSTNAME@{rank}"] = f"gpt-test-worker-{rank}"
    codes = launch_forked(WORLD, loop_scenarios.run, (str(tmp), scenarios, PER_NODE), env=env, timeout=500)
    assert codes == [0] * WORLD, f"ranks exited with {codes}"
    results = [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    print("scenario seconds (rank 0):", {k: round(v["seconds"], 1) for k, v in results[0].items()})
    return results


def test_a_resumed_run_is_bit_identical_to_one_that_never_stopped(six: list[dict[str, Any]]) -> None:
    for name in ("resume", "resume_scaler"):
        for rank_results in six:
            run = rank_results[name]
            assert run["saved"]
            assert run["resume_step"] == 3
            # The fresh job started elsewhere: weights, learning rate, and a schedule at its first step.
            assert run["before_resume"]["everything"] != run["straight"]["everything"]
            assert run["before_resume"]["lr"] != run["at_stop"]["lr"]
            # ... and ended where the run that never stopped did: weights, optimizer state, buffers,
            # learning rate, the schedule's and the scaler's state.
            assert run["resumed"] == run["straight"], name
            # The schedule moved after the stop, so the learning rate had to come back exactly.
            assert run["straight"]["lr"] != run["at_stop"]["lr"]
    scaler = six[0]["resume_scaler"]
    assert scaler["straight"]["scale"] == 1024.0 * 2**3, "the scale grew every 2 clean steps"


def test_clipping_bounds_the_update(six: list[dict[str, Any]]) -> None:
    bound = SGD_STEPS * SGD_LR * TINY_NORM
    for rank_results in six:
        clipped, unclipped = rank_results["clipped"], rank_results["unclipped"]
        assert clipped["alarm_count"] == unclipped["alarm_count"] == 0
        assert clipped["updated"] == unclipped["updated"] == SGD_STEPS
        assert 0 < clipped["displacement"] <= bound * (1 + 1e-6)
        # Unclipped, the same run goes past the bound: the check can fail.
        assert unclipped["displacement"] > 10 * bound
        # grad_norm is the norm before clipping, and without clipping the hook reports it.
        assert all(n > 10 * TINY_NORM for n in clipped["grad_norms"])
        first_clipped, first_unclipped = clipped["grad_norms"][0], unclipped["grad_norms"][0]
        assert abs(first_clipped - first_unclipped) <= 1e-5 * first_unclipped
    assert len({r["clipped"]["everything"] for r in six}) == 1


def test_every_forward_runs_under_autocast_and_recomputes_bit_identically(six: list[dict[str, Any]]) -> None:
    for rank, rank_results in enumerate(six):
        run = rank_results["autocast"]
        # Audits every step found nothing: under bf16 the recomputations reproduced every bit.
        assert run["alarm_count"] == 0, run["alarm"]
        assert run["audits"] == 4
        assert run["data_faults"] == [2]
        assert run["updated"] == 3
        # The settling pass, K micro-batches a step and K more for each audit ...
        assert len(run["forwards"]) == 1 + 4 * K + 4 * K + (K if rank in CONFIRMERS else 0)
        assert {tuple(f) for f in run["forwards"]} == {(True, "torch.bfloat16")}
        # A run without autocast_dtype shows up as such: the check can fail.
        assert {f[0] for f in rank_results["clipped"]["forwards"]} == {False}


def test_frozen_rare_and_unused_parameters_do_not_break_the_hook_or_the_audit(six: list[dict[str, Any]]) -> None:
    for rank_results in six:
        run = rank_results["branchy"]
        assert run["alarm_count"] == 0, run["alarm"]
        assert run["audits"] == 4
        assert run["updated"] == 4
    assert len({r["branchy"]["everything"] for r in six}) == 1


@pytest.mark.parametrize(("name", "inject", "detector", "step", "suspects"), [*FAULTS, TRIGGER],
                         ids=[f[0] for f in [*FAULTS, TRIGGER]])
def test_every_fault_is_still_caught_with_accumulation(
    six: list[dict[str, Any]], name: str, inject: str, detector: str, step: int, suspects: list[int],
) -> None:
    per_rank = [r[name] for r in six]
    alarms = [Alarm.model_validate(r["alarm"]) for r in per_rank if r["alarm"]]
    assert len(alarms) == WORLD, "every rank reaches the same verdict"
    alarm = alarms[0]
    assert {a.alarm_id for a in alarms} == {alarm.alarm_id}
    assert (alarm.detector.value, alarm.step, alarm.suspect_ranks, alarm.localized) == (detector, step, suspects,
                                                                                         True)
    assert alarm.suspect_nodes == sorted({node_name(r // PER_NODE) for r in suspects})
    assert all(r["alarm_step_updated"] is False and r["weights_unchanged"] for r in per_rank)


def test_a_corrupted_checkpoint_is_still_refused(six: list[dict[str, Any]]) -> None:
    for rank_results in six:
        run = rank_results["checkpoint_bad"]
        assert run["saved"]
        assert run["refused"]
