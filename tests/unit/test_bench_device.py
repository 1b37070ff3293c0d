"""The device run a GPU session makes: it must run here (on the CPU, offline, as on the lent image), must fail
when a check fails, and a failing section must leave the others."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pydantic
import pytest
import torch
import torch.distributed as dist

from benchmarks import bench_device
from benchmarks.device import figures
from benchmarks.device.report import Report, Watchdog
from sdcguard.agent import fingerprint as fp

SMOKE = ["--device", "cpu", "--repeats", "1", "--steps", "2"]
ROOT = Path(__file__).resolve().parents[2]
CARRIED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")
"""What the lent image lacks (or has too old) and the device run carries as wheels (benchmarks/device/wheels.txt)."""
ABSENT = (*CARRIED[:-1], "boto3", "botocore", "s3transfer", "jmespath", "sdcguard", "__editable__")
"""Not in the emulated image: the carried packages, boto3 and its kin (the agent must run without them) and the
project's own install (the device has the repository on PYTHONPATH only)."""


def _wheel_of(site: Path, package: str, into: Path) -> Path:
    """A wheel of ``package`` as installed in ``site`` (its files by its RECORD), so that the test installs wheels
    as the device does without any registry."""
    info = next(site.glob(f"{package}-*.dist-info"))
    tag = next(line.split(": ", 1)[1] for line in (info / "WHEEL").read_text().splitlines() if line.startswith("Tag:"))
    name, version = info.name.removesuffix(".dist-info").split("-", 1)
    wheel = into / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for line in (info / "RECORD").read_text().splitlines():
            path = line.split(",", 1)[0]
            if path and not path.startswith("..") and "__pycache__" not in path and (site / path).is_file():
                archive.write(site / path, path)
    return wheel


