"""``python -m sdcguard.agent.testing.train`` refuses bad flags and settings with exit 2 and one line, before any rank starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sdcguard.agent.testing import train

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--steps", "-1"], {}, "--steps: must be >= 0, got -1"),
        (["--checkpoint-every", "-5"], {}, "--checkpoint-every: must be >= 0"),
        (["--steps", "1"], {"SDCGUARD_INJECT": "kind=nope,rank=0,step=1"}, "SDCGUARD_INJECT: "),
        (["--steps", "1"], {"SDCGUARD_INJECT": "garbage"}, "SDCGUARD_INJECT: "),
        (["--steps", "1"], {"SDCGUARD_FINGERPRINT_KERNEL": "fast"}, "SDCGUARD_FINGERPRINT_KERNEL='fast' is not valid"),
    ],
)
def test_bad_settings_exit_2_with_one_line(
    argv: list[str], env: dict[str, str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("SDCGUARD_INJECT", "SDCGUARD_FINGERPRINT_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.setattr(train, "_worker", lambda *a, **k: pytest.fail("a rank was started"))
    assert train.main([*argv, "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("sdcguard.agent.testing.train: error: ")
    assert says in err[0]


def test_a_malformed_injection_gives_no_traceback_from_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sdcguard.agent.testing.train", "--nproc", "2", "--steps", "3"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
        env={"PATH": "", "SDCGUARD_INJECT": "kind=bitflip,rank=zero", "HOME": str(ROOT)},
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("sdcguard.agent.testing.train: error: SDCGUARD_INJECT: ")
