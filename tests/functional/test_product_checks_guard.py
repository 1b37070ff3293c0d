"""Product checks wired into the guard's step, and no blind window after a start (issue 28), in real process
groups (gloo): 3 simulated nodes of 1 rank, under ``GuardConfig``'s defaults (audit every 100 steps).

One launch (tests/functional/product_scenarios.py) runs: a transient bit flip
in one forward and in one backward matrix product of rank 1's own pass, with
product checks on: caught at its own step by the product check, rank 1 named
with the product's site, the update skipped on every rank; a clean run with
product checks on (dropout) that stays silent; and a loss of ~1e35 on rank 2
at step 2 of a fresh job (inside the magnitude trigger's warm-up), which the
cross-rank test catches; and the forward flip again with the ring audit and the weight votes on every
other step, under the default device and dtype a training script may set (``meta`` and fp64 here: on a GPU,
``torch.set_default_device("cuda")``), which the guard's host tensors must not follow; and the forward flip
in a compiled model (a backend whose code rounds otherwise than eager, as inductor's does) with the ring
audit on every other step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sdcguard.contract import Alarm, ProductCheckEvidence
from tests.forked import launch_forked
from tests.functional import product_scenarios

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORLD = 3
CLEAN_STEPS = 30
STEPS = 6
# A flip of bit 26 (an exponent bit: the element x256 or /256): visible, finite, not a NaN.
PRODUCT_FAULTS = {
    "product_fwd": ({"kind": "product", "rank": 1, "step": 4, "direction": "fwd", "product": 4, "bit": 26},
                    "blocks.0.fc forward"),
    "product_bwd": ({"kind": "product", "rank": 1, "step": 4, "direction": "bwd", "product": 1, "bit": 26},
                    "head backward dW"),
}
WARMUP_FAULT = {"kind": "loss", "rank": 2, "step": 2, "factor": 2.5e34}
SCRIPT_DEFAULTS = {"default_device": "meta", "default_dtype": "float64",
                   "config": {"audit_every": 2, "fingerprint_every": 2}}
"""What a training script may have set before its loop, and every check of the step running."""


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("products")
    scenarios: list[dict[str, Any]] = [
        {"name": name, "product_checks": True, "steps": STEPS, "fault": fault}
        for name, (fault, _) in PRODUCT_FAULTS.items()
    ]
    scenarios += [
        {"name": "clean", "product_checks": True, "steps": CLEAN_STEPS},
        {"name": "warmup_loss", "steps": 4, "fault": WARMUP_FAULT},
        {"name": "script_defaults", "product_checks": True, "steps": STEPS, "fault": PRODUCT_FAULTS["product_fwd"][0],
         **SCRIPT_DEFAULTS},
        {"name": "compiled", "product_checks": True, "steps": STEPS, "fault": PRODUCT_FAULTS["product_fwd"][0],
         "compiled": True, "config": {"audit_every": 2}},
    ]
    codes = launch_forked(WORLD, product_scenarios.run, (str(tmp), scenarios), timeout=500)
    assert codes == [0] * WORLD, f"ranks exited with {codes}"
    return [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", list(PRODUCT_FAULTS))
def test_a_transient_product_fault_is_caught_at_its_step_and_names_the_rank_and_the_product(
        three: list[dict[str, Any]], name: str) -> None:
    fault, site = PRODUCT_FAULTS[name]
    assert three[1][name]["flipped"] == 1
    alarms = [Alarm.model_validate(r[name]["alarm"]) for r in three]
    alarm = alarms[0]
    # Then: the same alarm on every rank, at the faulty step, by the product check, naming rank 1 and the product.
    assert {a.alarm_id for a in alarms} == {alarm.alarm_id}
    assert alarm.step == fault["step"]
    assert alarm.detector.value == "product_check"
    assert alarm.suspect_ranks == [1]
    assert alarm.localized
    assert isinstance(alarm.evidence, ProductCheckEvidence)
    assert [(s.rank, s.site) for s in alarm.evidence.sites] == [(1, site)]
    # ... confirmed by the two other nodes' recomputations, which disagree with rank 1's own pass.
    assert {(p.auditor, p.audited) for p in alarm.evidence.confirmation} == {(0, 1), (2, 1)}
    assert alarm.fault_persistence == "transient"
    assert all(r[name]["alarm_step_updated"] is False for r in three)
    assert all(r[name]["updated"] == STEPS - 1 and r[name]["alarm_count"] == 1 for r in three)
    # Every step before it passed the product checks; the sampled checks still bound what is trusted.
    assert alarm.last_clean.product_check == fault["step"] - 1
    assert alarm.trusted_through_step() == min(fault["step"], alarm.last_clean.ring_audit or 0)


def test_a_clean_run_with_product_checks_stays_silent(three: list[dict[str, Any]]) -> None:
    for r in three:
        run = r["clean"]
        assert run["alarm_count"] == 0, run["alarm"]
        assert run["product_flags"] == 0
        assert run["updated"] == CLEAN_STEPS


def test_a_huge_loss_in_a_fresh_job_s_first_steps_is_caught(three: list[dict[str, Any]]) -> None:
    # Given: rank 2's loss ~1e35 at step 2, inside the magnitude trigger's warm-up (10 steps of its own history).
    alarms = [r["warmup_loss"]["alarm"] for r in three]
    assert all(a is not None for a in alarms), "a catastrophic loss in the warm-up went silent"
    alarm = Alarm.model_validate(alarms[0])
    # Then: the cross-rank test asked, the other nodes' recomputations disagree: rank 2, at that step.
    assert alarm.step == WARMUP_FAULT["step"]
    assert alarm.detector.value == "magnitude_trigger"
    assert alarm.evidence.kind == "magnitude_trigger"
    assert alarm.suspect_ranks == [2]
    assert all(r["warmup_loss"]["alarm_step_updated"] is False for r in three)


def test_the_script_s_default_device_and_dtype_change_nothing_the_guard_does(three: list[dict[str, Any]]) -> None:
    # Given: the forward flip of product_fwd, with the ring audit and the weight votes on every other step,
    # while torch's default device is meta and its default dtype fp64 (set by the script, as
    # torch.set_default_device("cuda") would be on a GPU). Before, every rank crashed in the weight
    # fingerprint (a host buffer on the default device handed to the compiled kernel), and fp64 ones were
    # read as fp32 by the product checks (a false alarm at every step).
    fault, site = PRODUCT_FAULTS["product_fwd"]
    run = [r["script_defaults"] for r in three]
    alarm = Alarm.model_validate(run[0]["alarm"])
    # Then: the same outcome as under torch's own defaults: one alarm, at the faulty step, rank 1 and the
    # product named, confirmed by the other nodes, every other step updated (audited steps included).
    assert {Alarm.model_validate(r["alarm"]).alarm_id for r in run} == {alarm.alarm_id}
    assert (alarm.step, alarm.detector.value, alarm.suspect_ranks) == (fault["step"], "product_check", [1])
    assert isinstance(alarm.evidence, ProductCheckEvidence)
    assert [(s.rank, s.site) for s in alarm.evidence.sites] == [(1, site)]
    assert {(p.auditor, p.audited) for p in alarm.evidence.confirmation} == {(0, 1), (2, 1)}
    assert all(r["alarm_count"] == 1 and r["updated"] == STEPS - 1 for r in run)
    assert alarm.last_clean.ring_audit == alarm.step - 2  # the last audit before it passed


def test_a_compiled_model_is_audited_and_confirmed_as_its_checked_pass_ran(three: list[dict[str, Any]]) -> None:
    # Given: a compiled model (its compiled code rounds otherwise than eager), product checks on, so the own
    # pass runs eagerly; the ring audit every other step; the forward flip of product_fwd at step 4. Before,
    # the audit recomputed compiled: every audited step differed on every rank, and all three were blamed.
    fault, site = PRODUCT_FAULTS["product_fwd"]
    run = [r["compiled"] for r in three]
    alarm = Alarm.model_validate(run[0]["alarm"])
    # Then: the audits pass; the one alarm is the product check's, at the faulty step, confirmed by the
    # recomputations on the two other nodes (run as the checked pass ran), naming rank 1 and the product.
    assert all(r["alarm_count"] == 1 and r["updated"] == STEPS - 1 for r in run), alarm.message
    assert (alarm.step, alarm.detector.value, alarm.suspect_ranks) == (fault["step"], "product_check", [1])
    assert isinstance(alarm.evidence, ProductCheckEvidence)
    assert [(s.rank, s.site) for s in alarm.evidence.sites] == [(1, site)]
    assert {(p.auditor, p.audited) for p in alarm.evidence.confirmation} == {(0, 1), (2, 1)}
    assert alarm.last_clean.ring_audit == alarm.step - 2
