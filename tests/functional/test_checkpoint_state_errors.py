"""A checkpoint save on 2 gloo ranks whose state cannot be built: raised at once, on every rank, never retried."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcguard.agent.checkpoint import CheckpointSaveFailed, CheckpointStateError, save_checkpoint
from sdcguard.agent.testing.train import init_process_group, shutdown
from sdcguard.lineage.store import LocalStore
from tests.forked import launch_forked

WORLD = 2


class HookFailed(RuntimeError):
    """What the model's state-dict hook raised."""


def failing_hook(*_: Any) -> None:
    raise HookFailed("the fused weight cannot be split")


class Down(LocalStore):
    """A folder that refuses every write, as S3 does in an outage."""

    def put_bytes(self, key: str, data: bytes, **kwargs: Any) -> str:
        raise ConnectionError("Could not connect to the endpoint URL")


def _job(out_dir: str) -> None:
    init_process_group()
    rank = torch.distributed.get_rank()
    model = nn.Linear(4, 4)
    seen: dict[str, Any] = {}
    # A state-dict hook that raises on rank 0 (the rank that writes the model).
    model.register_state_dict_post_hook(failing_hook)
    try:
        save_checkpoint(LocalStore(Path(out_dir, "ckpt")), 1, model=model, optimizer=None, fingerprint="0" * 16)
    except Exception as exc:  # what each rank raised, for the test to check
        seen["state"] = [type(exc).__name__, str(exc), [f.name for f in traceback.extract_tb(exc.__traceback__)]]
    # An outage on rank 1 alone is still a storage failure, on both ranks.
    store = Down(Path(out_dir, "ckpt")) if rank == 1 else LocalStore(Path(out_dir, "ckpt"))
    try:
        save_checkpoint(store, 2, model=nn.Linear(4, 4), optimizer=None, fingerprint="0" * 16)
    except CheckpointSaveFailed as exc:
        seen["outage"] = type(exc).__name__
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(seen))
    shutdown()


def test_a_state_dict_that_raises_on_one_rank_stops_every_rank_and_an_outage_is_still_a_storage_failure(
        tmp_path: Path) -> None:
    codes = launch_forked(WORLD, _job, (str(tmp_path),), timeout=120)
    assert codes == [0] * WORLD, f"ranks exited with {codes}"
    rank0, rank1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD))
    # The failing rank raises its own error, its traceback reaching into the hook.
    assert rank0["state"][0] == "HookFailed"
    assert "failing_hook" in rank0["state"][2]
    # The other rank is told who failed and with what.
    assert rank1["state"][0] == CheckpointStateError.__name__
    assert "[0]" in rank1["state"][1]
    assert "HookFailed: the fused weight cannot be split" in rank1["state"][1]
    # Nothing was committed.
    assert not list((tmp_path / "ckpt").rglob("MANIFEST.json"))
    assert rank0["outage"] == rank1["outage"] == "CheckpointSaveFailed"