@pytest.fixture(scope="module")
def device_image(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The lent image as the device run meets it, made here: a fresh venv without pip of its own, seeing this
    environment's packages except ``ABSENT`` (torch, triton and pip among what it sees), and the carried
    packages as wheels in a folder. Returns the environment for ``run.sh``."""
    base = tmp_path_factory.mktemp("image")
    site = Path(sysconfig.get_paths()["purelib"])
    seen = base / "image-site"
    seen.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(ABSENT) and not entry.name.endswith(".pth"):
            (seen / entry.name).symlink_to(entry)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    venv_site = next(venv.glob("lib/python3*/site-packages"))
    (venv_site / "image.pth").write_text(f"{seen}\n")
    wheels = base / "wheels"
    wheels.mkdir()
    for package in CARRIED:
        _wheel_of(site, package, wheels)
    # Any registry is unreachable: an attempt to use one fails the run instead of passing slowly.
    dead = "http://127.0.0.1:9"
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))},
            "SDCGUARD_DEVICE_PYTHON": str(venv / "bin" / "python"), "SDCGUARD_DEVICE_WHEELS": str(wheels),
            "SDCGUARD_DEVICE_SITE": str(base / "site"), "PIP_INDEX_URL": f"{dead}/simple",
            "http_proxy": dead, "https_proxy": dead, "HTTP_PROXY": dead, "HTTPS_PROXY": dead}


def test_the_device_command_runs_offline_in_a_bare_image_and_writes_every_figure(
        device_image: dict[str, str], tmp_path: Path) -> None:
    # Given a python that has torch but not pydantic: it cannot import the agent.
    bare = subprocess.run([device_image["SDCGUARD_DEVICE_PYTHON"], "-c", "import pydantic"], capture_output=True,
                          text=True, env={**device_image, "PYTHONPATH": str(ROOT)}, check=False)
    assert bare.returncode != 0
    # When the device command runs there (no GPU: its smoke run).
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "benchmarks/device/run.sh"), str(out), "--", "--repeats", "1",
                           "--steps", "1"], capture_output=True, text=True, env=device_image, timeout=600,
                          check=False)
    log = done.stdout + done.stderr
    # Then it installed the carried wheels, ran every section and wrote its files.
    assert done.returncode == 0, log[-4000:]
    assert "Looking in indexes" not in log
    assert "127.0.0.1" not in log
    assert sorted(p.name for p in out.iterdir()) == ["device.json", "log.txt", "rows.jsonl", "table.txt"]
    found = json.loads((out / "device.json").read_text())
    assert found["stopped"] == "finished"
    assert set(found["sections"]) == {s.name for s in bench_device.SECTIONS if s.cuda is None}
    statuses = {row["name"]: row["status"] for row in found["rows"]}
    assert "FAIL" not in statuses.values()
    for check in ("fingerprints equal on the device and the CPU", "deterministic mode can be set up (not warn_only)",
                  "SDPA attention recomputed bit for bit", "the magnitude trigger runs under deterministic mode",
                  "the guard runs on the device (world 1)", "an injected NaN: no update",
                  "a forced jump fires the magnitude trigger",
                  "the GPT example's world-1 step: plain outside any interception"):
        assert statuses[check] == "PASS", check
    assert statuses["kernels"] == statuses["product_kernels"] == "SKIP"
    assert found["meta"]["pydantic"] == pydantic.VERSION
    # Every figure a GPU run would give has its place, measured here at the smoke run's sizes.
    assert found["figures"]["step"]["defaults_x_plain"] > 0
    assert found["figures"]["layer"]["failing_sites"] == 0
    assert set(found["figures"]["launches"]) == {"defaults", "defaults + clipping", "defaults + product checks"}
    streamed = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["name"] for r in streamed] == [r["name"] for r in found["rows"]]


def test_a_section_that_raises_is_a_fail_row_and_the_others_still_run(tmp_path: Path) -> None:
    sections = "environment,trigger,nonfinite"
    assert bench_device.main([*SMOKE, "--only", sections, "--fail-section", "trigger", "--out", str(tmp_path)]) == 1
    found = json.loads((tmp_path / "device.json").read_text())
    rows = [(row["section"], row["status"]) for row in found["rows"]]
    assert rows == [("environment", "INFO"), ("nonfinite", "PASS"), ("trigger", "FAIL")]  # in the run's order
    assert "asked to fail" in found["rows"][2]["detail"]
    assert found["stopped"] == "finished"
    assert (tmp_path / "table.txt").read_text().count("\n") == 3


def test_the_watchdog_writes_what_there_is_and_ends_the_run(tmp_path: Path) -> None:
    report = Report(tmp_path)
    report.section = "step"
    report.add("a row before the budget ran out", [])
    ended: list[int] = []
    watchdog = Watchdog(report, budget_s=0.01, exit=ended.append)
    watchdog.start()
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ended == [Watchdog.EXIT]
    found = json.loads((tmp_path / "device.json").read_text())
    assert found["stopped"].startswith("watchdog")
    assert "'step'" in found["stopped"]
    assert [row["name"] for row in found["rows"]] == ["a row before the budget ran out"]


def test_the_preflight_leaves_deterministic_mode_as_it_found_it() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    report = Report()
    run = bench_device.Run(torch.device("cpu"), argparse.Namespace(), report, Watchdog(report, math.inf))
    bench_device.run_section(run, next(s for s in bench_device.SECTIONS if s.name == "preflight"), set())
    assert torch.are_deterministic_algorithms_enabled() == before
    assert any(row.status == "PASS" for row in report.rows)


def test_without_cuda_it_says_so_and_exits_with_its_own_code(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_device.main([]) == bench_device.NO_CUDA_EXIT == 3
    out = capsys.readouterr().out
    assert "no CUDA device on this machine" in out
    assert "PASS" not in out


def test_a_device_that_fingerprints_differently_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = fp.fingerprint_torch

    def off_by_one(t: torch.Tensor, **kwargs: object) -> torch.Tensor:
        lanes = real(t)
        return lanes + (t.numel() > 1000)  # wrong on larger tensors only

    monkeypatch.setattr(fp, "fingerprint_torch", off_by_one)
    assert bench_device.main([*SMOKE, "--only", "fingerprints"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  fingerprints equal on the device and the CPU" in out
    assert "n=1025" in out


def test_attention_that_does_not_recompute_bit_for_bit_fails_only_without_warn_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = iter(range(100))

    def drifting(device: torch.device, repeats: int) -> list[list[str]]:
        return [[f"{next(calls)}"] for _ in range(repeats)]  # every run different

    monkeypatch.setattr(bench_device, "_attention_bits", drifting)
    table = Report()
    bench_device.check_attention(torch.device("cpu"), table)
    assert [row.status for row in table.rows] == ["FAIL", "INFO"]
    assert table.failed


def test_a_guard_that_cannot_run_on_the_device_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.agent import guard

    def refuse(*_: object, **__: object) -> None:
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(guard.SDCGuard, "step", refuse)
    table = Report()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        bench_device.check_guard(torch.device("cpu"), table)
    finally:
        dist.destroy_process_group()
    assert (table.rows[0].name, table.rows[0].status) == ("the guard runs on the device (world 1)", "FAIL")
    assert "same device" in table.rows[0].detail


def test_an_unusable_device_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_device.main(["--device", "warp-drive"])
    assert "--device warp-drive" in capsys.readouterr().err


def test_a_step_row_that_fails_is_a_fail_row_and_the_other_rows_stand(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The Triton rows ask for the fused kernels; here (no GPU, no interpreter) they cannot run.
    monkeypatch.setattr(bench_device.Run, "triton", property(lambda _run: True))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = os.environ.get("SDCGUARD_FINGERPRINT_KERNEL")
    # The device runs this in a fresh process; a test before this one in the same worker may have left product
    # checks alive (the interception stays while any exist), and then the plain row says so, as it should.
    leaked = figures.intercepting()
    assert bench_device.main([*SMOKE, "--only", "step,trigger", "--step-rounds", "1", "--out", str(tmp_path)]) == 1
    found = json.loads((tmp_path / "device.json").read_text())
    failed = [row for row in found["rows"] if row["status"] == "FAIL"]
    assert [row["name"] for row in failed] == [
        *(["the GPT example's world-1 step: plain outside any interception"] if leaked else []),
        "the GPT example's world-1 step: defaults + products, triton"]
    assert "TritonKernelError" in failed[-1]["detail"]
    statuses = {row["name"]: row["status"] for row in found["rows"]}
    assert statuses["the GPT example's world-1 step: defaults + product checks"] == "INFO"  # the others stand
    assert statuses["the magnitude trigger runs under deterministic mode"] == "PASS"  # and the sections after
    assert os.environ.get("SDCGUARD_FINGERPRINT_KERNEL") == before  # the setting restored


def test_the_kernels_counts_and_offsets_are_not_specialised() -> None:
    # The compile budget: a count that equals 1 or a multiple of 16 would otherwise compile a variant of its own.
    # Read from the source: where the tests run Triton's interpreter, the kernels keep no specialisation to ask.
    import ast

    tree = ast.parse((ROOT / "agent/kernels/_triton_jit.py").read_text())
    unspecialised: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
            names: set[str] = set()
            for decorator in node.decorator_list:
                for keyword in getattr(decorator, "keywords", []):
                    if keyword.arg == "do_not_specialize":
                        names = set(ast.literal_eval(keyword.value))
            assert names <= {a.arg for a in node.args.args}, node.name  # each a real argument
            unspecialised[node.name] = names
    assert unspecialised["fingerprint_kernel"] == {"start", "n_tiles"}
    assert unspecialised["row_finish_kernel"] == {"split", "total", "plane", "start"}
    assert len(unspecialised) == 8
    assert all(unspecialised.values())
