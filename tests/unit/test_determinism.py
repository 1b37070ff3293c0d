"""Environment signatures, deterministic mode and device-scoped seeding: what bit-exact recomputation needs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sdcguard.agent import determinism, replay
from sdcguard.agent.determinism import (
    DeterminismUnavailable,
    environment_signature,
    gather_signatures,
    require_deterministic,
    signature_differences,
)
from tests.forked import launch_forked

CPU = torch.device("cpu")
CUDA1 = torch.device("cuda", 1)


@pytest.fixture
def torch_flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Put deterministic mode, warn_only and the cuDNN flags back as they were."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # restored after the test
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def fake_gpu(monkeypatch: pytest.MonkeyPatch, *, initialized: bool) -> None:
    """torch.cuda as a process with a GPU would show it (this build has none)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, major=9, minor=0))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)


def test_a_signature_names_what_bit_exactness_depends_on() -> None:
    cpu = environment_signature(CPU)
    assert cpu["threads"] == str(torch.get_num_threads())
    assert cpu["torch"] == torch.__version__
    for key in ("tf32.matmul", "tf32.cudnn", "cudnn.benchmark", "cudnn.deterministic", "deterministic",
                "deterministic.warn_only", "sdpa.flash", "sdpa.mem_efficient", "sdpa.math", "sdpa.cudnn",
                "flash_attn", "cuda", "cudnn"):
        assert key in cpu, key
    assert all(isinstance(v, str) for v in cpu.values())


def test_a_gpu_signature_names_the_gpu_its_sm_count_and_the_cublas_workspace(
        monkeypatch: pytest.MonkeyPatch, torch_flags: None) -> None:
    fake_gpu(monkeypatch, initialized=True)
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace(__version__="2.7.4"))
    gpu = environment_signature(CUDA1)
    assert (gpu["gpu"], gpu["gpu.sm_count"], gpu["gpu.capability"]) == ("NVIDIA H200", "132", "9.0")
    assert gpu["CUBLAS_WORKSPACE_CONFIG"] == "(unset)"
    assert gpu["flash_attn"] == "2.7.4"
    assert "threads" not in gpu


def test_signature_differences_name_the_key_and_which_ranks_hold_which_value() -> None:
    same = {"gpu": "H100", "gpu.sm_count": "132", "torch": "2.5"}
    assert signature_differences([same, dict(same), dict(same)]) == []
    other = {**same, "gpu.sm_count": "114"}
    lacking = {k: v for k, v in same.items() if k != "torch"}
    assert signature_differences([same, same, other, lacking]) == [
        "gpu.sm_count: '132' on ranks [0, 1, 3]; '114' on rank [2]",
        "torch: '2.5' on ranks [0, 1, 2]; '(absent)' on rank [3]",
    ]


def test_deterministic_mode_is_turned_on_and_warn_only_off(caplog: pytest.LogCaptureFixture,
                                                           torch_flags: None) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = True
    with caplog.at_level(logging.WARNING, logger="sdcguard.agent.determinism"):
        require_deterministic(CPU)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (False, True)
    assert "warn_only turned off" in caplog.text
    assert "cudnn.benchmark turned off" in caplog.text
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ""  # the CPU needs no cuBLAS


