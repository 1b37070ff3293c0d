"""Checkpoint lineage on the local stand-in's S3 (moto): the choice, its refusals and the pointer race."""

from __future__ import annotations

import base64
import threading
import time
import uuid
from typing import Any

import pytest

from sdcguard.contract.checkpoint import POINTER_NAME
from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lineage.errors import NoSafeCheckpoint
from sdcguard.lineage.listing import list_checkpoints
from sdcguard.lineage.pointer import advance_pointer, read_pointer, rewrite_pointer
from sdcguard.lineage.selection import select_checkpoint
from sdcguard.lineage.store import S3Store, open_store, sha256_hex
from sdcguard.lineage.verify import manifest_key
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
    write_checkpoint(store, 100, objects={"model.pt": big, "optimizer.pt": b"moments", "trainer.pt": b"step 100"})
    head = s3.head_object(Bucket=bucket, Key=f"jobs/big/{object_key(100)}", ChecksumMode="ENABLED")
    assert head["ContentLength"] == len(big)
    assert head["ETag"].endswith('-3"')
    assert select_checkpoint(store, 100).step == 100
    assert store.get_with_sha256(object_key(100)) == (big, sha256_hex(big))
    with pytest.raises(ValueError, match="too large for a conditional write"):
        store.put_bytes("RESUME.json", big, if_none_match=True)
    assert not store.exists("RESUME.json")


def count_calls(client: Any) -> list[str]:
    calls: list[str] = []
    client.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
    return calls


def test_a_checkpoint_of_many_objects_verifies_from_s3s_checksums_without_downloading(s3: Any, bucket: str) -> None:
    # Given a checkpoint of 1,500 objects (the model, optimizer and trainer state, and a shard per rank),
    store = open_store(f"s3://{bucket}/jobs/many", client=s3)
    objects = {name: name.encode() * 3 for name in ("model.pt", "optimizer.pt", "trainer.pt")}
    objects.update({f"shard-{i:05d}.pt": f"shard {i}".encode() for i in range(1497)})
    write_checkpoint(store, 100, objects=objects)
    calls = count_calls(s3)

    # when selection verifies it,
    started = time.perf_counter()
    chosen = select_checkpoint(store, 150)
    seconds = time.perf_counter() - started
    print(f"\nverified a checkpoint of 1,500 objects from stored checksums in {seconds:.2f} s")

    # each object is checked from S3's own checksum, and only the manifest is downloaded.
    assert chosen.step == 100
    assert calls.count("GetObjectAttributes") == 1500
    assert calls.count("GetObject") == 1  # MANIFEST.json


def test_a_changed_object_fails_verification_from_its_stored_checksum(store: S3Store, s3: Any, bucket: str) -> None:
    write_checkpoint(store, 100)
    write_checkpoint(store, 200)
    # overwritten after the manifest, by a writer that sent S3 a correct checksum of its own bytes
    data = b"other weights"
    s3.put_object(
        Bucket=bucket, Key=f"jobs/gpt/{object_key(200)}", Body=data, ChecksumAlgorithm="SHA256",
        ChecksumSHA256=base64.b64encode(bytes.fromhex(sha256_hex(data))).decode(),
    )  # fmt: skip
    calls = count_calls(s3)
    chosen = select_checkpoint(store, 1000)
    assert chosen.step == 100
    assert "does not verify" in chosen.passed_over[0].reason
    assert calls.count("GetObject") == 2  # the two manifests; the objects are checked by their stored checksums


def test_an_object_uploaded_in_parts_verifies_from_its_parts_checksum(s3: Any, bucket: str) -> None:
    store = S3Store(bucket, "jobs/big", client=s3, multipart_threshold=5 * 1024**2, part_size=5 * 1024**2)
    big = bytes(range(256)) * (44 * 1024)  # 11 MiB: three parts
    write_checkpoint(store, 100, objects={"model.pt": big, "optimizer.pt": b"m", "trainer.pt": b"t"})
    attributes = s3.get_object_attributes(Bucket=bucket, Key=f"jobs/big/{object_key(100)}", ObjectAttributes=["Checksum"])
    assert attributes["Checksum"].get("ChecksumType") == "COMPOSITE" or "-" in attributes["Checksum"]["ChecksumSHA256"]
    assert store.stored_digest(object_key(100)) == (sha256_hex(big), len(big))
    calls = count_calls(s3)
    assert select_checkpoint(store, 100).step == 100
    assert calls.count("GetObject") == 1  # the manifest; the 11 MiB object is not read
    # an object whose parts are not the ones its writer hashed (its metadata claims the manifest's digest) is refused
    key = f"jobs/big/{object_key(100)}"
    upload = s3.create_multipart_upload(
        Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256",
        Metadata={"sdcguard-sha256": sha256_hex(big), "sdcguard-parts-sha256": "bm90IHRoZSBwYXJ0cw=="},
    )  # fmt: skip
    other = b"x" * len(big)
    parts = []
    for number, start in enumerate(range(0, len(other), 5 * 1024**2), start=1):
        chunk = other[start : start + 5 * 1024**2]
        checksum = base64.b64encode(bytes.fromhex(sha256_hex(chunk))).decode()
        etag = s3.upload_part(
            Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=number, Body=chunk,
            ChecksumAlgorithm="SHA256", ChecksumSHA256=checksum,
        )["ETag"]  # fmt: skip
        parts.append({"PartNumber": number, "ETag": etag, "ChecksumSHA256": checksum})
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"], MultipartUpload={"Parts": parts})
    with pytest.raises(NoSafeCheckpoint) as refused:
        select_checkpoint(store, 100)
    assert "is not the one its writer computed" in refused.value.passed_over[0].reason
