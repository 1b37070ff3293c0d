"""The guard under FSDP2 in real process groups (gloo on CPU): a 3 x 2 HSDP mesh on 3 simulated nodes.

Every scenario runs in the one launch of ``sharded_world`` (the ``six``
fixture): each fault kind must be caught at the expected step by the detector
that should see it, name the right ranks and nodes, skip the update and publish
the alarm. A 1-D mesh (pure FSDP: no replica) must warn, run the checks that
need no replica and still catch what they can see. The sharded checkpoints:
saved through the guard, resumed into a differently initialised model,
bit-identical with the run that never stopped; refused when a shard file
changed or the mesh differs. And 300 clean steps with dropout raise nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sdcguard.contract import Alarm
from sdcguard.contract.alarm import FingerprintEvidence, NonFiniteEvidence, RingAuditEvidence
from sdcguard.contract.checkpoint import checkpoint_dir
from sdcguard.lineage.errors import NoSafeCheckpoint
from sdcguard.lineage.selection import select_checkpoint
from sdcguard.lineage.store import open_store
from sdcguard.lineage.verify import read_manifest
from tests.distributed.sharded_world import (
    ACCUM_FAULTS,
    CHECKPOINT_STEP,
    CLEAN_AUDIT_EVERY,
    CLEAN_FINGERPRINT_EVERY,
    CLEAN_STEPS,
    FAULTS,
    FSDP_FAULTS,
    RANKS_PER_NODE,
    TRIGGER_FAULTS,
    TWO_REPLICAS,
    WORLD,
    node_name,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _alarm_of(results: list[dict[str, Any]], name: str) -> list[Alarm]:
    return [Alarm.model_validate(r[name]["alarm"]) for r in results if r[name]["alarm"]]


CAUGHT = FAULTS + TRIGGER_FAULTS + ACCUM_FAULTS + FSDP_FAULTS


@pytest.mark.parametrize(("name", "inject", "detector", "step", "suspects", "persistence"), CAUGHT,
                         ids=[f[0] for f in CAUGHT])
def test_every_fault_is_caught_named_and_skipped(six: tuple[Path, list[dict[str, Any]]], name: str, inject: str,
                                                 detector: str, step: int, suspects: list[int],
                                                 persistence: str) -> None:
    tmp, results = six
    alarms = _alarm_of(results, name)
    assert len(alarms) == WORLD, "every rank reaches the same verdict"
    alarm = alarms[0]
    assert all(a.alarm_id == alarm.alarm_id for a in alarms)
    assert alarm.detector.value == detector, alarm.message
    assert alarm.step == step
    assert alarm.suspect_ranks == suspects
    assert alarm.localized
    assert alarm.fault_persistence == persistence
    assert [s.node for s in alarm.suspects] == [node_name(r // RANKS_PER_NODE) for r in suspects]
    assert all(r[name]["alarm_step_updated"] is False and r[name]["weights_unchanged"] for r in results)
    # Published once, by the lowest rank that is not a suspect.
    published = [Alarm.model_validate_json(line) for p in sorted(tmp.glob(f"alarms-{name}-rank-*.jsonl"))
                 for line in p.read_text().splitlines()]
    assert [a.alarm_id for a in published] == [alarm.alarm_id]
    assert (tmp / f"alarms-{name}-rank-{alarm.publisher_rank}.jsonl").exists()


def test_findings_are_confirmed_on_the_replica_groups_before_and_after(
        six: tuple[Path, list[dict[str, Any]]]) -> None:
    # A NaN made by rank 3's pass: ranks 1 and 5 (the same shard position, the groups before and after)
    # recompute its micro-batch, agree with each other and not with it.
    alarm = _alarm_of(six[1], "nan_activation")[0]
    assert isinstance(alarm.evidence, NonFiniteEvidence)
    assert sorted(p.auditor for p in alarm.evidence.confirmation) == [1, 5]
    assert {p.audited for p in alarm.evidence.confirmation} == {3}
    assert all(six[1][r]["nan_activation"]["confirmed"] == {"1": [3]} for r in range(WORLD))


def test_the_magnitude_trigger_asks_for_a_confirmation_off_the_audit_steps(
        six: tuple[Path, list[dict[str, Any]]]) -> None:
    alarm = _alarm_of(six[1], "trigger")[0]
    assert alarm.step % 2 == 1, "not an audit step"
    assert isinstance(alarm.evidence, RingAuditEvidence)
    assert alarm.evidence.trigger == "magnitude"
    assert six[1][3]["trigger"]["triggered"] >= 1


def test_without_confirmation_a_transient_fault_names_both_ranks_of_the_pair(
        six: tuple[Path, list[dict[str, Any]]]) -> None:
    alarms = _alarm_of(six[1], "unconfirmed")
    assert len(alarms) == WORLD
    assert (alarms[0].detector.value, alarms[0].step) == ("ring_audit", 2)
    assert alarms[0].suspect_ranks == [1, 3]
    assert not alarms[0].localized


def test_a_data_fault_is_reproduced_on_other_nodes_and_only_skips_the_update(
        six: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in six[1]:
        run = r["data_fault"]
        assert run["alarm"] is None
        assert run["data_faults"] == [1]
        assert run["confirmed"] == {"1": [3]}
        assert run["updated"] == 2, "steps 0 and 2 updated, step 1 skipped on every rank"


@pytest.mark.parametrize(("name", "inject", "detector", "step", "holders"), TWO_REPLICAS,
                         ids=[f[0] for f in TWO_REPLICAS])
def test_two_replicas_detect_without_naming(six: tuple[Path, list[dict[str, Any]]], name: str, inject: str,
                                            detector: str, step: int, holders: list[int]) -> None:
    alarms = _alarm_of(six[1], name)
    assert len(alarms) == WORLD
    alarm = alarms[0]
    assert alarm.detector.value == detector, alarm.message
    assert alarm.step == step
    assert alarm.suspect_ranks == []
    assert not alarm.localized
    assert "no strict majority" in alarm.message
    assert isinstance(alarm.evidence, FingerprintEvidence)
    assert sorted(r for g in alarm.evidence.groups for r in g.ranks) == holders


def test_accumulated_steps_audit_clean(six: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in six[1]:
        assert r["accum_clean"]["alarm"] is None
        assert r["accum_clean"]["updated"] == 4
        assert r["accum_clean"]["audits"] == 2


def test_reduced_gradient_evidence_names_the_shards_holders(six: tuple[Path, list[dict[str, Any]]]) -> None:
    alarm = _alarm_of(six[1], "reduced_grad_corrupt")[0]
    assert isinstance(alarm.evidence, FingerprintEvidence)
    groups = {tuple(g.ranks) for g in alarm.evidence.groups}
    # Shard position 1 is held by ranks 1, 3, 5: two agree, rank 5 does not.
    assert groups == {(1, 3), (5,)}
    assert alarm.evidence.majority is not None


def test_a_one_dimensional_mesh_runs_only_what_needs_no_replica(six: tuple[Path, list[dict[str, Any]]]) -> None:
    clean = [r["fsdp_clean"] for r in six[1]]
    assert all(r["alarm"] is None and r["updated"] == 4 for r in clean)
    assert all(r["config"] == {"reduced_grad": False, "fingerprint_every": 0, "audit": True} for r in clean)
    assert all(r["weight_checks"] == 0 and r["audits"] == 2 for r in clean)


def test_resume_from_the_sharded_checkpoint_is_bit_exact(six: tuple[Path, list[dict[str, Any]]]) -> None:
    results = six[1]
    for rank, r in enumerate(results):
        first, resumed = r["ckpt_first"], r["ckpt_resume"]
        assert first["saved"]
        assert resumed["refused"] is None
        assert resumed["start"] == CHECKPOINT_STEP
        assert resumed["data_position"] == {"step": CHECKPOINT_STEP}
        assert resumed["at_resume"] == first["at_save"], f"rank {rank}: the loaded shards are the saved ones"
        assert resumed["final"] == first["final"], f"rank {rank}: resumed run differs from the one that never stopped"
    # Replicas hold identical shards, so ranks of the same shard position end identical.
    assert len({r["ckpt_first"]["final"] for r in results[0::2]}) == 1
    assert len({r["ckpt_first"]["final"] for r in results[1::2]}) == 1


def test_the_manifest_lists_every_shard_file_and_the_agreed_fingerprints(
        six: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, results = six
    store = open_store(str(tmp / "ckpt-one"))
    manifest = read_manifest(store, CHECKPOINT_STEP)
    names = {o.name for o in manifest.objects}
    assert {"dcp.metadata", "trainer.pt"} <= names
    assert {f"rng-rank-{r:05d}.pt" for r in range(WORLD)} <= names
    assert any(n.startswith("dcp__") and n.endswith(".distcp") for n in names)
    stored = {p.name for p in Path(tmp / "ckpt-one", checkpoint_dir(CHECKPOINT_STEP)).iterdir()} - {"MANIFEST.json"}
    assert stored == names, "the manifest lists every file the save stored"
    assert manifest.sharding is not None
    assert (manifest.sharding.replicas, manifest.sharding.shards) == (3, 2)
    assert manifest.fingerprint == results[0]["ckpt_first"]["agreed"]
    assert len(manifest.sharding.shard_fingerprints) == 2
    # The pipeline's selection treats it like any other checkpoint: committed, verified, pre-suspect.
    assert select_checkpoint(store, trusted_through_step=CHECKPOINT_STEP).step == CHECKPOINT_STEP
    with pytest.raises(NoSafeCheckpoint, match="suspect window"):
        select_checkpoint(store, trusted_through_step=CHECKPOINT_STEP - 1)


def test_a_corrupted_shard_file_is_refused_on_every_rank(six: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, results = six
    flipped = results[0]["flip"]["flipped"]
    assert flipped
    assert flipped.endswith(".distcp")
    for r in results:
        assert r["ckpt_refused"]["refused"] is not None
        assert r["ckpt_refused"]["refused"].startswith("CheckpointCorrupt")
        assert flipped in r["ckpt_refused"]["refused"]
        assert "sha256" in r["ckpt_refused"]["refused"]
    # ... and the pipeline's selection passes it over.
    with pytest.raises(NoSafeCheckpoint) as caught:
        select_checkpoint(open_store(str(tmp / "ckpt-two")), trusted_through_step=10)
    assert flipped in str(caught.value.passed_over[0].reason)


def test_resuming_on_another_mesh_shape_is_refused_clearly(six: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in six[1]:
        refused = r["ckpt_other_mesh"]["refused"]
        assert refused.startswith("CheckpointLayoutMismatch")
        assert "3 replica group(s) of 2 shard(s)" in refused
        assert "1 of 6" in refused


def test_a_clean_run_with_dropout_raises_no_alarm(six: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in six[1]:
        run = r["clean"]
        assert run["alarms"] == 0
        assert run["alarm"] is None
        assert run["updated"] == CLEAN_STEPS
        assert run["audits"] == CLEAN_STEPS // CLEAN_AUDIT_EVERY
        assert run["weight_checks"] == CLEAN_STEPS // CLEAN_FINGERPRINT_EVERY
        # The magnitude trigger and the confirmations are on: whatever fired was reproduced, nothing skipped.
        assert run["data_faults"] == []
    losses = six[1][0]["clean"]["losses"]
    assert sum(losses[-20:]) < sum(losses[:20]), "it learns"


def test_product_checks_under_hsdp_check_the_unsharded_products_and_stay_silent(
        six: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in six[1]:
        run = r["products_clean"]
        assert run["alarms"] == 0, run["alarm"]
        assert run["updated"] == 4
        assert run["products_checked"] > 0
