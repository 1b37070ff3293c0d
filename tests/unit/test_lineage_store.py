"""The local-directory object store: round trips, listings and conditional writes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest

from sdcguard.lineage.errors import InvalidStoreUri, ObjectNotFound, PreconditionFailed
from sdcguard.lineage.store import LocalStore, S3Store, open_store, sha256_hex

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

# These tests parse locations and check sizes: a client must be given (else boto3 builds one) but is never called.
UNCALLED_S3 = cast("S3Client", object())


def test_put_get_round_trip_with_sha256_etag(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "job"))
    etag = store.put_bytes("checkpoints/step-000000010/model.pt", b"weights")
    data, got = store.get_bytes("checkpoints/step-000000010/model.pt")
    assert data == b"weights"
    assert etag == got == sha256_hex(b"weights")
    assert (tmp_path / "job" / "checkpoints" / "step-000000010" / "model.pt").read_bytes() == b"weights"
    assert store.digest("checkpoints/step-000000010/model.pt") == (sha256_hex(b"weights"), 7)


def test_wrong_caller_digest_writes_nothing(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    with pytest.raises(ValueError, match="sha256"):
        store.put_bytes("a", b"data", sha256="0" * 64)
    assert not store.exists("a")


def test_missing_object_is_named(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    with pytest.raises(ObjectNotFound, match=r"no object at .*nope"):
        store.get_bytes("nope")
    with pytest.raises(ObjectNotFound):
        store.digest("nope")


def test_if_none_match_refuses_an_existing_object(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.put_bytes("RESUME.json", b"first", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("RESUME.json", b"second", if_none_match=True)
    assert store.get_bytes("RESUME.json")[0] == b"first"


def test_if_match_writes_only_over_the_expected_version(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    first = store.put_bytes("RESUME.json", b"first")
    second = store.put_bytes("RESUME.json", b"second", if_match=first)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("RESUME.json", b"third", if_match=first)
    assert store.get_bytes("RESUME.json") == (b"second", second)


def test_listings_skip_hidden_files_and_name_folders(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.put_bytes("checkpoints/step-000000002/MANIFEST.json", b"{}")
    store.put_bytes("checkpoints/step-000000001/model.pt", b"x")
    store.put_bytes("RESUME.json", b"{}", if_none_match=True)  # leaves a lock file behind
    assert store.list() == [
        "RESUME.json",
        "checkpoints/step-000000001/model.pt",
        "checkpoints/step-000000002/MANIFEST.json",
    ]
    assert store.list("checkpoints/step-000000001/") == ["checkpoints/step-000000001/model.pt"]
    assert store.list_dirs("checkpoints/") == ["checkpoints/step-000000001/", "checkpoints/step-000000002/"]
    assert open_store(str(tmp_path / "absent")).list() == []


def test_delete_and_exists(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.put_bytes("a/b", b"x")
    assert store.exists("a/b")
    store.delete("a/b")
    store.delete("a/b")
    assert not store.exists("a/b")


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "../up", "a/./b"])
def test_keys_must_be_plain(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="key"):
        open_store(str(tmp_path)).put_bytes(key, b"x")


def test_open_store_parses_locations(tmp_path: Path) -> None:
    s3 = open_store("s3://bucket-name/jobs/llama/", client=UNCALLED_S3)
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix) == ("bucket-name", "jobs/llama")
    assert s3.uri("RESUME.json") == "s3://bucket-name/jobs/llama/RESUME.json"
    assert open_store("s3://bucket-name", client=UNCALLED_S3).uri("k") == "s3://bucket-name/k"
    local = open_store(f"file://{tmp_path}")
    assert isinstance(local, LocalStore)
    assert local.uri("k") == str(tmp_path / "k")


@pytest.mark.parametrize(("uri", "message"), [("", "empty"), ("s3://", "no bucket"), ("gs://b/p", "only s3://")])
def test_open_store_refuses_bad_locations(uri: str, message: str) -> None:
    with pytest.raises(InvalidStoreUri, match=message):
        open_store(uri)


def test_open_store_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidStoreUri, match="not a directory"):
        open_store(str(tmp_path / "f"))


def test_s3_part_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="part_size"):
        S3Store("bucket-name", client=UNCALLED_S3, part_size=1024)
    with pytest.raises(ValueError, match="part_size"):
        S3Store("bucket-name", client=UNCALLED_S3, multipart_threshold=6 * 1024**2, part_size=8 * 1024**2)
