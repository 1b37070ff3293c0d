"""The ``sdcguard`` entry point: help, dispatch and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from sdcguard.cli import main


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "schema" in out


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: sdcguard" in capsys.readouterr().out


def test_schema_check_passes_on_a_clean_tree() -> None:
    assert main(["schema", "--check"]) == 0


def test_schema_prints_the_alarm_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "alarm"]) == 0
    assert '"schema_version"' in capsys.readouterr().out


def test_incidents_without_credentials_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_ENDPOINT_URL", "SDCGUARD_LEDGER_TABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # boto3's default session keeps the credentials an earlier test's environment gave it.
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    for argv in (["incidents"], ["incidents", "--table", "ledger"], ["incidents", "show", "sdc-x", "--table", "t"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "sdcguard: error: no AWS credentials" in err
        assert "no ledger table" not in err


@pytest.mark.parametrize(("args", "names"), [
    (["--faults-per-model", "0"], "faults_per_model: must be > 0"),
    (["--models", "matmul_fwd,cosmic_ray"], "unknown fault model(s) ['cosmic_ray']"),
    (["--replay", "matmul_fwd/sometimes/001"], "unknown persistence 'sometimes'"),
    (["--job", "mypkg.sdc.campaign_job"], "--job 'mypkg.sdc.campaign_job': expected MODULE:FUNCTION"),
    (["--job", "sdcguard_no_such_pkg.sdc:campaign_job"], "module 'sdcguard_no_such_pkg.sdc' cannot be imported"),
    (["--job", "sdcguard.campaign.job:no_such_factory"], "module 'sdcguard.campaign.job' has no attribute 'no_such_factory'"),
])
def test_campaign_refuses_bad_options_before_running_anything(
        args: list[str], names: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["campaign", "--out", str(out), *args]) == 2
    assert names in capsys.readouterr().err
    assert not out.exists()  # nothing was started, nothing written


@pytest.mark.parametrize("argv", [["local", "exec-credential", "--help"], ["campaign", "--help"], ["--help"]])
def test_a_command_imports_only_its_own_part(argv: list[str]) -> None:
    # kubectl starts `sdcguard local exec-credential` for every call: it must not load the drill, the
    # pipeline's Kubernetes client or torch, and neither must --help.
    code = ("import sys\nfrom sdcguard.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'kubernetes', 'sdcguard.infra.drill', 'sdcguard.lambdas') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                          check=True, cwd=Path(__file__).parents[2])
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
