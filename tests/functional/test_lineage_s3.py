"""Checkpoint lineage on the local stand-in's S3 (moto): the choice, its refusals and the pointer race."""

from __future__ import annotations

import base64
import threading
import uuid
from typing import Any

import pytest

from contract.checkpoint import POINTER_NAME
from infra.local.standin import LocalStandIn
from lineage.errors import NoSafeCheckpoint
from lineage.listing import list_checkpoints
from lineage.pointer import advance_pointer, read_pointer, rewrite_pointer
from lineage.selection import select_checkpoint
from lineage.store import S3Store, open_store, sha256_hex
from lineage.verify import manifest_key
from tests.lineage_checkpoints import object_key, write_checkpoint


@pytest.fixture
def s3(standin: LocalStandIn) -> Any:
    return standin.client("s3")


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


@pytest.fixture
def store(s3: Any, bucket: str) -> S3Store:
    store = open_store(f"s3://{bucket}/jobs/gpt", client=s3)
    assert isinstance(store, S3Store)
    return store


def test_objects_carry_s3_sha256_checksums(store: S3Store, s3: Any, bucket: str) -> None:
    write_checkpoint(store, 100)
    head = s3.head_object(Bucket=bucket, Key=f"jobs/gpt/{object_key(100)}", ChecksumMode="ENABLED")
    data, _ = store.get_bytes(object_key(100))
    assert base64.b64decode(head["ChecksumSHA256"]).hex() == sha256_hex(data)


def test_incomplete_checkpoint_is_passed_over(store: S3Store) -> None:
    write_checkpoint(store, 100)
    write_checkpoint(store, 200, committed=False)
    chosen = select_checkpoint(store, 250)
    assert chosen.step == 100
    assert chosen.uri == f"{store.uri()}/checkpoints/step-000000100"
    assert [(p.step, p.reason) for p in chosen.passed_over] == [(200, "incomplete: no manifest (never committed)")]
    assert [(f.step, f.committed) for f in list_checkpoints(store)] == [(100, True), (200, False)]


def test_object_changed_after_the_manifest_is_passed_over(store: S3Store) -> None:
    write_checkpoint(store, 100)
    write_checkpoint(store, 200)
    original, _ = store.get_bytes(object_key(200))
    store.put_bytes(object_key(200), original[:-1] + b"?")
    chosen = select_checkpoint(store, 200)
    assert chosen.step == 100
    (passed,) = chosen.passed_over
    assert passed.step == 200
    assert "model.pt: sha256" in passed.reason
    assert "does not match the manifest" in passed.reason


def test_empty_prefix_is_nothing_safe(store: S3Store) -> None:
    with pytest.raises(NoSafeCheckpoint, match="nothing safe to resume from: no checkpoints under s3://"):
        select_checkpoint(store, 1000)


def test_suspect_window_before_the_first_checkpoint(store: S3Store) -> None:
    write_checkpoint(store, 100)
    with pytest.raises(NoSafeCheckpoint, match=r"trusted step 40 is before the first checkpoint \(step 100\)"):
        rewrite_pointer(store, trusted_through_step=40, reason="alarm", written_by="pipeline")
    assert not store.exists(POINTER_NAME)


def test_two_writers_racing_on_the_pointer_lose_no_update(store: S3Store) -> None:
    for step in (100, 200, 300, 400):
        write_checkpoint(store, step)
    advance_pointer(store, 400, expected_etag=None, reason="saved", written_by="job")
    start = threading.Barrier(2)
    done: dict[str, int] = {}
    errors: list[BaseException] = []

    def writer(name: str, trusted: int) -> None:
        start.wait()
        try:
            done[name] = rewrite_pointer(
                store, trusted_through_step=trusted, reason=name, written_by=name, incident_id=name
            ).step
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=a) for a in (("inc-a", 350), ("inc-b", 250))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert set(done) == {"inc-a", "inc-b"}
    final, _ = read_pointer(store)
    assert final is not None
    assert final.step == 200  # the earlier window wins whichever order they landed in
    entries = [final.incident_id, *(h.incident_id for h in final.history)]
    assert sorted(e for e in entries if e) == ["inc-a", "inc-b"]
    assert final.history[-1].written_by == "job"


def test_bucket_versioning_keeps_every_pointer(store: S3Store, s3: Any, bucket: str) -> None:
    for step in (100, 200):
        write_checkpoint(store, step)
    advance_pointer(store, 200, expected_etag=None, reason="saved", written_by="job")
    rewrite_pointer(store, trusted_through_step=150, reason="alarm", written_by="pipeline")
    versions = s3.list_object_versions(Bucket=bucket, Prefix=f"jobs/gpt/{POINTER_NAME}")["Versions"]
    assert len(versions) == 2


def test_a_manifest_that_does_not_parse_is_passed_over(store: S3Store) -> None:
    write_checkpoint(store, 100)
    write_checkpoint(store, 200)
    store.put_bytes(manifest_key(200), b'{"schema_version": "1"')
    chosen = select_checkpoint(store, 500)
    assert chosen.step == 100
    assert "manifest does not parse" in chosen.passed_over[0].reason


def test_large_objects_go_up_in_parts_and_verify(s3: Any, bucket: str) -> None:
    store = S3Store(bucket, "jobs/big", client=s3, multipart_threshold=6 * 1024**2, part_size=5 * 1024**2)
    big = bytes(range(256)) * (13 * 1024 * 1024 // 256)  # 13 MiB: three parts
    write_checkpoint(store, 100, objects={"model.pt": big})
    head = s3.head_object(Bucket=bucket, Key=f"jobs/big/{object_key(100)}", ChecksumMode="ENABLED")
    assert head["ContentLength"] == len(big)
    assert head["ETag"].endswith('-3"')
    assert select_checkpoint(store, 100).step == 100
    assert store.get_with_sha256(object_key(100)) == (big, sha256_hex(big))
    with pytest.raises(ValueError, match="too large for a conditional write"):
        store.put_bytes("RESUME.json", big, if_none_match=True)
    assert not store.exists("RESUME.json")
