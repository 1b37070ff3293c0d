"""Object stores for checkpoints: S3 (``s3://bucket/prefix``) and a local directory.

Both speak the same small interface, keyed relative to the store's root (the
job's checkpoint prefix): whole-object puts with a sha256, gets that return the
entity tag, listings, and conditional writes (If-Match / If-None-Match) so that
the resume pointer is never overwritten by a writer that read an older value.

On S3 every put carries ``ChecksumSHA256``, so S3 checks the bytes it received
against our own digest (which also goes into the manifest). The local directory
emulates conditional writes with an exclusive lock file and uses the content's
sha256 as its entity tag.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import fcntl
import hashlib
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdcguard.lineage.errors import CheckpointCorrupt, InvalidStoreUri, ObjectNotFound, PreconditionFailed

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef, ListObjectsV2OutputTypeDef

# Streaming digests read this much at a time: big enough to be fast, small
# enough that a Lambda verifying a multi-GB checkpoint stays within memory.
_CHUNK = 8 * 1024 * 1024
_LOCK_NAME = ".sdcguard.lock"
META_SHA256 = "sdcguard-sha256"
"""Object metadata: the whole object's sha256 (hex), on objects uploaded in parts."""
META_COMPOSITE = "sdcguard-parts-sha256"
"""Object metadata: the sha256 of the parts' sha256 digests (base64), as S3 computes it for the object."""


def sha256_hex(data: bytes) -> str:
    """The lowercase hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


class ObjectStore(ABC):
    """A flat key space under one root. Keys use ``/`` and never start with one."""

    @abstractmethod
    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        sha256: str | None = None,
        if_match: str | None = None,
        if_none_match: bool = False,
    ) -> str:
        """Store ``data`` at ``key`` and return its entity tag.

        ``sha256`` (hex) is the digest the caller computed; it is checked
        against the data before anything is written. ``if_match`` writes only
        if the object's current entity tag is that value; ``if_none_match``
        writes only if no object exists. Raises :class:`ValueError` for a
        wrong ``sha256`` or a bad key and :class:`PreconditionFailed` when a
        condition does not hold (nothing is written then).
        """

    @abstractmethod
    def get_bytes(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and entity tag. Raises :class:`ObjectNotFound`."""

    def get_with_sha256(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and their sha256 (hex), hashing them once. Raises :class:`ObjectNotFound`."""
        data, _ = self.get_bytes(key)
        return data, sha256_hex(data)

    @abstractmethod
    def digest(self, key: str) -> tuple[str, int]:
        """The sha256 (hex) and size of the object, read in chunks. Raises :class:`ObjectNotFound`."""

    def stored_digest(self, key: str) -> tuple[str, int] | None:
        """The object's sha256 (hex) and size as the store itself keeps them, without reading the bytes;
        None when it keeps no such checksum (then :meth:`digest` must read them). Raises :class:`ObjectNotFound`."""
        return None

    @abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]:
        """Every key under ``prefix`` (recursively), sorted."""

    @abstractmethod
    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """The immediate sub-folders of ``prefix`` (which ends in ``/``), as keys ending in ``/``, sorted."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object at ``key`` (no error if it is absent)."""

    @abstractmethod
    def uri(self, key: str = "") -> str:
        """The full location of ``key``: ``s3://bucket/prefix/key`` or a path."""


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or "//" in key or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"key: {key!r} is not a plain relative key")
    return key


def _check_sha(data: bytes, sha256: str | None) -> str:
    actual = sha256_hex(data)
    if sha256 is not None and sha256 != actual:
        raise ValueError(f"sha256: the caller's digest {sha256} does not match the data ({actual})")
    return actual


# One PutObject takes at most 5 GiB; bigger objects go up in parts (at most
# 10,000 of them, each but the last at least 5 MiB).
MULTIPART_THRESHOLD = 4 * 1024**3
PART_SIZE = 512 * 1024**2


