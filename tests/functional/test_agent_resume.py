"""Exact resume through the guard and the reference job: N steps, a restart from the checkpoint, N more
give the same bits as 2N steps straight.

Three ranks, because with two the all-reduce adds two numbers and any order
rounds alike; with three the order of the sum shows in the bits, so a resumed
DDP that reduced its first step with another bucket layout than the
uninterrupted run would differ here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.testing.train import JobShape, init_process_group, shutdown, train
from tests.forked import launch_forked

WORLD = 3


def _job(out_dir: str, steps: int, prefix: str) -> None:
    init_process_group()
    config = GuardConfig(
        ranks_per_node=1, audit_every=3, fingerprint_every=3, checkpoint_prefix=prefix,
        on_alarm="raise", spool_dir=str(Path(out_dir) / "spool"),
    )
    summary = train(steps, JobShape(), config, checkpoint_every=4)
    summary["deterministic"] = torch.are_deterministic_algorithms_enabled()
    rank = summary["rank"]
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(summary))
    shutdown()


def _run(tmp: Path, name: str, steps: int, prefix: Path) -> list[dict[str, object]]:
    out = tmp / name
    out.mkdir()
    codes = launch_forked(WORLD, _job, (str(out), steps, str(prefix)), timeout=240)
    assert codes == [0] * WORLD, f"ranks exited with {codes}"
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_a_restart_from_the_checkpoint_gives_the_bits_of_an_uninterrupted_run(tmp_path: Path) -> None:
    # Given: 8 steps straight, and 4 steps then a fresh set of processes that resumes from the pointer.
    straight = _run(tmp_path, "straight", 8, tmp_path / "ckpt-straight")
    first_half = _run(tmp_path, "first-half", 4, tmp_path / "ckpt-resumed")
    resumed = _run(tmp_path, "resumed", 8, tmp_path / "ckpt-resumed")

    # Then: the second run started at step 4 and ended with the same weights and optimizer state.
    assert {r["first_step"] for r in first_half} == {0}
    assert {r["first_step"] for r in resumed} == {4}
    assert all(not r["alarms"] for r in straight + first_half + resumed)
    # With the ring audit on, the guard ran the job under torch's deterministic algorithms.
    assert all(r["deterministic"] for r in straight + first_half + resumed)
    fingerprints = {r["final_fingerprint"] for r in straight} | {r["final_fingerprint"] for r in resumed}
    assert len(fingerprints) == 1, fingerprints
