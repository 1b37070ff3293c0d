"""Choosing the checkpoint to resume from: the rule, its reasons and its refusals (local store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdcguard.contract.checkpoint import CheckpointManifest
from sdcguard.lineage.errors import CheckpointCorrupt, CheckpointIncomplete, NoSafeCheckpoint
from sdcguard.lineage.listing import checkpoint_steps, list_checkpoints, newest_committed
from sdcguard.lineage.selection import select_checkpoint
from sdcguard.lineage.store import ObjectStore, open_store
from sdcguard.lineage.verify import check_fingerprint, manifest_key, read_manifest, verify_checkpoint
from tests.lineage_checkpoints import fingerprint_for, object_key, write_checkpoint


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return open_store(str(tmp_path / "job"))


def test_chooses_the_newest_at_or_before_the_trusted_step(store: ObjectStore) -> None:
    for step in (100, 200, 300, 400):
        write_checkpoint(store, step)
    chosen = select_checkpoint(store, 300)
    assert (chosen.step, chosen.checkpoint) == (300, "checkpoints/step-000000300")
    assert chosen.uri == store.uri("checkpoints/step-000000300")
    assert chosen.manifest.fingerprint == fingerprint_for(300)
    assert [(p.step, "suspect window" in p.reason) for p in chosen.passed_over] == [(400, True)]
    assert select_checkpoint(store, 399).step == 300


def test_passes_over_incomplete_and_corrupt_with_reasons(store: ObjectStore) -> None:
    for step in (100, 200):
        write_checkpoint(store, step)
    write_checkpoint(store, 300, committed=False)
    write_checkpoint(store, 250)
    store.put_bytes(object_key(250), b"flipped bits after the manifest was written")
    chosen = select_checkpoint(store, 1000)
    assert chosen.step == 200
    reasons = {p.step: p.reason for p in chosen.passed_over}
    assert list(reasons) == [300, 250]
    assert "no manifest" in reasons[300]
    assert "model.pt" in reasons[250]
    assert "does not match the manifest" in reasons[250] or "size" in reasons[250]
    assert chosen.to_dict()["passed_over"][0] == {"step": 300, "reason": reasons[300]}


def test_empty_prefix_has_nothing_safe(store: ObjectStore) -> None:
    with pytest.raises(NoSafeCheckpoint, match="nothing safe to resume from: no checkpoints"):
        select_checkpoint(store, 10)


def test_suspect_window_before_the_first_checkpoint(store: ObjectStore) -> None:
    write_checkpoint(store, 100)
    with pytest.raises(NoSafeCheckpoint, match="before the first checkpoint") as info:
        select_checkpoint(store, 99)
    assert info.value.trusted_through_step == 99
    assert [p.step for p in info.value.passed_over] == [100]
    with pytest.raises(NoSafeCheckpoint, match="no detector was ever clean"):
        select_checkpoint(store, -1)


def test_all_candidates_bad_is_nothing_safe(store: ObjectStore) -> None:
    write_checkpoint(store, 100, committed=False)
    write_checkpoint(store, 200)
    store.put_bytes(manifest_key(200), b"{not json")
    with pytest.raises(NoSafeCheckpoint, match="all 2 checkpoint"):
        select_checkpoint(store, 500)


def test_listing_reports_committed_folders(store: ObjectStore) -> None:
    write_checkpoint(store, 5)
    write_checkpoint(store, 7, committed=False)
    store.put_bytes("checkpoints/not-a-step/x", b"ignored")
    folders = list_checkpoints(store)
    assert [(f.step, f.committed) for f in folders] == [(5, True), (7, False)]
    assert folders[0].objects == ("MANIFEST.json", "model.pt", "optimizer.pt", "trainer.pt")
    assert checkpoint_steps(store) == [5, 7]
    assert newest_committed(store) == 5


def test_verify_names_each_kind_of_damage(store: ObjectStore) -> None:
    write_checkpoint(store, 10)
    assert isinstance(verify_checkpoint(store, 10), CheckpointManifest)
    store.delete(object_key(10, "optimizer.pt"))
    with pytest.raises(CheckpointCorrupt, match=r"optimizer\.pt: listed in the manifest but missing"):
        verify_checkpoint(store, 10)
    with pytest.raises(CheckpointIncomplete, match=r"no MANIFEST\.json"):
        read_manifest(store, 11)
    write_checkpoint(store, 12)
    store.put_bytes(manifest_key(12), read_manifest(store, 10).model_dump_json().encode())
    with pytest.raises(CheckpointCorrupt, match="manifest is for step 10, not 12"):
        read_manifest(store, 12)
    store.put_bytes(manifest_key(12), b'{"schema_version": "1", "step": 12}')
    with pytest.raises(CheckpointCorrupt, match="manifest does not parse"):
        read_manifest(store, 12)


def test_fingerprint_comparison_refuses_a_lying_manifest(store: ObjectStore) -> None:
    manifest = write_checkpoint(store, 10)
    assert manifest is not None
    check_fingerprint(manifest, fingerprint_for(10))
    with pytest.raises(CheckpointCorrupt, match=r"differs from the manifest's .*refusing to train"):
        check_fingerprint(manifest, fingerprint_for(11))


def test_passes_over_a_checkpoint_whose_manifest_lacks_what_a_resume_loads(store: ObjectStore) -> None:
    write_checkpoint(store, 100)
    write_checkpoint(store, 200, objects={"model.pt": b"weights", "trainer.pt": b"step 200"})  # no optimizer state
    write_checkpoint(store, 300, objects={"model.pt": b"weights", "optimizer.pt": b"moments"})  # no trainer state
    chosen = select_checkpoint(store, 1000)
    assert chosen.step == 100
    reasons = {p.step: p.reason for p in chosen.passed_over}
    assert "lists no trainer.pt" in reasons[300]
    assert "lists no optimizer.pt" in reasons[200]
    assert verify_checkpoint(store, 300).step == 300  # intact, only not enough to resume from
    with pytest.raises(NoSafeCheckpoint, match="lack an object a resume needs"):
        select_checkpoint(store, 250, required=("model.pt", "optimizer.pt", "trainer.pt", "extra.pt"))
