"""The resume pointer: conditional rewrites, never forward, history kept (local store)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sdcguard.contract.checkpoint import POINTER_NAME
from sdcguard.lineage.errors import NoSafeCheckpoint, PointerConflict, PointerCorrupt
from sdcguard.lineage.pointer import advance_pointer, read_pointer, rewrite_pointer, rewrite_pointer_explained
from sdcguard.lineage.store import ObjectStore, open_store
from tests.lineage_checkpoints import write_checkpoint


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    store = open_store(str(tmp_path / "job"))
    for step in (100, 200, 300, 400):
        write_checkpoint(store, step)
    return store


def test_first_rewrite_creates_the_pointer(store: ObjectStore) -> None:
    assert read_pointer(store) == (None, None)
    pointer = rewrite_pointer(store, trusted_through_step=350, reason="alarm", written_by="pipeline", incident_id="i-1")
    stored, etag = read_pointer(store)
    assert stored == pointer
    assert etag is not None
    assert (pointer.step, pointer.checkpoint, pointer.incident_id, pointer.history) == (
        300,
        "checkpoints/step-000000300",
        "i-1",
        [],
    )


def test_rewrite_moves_back_and_keeps_history(store: ObjectStore) -> None:
    advance_pointer(store, 400, expected_etag=None, reason="saved", written_by="job")
    pointer = rewrite_pointer(store, trusted_through_step=250, reason="alarm", written_by="pipeline")
    assert pointer.step == 200
    assert [(h.step, h.written_by) for h in pointer.history] == [(400, "job")]


def test_rewrite_never_moves_forward(store: ObjectStore) -> None:
    rewrite_pointer(store, trusted_through_step=150, reason="first alarm", written_by="a", incident_id="i-1")
    pointer = rewrite_pointer(store, trusted_through_step=390, reason="second alarm", written_by="b", incident_id="i-2")
    assert pointer.step == 100
    assert "kept step 100" in pointer.reason
    assert [h.incident_id for h in pointer.history] == ["i-1"]


def test_retry_of_the_same_incident_writes_nothing(store: ObjectStore) -> None:
    first = rewrite_pointer_explained(store, trusted_through_step=250, reason="r", written_by="p", incident_id="i-9")
    again = rewrite_pointer_explained(store, trusted_through_step=250, reason="r", written_by="p", incident_id="i-9")
    assert (first.written, again.written) == (True, False)
    assert again.etag == first.etag
    assert read_pointer(store)[0] == first.pointer


def test_nothing_safe_leaves_the_pointer_alone(store: ObjectStore) -> None:
    advance_pointer(store, 400, expected_etag=None, reason="saved", written_by="job")
    before = store.get_bytes(POINTER_NAME)
    with pytest.raises(NoSafeCheckpoint):
        rewrite_pointer(store, trusted_through_step=50, reason="alarm", written_by="pipeline")
    assert store.get_bytes(POINTER_NAME) == before


def test_bad_arguments_change_nothing(store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="reason"):
        rewrite_pointer(store, trusted_through_step=250, reason=" ", written_by="p")
    with pytest.raises(ValueError, match="written_by"):
        rewrite_pointer(store, trusted_through_step=250, reason="r", written_by="")
    assert not store.exists(POINTER_NAME)


def test_a_corrupt_pointer_is_named_and_replaced(store: ObjectStore) -> None:
    store.put_bytes(POINTER_NAME, b"garbage")
    with pytest.raises(PointerCorrupt, match="not a valid resume pointer"):
        read_pointer(store)
    pointer = rewrite_pointer(store, trusted_through_step=250, reason="alarm", written_by="pipeline")
    assert pointer.step == 200
    assert "did not parse" in pointer.reason


def test_advance_refuses_when_someone_else_moved_it(store: ObjectStore) -> None:
    _, etag = advance_pointer(store, 300, expected_etag=None, reason="saved", written_by="job")
    rewrite_pointer(store, trusted_through_step=150, reason="alarm", written_by="pipeline")
    with pytest.raises(PointerConflict, match="changed by pipeline"):
        advance_pointer(store, 400, expected_etag=etag, reason="saved", written_by="job")
    assert read_pointer(store)[0].step == 100  # type: ignore[union-attr]


def test_racing_rewrites_lose_no_update(store: ObjectStore) -> None:
    advance_pointer(store, 400, expected_etag=None, reason="saved", written_by="job")
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def writer(i: int, trusted: int) -> None:
        barrier.wait()
        try:
            rewrite_pointer(store, trusted_through_step=trusted, reason=f"w{i}", written_by=f"w{i}", incident_id=f"i-{i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i, t)) for i, t in enumerate((350, 250, 390, 150))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    final, _ = read_pointer(store)
    assert final is not None
    assert final.step == 100
    seen = {final.incident_id, *(h.incident_id for h in final.history)}
    assert seen >= {"i-0", "i-1", "i-2", "i-3"}
    assert final.history[-1].written_by == "job"
