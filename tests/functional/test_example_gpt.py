"""The guarded GPT example (examples/gpt_ddp_guarded.py) runs as a user would run it, on 3 simulated nodes.

Once with its own launcher (``--spawn 3x1``): it trains, logs, evaluates and
commits verified checkpoints. Once as the PyTorchJob's container runs it
(examples/k8s/pytorchjob.yaml): torchrun through torchrun_keep_alarm.py, with
a fault injected; the alarm stops every rank and the command exits 87, where
torchrun alone exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sdcguard.agent.config import ALARM_EXIT_CODE
from sdcguard.contract.checkpoint import checkpoint_dir
from sdcguard.infra.local.standin import LocalStandIn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--dim", "32", "--layers", "2", "--seq", "16", "--micro-batch", "4", "--accum", "2", "--warmup", "2",
        "--log-every", "1"]


def _env(standin: LocalStandIn, tmp: Path, **settings: str) -> dict[str, str]:
    bus = f"sdcguard-example-{uuid.uuid4().hex[:8]}"
    standin.client("events").create_event_bus(Name=bus)
    return {**os.environ, **standin.env, "SDCGUARD_EVENT_BUS": bus, "SDCGUARD_SPOOL_DIR": str(tmp / "spool"),
            "SDCGUARD_AUDIT_EVERY": "2", "SDCGUARD_FINGERPRINT_EVERY": "1", "PYTHONPATH": str(ROOT), **settings}


def test_the_guarded_example_trains_and_checkpoints_on_three_nodes(tmp_path: Path, standin: LocalStandIn) -> None:
    ckpt = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gpt_ddp_guarded.py"), "--spawn", "3x1", "--steps", "4",
         "--checkpoint-every", "2", "--eval-every", "2", "--checkpoint-dir", str(ckpt), *TINY],
        env=_env(standin, tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [line.split() for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [int(w[1]) for w in logged if w[2] == "loss"] == [0, 1, 2, 3]
    assert [w[1] for w in logged if w[2] == "held-out"] == ["2", "4"]
    assert all(float(w[5]) > 0 for w in logged if w[2] == "loss"), "grad_norm reported"
    for step in (2, 4):
        assert (ckpt / checkpoint_dir(step) / "MANIFEST.json").is_file()
    assert json.loads((ckpt / "RESUME.json").read_text())["checkpoint"] == checkpoint_dir(4)


def test_under_torchrun_an_alarm_exits_87_through_the_pods_command(tmp_path: Path, standin: LocalStandIn) -> None:
    # Given: the pod's command line, 3 ranks as 3 nodes (one torchrun here stands for 3 pods), a NaN on rank 1.
    env = _env(standin, tmp_path, SDCGUARD_RANKS_PER_NODE="1", SDCGUARD_INJECT="kind=nan_activation,rank=1,step=3")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "k8s" / "torchrun_keep_alarm.py"), "--hold-s=0", "--",
         "--nproc-per-node=3", "--max-restarts=0", str(ROOT / "examples" / "gpt_ddp_guarded.py"), "--steps=6",
         "--checkpoint-every=2", "--eval-every=0", f"--checkpoint-dir={tmp_path / 'ckpt'}", *TINY],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    # Then: stopped in the fault's step (step 2 was the last to finish) with the alarm's exit code, not torchrun's 1.
    assert done.returncode == ALARM_EXIT_CODE, done.stderr[-3000:]
    assert "an sdcguard alarm stopped training" in done.stderr
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("step ")][-1] == "2"
    assert json.loads((tmp_path / "ckpt" / "RESUME.json").read_text())["checkpoint"] == checkpoint_dir(2)
