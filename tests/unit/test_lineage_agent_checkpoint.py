"""The agent's checkpoint writer and reader in one process, on a local directory."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from sdcguard.agent.checkpoint import CheckpointWriter, load_checkpoint, rng_name, save_checkpoint
from sdcguard.contract.checkpoint import checkpoint_dir
from sdcguard.lineage.errors import CheckpointCorrupt, PointerCorrupt
from sdcguard.lineage.pointer import read_pointer, rewrite_pointer
from sdcguard.lineage.store import ObjectStore, open_store
from sdcguard.lineage.verify import manifest_key, read_manifest, verify_checkpoint


def state_hex(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over the raw bytes of the weights and optimizer moments: equal iff bit-identical."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for _, v in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trained(seed: int = 0, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
    return model, opt


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return open_store(str(tmp_path / "job"))


def save(store: ObjectStore, step: int, model: nn.Module, opt: torch.optim.Optimizer, **kw: object) -> None:
    save_checkpoint(
        store, step, model=model, optimizer=opt, fingerprint=state_hex(model, opt), data_position={"batch": step * 4},
        extra={"note": "hello"}, last_clean_audit_step=step - 1, last_clean_fingerprint_step=step, **kw,  # type: ignore[arg-type]
    )


def test_save_writes_objects_then_a_manifest_and_advances_the_pointer(store: ObjectStore) -> None:
    model, opt = trained()
    save(store, 30, model, opt)
    manifest = verify_checkpoint(store, 30)
    assert sorted(o.name for o in manifest.objects) == ["model.pt", "optimizer.pt", rng_name(0), "trainer.pt"]
    assert (manifest.world_size, manifest.fingerprint) == (1, state_hex(model, opt))
    assert (manifest.last_clean_audit_step, manifest.last_clean_fingerprint_step) == (29, 30)
    pointer, _ = read_pointer(store)
    assert pointer is not None
    assert pointer.checkpoint == checkpoint_dir(30)


def test_load_restores_weights_optimizer_rng_and_data_position(store: ObjectStore) -> None:
    model, opt = trained()
    random.seed(7)
    torch.manual_seed(7)
    save(store, 30, model, opt)
    expected_python, expected_torch = random.random(), torch.rand(3)
    fresh, fresh_opt = trained(seed=1, steps=1)
    random.seed(99)
    torch.manual_seed(99)
    loaded = load_checkpoint(store, model=fresh, optimizer=fresh_opt, fingerprint_fn=lambda: state_hex(fresh, fresh_opt))
    assert loaded is not None
    assert (loaded.step, loaded.source, loaded.data_position, loaded.extra) == (30, "pointer", {"batch": 120}, {"note": "hello"})
    assert state_hex(fresh, fresh_opt) == state_hex(model, opt)
    assert random.random() == expected_python
    assert torch.equal(torch.rand(3), expected_torch)


def test_nothing_to_load_is_a_fresh_start(store: ObjectStore) -> None:
    model, opt = trained()
    assert load_checkpoint(store, model=model, optimizer=opt) is None


def test_without_a_pointer_the_newest_committed_is_loaded(store: ObjectStore) -> None:
    model, opt = trained()
    save(store, 10, model, opt, advance=False)
    save(store, 20, model, opt, advance=False)
    store.delete(manifest_key(20))
    loaded = load_checkpoint(store, model=model, optimizer=opt)
    assert loaded is not None
    assert (loaded.step, loaded.source) == (10, "newest")


def test_changed_bytes_are_refused_before_unpickling(store: ObjectStore) -> None:
    model, opt = trained()
    save(store, 10, model, opt)
    data, _ = store.get_bytes(f"{checkpoint_dir(10)}/model.pt")
    store.put_bytes(f"{checkpoint_dir(10)}/model.pt", data[:-1] + bytes([data[-1] ^ 1]))
    fresh, fresh_opt = trained(seed=1)
    before = state_hex(fresh, fresh_opt)
    with pytest.raises(CheckpointCorrupt, match=r"model\.pt: sha256 .* does not match"):
        load_checkpoint(store, model=fresh, optimizer=fresh_opt)
    assert state_hex(fresh, fresh_opt) == before


def test_a_lying_fingerprint_is_refused(store: ObjectStore) -> None:
    model, opt = trained()
    save_checkpoint(store, 10, model=model, optimizer=opt, fingerprint="ab" * 24)
    with pytest.raises(CheckpointCorrupt, match="differs from the manifest's"):
        load_checkpoint(store, model=model, optimizer=opt, fingerprint_fn=lambda: state_hex(model, opt))


def test_injected_corruption_is_caught_at_load(store: ObjectStore) -> None:
    model, opt = trained()

    def flip(data: bytes, *, step: int, rank: int) -> bytes:
        return data[:10] + bytes([data[10] ^ 0x80]) + data[11:]

    save(store, 10, model, opt, corrupt=flip)
    assert read_manifest(store, 10).step == 10
    with pytest.raises(CheckpointCorrupt, match="does not match the manifest"):
        verify_checkpoint(store, 10)


def test_resaving_a_step_replaces_the_checkpoint(store: ObjectStore) -> None:
    model, opt = trained()
    save(store, 10, model, opt)
    model2, opt2 = trained(seed=3)
    save(store, 10, model2, opt2)
    assert verify_checkpoint(store, 10).fingerprint == state_hex(model2, opt2)


def test_writer_does_not_undo_the_pipelines_rewrite(store: ObjectStore) -> None:
    model, opt = trained()
    writer = CheckpointWriter(store, written_by="job")
    assert writer.load(model=model, optimizer=opt) is None
    assert writer.save(10, model=model, optimizer=opt, fingerprint=state_hex(model, opt)).pointer_advanced
    assert writer.save(20, model=model, optimizer=opt, fingerprint=state_hex(model, opt)).pointer_advanced
    rewrite_pointer(store, trusted_through_step=15, reason="alarm", written_by="pipeline", incident_id="inc-1")
    result = writer.save(30, model=model, optimizer=opt, fingerprint=state_hex(model, opt))
    assert not result.pointer_advanced
    pointer, _ = read_pointer(store)
    assert pointer is not None
    assert (pointer.step, pointer.incident_id) == (10, "inc-1")
    assert [h.step for h in pointer.history] == [20, 10]


def test_writer_advances_again_after_resuming_from_the_rewrite(store: ObjectStore) -> None:
    model, opt = trained()
    save(store, 10, model, opt)
    save(store, 20, model, opt, advance=False)
    rewrite_pointer(store, trusted_through_step=15, reason="alarm", written_by="pipeline")
    writer = CheckpointWriter(store)
    loaded = writer.load(model=model, optimizer=opt)
    assert loaded is not None
    assert loaded.step == 10
    assert writer.save(20, model=model, optimizer=opt, fingerprint=state_hex(model, opt)).pointer_advanced
    assert read_pointer(store)[0].step == 20  # type: ignore[union-attr]


def test_bad_arguments_are_refused_before_anything_is_written(store: ObjectStore) -> None:
    model, opt = trained()
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(store, -1, model=model, optimizer=opt, fingerprint="ab" * 24)
    with pytest.raises(ValueError, match="fingerprint"):
        save_checkpoint(store, 10, model=model, optimizer=opt, fingerprint="not hex")
    assert store.list() == []


def test_an_unreadable_pointer_is_refused(store: ObjectStore) -> None:
    model, opt = trained()
    save(store, 10, model, opt)
    store.put_bytes("RESUME.json", b"garbage")
    with pytest.raises(PointerCorrupt, match="not a valid resume pointer"):
        load_checkpoint(store, model=model, optimizer=opt)
