"""The C fingerprint kernel: the same bits as the definition on every instruction set, and a loader that fails safe."""

from __future__ import annotations

import itertools
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent import native
from tests.unit.test_fingerprint import EVERY_DTYPE, reference_hex, sample

HAVE_COMPILER = any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def kernel() -> native.Kernel:
    if not HAVE_COMPILER:
        pytest.skip("no C compiler on this machine")
    return native.load(native.build())


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The loader forgets its kernel and builds into an empty cache; restored afterwards."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    for name in (native.KERNEL_ENV, native.ISA_ENV):
        monkeypatch.delenv(name, raising=False)
    native.reset_for_tests()
    yield tmp_path
    native.reset_for_tests()


def isas(kernel: native.Kernel) -> list[native.Kernel]:
    """The kernel at every instruction set this machine has (scalar always)."""
    return [kernel.with_isa(i) for i in range(kernel.lib.sdc_fp_best_isa() + 1)]


@needs_compiler
def test_the_c_kernel_is_in_use_where_there_is_a_compiler() -> None:
    # CI machines have gcc: the fast path must really be the one the suite runs.
    used = native.kernel()
    assert used is not None
    assert used.path.is_file()


@pytest.mark.parametrize("dtype", EVERY_DTYPE, ids=str)
@pytest.mark.parametrize(
    "shape", [(0,), (), (1,), (15,), (17,), (1023,), (1024,), (1025,), (3 * 1024 + 31,), (3, 1100)], ids=str
)
def test_every_instruction_set_matches_the_reference(
    kernel: native.Kernel, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    t = sample(dtype, shape, seed=len(shape) + sum(shape))
    expected = reference_hex(t)
    for k in isas(kernel):
        assert fp.to_hex(fp.fingerprint_native(t, k)) == expected, k.isa_name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8], ids=str)
def test_strided_tensors_are_gathered_in_chunks(kernel: native.Kernel, dtype: torch.dtype) -> None:
    base = sample(dtype, (5, 900, 3))
    for view in (base.transpose(0, 1), base[:, ::7, 1], base.permute(2, 0, 1)[:, 1:, 5:]):
        expected = reference_hex(view)
        for k in isas(kernel):
            for chunk in (fp.BLOCK, 3 * fp.BLOCK, None):
                assert fp.to_hex(fp.fingerprint_native(view, k, chunk=chunk)) == expected


