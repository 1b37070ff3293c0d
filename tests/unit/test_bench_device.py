"""The device check a GPU session runs: it must run here (on the CPU) and must fail when a check fails."""

from __future__ import annotations

import pytest
import torch

from agent import fingerprint as fp
from benchmarks import bench_device


def test_the_smoke_run_passes_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_device.main(["--device", "cpu", "--elements", "64K", "--repeats", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 3
    assert "FAIL" not in out
    assert "float32" in out  # the timing table


def test_a_device_that_fingerprints_differently_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = fp.fingerprint_torch

    def off_by_one(t: torch.Tensor, **kwargs: object) -> torch.Tensor:
        lanes = real(t)
        return lanes + (t.numel() > 1000)  # wrong on larger tensors only

    monkeypatch.setattr(fp, "fingerprint_torch", off_by_one)
    assert bench_device.main(["--device", "cpu", "--elements", "64K", "--repeats", "1", "--steps", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  fingerprints equal on the device and the CPU" in out
    assert "n=1025" in out


def test_an_unusable_device_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_device.main(["--device", "warp-drive"])
    assert "--device warp-drive" in capsys.readouterr().err
