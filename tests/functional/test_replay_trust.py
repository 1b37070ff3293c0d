"""``sdcguard replay`` treats a capsule as untrusted input: the factory it names is imported only when the
replay's allow-list holds it, and a refusal comes before anything of the capsule is read or imported.

The attacker here is whoever can write under the job's checkpoint prefix (the tenant): its capsule is
sound (every digest matches, as anyone can make them) and names a factory that runs a command, or a module
whose import does. Each test's command would create a marker file; the marker never appears.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sdcguard.cli import main
from tests.capsules import FACTORY, write

ROOT = Path(__file__).resolve().parents[2]


def _replay(capsule: str, *more: str, env: dict[str, str] | None = None,
            pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``sdcguard replay`` in a fresh process, as an operator's laptop or a node check's Job runs it, with only
    ``env`` as its allow-list settings (the suite's own are removed)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("SDCGUARD_REPLAY_FACTORIES", "SDCGUARD_CAPSULE_FACTORY")}
    if pythonpath is not None:
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), base.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "sdcguard", "replay", capsule, "--repeat", "1", *more],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env={**base, **(env or {})},
                          check=False)


def _report(stdout: str) -> dict[str, Any]:
    document = json.loads(stdout.strip().splitlines()[-1])
    assert isinstance(document, dict)
    return document


def test_a_factory_that_runs_a_command_is_refused_and_the_command_never_runs(tmp_path: Path) -> None:
    # Given a sound capsule whose factory is subprocess:getoutput with a command that creates a marker
    marker = tmp_path / "ran"
    evil = write(tmp_path / "ckpt", factory="subprocess:getoutput", factory_args={"cmd": f"touch {marker}"})
    assert evil.written, evil.reason
    # When it is replayed where the job's configured factory is another one
    done = _replay(evil.location, "--json", env={"SDCGUARD_CAPSULE_FACTORY": FACTORY})
    # Then it is refused, exit 2, naming the factory and the flag that would admit it; the command never ran
    assert done.returncode == 2, done.stdout + done.stderr
    report = _report(done.stdout)
    assert (report["outcome"], report["problem"], report["repetitions"]) == ("unusable", "factory", [])
    reason = report["reasons"][0]
    assert "'subprocess:getoutput'" in reason
    assert "--allow-factory subprocess:getoutput" in reason
    assert f"SDCGUARD_CAPSULE_FACTORY={FACTORY}" in reason
    assert not marker.exists()


def test_the_refusal_comes_before_the_factorys_module_is_imported_or_the_capsule_is_read(tmp_path: Path) -> None:
    # Given a module whose import and whose function each create a marker, and a capsule naming that function
    # whose state has been removed since (anything read past the manifest would fail as "corrupt")
    imported, called = tmp_path / "imported", tmp_path / "called"
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "tenant_factory.py").write_text(
        f"import pathlib\npathlib.Path({str(imported)!r}).touch()\n\n"
        f"def build():\n    pathlib.Path({str(called)!r}).touch()\n")
    evil = write(tmp_path / "ckpt", factory="tenant_factory:build")
    assert evil.written, evil.reason
    (Path(evil.location) / "state.pt").unlink()
    # When it is replayed with no factory allowed at all, the module importable
    done = _replay(evil.location, pythonpath=package)
    # Then: refused on the manifest alone (the factory, not the missing object), nothing imported or called
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot be used here (factory)" in done.stdout
    assert "'tenant_factory:build'" in done.stdout
    assert "--allow-factory tenant_factory:build" in done.stdout
    assert "SDCGUARD_CAPSULE_FACTORY=(unset)" in done.stdout
    assert not imported.exists()
    assert not called.exists()


def _in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: dict[str, str],
                *argv: str) -> tuple[int, str, str]:
    for name in ("SDCGUARD_REPLAY_FACTORIES", "SDCGUARD_CAPSULE_FACTORY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(["replay", *argv])
    except SystemExit as exc:  # argparse's refusal
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_configured_factory_a_setting_and_the_flag_each_admit_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    capsule = write(tmp_path / "ckpt").location
    # By default the job's configured factory; then the setting; then the flag; each admits exactly its own.
    for env, flags in (({"SDCGUARD_CAPSULE_FACTORY": FACTORY}, ()),
                       ({"SDCGUARD_REPLAY_FACTORIES": f"mypkg.sdc:other, {FACTORY}"}, ()),
                       ({}, ("--allow-factory", "mypkg.sdc:other", "--allow-factory", FACTORY))):
        code, out, _ = _in_process(monkeypatch, capsys, env, capsule, "--repeat", "1", "--json", "--quiet", *flags)
        assert code == 0, (env, flags, out)
        assert _report(out)["matched"] == 1
    # Another function of the same module is not admitted by its neighbour.
    code, out, _ = _in_process(monkeypatch, capsys, {}, capsule, "--json", "--quiet",
                               "--allow-factory", "tests.capsules:tiny_model")
    assert (code, _report(out)["problem"]) == (2, "factory")


@pytest.mark.parametrize(("env", "flags", "message"), [
    ({"SDCGUARD_REPLAY_FACTORIES": "subprocess.getoutput"}, (),
     "SDCGUARD_REPLAY_FACTORIES: 'subprocess.getoutput' is not package.module:function"),
    ({}, ("--allow-factory", "os.system"), "--allow-factory: 'os.system' is not package.module:function"),
])
def test_a_malformed_allow_list_is_refused_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    env: dict[str, str], flags: tuple[str, ...], message: str
) -> None:
    code, _, err = _in_process(monkeypatch, capsys, env, str(tmp_path), *flags)
    assert code == 2
    assert message in err


def test_help_says_a_capsule_is_untrusted_and_how_to_allow_a_factory() -> None:
    done = subprocess.run([sys.executable, "-m", "sdcguard", "replay", "--help"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, check=True)
    text = " ".join(done.stdout.split())
    assert "A capsule is untrusted input" in text
    assert "--allow-factory MODULE:FUNCTION" in text
    assert "$SDCGUARD_CAPSULE_FACTORY" in text
    assert "$SDCGUARD_REPLAY_FACTORIES" in text
