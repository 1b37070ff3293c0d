"""``sdcguard replay`` under ``SDCGUARD_INJECT``: the simulated faulty GPU acts on a replay as on the training
rank it names, so a persistent fault reproduces on every repetition and a transient one on none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sdcguard.cli import main
from sdcguard.infra.local.standin import LocalStandIn
from tests.capsules import RANK, STEP, write

ROOT = Path(__file__).resolve().parents[2]
NODE = "hyperpod-i-0123456789abcdef0"


@pytest.fixture
def capsule(tmp_path: Path) -> str:
    result = write(tmp_path / "ckpt")
    assert result.written, result.reason
    return result.location


def _replay(capsule: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], inject: str | None,
            node: str = NODE, repeat: int = 2) -> tuple[int, dict[str, Any], str]:
    if inject is None:
        monkeypatch.delenv("SDCGUARD_INJECT", raising=False)
    else:
        monkeypatch.setenv("SDCGUARD_INJECT", inject)
    monkeypatch.setenv("NODE_NAME", node)
    code = main(["replay", capsule, "--repeat", str(repeat), "--json", "--quiet"])
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert isinstance(report, dict)
    return code, report, captured.err


def test_a_persistent_fault_on_this_node_mismatches_every_repetition_and_says_so(
    capsule: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, err = _replay(capsule, monkeypatch, capsys, f"kind=finite_activation,node={NODE},step=0,repeat=50")
    assert code == 1
    assert (report["outcome"], report["matched"], report["reproduced"]) == ("mismatch", 0, 2)
    assert report["verdict"] == "reproduced 2/2: persistent"
    assert report["injection"].startswith("kind=finite_activation node=" + NODE)
    assert "SDCGUARD FAULT INJECTION IS ON" in err
    assert "corrupts every repetition" in err


def test_the_same_fault_bound_to_another_node_changes_nothing(
    capsule: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, err = _replay(capsule, monkeypatch, capsys, f"kind=finite_activation,node={NODE},step=0,repeat=50",
                                node="hyperpod-i-0fffffffffffffff0")
    assert (code, report["outcome"], report["matched"]) == (0, "match", 2)
    assert "does not fire here" in err


def test_a_fault_bound_to_the_capsules_rank_fires_and_to_another_rank_does_not(
    capsule: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, _ = _replay(capsule, monkeypatch, capsys, f"kind=grad_bitflip,rank={RANK},step={STEP},repeat=2")
    assert (code, report["reproduced"]) == (1, 2)
    assert report["repetitions"][0]["loss_match"] is True  # a gradient fault leaves the loss alone
    assert report["repetitions"][0]["mismatched_params"] == ["head.bias"]
    code, report, _ = _replay(capsule, monkeypatch, capsys, f"kind=grad_bitflip,rank={RANK + 1},step={STEP},repeat=2")
    assert (code, report["matched"]) == (0, 2)


def test_a_transient_fault_or_a_window_that_misses_the_step_changes_nothing(
    capsule: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for inject in (
        f"kind=finite_activation,node={NODE},step={STEP + 2}",  # transient, another step
        f"kind=finite_activation,node={NODE},step={STEP}",  # transient at the step: it hit the rank's own pass only
        f"kind=finite_activation,node={NODE},step={STEP + 1},repeat=20",  # persistent, from a later step
        f"kind=weight_bitflip,node={NODE},step=0,repeat=50",  # not a fault of a computation: no optimizer here
    ):
        code, report, _ = _replay(capsule, monkeypatch, capsys, inject)
        assert (code, report["outcome"], report["matched"]) == (0, "match", 2), inject


def test_a_malformed_value_makes_the_capsule_unusable_never_reproduced(
    capsule: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, _ = _replay(capsule, monkeypatch, capsys, "kind=finite_activation,node=x")
    assert (code, report["outcome"], report["problem"]) == (2, "unusable", "injection")
    assert "step: missing" in report["reasons"][0]


def test_the_hooks_leave_with_the_replay(
    capsule: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = _replay(capsule, monkeypatch, capsys, f"kind=nan_activation,node={NODE},step=0,repeat=50")
    assert code == 1
    code, report, err = _replay(capsule, monkeypatch, capsys, None)
    assert (code, report["matched"], report["injection"]) == (0, 2, None)
    assert "INJECTION" not in err


def test_a_fresh_process_on_the_faulty_node_reproduces_as_a_job_would(capsule: str) -> None:
    env = {**os.environ, "SDCGUARD_INJECT": f"kind=finite_activation,node={NODE},step=0,repeat=50", "NODE_NAME": NODE}
    done = subprocess.run([sys.executable, "-m", "sdcguard", "replay", capsule, "--repeat", "2", "--json"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env, check=False)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["reproduced"], report["node"]) == (2, NODE)
    assert "SDCGUARD FAULT INJECTION IS ON" in done.stderr


def test_a_capsule_in_a_bucket_that_does_not_exist_is_unusable_not_a_crash(
    standin: LocalStandIn, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A crash would exit 1 without a report, which a reader could take for a mismatch.
    for key, value in standin.env.items():
        monkeypatch.setenv(key, value)
    location = "s3://sdcguard-no-such-bucket/jobs/gpt/capsules/step-000000003-rank-00001"
    code, report, _ = _replay(location, monkeypatch, capsys, f"kind=finite_activation,node={NODE},step=0,repeat=50")
    assert (code, report["outcome"], report["problem"]) == (2, "unusable", "missing")
    assert "NoSuchBucket" in report["reasons"][0]
