"""The guard under tensor parallelism: TP 2 inside each of 3 nodes, FSDP2 replicas across them (gloo, CPU).

Every scenario runs in the one launch of ``tp_world`` (the ``tp_six``
fixture). Clean runs raise nothing, the replicas agree position by position
and the guarded job's losses are the unguarded job's bit for bit; a fault per
detector is caught at its step, named (the TP group's node, the rank where only
that rank's bits changed) and its update skipped; the meshes the guard cannot
check are refused at start naming TP; a TP checkpoint resumes bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sdcguard.agent.capsule import load_capsule
from sdcguard.cli import main
from sdcguard.contract import Alarm
from sdcguard.lineage.store import open_store
from sdcguard.lineage.verify import read_manifest
from tests.distributed.sharded_world import RANKS_PER_NODE, WORLD, node_name
from tests.distributed.tp_world import (
    CHECKPOINT_STEP,
    CLEAN_STEPS,
    FAULTS,
    LONG_AUDIT_EVERY,
    LONG_FINGERPRINT_EVERY,
    LONG_STEPS,
    NO_REPLICA_FAULTS,
    REDUCED,
    REFUSED,
    TRIGGER,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

Results = tuple[Path, list[dict[str, Any]]]


def _alarms(results: list[dict[str, Any]], name: str) -> list[Alarm]:
    return [Alarm.model_validate(r[name]["alarm"]) for r in results if r[name].get("alarm")]


def test_clean_tp_steps_raise_nothing_and_the_replicas_agree_position_by_position(tp_six: Results) -> None:
    results = tp_six[1]
    clean = [r["tp_clean"] for r in results]
    assert [c["alarms"] for c in clean] == [0] * WORLD
    assert all(c["audits"] == CLEAN_STEPS // 2 and c["weight_checks"] == CLEAN_STEPS // 2 for c in clean)
    assert all(c["updated"] == CLEAN_STEPS for c in clean)
    # Each (shard, tp) position holds the same bits in every replica, and the two TP positions differ.
    assert len({c["final"] for c in clean[0::2]}) == 1
    assert len({c["final"] for c in clean[1::2]}) == 1
    assert clean[0]["final"] != clean[1]["final"]
    # A TP group trains on one micro-batch: its ranks see one loss.
    assert all(clean[2 * n]["losses"] == clean[2 * n + 1]["losses"] for n in range(WORLD // 2))


def test_the_guarded_tp_job_loses_what_the_unguarded_one_does_bit_for_bit(tp_six: Results) -> None:
    for r in tp_six[1]:
        assert r["tp_clean"]["losses"] == r["tp_unguarded"]["losses"]


def test_torchtitans_dim_names_are_accepted(tp_six: Results) -> None:
    titan = [r["tp_titan_names"] for r in tp_six[1]]
    assert all(t["alarms"] == 0 and t["audits"] == 2 and t["weight_checks"] == 2 for t in titan)
    assert [t["losses"] for t in titan] == [r["tp_clean"]["losses"][:4] for r in tp_six[1]]


@pytest.mark.parametrize(("name", "inject", "detector", "step", "suspects", "persistence"), [*FAULTS, TRIGGER],
                         ids=[f[0] for f in [*FAULTS, TRIGGER]])
def test_a_tp_fault_is_caught_named_and_its_update_skipped(tp_six: Results, name: str, inject: str, detector: str,
                                                           step: int, suspects: list[int], persistence: str) -> None:
    results = tp_six[1]
    alarms = _alarms(results, name)
    assert len(alarms) == WORLD, "every rank reaches the same verdict"
    alarm = alarms[0]
    assert all(a.alarm_id == alarm.alarm_id for a in alarms)
    assert alarm.detector.value == detector, alarm.message
    assert alarm.step == step
    assert alarm.suspect_ranks == suspects, alarm.message
    assert alarm.localized
    assert alarm.fault_persistence == persistence
    # The faulty rank's node (a TP group is one node's).
    assert [s.node for s in alarm.suspects] == [node_name(r // RANKS_PER_NODE) for r in suspects]
    assert len({s.node for s in alarm.suspects}) == 1
    assert all(r[name]["alarm_step_updated"] is False and r[name]["weights_unchanged"] for r in results)


def test_a_corrupted_reduced_gradient_names_the_rank_of_its_position(tp_six: Results) -> None:
    name, _, detector, step, suspects = REDUCED
    alarm = _alarms(tp_six[1], name)[0]
    assert (alarm.detector.value, alarm.step, alarm.suspect_ranks) == (detector, step, suspects)
    assert all(r[name]["alarm_step_updated"] is False for r in tp_six[1])


def test_without_replicas_tp_runs_what_needs_none_and_catches_what_it_can(tp_six: Results) -> None:
    results = tp_six[1]
    clean = [r["tp_no_replicas"] for r in results]
    assert all(c["alarms"] == 0 and c["audits"] == 2 for c in clean)
    assert all(c["config"] == {"reduced_grad": False, "fingerprint_every": 0, "audit": True} for c in clean)
    for name, _, detector, step, suspects, persistence in NO_REPLICA_FAULTS:
        alarm = _alarms(results, name)[0]
        assert (alarm.detector.value, alarm.step, alarm.suspect_ranks, alarm.fault_persistence) == \
            (detector, step, suspects, persistence), alarm.message


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_mesh_the_guard_cannot_check_is_refused_at_start_on_every_rank(tp_six: Results, name: str) -> None:
    said = REFUSED[name][1]
    errors = [r[name].get("error") for r in tp_six[1]]
    assert all(e is not None and said in e for e in errors), errors[0]
    # Never a guard that trains on: the refusal comes before (or, for batch_for, at) the first step.
    assert all("alarm" not in r[name] for r in tp_six[1])


def test_the_product_checks_run_under_tp_and_skip_the_tp_layers_products(tp_six: Results) -> None:
    tp = [r["tp_products"] for r in tp_six[1]]
    hsdp = [r["hsdp_products"] for r in tp_six[1]]
    assert all(t["alarms"] == 0 and t["updated"] == 2 for t in tp)
    # The same model: under TP the checks see every product but the TP'd layers' (fc and out, forward and
    # backward: 6), whose operands are DTensors at the interception and whose local products run below it.
    # Not checked yet (docs/sharded.md); this count changes when they are.
    assert [t["products_checked"] for t in tp] == [h["products_checked"] - 6 for h in hsdp]


def test_resume_from_a_tp_checkpoint_is_bit_exact(tp_six: Results) -> None:
    for r in tp_six[1]:
        first, resumed = r["tp_ckpt_first"], r["tp_ckpt_resume"]
        assert first["saved"]
        assert resumed["refused"] is None
        assert resumed["at_resume"] == first["at_save"]
        assert resumed["final"] == first["final"]


def test_a_tp_checkpoint_is_refused_on_another_split_of_the_same_positions(tp_six: Results) -> None:
    for r in tp_six[1]:
        refused = r["tp_ckpt_other_split"]["refused"]
        assert refused is not None
        assert refused.startswith("CheckpointLayoutMismatch")
        assert "3 replica(s) x 1 shard(s) x TP 2; this job runs 3 x 2 x 1" in refused


def test_the_tp_manifest_records_one_agreed_fingerprint_per_position(tp_six: Results) -> None:
    tmp, results = tp_six
    manifest = read_manifest(open_store(str(tmp / "ckpt-tp")), CHECKPOINT_STEP)
    assert manifest.sharding is not None
    assert (manifest.sharding.replicas, manifest.sharding.shards) == (3, 2)
    assert manifest.fingerprint == results[0]["tp_ckpt_first"]["agreed"]
    assert len(set(manifest.sharding.shard_fingerprints)) == 2


def test_a_long_clean_tp_run_with_dropout_is_silent(tp_six: Results) -> None:
    long = [r["tp_long"] for r in tp_six[1]]
    assert [x["alarms"] for x in long] == [0] * WORLD
    assert all(x["audits"] == LONG_STEPS // LONG_AUDIT_EVERY for x in long)
    assert all(x["weight_checks"] == LONG_STEPS // LONG_FINGERPRINT_EVERY for x in long)
    assert all(x["updated"] == LONG_STEPS for x in long)


def test_a_tp_faults_capsule_replays_unsharded_and_reproduces_with_the_fault(
        tp_six: Results, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    tmp, results = tp_six
    alarm = _alarms(results, "tp_layer_fault")[0]
    location = tmp / "capsules-tp" / "capsules" / "step-000000002-rank-00003"
    assert f"replay capsule at {location}" in alarm.message
    assert "+ TP, 3 replicas x 1 shards x TP 2" in load_capsule(str(location)).manifest.origin["sharding"]
    # A healthy process gets the expected bits; the suspect's fault (its TP layer, installed as the injector
    # does on the unsharded model) reproduces.
    assert main(["replay", str(location), "--repeat", "2", "--json", "--quiet"]) == 0
    monkeypatch.setenv("SDCGUARD_INJECT", FAULTS[1][1])
    assert main(["replay", str(location), "--repeat", "2", "--json", "--quiet"]) == 1
    reports = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["matched"], r["reproduced"]) for r in reports] == [(2, 0), (0, 2)]
