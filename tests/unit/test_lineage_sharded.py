"""A sharded (DCP) checkpoint in the pipeline's selection: committed, verified, pre-suspect, like any other."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sdcguard.contract.checkpoint import CheckpointManifest, ShardedLayout, checkpoint_dir
from sdcguard.lineage.commit import commit, put_object
from sdcguard.lineage.errors import NoSafeCheckpoint
from sdcguard.lineage.selection import select_checkpoint
from sdcguard.lineage.store import ObjectStore, open_store
from sdcguard.lineage.verify import missing_for_resume

SHARD_FP = ["0123456789abcdef" * 3, "fedcba9876543210" * 3]


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return open_store(str(tmp_path / "job"))


def write_sharded(store: ObjectStore, step: int, names: tuple[str, ...] = (
        "dcp.metadata", "dcp__0_0.distcp", "dcp__1_0.distcp", "trainer.pt", "rng-rank-00000.pt")) -> None:
    digests = [put_object(store, step, name, f"{name} at {step}".encode()) for name in names]
    commit(store, CheckpointManifest(step=step, world_size=6, fingerprint="ab" * 24, objects=digests,
                                     sharding=ShardedLayout(replicas=3, shards=2, shard_fingerprints=SHARD_FP)))


def test_a_sharded_checkpoint_is_chosen_like_any_other(store: ObjectStore) -> None:
    write_sharded(store, 100)
    write_sharded(store, 200)
    chosen = select_checkpoint(store, 150)
    assert chosen.step == 100
    assert chosen.manifest.sharding is not None
    assert chosen.manifest.sharding.shard_fingerprints == SHARD_FP
    assert [p.step for p in chosen.passed_over] == [200]


def test_a_changed_shard_file_is_passed_over(store: ObjectStore) -> None:
    write_sharded(store, 100)
    write_sharded(store, 200)
    store.put_bytes(f"{checkpoint_dir(200)}/dcp__1_0.distcp", b"flipped")
    chosen = select_checkpoint(store, 1000)
    assert chosen.step == 100
    assert "dcp__1_0.distcp" in chosen.passed_over[0].reason


def test_a_sharded_checkpoint_needs_its_metadata_and_trainer_state(store: ObjectStore) -> None:
    write_sharded(store, 100, names=("dcp__0_0.distcp", "trainer.pt"))
    with pytest.raises(NoSafeCheckpoint) as caught:
        select_checkpoint(store, 1000)
    assert "dcp.metadata" in caught.value.passed_over[0].reason


def test_a_replicated_checkpoint_still_needs_its_model_and_optimizer() -> None:
    manifest = CheckpointManifest(step=1, world_size=2, fingerprint="ab" * 24,
                                  objects=[{"name": "trainer.pt", "sha256": "0" * 64, "size": 1}])
    assert missing_for_resume(manifest) == ["model.pt", "optimizer.pt"]


def test_the_layout_holds_one_fingerprint_per_shard() -> None:
    with pytest.raises(ValidationError, match="shard_fingerprints"):
        ShardedLayout(replicas=3, shards=3, shard_fingerprints=SHARD_FP)
