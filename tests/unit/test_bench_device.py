"""The device check a GPU session runs: it must run here (on the CPU) and must fail when a check fails."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from benchmarks import bench_device
from sdcguard.agent import fingerprint as fp

SMOKE = ["--device", "cpu", "--elements", "64K", "--repeats", "1", "--steps", "2"]


def test_the_smoke_run_passes_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_device.main(SMOKE) == 0
    out = capsys.readouterr().out
    for check in ("fingerprints equal on the device and the CPU", "deterministic mode can be set up",
                  "SDPA attention recomputed bit for bit", "the guard runs on the device (world 1)",
                  "an injected NaN: no update", "a forced jump fires the magnitude trigger"):
        assert f"PASS  {check}" in out, check
    assert "INFO  environment signature" in out
    assert "FAIL" not in out
    assert "float32" in out  # the timing table
    # The whole step: a row each, timed against plain DDP in the same run.
    for row in bench_device.STEP_ROWS:
        assert any(line.startswith(row) and line.split()[-1].replace(".", "").isdigit() for line in out.splitlines()), row


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
    assert bench_device.main([*SMOKE[:-1], "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  fingerprints equal on the device and the CPU" in out
    assert "n=1025" in out


def test_attention_that_does_not_recompute_bit_for_bit_fails_only_without_warn_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = iter(range(100))

    def drifting(device: torch.device, repeats: int) -> list[list[str]]:
        return [[f"{next(calls)}"] for _ in range(repeats)]  # every run different

    monkeypatch.setattr(bench_device, "_attention_bits", drifting)
    table = bench_device.Table()
    bench_device.check_attention(torch.device("cpu"), table)
    assert [status for _, status, _ in table.rows] == ["FAIL", "INFO"]
    assert table.failed


def test_a_guard_that_cannot_run_on_the_device_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.agent import guard

    def refuse(*_: object, **__: object) -> None:
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(guard.SDCGuard, "step", refuse)
    table = bench_device.Table()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        bench_device.check_guard(torch.device("cpu"), table)
    finally:
        dist.destroy_process_group()
    assert table.rows[0][:2] == ("the guard runs on the device (world 1)", "FAIL")
    assert "same device" in table.rows[0][2]


def test_an_unusable_device_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_device.main(["--device", "warp-drive"])
    assert "--device warp-drive" in capsys.readouterr().err


def test_a_fused_kernel_row_that_fails_is_dropped_and_the_others_stand(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # The fourth row asks for the Triton kernels; here (no GPU, no interpreter) they cannot run.
    monkeypatch.setattr(bench_device, "_fused_row", lambda _device: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = os.environ.get("SDCGUARD_FINGERPRINT_KERNEL")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        medians = bench_device.time_steps(torch.device("cpu"), rounds=1)
    finally:
        dist.destroy_process_group()
    assert list(medians) == list(bench_device.STEP_ROWS)
    assert all(seconds > 0 for seconds in medians.values())
    out = capsys.readouterr().out
    assert f"the row {bench_device.TRITON_ROW!r} failed and was dropped: TritonKernelError" in out
    assert os.environ.get("SDCGUARD_FINGERPRINT_KERNEL") == before  # the setting restored