class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix/``. The bucket should have versioning on.

    Objects above ``multipart_threshold`` bytes are uploaded in parts of
    ``part_size``, each with its own SHA256 checksum that S3 checks; the
    manifest still records the sha256 of the whole object.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client: S3Client | None = None,
        *,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        part_size: int = PART_SIZE,
    ):
        if not bucket:
            raise InvalidStoreUri("s3 location: the bucket name is empty")
        if part_size < 5 * 1024**2 or multipart_threshold < part_size:
            raise ValueError("part_size: must be >= 5 MiB and <= multipart_threshold")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        if client is None:
            import boto3

            client = boto3.client("s3")
        self.client = client

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _strip(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        sha256: str | None = None,
        if_match: str | None = None,
        if_none_match: bool = False,
    ) -> str:
        digest = _check_sha(data, sha256)
        if len(data) > self.multipart_threshold:
            if if_match is not None or if_none_match:
                raise ValueError(f"key: {key!r} is too large for a conditional write ({len(data)} bytes)")
            return self._put_parts(_check_key(key), data)
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self._full(_check_key(key)),
            "Body": data,
            # S3 recomputes the sha256 of what it received, refuses a mismatch and
            # keeps the checksum with the object (HeadObject with ChecksumMode).
            "ChecksumAlgorithm": "SHA256",
            "ChecksumSHA256": base64.b64encode(bytes.fromhex(digest)).decode(),
        }
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        try:
            response = self.client.put_object(**kwargs)
        except self.client.exceptions.ClientError as exc:
            if _status(exc) in (409, 412):
                # 412: the condition failed; 409: a concurrent conditional write won the race.
                raise PreconditionFailed(f"conditional write to {self.uri(key)} lost: {exc}") from exc
            raise
        return str(response["ETag"])

    def _put_parts(self, key: str, data: bytes) -> str:
        full = self._full(key)
        chunks = [data[start : start + self.part_size] for start in range(0, len(data), self.part_size)]
        digests = [hashlib.sha256(chunk).digest() for chunk in chunks]
        # S3 keeps a multipart object's checksum as the checksum of its parts' checksums
        # (COMPOSITE), never the whole object's sha256. The metadata carries both, from the
        # same bytes: S3 computes the composite of what it stored, and stored_digest
        # accepts the whole-object digest only when that composite is the writer's.
        metadata = {
            META_SHA256: sha256_hex(data),
            META_COMPOSITE: base64.b64encode(hashlib.sha256(b"".join(digests)).digest()).decode(),
        }
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=full, ChecksumAlgorithm="SHA256", Metadata=metadata
        )
        upload_id = upload["UploadId"]
        parts: list[CompletedPartTypeDef] = []
        try:
            for number, (chunk, digest) in enumerate(zip(chunks, digests, strict=True), start=1):
                checksum = base64.b64encode(digest).decode()
                response = self.client.upload_part(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=chunk,
                    ChecksumAlgorithm="SHA256", ChecksumSHA256=checksum,
                )
                parts.append({"PartNumber": number, "ETag": response["ETag"], "ChecksumSHA256": checksum})
            done = self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            # Leave no half-uploaded parts behind (they are billed and invisible).
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            raise
        return str(done["ETag"])

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._full(_check_key(key)))
        except self.client.exceptions.NoSuchKey as exc:
            raise ObjectNotFound(f"no object at {self.uri(key)}") from exc
        return response["Body"].read(), str(response["ETag"])

    def digest(self, key: str) -> tuple[str, int]:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._full(_check_key(key)))
        except self.client.exceptions.NoSuchKey as exc:
            raise ObjectNotFound(f"no object at {self.uri(key)}") from exc
        hasher = hashlib.sha256()
        size = 0
        for chunk in response["Body"].iter_chunks(_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
        return hasher.hexdigest(), size

    def stored_digest(self, key: str) -> tuple[str, int] | None:
        """The sha256 S3 computed and checked when the object was stored (GetObjectAttributes), and its size.

        For a multipart object S3 keeps only the composite of the parts'
        checksums: the whole-object sha256 its writer recorded (our metadata)
        is returned when S3's composite is the one the writer computed from the
        same bytes (one HeadObject more). None when S3 keeps no SHA256 checksum
        or the object carries no writer's digest: then the bytes must be read.
        Raises :class:`ObjectNotFound`, and ``CheckpointCorrupt`` when S3's
        composite differs from the writer's (the object is not what was written).
        """
        full = self._full(_check_key(key))
        try:
            attributes = self.client.get_object_attributes(
                Bucket=self.bucket, Key=full, ObjectAttributes=["Checksum", "ObjectSize"]
            )
        except self.client.exceptions.ClientError as exc:
            if _status(exc) == 404:
                raise ObjectNotFound(f"no object at {self.uri(key)}") from exc
            raise
        size = int(attributes["ObjectSize"])
        checksum = attributes.get("Checksum", {})
        stored = str(checksum.get("ChecksumSHA256", ""))
        if not stored:
            return None
        composite = checksum.get("ChecksumType") == "COMPOSITE" or "-" in stored
        if not composite:
            return base64.b64decode(stored).hex(), size
        metadata = self.client.head_object(Bucket=self.bucket, Key=full).get("Metadata", {})
        whole, expected = metadata.get(META_SHA256), metadata.get(META_COMPOSITE)
        if not whole or not expected:
            return None
        if stored.split("-")[0] != expected:
            raise CheckpointCorrupt(
                f"{self.uri(key)}: S3's checksum of its parts {stored} is not the one its writer computed ({expected})"
            )
        return whole, size

    def _pages(self, prefix: str, delimiter: str | None) -> Iterator[ListObjectsV2OutputTypeDef]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._full(prefix) if prefix else self._root()}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        yield from self.client.get_paginator("list_objects_v2").paginate(**kwargs)

    def _root(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def list(self, prefix: str = "") -> builtins.list[str]:
        return sorted(self._strip(o["Key"]) for page in self._pages(prefix, None) for o in page.get("Contents", []))

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        return sorted(
            self._strip(p["Prefix"]) for page in self._pages(prefix, "/") for p in page.get("CommonPrefixes", [])
        )

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._full(_check_key(key)))
        except self.client.exceptions.ClientError as exc:
            if _status(exc) == 404:
                return False
            raise
        return True

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._full(_check_key(key)))

    def uri(self, key: str = "") -> str:
        path = self._full(key) if key else self.prefix
        return f"s3://{self.bucket}/{path}" if path else f"s3://{self.bucket}"