def test_the_cublas_workspace_is_set_before_cuda_starts_or_refused_after(monkeypatch: pytest.MonkeyPatch,
                                                                        torch_flags: None) -> None:
    # Before CUDA is initialised: set here, and it takes effect.
    fake_gpu(monkeypatch, initialized=False)
    require_deterministic(CUDA1)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # After: cuBLAS may already have chosen its workspace; refused, with what to do.
    fake_gpu(monkeypatch, initialized=True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    with pytest.raises(DeterminismUnavailable, match=r"set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the job's environment"):
        require_deterministic(CUDA1)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(DeterminismUnavailable, match=r"^CUBLAS_WORKSPACE_CONFIG is :0:0 and CUDA is already"):
        require_deterministic(CUDA1)
    # The job's own deterministic setting, from its environment, is accepted as it is.
    for setting in (":16:8", ":4096:8"):
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", setting)
        require_deterministic(CUDA1)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == setting
    # The guard's old name still does it.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    with pytest.raises(DeterminismUnavailable):
        replay.use_deterministic_algorithms(CUDA1)


def test_seeding_seeds_the_ranks_own_gpu_not_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    seeded: list[Any] = []
    current = [torch.device("cuda", 0)]

    class Device:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def __enter__(self) -> None:
            current.append(self.device)

        def __exit__(self, *_: object) -> None:
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: seeded.append((current[-1], seed)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    replay.seed_micro_batch(0, 7, 3, CUDA1)
    assert seeded == [(CUDA1, replay.seed_for(0, 7, 3))]
    # The CPU generator too, as before.
    after = torch.rand(3)
    replay.seed_micro_batch(0, 7, 3, CUDA1)
    assert torch.equal(torch.rand(3), after)
    # Without a device: the current one (the old calls); a CPU device: no CUDA generator at all.
    seeded.clear()
    replay.seed_micro_batch(0, 7, 3)
    replay.seed_micro_batch(0, 7, 3, CPU)
    assert seeded == [(torch.device("cuda", 0), replay.seed_for(0, 7, 3))]


def test_a_world_of_one_gathers_its_own_signature() -> None:
    assert gather_signatures(CPU) == [environment_signature(CPU)]


def gather_rank(out: str) -> None:
    """A rank of the gather test: its thread count from the environment, every rank's signature to a file."""
    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        same = gather_signatures(CPU)  # equal hashes: no text gathered
        torch.set_num_threads(int(os.environ["TEST_THREADS"]))
        rows = gather_signatures(CPU)
        Path(out, f"{dist.get_rank()}.json").write_text(json.dumps({"same": same, "rows": rows}))
    finally:
        dist.destroy_process_group()


def test_three_ranks_gather_each_others_signatures_and_the_one_that_differs_is_named(tmp_path: Path) -> None:
    codes = launch_forked(3, gather_rank, [str(tmp_path)], env={"TEST_THREADS": "1", "TEST_THREADS@2": "2"},
                          timeout=180, preload=["sdcguard.agent.determinism"])
    assert codes == [0, 0, 0]
    seen = [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(3)]
    assert seen[0] == seen[1] == seen[2]  # every rank has every rank's
    assert len(seen[0]["same"]) == 3
    assert signature_differences(seen[0]["same"]) == []
    assert signature_differences(seen[0]["rows"]) == ["threads: '1' on ranks [0, 1]; '2' on rank [2]"]


def test_the_signature_hash_is_canonical() -> None:
    a = {"b": "1", "a": "2"}
    assert determinism.canonical(a) == determinism.canonical(dict(sorted(a.items())))
    assert torch.equal(determinism.signature_lanes(a, CPU), determinism.signature_lanes({"a": "2", "b": "1"}, CPU))
    assert not torch.equal(determinism.signature_lanes(a, CPU), determinism.signature_lanes({**a, "b": "3"}, CPU))


def test_the_policies_for_mismatched_environments_and_nonreproducible_work_are_settings() -> None:
    from sdcguard.agent.config import GuardConfig

    config = GuardConfig()
    assert (config.on_environment_mismatch, config.on_nonreproducible) == ("refuse", "stop")
    env = {"SDCGUARD_ON_ENVIRONMENT_MISMATCH": "degrade", "SDCGUARD_ON_NONREPRODUCIBLE": "continue",
           "SDCGUARD_SPOOL_MAX_AGE_S": "60"}
    config = GuardConfig.from_env(env)
    assert (config.on_environment_mismatch, config.on_nonreproducible, config.spool_max_age_s) == (
        "degrade", "continue", 60.0)
    for field, value in (("on_environment_mismatch", "ignore"), ("on_nonreproducible", "raise"),
                         ("spool_max_age_s", 0.0)):
        with pytest.raises(ValueError, match=rf"^{field}:"):
            GuardConfig(**{field: value})  # type: ignore[arg-type]


_PER_BACKEND_SCRIPT = r"""
import json, math, sys, tempfile, warnings
from pathlib import Path
warnings.simplefilter("ignore")  # torch's deprecation notices of the legacy settings
import torch
import torch.distributed as dist
# What a training script does on torch 2.9 and later, as torch's own warning asks: the per-backend settings.
torch.backends.cuda.matmul.fp32_precision = "tf32"
torch.backends.mkldnn.matmul.fp32_precision = "bf16"
out = {}
try:
    torch.get_float32_matmul_precision()
    out["legacy_raises"] = False
except RuntimeError:
    out["legacy_raises"] = True
from sdcguard.agent import capsule, capsule_replay, determinism
from sdcguard.agent.product_checks import Arithmetic
cpu = torch.device("cpu")
signature = determinism.environment_signature(cpu)
out["signature"] = {k: v for k, v in signature.items() if "fp32" in k or "tf32" in k}
settings = capsule.ReplaySettings.capture(torch.nn.Linear(2, 2), seed=0, step=0, rank=0)
out["capsule"] = settings.fp32_precision
bf16 = Arithmetic.of(torch.float32, torch.float32, cpu, conv=False)
out["cpu_inputs"] = bf16.inputs if bf16 is not None else None
recorded = settings.model_copy(update={"fp32_precision": {**settings.fp32_precision, "cpu.matmul": "ieee"}})
with capsule_replay.applied(recorded, cpu):
    out["applied"] = determinism.fp32_precisions()["cpu.matmul"]
out["restored"] = determinism.fp32_precisions()["cpu.matmul"]
# The guard with the product checks, built and stepped under these settings.
sys.path.insert(0, sys.argv[1])
from tests.unit.test_agent_guard import guard_for
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
guard, recorder = guard_for(Path(tempfile.mkdtemp()), "continue", None, config={"product_checks": True})
out["updated"] = [guard.step(step).updated for step in range(2)]
out["alarms"] = len(recorder.sent)
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_a_script_on_torch_s_per_backend_fp32_settings_is_read_without_the_getters_that_raise() -> None:
    # Given: a script that set TF32 for cuBLAS and bf16 for oneDNN through torch's per-backend settings, after
    # which torch's legacy getters raise (run in its own process: these settings are process-wide).
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _PER_BACKEND_SCRIPT, str(root)], capture_output=True, text=True,
                          timeout=240, check=False, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["legacy_raises"] is True
    # Then: the signature, the capsule's settings and the product checks' bound read each backend's own.
    assert out["signature"] == {"tf32.matmul": "True", "tf32.cudnn": "True", "fp32_precision.cuda.matmul": "tf32",
                                "fp32_precision.cuda.conv": "tf32", "fp32_precision.cpu.matmul": "bf16",
                                "fp32_precision.cpu.conv": "ieee"}
    assert out["capsule"] == {"cuda.matmul": "tf32", "cuda.conv": "tf32", "cpu.matmul": "bf16", "cpu.conv": "ieee"}
    assert out["cpu_inputs"] == (1 + 2.0 ** -8) ** 2 - 1  # bf16 operands, both rounded
    # ... a replay applies a capsule's and puts the script's back; the guard with product checks trains.
    assert (out["applied"], out["restored"]) == ("ieee", "bf16")
    assert out["updated"] == [True, True]
    assert out["alarms"] == 0


def test_fp32_precisions_inherit_from_the_backend_then_torch_s_global_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    backends = SimpleNamespace(
        fp32_precision="tf32",
        cuda=SimpleNamespace(matmul=SimpleNamespace(fp32_precision="none")),
        cudnn=SimpleNamespace(fp32_precision="ieee", conv=SimpleNamespace(fp32_precision="none")),
        mkldnn=SimpleNamespace(fp32_precision="none", matmul=SimpleNamespace(fp32_precision="bf16"),
                               conv=SimpleNamespace(fp32_precision="none")))
    monkeypatch.setattr(torch, "backends", backends)
    assert determinism.fp32_precisions() == {"cuda.matmul": "tf32", "cuda.conv": "ieee", "cpu.matmul": "bf16",
                                             "cpu.conv": "tf32"}
    backends.fp32_precision = "none"
    backends.mkldnn.matmul.fp32_precision = "fp8"  # one this reader does not know: the coarsest it does
    assert determinism.fp32_precisions() == {"cuda.matmul": "ieee", "cuda.conv": "ieee", "cpu.matmul": "bf16",
                                             "cpu.conv": "ieee"}