@pytest.mark.parametrize("kind_dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64], ids=str)
def test_pieces_at_any_offset_add_up_to_the_whole(kernel: native.Kernel, kind_dtype: torch.dtype) -> None:
    # How a strided gather and the thread split feed the kernel: each piece at its element offset.
    t = sample(kind_dtype, (5 * fp.BLOCK + 77,), seed=9)
    kind = kernel.kind(t.element_size(), kind_dtype == torch.uint8)
    cuts = [0, 1, 9, 1023, 1024, 1030, 2500, 4096, t.numel()]
    for k in isas(kernel):
        whole = torch.zeros(3, dtype=torch.int64)
        k.segment(t.data_ptr(), t.numel(), kind, 0, whole.data_ptr())
        pieces = torch.zeros(3, dtype=torch.int64)
        for start, end in itertools.pairwise(cuts):
            k.segment(t[start:].data_ptr(), end - start, kind, start, pieces.data_ptr())
        assert torch.equal(pieces, whole), k.isa_name


def test_large_tensors_split_across_threads_give_the_same_bits(
    kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fp, "PARALLEL_MIN", 4 * fp.BLOCK)
    t = sample(torch.float32, (10 * fp.BLOCK + 3,), seed=4)
    expected = reference_hex(t)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert fp.to_hex(fp.fingerprint_native(t, kernel)) == expected, threads
            assert fp.to_hex(fp.fingerprint_many([t, t[:5]])[0]) == expected, threads
    finally:
        torch.set_num_threads(saved)


def test_many_mixes_batched_strided_and_large_tensors(kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp, "PARALLEL_MIN", 8 * fp.BLOCK)
    base = sample(torch.float32, (40, 300))
    tensors = [
        sample(torch.float32, (7,)),
        base[:, ::3],
        torch.tensor(2.5),
        sample(torch.bfloat16, (9 * fp.BLOCK,), 3),
        torch.zeros(0, 3, dtype=torch.bfloat16),
        sample(torch.bool, (fp.BLOCK + 1,), 4),
        sample(torch.complex64, (9,), 6),
    ]
    rows = fp.fingerprint_many(tensors)
    for row, t in zip(rows, tensors, strict=True):
        assert fp.to_hex(row) == reference_hex(t)


def test_the_cuda_path_is_refused_by_name(kernel: native.Kernel) -> None:
    with pytest.raises(ValueError, match="CPU memory"):
        fp.fingerprint_native(torch.zeros(3, device="meta"), kernel)


def test_torch_mode_never_builds(fresh_loader: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.KERNEL_ENV, "torch")
    assert native.kernel() is None
    t = sample(torch.float32, (2000,))
    assert fp.to_hex(fp.fingerprint(t)) == reference_hex(t)
    assert not (fresh_loader / "cache").exists()


@pytest.mark.parametrize(("name", "value"), [(native.KERNEL_ENV, "fast"), (native.ISA_ENV, "sse9")])
def test_bad_settings_are_refused_by_name(fresh_loader: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    for _ in range(2):  # every call, not only the first
        with pytest.raises(ValueError, match=name):
            native.kernel()


@needs_compiler
def test_the_isa_setting_caps_the_instruction_set(fresh_loader: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ISA_ENV, "scalar")
    used = native.kernel()
    assert used is not None
    assert used.isa_name == "scalar"


def test_a_failed_build_falls_back_in_auto_and_is_an_error_in_native(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="sdcguard.agent.native"):
        assert native.kernel() is None
    assert "torch implementation" in caplog.text
    assert "false failed to build" in caplog.text
    t = sample(torch.bfloat16, (3000,))
    assert fp.to_hex(fp.fingerprint(t)) == reference_hex(t)  # still right, only slower
    native.reset_for_tests()
    monkeypatch.setenv(native.KERNEL_ENV, "native")
    with pytest.raises(native.NativeKernelError, match="false failed to build"):
        native.kernel()


@needs_compiler
def test_a_kernel_that_disagrees_with_the_definition_is_never_used(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = fresh_loader / "fingerprint.c"
    source = native.SOURCE.read_text()
    assert "position[j] = mix64(2 * (uint64_t)j);" in source
    wrong.write_text(source.replace("position[j] = mix64(2 * (uint64_t)j);", "position[j] = mix64(2 * (uint64_t)j + 2);"))
    monkeypatch.setattr(native, "SOURCE", wrong)
    assert native.kernel() is None
    native.reset_for_tests()
    monkeypatch.setenv(native.KERNEL_ENV, "native")
    with pytest.raises(native.NativeKernelError, match="disagrees with torch"):
        native.kernel()


@needs_compiler
def test_a_built_kernel_is_reused_from_the_cache(fresh_loader: Path) -> None:
    first = native.build()
    stamp = first.stat().st_mtime_ns
    again = native.build()
    assert again == first
    assert again.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary files left behind


@pytest.mark.parametrize("kernel_mode", ["auto", "torch"])
def test_a_concatenation_is_fingerprinted_without_making_it(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch, kernel_mode: str
) -> None:
    monkeypatch.setenv(native.KERNEL_ENV, kernel_mode)
    base = sample(torch.float32, (30, 70))
    groups = [
        [sample(torch.float32, (5,)), base, sample(torch.float32, (3 * fp.BLOCK + 1,), 1), torch.tensor(1.5)],
        [base[:, ::3], sample(torch.float32, (2, 2)), base.t()],  # strided pieces
        [sample(torch.complex64, (7,)), sample(torch.complex64, (2, 600), 2)],
        [sample(torch.bfloat16, (1,))],
    ]
    for group in groups:
        whole = torch.cat([t.reshape(-1) for t in group])
        assert fp.to_hex(fp.fingerprint_concat(group)) == reference_hex(whole)
    with pytest.raises(ValueError, match="one dtype"):
        fp.fingerprint_concat([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="no tensors"):
        fp.fingerprint_concat([])


@needs_compiler
def test_a_read_only_cache_falls_back_to_the_temporary_folder(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = fresh_loader / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.delenv(native.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setenv("TMPDIR", str(fresh_loader / "tmp"))
    (fresh_loader / "tmp").mkdir()
    monkeypatch.setattr(native.tempfile, "tempdir", None)  # re-read TMPDIR
    built = native.build()
    assert built.parent.parent == fresh_loader / "tmp"
    # An explicit cache folder is never second-guessed: its failure is reported.
    monkeypatch.setenv(native.CACHE_ENV, str(blocked / "cache"))
    with pytest.raises(native.NativeKernelError, match=native.CACHE_ENV):
        native.build()


def test_the_kernels_own_threads_give_the_same_bits_at_any_count(kernel: native.Kernel) -> None:
    t = sample(torch.int16, (2 * fp.BLOCK + 1,), seed=12)  # small: some of 64 pieces are empty
    kind = kernel.kind(t.element_size(), False)
    whole = torch.zeros(3, dtype=torch.int64)
    kernel.segment(t.data_ptr(), t.numel(), kind, 7, whole.data_ptr())  # at an offset, as a piece would be
    for threads in (1, 2, 3, 7, 64, 500):
        split = torch.zeros(3, dtype=torch.int64)
        kernel.segment_threads(t.data_ptr(), t.numel(), kind, 7, threads, split.data_ptr())
        assert torch.equal(split, whole), threads


@needs_compiler
def test_an_installation_without_the_source_falls_back(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "SOURCE", fresh_loader / "csrc" / "fingerprint.c")
    with caplog.at_level(logging.WARNING, logger="sdcguard.agent.native"):
        assert native.kernel() is None
    assert "source is missing" in caplog.text


@needs_compiler
def test_a_prebuilt_kernel_needs_no_compiler(fresh_loader: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An image built with a compiler (python -m sdcguard.agent.native), run without one.
    assert native.main([]) == 0
    monkeypatch.setenv("PATH", str(fresh_loader / "no-tools-here"))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(native.NativeKernelError, match="no C compiler"):
        native.compiler()
    native.reset_for_tests()
    used = native.kernel()
    assert used is not None
    assert used.path.parent == fresh_loader / "cache"


def test_the_known_answers_are_the_torch_implementations() -> None:
    """The self-check's constants are the definition's: recomputed here by the torch implementation."""
    dtypes = {(8, False): torch.int64, (4, False): torch.int32, (2, False): torch.int16,
              (1, False): torch.int8, (1, True): torch.uint8}
    for (size, unsigned, n), data, want in zip(
        native.KNOWN_ANSWER_CASES, native.known_answer_inputs(), native.KNOWN_ANSWERS, strict=True
    ):
        t = torch.frombuffer(bytearray(data), dtype=dtypes[size, unsigned])
        assert t.numel() == n
        lanes = fp.fingerprint_torch(t).tolist()
        descriptor = fp.descriptor(t.dtype, tuple(t.shape))
        assert tuple((lane - d) % 2**64 for lane, d in zip(lanes, descriptor, strict=True)) == want


@needs_compiler
def test_the_kernel_reports_its_own_element_kinds(kernel: native.Kernel) -> None:
    """The kinds come from the library (``sdc_fp_kind``), and every width has a distinct one."""
    kinds = {(size, unsigned): kernel.lib.sdc_fp_kind(size, int(unsigned))
             for size in native.ELEMENT_SIZES for unsigned in (False, True) if size == 1 or not unsigned}
    assert kernel.kinds == kinds
    assert len(set(kinds.values())) == len(kinds)
    assert 0 not in kinds.values()
    assert kernel.lib.sdc_fp_kind(3, 0) == 0
    assert kernel.kind(1, True) != kernel.kind(1, False)
    assert kernel.kind(2, True) == kernel.kind(2, False)