def _status(exc: Exception) -> int | None:
    response = getattr(exc, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


class LocalStore(ObjectStore):
    """Objects as files under a directory. Entity tags are the content's sha256.

    Writes go to a hidden temporary file and are renamed into place, so a
    reader sees the old object or the new one, never half of one; names
    starting with ``.`` are never listed.
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().absolute()
        if self.root.exists() and not self.root.is_dir():
            raise InvalidStoreUri(f"checkpoint location {str(self.root)!r} exists and is not a directory")

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*_check_key(key).split("/"))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / _LOCK_NAME, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        sha256: str | None = None,
        if_match: str | None = None,
        if_none_match: bool = False,
    ) -> str:
        digest = _check_sha(data, sha256)
        path = self._path(key)
        if if_match is None and not if_none_match:
            self._write(path, data)
            return digest
        with self._locked():
            current = _file_sha(path)
            if if_none_match and current is not None:
                raise PreconditionFailed(f"{path} already exists")
            if if_match is not None and current != if_match:
                raise PreconditionFailed(f"{path} changed: entity tag {current} is not {if_match}")
            self._write(path, data)
        return digest

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ObjectNotFound(f"no object at {path}") from exc
        return data, sha256_hex(data)

    def get_with_sha256(self, key: str) -> tuple[bytes, str]:
        # Here the entity tag is the sha256: no second pass over the bytes.
        return self.get_bytes(key)

    def digest(self, key: str) -> tuple[str, int]:
        path = self._path(key)
        digest = _file_sha(path)
        if digest is None:
            raise ObjectNotFound(f"no object at {path}")
        return digest, path.stat().st_size

    def list(self, prefix: str = "") -> builtins.list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        keys: builtins.list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if not name.startswith("."):
                    keys.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(k for k in keys if k.startswith(prefix))

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        # scandir knows each entry's type from the directory itself: no stat per checkpoint.
        rel = base.relative_to(self.root).as_posix()
        lead = "" if rel == "." else f"{rel}/"
        with os.scandir(base) as entries:
            return sorted(f"{lead}{e.name}/" for e in entries if e.is_dir() and not e.name.startswith("."))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def uri(self, key: str = "") -> str:
        return str(self._path(key)) if key else str(self.root)


def _file_sha(path: Path) -> str | None:
    hasher = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                hasher.update(chunk)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    return hasher.hexdigest()


def open_store(uri: str, client: S3Client | None = None) -> ObjectStore:
    """The store for ``s3://bucket[/prefix]``, ``file:///path`` or a plain directory path.

    ``client`` is the S3 client to use (default: a new boto3 client from the
    environment). Raises :class:`InvalidStoreUri` for an empty location, an
    S3 location without a bucket, another URL scheme, or a path that is a file.
    """
    uri = uri.strip()
    if not uri:
        raise InvalidStoreUri("checkpoint location: empty")
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise InvalidStoreUri(f"checkpoint location {uri!r}: no bucket name after s3://")
        return S3Store(bucket, prefix, client=client)
    if uri.startswith("file://"):
        return LocalStore(uri[len("file://") :])
    if "://" in uri:
        raise InvalidStoreUri(f"checkpoint location {uri!r}: only s3:// and local directories are supported")
    return LocalStore(uri)
