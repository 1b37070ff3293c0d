"""The replay capsule: written from a real recomputation, verified before use, replayed bit for bit.

Given a tiny reference model and a step recomputed as the audit recomputes it,
a capsule replays N/N on this CPU; a flipped byte anywhere, a missing object,
another signature or a factory that does not import are refused (exit 2),
never "reproduced"; a fault hook on the replaying "device" reproduces (exit 1)
and names the parameters whose gradients differ.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from sdcguard.agent import capsule as cap
from sdcguard.agent import fingerprint as fp
from sdcguard.agent import replay as seeding
from sdcguard.agent.capsule_replay import replay
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.determinism import environment_signature
from sdcguard.agent.recompute import recompute_step
from sdcguard.agent.ring_audit import loss_bits
from sdcguard.agent.testing.train import SyntheticData
from sdcguard.lineage.store import LocalStore
from tests.capsules import ARGS, CPU, FACTORY, SEQ, SHAPE, VOCAB, faulty_device, model, recomputed, write


@pytest.fixture
def written(tmp_path: Path) -> cap.CapsuleResult:
    result = write(tmp_path / "ckpt")
    assert result.written, result.reason
    return result


def test_a_capsule_of_a_real_recomputation_replays_n_of_n(written: cap.CapsuleResult, tmp_path: Path) -> None:
    assert written.location == str(tmp_path / "ckpt" / "capsules" / "step-000000003-rank-00001")
    assert sorted(p.name for p in Path(written.location).iterdir()) == ["CAPSULE.json", "batch-000.pt", "state.pt"]
    report = replay(written.location, repeats=3)
    assert (report.exit_code, report.matched, report.reproduced) == (0, 3, 0), report.to_dict()
    assert report.verdict == "reproduced 0/3: every repetition gave the healthy bits"
    assert report.to_dict()["repetitions"][0]["loss"] == written.manifest.expected.loss  # type: ignore[union-attr]


def test_accumulation_autocast_and_a_grad_scaler_replay_too(tmp_path: Path) -> None:
    result = write(tmp_path, k=2, autocast="bfloat16", grad_scale=1024.0)
    assert result.written
    assert result.manifest is not None
    assert len(result.manifest.batches) == 2
    assert result.manifest.settings.grad_scale == (1024.0).hex()
    report = replay(result.location, repeats=2)
    assert (report.exit_code, report.matched) == (0, 2), report.to_dict()


@pytest.mark.parametrize("eager", [True, False])
def test_a_compiled_model_replays_as_the_checked_pass_ran(tmp_path: Path, eager: bool) -> None:
    # Given: a step recomputed eagerly (with the product checks on, compiled code runs eagerly), and a factory
    # that rebuilds the model compiled, by a backend whose code rounds otherwise than eager (as inductor's).
    result = write(tmp_path, eager=eager, factory="tests.capsules:compiled_reference_model")
    assert result.written
    assert result.manifest is not None
    assert result.manifest.settings.eager is eager
    report = replay(result.location, repeats=2)
    if eager:
        # Then: the capsule says so, the replay runs the compiled code eagerly too, and healthy hardware
        # gives the healthy bits.
        assert (report.exit_code, report.matched, report.reproduced) == (0, 2, 0), report.to_dict()
    else:
        # Without it the replay would run the compiled code and accuse healthy hardware: what the flag is for.
        assert (report.exit_code, report.reproduced) == (1, 2), report.to_dict()


def test_the_replay_leaves_torch_settings_as_it_found_them(written: cap.CapsuleResult) -> None:
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    replay(written.location, repeats=1)
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, deterministic)


def test_a_persistent_fault_on_the_replaying_device_reproduces_and_names_the_parameters(
        written: cap.CapsuleResult) -> None:
    with faulty_device(persistent=True):
        report = replay(written.location, repeats=3)
    assert (report.exit_code, report.outcome, report.reproduced) == (1, "mismatch", 3)
    assert report.verdict == "reproduced 3/3: persistent"
    first = report.repetitions[0]
    assert not first.loss_match
    assert "head.weight" in first.mismatched_params
    assert "head.bias" in first.mismatched_params


def test_a_transient_fault_reproduces_once(written: cap.CapsuleResult) -> None:
    with faulty_device(persistent=False):
        report = replay(written.location, repeats=3)
    assert [r.match for r in report.repetitions] == [False, True, True]
    assert (report.exit_code, report.verdict) == (1, "reproduced 1/3: intermittent")


def test_an_expected_digest_unlike_this_devices_names_that_parameter(tmp_path: Path) -> None:
    parts = recomputed()
    expected: cap.Expected = parts["expected"]
    parts["expected"] = expected.model_copy(update={"grads": {**expected.grads, "head.bias": "0" * 48}})
    result = cap.write_capsule(str(tmp_path), **parts)
    report = replay(result.location, repeats=2)
    assert report.exit_code == 1
    assert [(r.loss_match, r.mismatched_params) for r in report.repetitions] == [(True, ["head.bias"])] * 2


@pytest.mark.parametrize("name", ["state.pt", "batch-000.pt", "CAPSULE.json"])
@pytest.mark.parametrize("where", [0, 0.5, -1])
def test_a_flipped_byte_in_any_object_is_refused_never_reproduced(
        written: cap.CapsuleResult, name: str, where: float) -> None:
    path = Path(written.location) / name
    data = bytearray(path.read_bytes())
    index = int(len(data) * where) if where >= 0 else len(data) - 1
    data[index] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(cap.CapsuleCorrupt, match="never replayed"):
        cap.load_capsule(written.location)
    report = replay(written.location, repeats=2)
    assert (report.exit_code, report.problem, report.repetitions) == (2, "corrupt", [])
    assert "reproduced" not in report.verdict
    assert name in report.reasons[0]


def test_every_byte_of_the_manifest_is_covered_by_its_digest(written: cap.CapsuleResult) -> None:
    data = (Path(written.location) / cap.MANIFEST_NAME).read_bytes()
    assert cap.parse_manifest(data, where="x") == written.manifest
    for index in range(len(data)):
        for bit in (0x01, 0x20):
            changed = bytearray(data)
            changed[index] ^= bit
            with pytest.raises(cap.CapsuleCorrupt):
                cap.parse_manifest(bytes(changed), where="x")


def test_a_missing_object_or_manifest_is_refused(written: cap.CapsuleResult) -> None:
    (Path(written.location) / "batch-000.pt").unlink()
    with pytest.raises(cap.CapsuleCorrupt, match="listed in the manifest but missing"):
        cap.load_capsule(written.location)
    (Path(written.location) / cap.MANIFEST_NAME).unlink()
    with pytest.raises(cap.CapsuleNotFound, match="not a committed replay capsule"):
        cap.load_capsule(written.location)
    assert replay(written.location, repeats=1).problem == "missing"


def test_another_environment_signature_is_refused_naming_what_differs(tmp_path: Path) -> None:
    signature = environment_signature(CPU)
    key = sorted(signature)[0]
    result = write(tmp_path, signature={**signature, key: signature[key] + "-elsewhere"})
    report = replay(result.location, repeats=2)
    assert (report.exit_code, report.problem, report.repetitions) == (2, "signature", [])
    assert any(key in reason and "-elsewhere" in reason for reason in report.reasons), report.reasons


def test_another_gpu_model_is_refused_as_another_device(tmp_path: Path) -> None:
    signature = {**environment_signature(CPU), "gpu": "NVIDIA H100 80GB HBM3", "gpu.sm_count": "132"}
    report = replay(write(tmp_path, signature=signature).location, repeats=1)
    assert (report.exit_code, report.problem, report.repetitions) == (2, "device", [])
    assert report.reasons[0] == "another GPU model: NVIDIA H100 80GB HBM3 in the capsule, no GPU here"
    assert any(r.startswith("gpu.sm_count: '132' on rank [0]") for r in report.reasons), report.reasons


def test_a_capsule_of_a_device_this_machine_lacks_is_refused(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    parts = recomputed()
    parts["settings"] = parts["settings"].model_copy(update={"device_type": "cuda"})
    result = cap.write_capsule(str(tmp_path), **parts)
    report = replay(result.location, repeats=1)
    assert (report.exit_code, report.problem) == (2, "device")
    assert "'cuda'" in report.reasons[0]


@pytest.mark.parametrize(("changes", "problem", "says"), [
    ({"factory": "sdcguard_no_such_pkg.sdc:replay_model"}, "factory", "cannot be imported here"),
    ({"factory": "tests.capsules:no_such_factory"}, "factory", "has no function 'no_such_factory'"),
    ({"factory_args": {**ARGS, "dim": 12}}, "model", "builds a model unlike the capsule's state"),
])
def test_a_factory_that_cannot_rebuild_the_model_is_refused(
        tmp_path: Path, changes: dict[str, Any], problem: str, says: str) -> None:
    result = write(tmp_path, **changes)
    assert result.written
    report = replay(result.location, repeats=1)
    assert (report.exit_code, report.problem) == (2, problem)
    assert says in report.reasons[0]


def test_over_the_cap_nothing_is_written_and_the_result_says_so(tmp_path: Path) -> None:
    result = write(tmp_path / "ckpt", cap_bytes=4096)
    assert not result.written
    assert "above capsule_max_bytes (4096)" in result.reason
    assert "nothing was written" in result.reason
    assert result.describe().startswith("no replay capsule: it would be")
    assert not (tmp_path / "ckpt").exists()


def test_a_micro_batch_that_cannot_be_stored_writes_nothing(tmp_path: Path) -> None:
    parts = recomputed()
    parts["batches"] = [(parts["batches"][0], object())]
    result = cap.write_capsule(str(tmp_path / "ckpt"), **parts)
    assert not result.written
    assert "batch[1]: a object cannot be stored" in result.reason
    assert not (tmp_path / "ckpt").exists()


def test_a_batch_sliced_from_a_whole_data_set_stores_the_slice_not_the_data_set(tmp_path: Path) -> None:
    data_set = torch.randint(VOCAB, (50_000, SEQ + 1))
    sliced = (data_set[8:10, :-1], data_set[8:10, 1:])
    result = write(tmp_path, batches=[sliced], expected=recomputed(batch=sliced)["expected"])
    assert result.written, result.reason
    assert (Path(result.location) / "batch-000.pt").stat().st_size < 4096  # the data set is 2.8 MB
    assert replay(result.location, repeats=2).matched == 2


def test_a_store_that_fails_gives_a_result_not_an_exception(tmp_path: Path) -> None:
    class Outage(LocalStore):
        def put_bytes(self, key: str, data: bytes, **kwargs: Any) -> str:
            raise OSError("S3 is unreachable")

    result = cap.write_capsule(Outage(tmp_path), **recomputed())
    assert not result.written
    assert result.reason.endswith("failed: OSError: S3 is unreachable")
    with pytest.raises(cap.CapsuleNotFound):  # nothing committed: never read as a capsule
        cap.load_capsule(result.location)


def test_bad_arguments_name_the_argument(tmp_path: Path) -> None:
    parts = recomputed()
    with pytest.raises(ValueError, match=re.escape("factory: '__main__.build' is not package.module:function")):
        cap.write_capsule(str(tmp_path), **{**parts, "factory": "__main__.build"})
    with pytest.raises(ValueError, match="expected: its"):
        cap.write_capsule(str(tmp_path), **{**parts, "expected": cap.Expected(loss_bits=0, loss="0x0p+0", grads={})})
    with pytest.raises(ValueError, match="repeats: must be >= 1"):
        replay(str(tmp_path), repeats=0)
    assert not (tmp_path / "capsules").exists()


def test_expected_from_an_audit_record_is_expected_from_the_recomputation() -> None:
    module, loss_fn = model()
    names = [n for n, p in module.named_parameters()]
    rec = recompute_step(module, loss_fn, [SyntheticData(SHAPE, CPU)(0, 0)], names, list(module.parameters()),
                         functools.partial(seeding.seed_micro_batch, 0, 0, 0))
    record = torch.cat([loss_bits(rec.loss).reshape(1), fp.fingerprint_many([rec.grads[n] for n in names]).reshape(-1)])
    assert cap.Expected.from_record(record, names) == cap.Expected.from_recomputation(rec)
    with pytest.raises(ValueError, match="record: "):
        cap.Expected.from_record(record[:-1], names)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("capsule_max_bytes", -1, "capsule_max_bytes: must be >= 0"),
    ("capsule_factory", "mypkg.sdc.replay_model", "capsule_factory: must be package.module:function"),
])
def test_guard_config_validates_the_capsule_settings(field: str, value: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        GuardConfig(**{field: value})
    assert GuardConfig.from_env({"SDCGUARD_CAPSULE_FACTORY": FACTORY}).capsule_factory == FACTORY
