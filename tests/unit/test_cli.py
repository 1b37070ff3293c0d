"""The ``sdcguard`` entry point: help, dispatch and exit codes."""

from __future__ import annotations

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
