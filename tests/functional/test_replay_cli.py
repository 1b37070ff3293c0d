"""``sdcguard replay CAPSULE``: exit codes, the JSON the pipeline's Job will read from the pod log, and a
capsule beside checkpoints on the stand-in's S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from sdcguard.agent import capsule as cap
from sdcguard.agent.determinism import environment_signature
from sdcguard.cli import main
from sdcguard.infra.local.standin import LocalStandIn
from sdcguard.lineage.store import S3Store, open_store
from tests.capsules import faulty_device, recomputed, write

ROOT = Path(__file__).resolve().parents[2]


def _sdcguard(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command in a fresh process, as a Kubernetes Job runs it."""
    return subprocess.run([sys.executable, "-m", "sdcguard", *argv], capture_output=True, text=True, timeout=240,
                          cwd=ROOT, env={**os.environ, **(env or {})}, check=False)


def _last_json(stdout: str) -> dict[str, Any]:
    document = json.loads(stdout.strip().splitlines()[-1])
    assert isinstance(document, dict)
    return document


@pytest.fixture
def capsule(tmp_path: Path) -> str:
    result = write(tmp_path / "ckpt")
    assert result.written, result.reason
    return result.location


def test_a_healthy_replay_in_a_fresh_process_exits_0_with_one_json_object(capsule: str) -> None:
    done = _sdcguard("replay", capsule, "--repeat", "3", "--json")
    assert done.returncode == 0, done.stderr
    report = _last_json(done.stdout)
    assert {k: report[k] for k in ("capsule", "step", "rank", "repeats", "matched", "reproduced", "outcome",
                                   "exit_code", "problem", "reasons")} == {
        "capsule": capsule, "step": 3, "rank": 1, "repeats": 3, "matched": 3, "reproduced": 0, "outcome": "match",
        "exit_code": 0, "problem": None, "reasons": []}
    assert report["verdict"] == "reproduced 0/3: every repetition gave the healthy bits"
    assert [r["match"] for r in report["repetitions"]] == [True] * 3
    assert "repetition 3/3: match" in done.stderr  # progress, on stderr


def test_the_manifest_path_and_human_output_work_too(capsule: str) -> None:
    done = _sdcguard("replay", f"{capsule}/CAPSULE.json", "--repeat", "1", "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "reproduced 0/1: every repetition gave the healthy bits"
    assert done.stderr == ""


def test_a_flipped_byte_exits_2_and_is_never_reproduced(capsule: str) -> None:
    path = Path(capsule) / "state.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))
    done = _sdcguard("replay", capsule, "--json", "--quiet")
    assert done.returncode == 2
    report = _last_json(done.stdout)
    assert (report["outcome"], report["problem"], report["matched"], report["reproduced"]) == ("unusable", "corrupt", 0, 0)
    assert "state.pt" in report["reasons"][0]
    assert not report["verdict"].startswith("reproduced")


def test_a_faulty_device_exits_1_naming_the_parameters(capsule: str, capsys: pytest.CaptureFixture[str]) -> None:
    with faulty_device(persistent=True):
        code = main(["replay", capsule, "--repeat", "2", "--json", "--quiet"])
    assert code == 1
    report = _last_json(capsys.readouterr().out)
    assert (report["verdict"], report["matched"], report["reproduced"]) == ("reproduced 2/2: persistent", 0, 2)
    assert "head.weight" in report["repetitions"][0]["mismatched_params"]
    assert report["repetitions"][0]["loss_match"] is False


def test_a_signature_mismatch_exits_2_naming_what_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    signature = environment_signature(torch.device("cpu"))
    key = sorted(signature)[0]
    result = write(tmp_path, signature={**signature, key: "another"})
    assert main(["replay", result.location, "--quiet"]) == 2
    out = capsys.readouterr().out
    assert "cannot be used here (signature)" in out
    assert key in out


def test_no_capsule_and_a_bad_repeat_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path), "--json", "--quiet"]) == 2
    assert _last_json(capsys.readouterr().out)["problem"] == "missing"
    with pytest.raises(SystemExit) as info:
        main(["replay", str(tmp_path), "--repeat", "0"])
    assert info.value.code == 2
    assert "--repeat: must be >= 1, got 0" in capsys.readouterr().err


def test_a_capsule_beside_checkpoints_on_s3_replays_from_its_s3_location(standin: LocalStandIn) -> None:
    s3 = standin.client("s3")
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    prefix = open_store(f"s3://{bucket}/jobs/gpt", client=s3)
    assert isinstance(prefix, S3Store)
    result = cap.write_capsule(prefix, **recomputed())
    assert result.written
    assert result.location == f"s3://{bucket}/jobs/gpt/capsules/step-000000003-rank-00001"
    done = _sdcguard("replay", result.location, "--repeat", "2", "--json", "--quiet", env=standin.env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _last_json(done.stdout)["matched"] == 2
    # A changed object on S3 is refused as well.
    key = "jobs/gpt/capsules/step-000000003-rank-00001/batch-000.pt"
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-1] ^= 0x01
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    done = _sdcguard("replay", result.location, "--json", "--quiet", env=standin.env)
    assert done.returncode == 2
    assert _last_json(done.stdout)["problem"] == "corrupt"


def test_replay_help_imports_no_torch() -> None:
    # The command's own part (sdcguard.agent.capsule, torch) is imported only when it runs, never for --help.
    code = ("import sys\nfrom sdcguard.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'sdcguard.agent.capsule', 'sdcguard.agent.capsule_replay') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, "replay", "--help"], capture_output=True, text=True,
                          timeout=60, check=True, cwd=ROOT)
    assert "Exit status: 0 every repetition matched" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"
