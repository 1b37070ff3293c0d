"""The reference job under ``--sharding hsdp``: trains and checkpoints, resumes from the pointer, stops on an alarm.

Its loop (``sdcguard.agent.testing.train.train``) trains and checkpoints in the shared launch
(the ``six`` fixture); the command line then resumes from that checkpoint
with a persistent fault on one rank and must stop on the alarm: one launch of
the command instead of two.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sdcguard.agent.config import ALARM_EXIT_CODE
from sdcguard.contract.checkpoint import checkpoint_dir
from tests.distributed.sharded_scenarios import REFERENCE_FLAGS
from tests.distributed.sharded_world import REFERENCE_STEPS, ROOT, WORLD

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_reference_loop_trains_and_checkpoints_under_hsdp(six: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, results = six
    summary = results[0]["reference"]
    assert summary["alarms"] == []
    assert summary["first_step"] == 0
    assert summary["steps"] == REFERENCE_STEPS
    # Every rank reports the one digest all replicas agree on.
    assert len({r["reference"]["final_fingerprint"] for r in results}) == 1
    assert (tmp / "ckpt-reference" / checkpoint_dir(REFERENCE_STEPS) / "MANIFEST.json").exists()


def test_the_reference_job_resumes_and_stops_on_an_alarm_under_hsdp(six: tuple[Path, list[dict[str, Any]]],
                                                                   tmp_path: Path) -> None:
    # Given the checkpoint the reference loop saved at step 4 (a copy: this run writes to it),
    prefix = tmp_path / "ckpt"
    shutil.copytree(six[0] / "ckpt-reference", prefix)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}
    # a persistent fault on rank 3 from step 6 (the first audit after the resume):
    env["SDCGUARD_INJECT"] = "kind=finite_activation,rank=3,step=6,repeat=2"
    # (No EventBridge here: the alarm is spooled, into this test's folder, not the working directory's
    # default spool, where a later guard of the same checkout would republish it.)
    env["SDCGUARD_SPOOL_DIR"] = str(tmp_path / "spool")

    # when the command starts on the same mesh,
    done = subprocess.run(
        [sys.executable, "-m", "sdcguard.agent.testing.train", "--nproc", str(WORLD), "--ranks-per-node", "2", "--sharding", "hsdp",
         "--steps", "12", "--audit-every", "2", "--fingerprint-every", "2", "--checkpoint-every", "4",
         "--checkpoint-prefix", str(prefix), *REFERENCE_FLAGS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=500, check=False)

    # it resumes from that checkpoint through the pointer, and the ring audit stops it, naming rank 3.
    assert done.returncode == ALARM_EXIT_CODE, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    assert checkpoint_dir(REFERENCE_STEPS) in done.stderr
    assert "SDC alarm at step 6 by ring_audit: suspects [3]" in done.stderr
    assert list((tmp_path / "spool").glob("alarm-*.json"))
