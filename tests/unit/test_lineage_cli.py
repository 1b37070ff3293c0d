"""``sdcguard checkpoints list`` and ``select`` on a local directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdcguard.cli import main
from sdcguard.contract.checkpoint import POINTER_NAME
from sdcguard.lineage.pointer import read_pointer
from sdcguard.lineage.store import open_store
from tests.lineage_checkpoints import fingerprint_for, object_key, write_checkpoint

EVENTS = Path(__file__).resolve().parent.parent / "events"


@pytest.fixture
def job(tmp_path: Path) -> str:
    store = open_store(str(tmp_path / "job"))
    for step in (100, 200, 300):
        write_checkpoint(store, step)
    write_checkpoint(store, 400, committed=False)
    write_checkpoint(store, 250)
    store.put_bytes(object_key(250), b"changed")
    return str(tmp_path / "job")


def test_list_json(job: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", "list", job, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["committed"], r["verified"]) for r in rows] == [
        (100, True, True),
        (200, True, True),
        (250, True, False),
        (300, True, True),
        (400, False, False),
    ]
    assert rows[0]["fingerprint"] == fingerprint_for(100)
    assert "sha256" in rows[2]["problem"] or "size" in rows[2]["problem"]


def test_list_table(job: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", "list", job]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["STEP", "TIME", "COMMITTED", "VERIFIED", "FINGERPRINT"]
    assert lines[-1].split()[:4] == ["400", "-", "NO", "NO"]


def test_select_prints_choice_and_reasons(job: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", "select", job, "--suspect-since", "1000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["step"], out["uri"]) == (300, str(Path(job) / "checkpoints" / "step-000000300"))
    assert [p["step"] for p in out["passed_over"]] == [400]
    assert out["pointer"]["written"] is False
    assert not open_store(job).exists(POINTER_NAME)


def test_select_write_pointer(job: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", "select", job, "--suspect-since", "299", "--write-pointer", "--incident-id", "inc-1"]) == 0
    out = capsys.readouterr().out
    assert "chosen: step 200" in out
    assert "passed over step 250" in out
    pointer, _ = read_pointer(open_store(job))
    assert pointer is not None
    assert (pointer.step, pointer.incident_id) == (200, "inc-1")


def test_select_from_an_alarm_uses_its_trusted_step(job: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The stored ring-audit alarm fired at step 200 with the last clean audit at step 100.
    assert main(["checkpoints", "select", job, "--alarm", str(EVENTS / "alarm_ring_audit.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["trusted_through_step"], out["step"]) == (100, 100)
    assert [p["step"] for p in out["passed_over"]] == [400, 300, 250, 200]


def test_select_nothing_safe_exits_nonzero(job: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", "select", job, "--suspect-since", "50", "--write-pointer"]) == 1
    err = capsys.readouterr().err
    assert "nothing safe to resume from" in err
    assert "before the first checkpoint" in err
    assert not open_store(job).exists(POINTER_NAME)


def test_select_refuses_bad_input(job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", "select", job, "--suspect-since", "-3"]) == 1
    assert "--suspect-since: must be >= 0" in capsys.readouterr().err
    bad = tmp_path / "alarm.json"
    bad.write_text('{"schema_version": "9"}')
    assert main(["checkpoints", "select", job, "--alarm", str(bad)]) == 1
    assert "not a valid alarm" in capsys.readouterr().err
    bad.write_text("{")
    assert main(["checkpoints", "select", job, "--alarm", str(bad)]) == 1
    assert "is not JSON" in capsys.readouterr().err
    assert main(["checkpoints", "list", "gs://bucket/x"]) == 1
    assert "only s3://" in capsys.readouterr().err


def test_select_says_the_same_trusted_step_with_and_without_write_pointer(
    job: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a pointer already behind the suspect step (at step 100)
    assert main(["checkpoints", "select", job, "--suspect-since", "100", "--write-pointer"]) == 0
    capsys.readouterr()
    # When the same step is asked for with and without --write-pointer
    assert main(["checkpoints", "select", job, "--suspect-since", "299"]) == 0
    dry = capsys.readouterr().out
    assert main(["checkpoints", "select", job, "--suspect-since", "299", "--write-pointer", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert main(["checkpoints", "select", job, "--suspect-since", "299", "--write-pointer"]) == 0
    text = capsys.readouterr().out
    # Then both name the step that was asked for; the pointer stays where it was and says why
    assert "trusted through step 299;" in dry
    assert "trusted through step 299;" in text
    assert written["trusted_through_step"] == 299
    assert (written["step"], written["pointer"]["kept_behind"]) == (100, True)
    assert "the pointer never moves forward: it was already at step 100, before the trusted step 299" in text
