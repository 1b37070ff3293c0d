"""The fused Triton kernels, run on the CPU by Triton's interpreter: the bits of the torch implementation and
the C kernel for every dtype, size, stride and special value; a setting that cannot be honoured is refused."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent import grad_norm, native
from tests.unit.test_fingerprint import EVERY_DTYPE, sample

# Triton decides when it is imported (its own library functions are decorated then) whether kernels run in
# its interpreter, so this precedes any import of it (only the kernels import it, on first use); the setting
# is removed again after this file's tests.
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

HAVE_COMPILER = any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (the dev extra has it)")

HALF_AND_SINGLE = [torch.float16, torch.bfloat16, torch.float32]
# Either side of a block (1,024) and of a tile and sum-of-squares chunk (4,096), and enough tiles that both of
# the interpreter's programs take several.
SIZES = [0, 1, 1023, 1025, 4095, 4097, 5 * 4096 + 1037]


@pytest.fixture(scope="module", autouse=True)
def _restore_interpret_setting() -> Iterator[None]:
    yield
    if _INTERPRET_BEFORE is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _INTERPRET_BEFORE


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """SDCGUARD_FINGERPRINT_KERNEL=triton with Triton's interpreter on (for this test; restored after)."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (the dev extra has it)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(native.KERNEL_ENV, "triton")


def torch_hex(t: torch.Tensor) -> str:
    return fp.to_hex(fp.fingerprint_torch(t))


def c_hex(t: torch.Tensor) -> str | None:
    """The C kernel's fingerprint, or None without a compiler."""
    return fp.to_hex(fp.fingerprint_native(t, native.load(native.build()))) if HAVE_COMPILER else None


def bucket(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Gradient-like values over many magnitudes, finite, with zeros, a negative zero and subnormals."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    t = (torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))).clamp(-info.max, info.max)
    t = t.to(dtype)
    for k, value in enumerate((0.0, -0.0, info.smallest_normal / 8, -info.smallest_normal / 3, -info.max)):
        if k < n:
            t[(k * 7919) % n] = value
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, except that a NaN only has to be a NaN (a GPU's division gives the canonical one)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(fp.bit_view(a)[~nan], fp.bit_view(b)[~nan])


def double_bits(x: float) -> int:
    return int.from_bytes(struct.pack("<d", x), "little")


@needs_triton
@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", EVERY_DTYPE, ids=str)
def test_every_dtype_and_size_has_the_torch_and_c_bits(dtype: torch.dtype) -> None:
    for shape in [(), *((n,) for n in SIZES), (3, 1100)]:
        t = sample(dtype, shape, seed=len(shape) + sum(shape))
        got = fp.to_hex(fp.fingerprint(t))  # the setting routes it to the Triton kernel
        assert got == torch_hex(t), shape
        assert c_hex(t) in (None, got), shape


@needs_triton
@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool], ids=str)
def test_strided_views_are_read_in_place_with_the_same_bits(dtype: torch.dtype) -> None:
    base = sample(dtype, (5, 900, 3))
    views = [base.transpose(0, 1), base[:, ::7, 1], base.permute(2, 0, 1)[:, 1:, 5:],
             sample(dtype, (1, 700)).expand(3, 700),  # a zero stride
             sample(dtype, (2, 3, 4, 5, 6, 7)).permute(5, 4, 3, 2, 1, 0)[:, ::2]]  # five dimensions after merging
    for view in views:
        assert not view.is_contiguous()
        assert fp.to_hex(fp.fingerprint(view)) == torch_hex(view), view.shape
    complex_view = sample(torch.complex64, (40, 30))[:, ::4]
    assert fp.to_hex(fp.fingerprint(complex_view)) == torch_hex(complex_view)


@needs_triton
@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_nan_infinity_and_subnormals_are_fingerprinted_by_their_bits(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    t = sample(dtype, (2 * 4096 + 3,), seed=3)
    specials = [math.nan, -math.nan, math.inf, -math.inf, info.smallest_normal / 4, -info.smallest_normal / 2,
                info.max, -0.0]
    for k, value in enumerate(specials):
        t[k * 1031] = value
    payload_nan = {torch.float16: 0x7E01, torch.bfloat16: 0x7FC1, torch.float32: 0x7FC00001,
                   torch.float64: 0x7FF8000000000001}[dtype]
    fp.bit_view(t)[-1] = payload_nan  # a NaN with a payload of its own, at the end
    assert fp.to_hex(fp.fingerprint(t)) == torch_hex(t)
    assert c_hex(t) in (None, fp.to_hex(fp.fingerprint(t)))


@needs_triton
@pytest.mark.usefixtures("interpreted")
def test_many_tensors_and_concatenations_into_a_preallocated_summary() -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    base = sample(torch.float32, (40, 300))
    tensors = [sample(torch.float32, (7,)), base[:, ::3], torch.tensor(2.5), sample(torch.bfloat16, (9 * 1024,), 3),
               torch.zeros(0, 3, dtype=torch.bfloat16), sample(torch.bool, (1025,), 4),
               sample(torch.complex64, (9,), 6), sample(torch.int64, (3000,), 7), sample(torch.uint8, (5000,), 8)]
    rows = fp.fingerprint_many(tensors)
    assert [fp.to_hex(r) for r in rows] == [torch_hex(t) for t in tensors]
    # Weights and optimizer state as the weight check packs them: large tensors alone, small ones concatenated
    # per dtype (pieces at positions that are not multiples of a block).
    small = [sample(torch.float32, (n,), n) for n in (5, 1500, 1, 2100)]
    layout_rows = [[tensors[3]], small, [tensors[7]]]
    layout = tf.layout_for(layout_rows)
    assert tf.layout_for(layout_rows) is layout  # the metadata stays on the device between calls
    out = torch.full((3, fp.LANES), -1, dtype=torch.int64)
    assert layout(out) is out
    flat = torch.cat([t.reshape(-1) for t in small])
    assert [fp.to_hex(r) for r in out] == [torch_hex(tensors[3]), torch_hex(flat), torch_hex(tensors[7])]
    layout(out)  # a second call into the same summary: the same, not doubled
    assert fp.to_hex(out[1]) == torch_hex(flat)
    assert fp.to_hex(fp.fingerprint_concat(small)) == torch_hex(flat)
    assert fp.to_hex(fp.combine(rows)) == fp.to_hex(fp.fingerprint_torch(rows))


@needs_triton
@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
def test_the_bucket_passes_have_the_separate_passes_bits(dtype: torch.dtype) -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    kernel = native.load(native.build()) if HAVE_COMPILER else None
    float_format = native.SUM_FORMATS[str(dtype).removeprefix("torch.")]
    for n in SIZES:
        t = bucket(dtype, n, seed=n)
        total = grad_norm.sum_of_squares_torch(t)
        if kernel is not None:
            assert double_bits(kernel.sum_of_squares(t.data_ptr(), n, float_format)) == double_bits(total)
        after = tf.reduced_pass(t)
        assert after.fingerprint is not None
        assert fp.to_hex(after.fingerprint) == torch_hex(t), n
        assert double_bits(float(after.sum_of_squares)) == double_bits(total), n
        assert double_bits(float(after.norm)) == double_bits(math.sqrt(total)), n
        assert not bool(after.nonfinite)
        assert tf.reduced_pass(t, fingerprint=False).fingerprint is None
        for world in (1, 3, 4, 7):
            buffer = t.clone()
            before = tf.local_pass(buffer, world)
            assert double_bits(float(before.sum_of_squares)) == double_bits(total), (n, world)  # of what it read
            assert same_bits(buffer, t.clone().div_(world)), (n, world)  # torch's division, bit for bit


@needs_triton
@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
def test_a_nonfinite_element_anywhere_is_flagged_and_sums_to_the_canonical_value(dtype: torch.dtype) -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    n = 2 * 4096 + 333
    clean = bucket(dtype, n, seed=5)
    for bad in (math.nan, math.inf, -math.inf):
        for where in (0, 4095, 4096, n - 1):  # both ends, either side of a chunk boundary
            t = clean.clone()
            t[where] = bad
            after = tf.reduced_pass(t)
            for seen in (after, tf.local_pass(t.clone(), 2)):
                assert bool(seen.nonfinite), (bad, where)
                expected = math.nan if math.isnan(bad) else math.inf
                assert double_bits(float(seen.sum_of_squares)) == double_bits(expected)
                assert double_bits(float(seen.norm)) == double_bits(expected)
            assert fp.to_hex(after.packed[:3]) == torch_hex(t)
    # The largest finite squares there are: finite, not flagged.
    big = torch.full((4096 + 5,), torch.finfo(dtype).max, dtype=dtype)
    seen = tf.reduced_pass(big)
    assert not bool(seen.nonfinite)
    assert double_bits(float(seen.sum_of_squares)) == double_bits(grad_norm.sum_of_squares_torch(big))


@needs_triton
@pytest.mark.usefixtures("interpreted")
def test_bad_input_is_refused_by_name() -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    with pytest.raises(ValueError, match="float64"):
        tf.local_pass(torch.zeros(10, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="not contiguous"):
        tf.reduced_pass(torch.zeros(10, 10)[:, 0])
    with pytest.raises(ValueError, match="divisor"):
        tf.local_pass(torch.zeros(10), 0)
    with pytest.raises(ValueError, match="row 0 mixes"):
        tf.FingerprintLayout([[torch.zeros(3), torch.zeros(3, dtype=torch.int32)]])
    with pytest.raises(ValueError, match=r"int64 \[1, 3\]"):
        tf.FingerprintLayout([[torch.zeros(3)]])(torch.zeros(2, 3, dtype=torch.int64))


@needs_triton
def test_without_a_gpu_or_the_interpreter_the_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(native.KERNEL_ENV, "triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(tf.TritonKernelError, match="no CUDA device is visible and TRITON_INTERPRET is not set"):
        native.kernel()  # what the guard calls when it starts: the job fails there, with the reason
    with pytest.raises(tf.TritonKernelError, match="Triton compiles for CUDA devices"):
        tf.fingerprint(torch.zeros(3))
    # CPU tensors keep the CPU's implementation: the same bits.
    t = sample(torch.float32, (2000,))
    monkeypatch.setattr(native, "kernel", lambda: None)
    assert fp.to_hex(fp.fingerprint(t)) == torch_hex(t)


def test_without_triton_the_setting_fails_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(native.KERNEL_ENV, "triton")
    with pytest.raises(native.NativeKernelError, match=r"Triton is not importable.*sdcguard\[gpu\]"):
        native.kernel()
    with pytest.raises(native.NativeKernelError, match="SDCGUARD_FINGERPRINT_KERNEL=triton: Triton is not importable"):
        fp.fingerprint(torch.zeros(3))
    monkeypatch.setenv(native.KERNEL_ENV, "auto")  # any other setting never imports it
    assert fp.to_hex(fp.fingerprint(torch.zeros(3))) == torch_hex(torch.zeros(3))


def test_the_device_benchmarks_table_and_comparison() -> None:
    from benchmarks import device_kernels as dk

    timing = dk.Timing("triton fingerprint", "float32", 25, ms=0.01, moved_bytes=25 * 10**6, copy_gbps=5000.0)
    assert timing.gbps == pytest.approx(2500.0)
    assert timing.x_copy == pytest.approx(0.5)
    table = dk.format_timings([timing])
    assert "x copy" in table.splitlines()[0]
    assert "triton fingerprint" in table
    assert "2500.0" in table
    assert " 0.50" in table
    a = torch.tensor([1.0, math.nan, 3.0])
    assert dk.differs("same", a, a.clone()) is None
    other_nan = a.clone()
    fp.bit_view(other_nan)[1] = 0x7FC00001  # another NaN payload: a NaN only has to meet a NaN
    assert dk.differs("payload", a, other_nan) is None
    b = a.clone()
    fp.bit_view(b)[2] ^= 1
    assert dk.differs("one bit", a, b) == "one bit: 1 of 2 values differ (first at 1)"
    assert "int64" in (dk.differs("dtype", torch.zeros(3, dtype=torch.int64), torch.zeros(3)) or "")


@needs_triton
@pytest.mark.usefixtures("interpreted")
def test_the_device_benchmarks_checks_pass_and_catch_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import device_kernels as dk
    from sdcguard.agent.kernels import triton_fingerprint as tf

    report = dk.measure(torch.device("cpu"), sizes=(1025,), product_shapes=((33, 129),))
    assert [name for name, _ in report.checks] == ["triton, torch and cpu fingerprints equal bit for bit",
                                                   "triton bucket passes have the cpu's bits",
                                                   "triton product checks: rounding, clean GEMM silent, corruption caught"]
    assert not report.failed, report.checks
    assert report.timings == []  # timed on a GPU only
    real = tf.fingerprint
    monkeypatch.setattr(tf, "fingerprint", lambda t: real(t) + (t.numel() > 1000))
    report = dk.measure(torch.device("cpu"), sizes=(1025,), product_shapes=((33, 129),))
    assert report.failed
    assert "torch.float32 n=1025 triton vs cpu" in report.checks[0][1][0]


@needs_triton
def _timed_once(monkeypatch: pytest.MonkeyPatch, dk: Any, rows_per_product: int) -> list[int]:
    """CUDA events are a GPU's: each timed call runs once here, the product 2 ms and every check after it 0.5 ms
    (``rows_per_product`` rows per product); the repeats asked for, returned."""
    calls: list[int] = []

    def timed(fn: Callable[[], object], repeats: int) -> float:
        fn()
        calls.append(repeats)
        return 2.0 if len(calls) % rows_per_product == 1 else 0.5

    monkeypatch.setattr(dk, "_cuda_ms", timed)
    return calls


@pytest.mark.usefixtures("interpreted")
def test_the_device_benchmarks_product_pass_table_runs_and_its_check_catches_a_wrong_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import device_kernels as dk
    from sdcguard.agent.kernels import triton_products

    calls = _timed_once(monkeypatch, dk, rows_per_product=3)
    table = dk.time_product_pass(torch.device("cpu"), repeats=3, operand=(64, 128)).splitlines()
    assert table[0].startswith("the product checks' check of one 64 x 128 by 128 x 128 product")
    rows = [line.split() for line in table[2:]]
    assert [row[-1] for row in rows] == ["1.000", "0.250", "0.250"] * 2  # each against its own product
    assert calls == [3] * 6
    assert dk.check_product_pass(torch.device("cpu"), shapes=((40, 300),)) == []
    real = triton_products.dual_matvec
    monkeypatch.setattr(triton_products, "dual_matvec", lambda a, s, t: (real(a, s, t)[0] * 1.001, real(a, s, t)[1]))
    problems = dk.check_product_pass(torch.device("cpu"), shapes=((40, 300),))
    assert len(problems) == 6
    assert "outside fp32 rounding" in problems[0]
    monkeypatch.setattr(triton_products, "dual_matvec", real)
    real_check = triton_products.row_check

    def blind(*args: Any, **kwargs: Any) -> None:  # a check that never sees a difference
        real_check(*args, **kwargs)
        args[7][0].zero_()

    monkeypatch.setattr(triton_products, "row_check", blind)
    problems = dk.check_product_pass(torch.device("cpu"), shapes=((40, 300),))
    assert [line.split(":")[0] for line in problems] == [
        f"{d} 40x300 linear corrupted in {split} part(s)" for d in triton_products.READS for split in (1, 3)]


@pytest.mark.usefixtures("interpreted")
def test_the_device_benchmark_times_a_weight_gradients_check_split_and_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import device_kernels as dk

    calls = _timed_once(monkeypatch, dk, rows_per_product=4)
    table = dk.time_weight_gradient_check(torch.device("cpu"), repeats=3, shape=(1100, 40)).splitlines()
    assert table[0].startswith("the check of a weight gradient dW = dY^T X (40 x 1100 by 1100 x 40)")
    names = [line[:40].strip() for line in table[2:]]
    # Off a GPU nothing is split unless asked (the interpreter runs one program at a time).
    assert names == ["the product (dY^T @ X)", "triton check, 1 part(s) (chosen)", "triton check, one launch",
                     "torch form of the check"] * 2
    assert [line.split()[-1] for line in table[2:]] == ["1.000", "0.250", "0.250", "0.250"] * 2
    assert calls == [3] * 8


def test_the_device_benchmark_says_why_it_did_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import device_kernels as dk

    rows: list[tuple[str, list[str] | None, str]] = []

    class Table:
        def add(self, name: str, problems: list[str] | None, detail: str = "") -> None:
            rows.append((name, problems, detail))

    assert dk.run(Table(), torch.device("cpu")) is False
    assert len(rows) == 1
    _, problems, detail = rows[0]
    assert problems is None  # INFO on a CPU smoke run, not a failure
    assert detail.startswith("not run: GPU only")


@needs_triton
def test_the_hook_is_told_which_buckets_the_kernels_take(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bucket_ = torch.zeros(4096)
    monkeypatch.setenv(native.KERNEL_ENV, "auto")
    assert not tf.chosen_for_bucket(bucket_)  # only the triton setting chooses them
    monkeypatch.setenv(native.KERNEL_ENV, "triton")
    assert tf.chosen_for_bucket(bucket_)
    assert tf.chosen_for_bucket(bucket_.bfloat16())
    assert not tf.chosen_for_bucket(bucket_.double())  # fp64 squares are not exact: the separate passes
    assert not tf.chosen_for_bucket(torch.zeros(64, 64)[:, 0])
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not tf.chosen_for_bucket(bucket_)  # a CPU tensor without the interpreter: the CPU's passes


def _passes(t: torch.Tensor, world: int) -> tuple[object, ...]:
    """What the hook's bucket passes say of ``t`` (a copy, divided by ``world`` before it is read again), by
    whichever implementation the setting chooses: flag, norm bits, divided bits, reduced flag, norm and
    fingerprint."""
    from sdcguard.agent import nonfinite

    buffer = t.clone()
    before = nonfinite.local_pass(buffer, world, flag=True, norm=True)
    after = nonfinite.reduced_pass(buffer, flag=True, fingerprint=True, norm=True)
    assert before.nonfinite is not None
    assert before.norm is not None
    assert after.nonfinite is not None
    assert after.norm is not None
    assert after.fingerprint is not None
    return (bool(before.nonfinite), double_bits(float(before.norm)), fp.to_hex(fp.fingerprint_torch(buffer)),
            bool(after.nonfinite), double_bits(float(after.norm)), fp.to_hex(after.fingerprint))


@needs_triton
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
def test_the_hooks_bucket_passes_take_the_kernels_with_the_same_bits(monkeypatch: pytest.MonkeyPatch,
                                                                     dtype: torch.dtype) -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    finite = bucket(dtype, 4097 + 300, seed=5)
    broken = finite.clone()
    broken[4100] = math.inf
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(native.KERNEL_ENV, "auto")  # the CPU's passes (the C kernel, or torch without one)
    want = [_passes(t, 3) for t in (finite, broken)]
    calls: list[str] = []

    def counted(name: str) -> Callable[..., object]:
        real = getattr(tf, name)

        def call(*args: object, **kwargs: object) -> object:
            calls.append(name)
            return real(*args, **kwargs)

        return call

    for name in ("local_pass", "reduced_pass"):
        monkeypatch.setattr(tf, name, counted(name))
    monkeypatch.setenv(native.KERNEL_ENV, "triton")
    assert [_passes(t, 3) for t in (finite, broken)] == want
    assert calls == ["local_pass", "reduced_pass"] * 2  # the fused kernels did the work
    assert want[1][0]
    assert want[1][3]
    assert not want[0][0]
    # A bucket they do not read (fp64) keeps the separate passes, with the flag and norm all the same.
    wide = finite.double()
    fused = _passes(wide, 3)
    assert calls == ["local_pass", "reduced_pass"] * 2
    monkeypatch.setenv(native.KERNEL_ENV, "auto")
    assert _passes(wide, 3) == fused


@needs_triton
def test_the_weight_check_packs_its_rows_with_the_kernels_in_the_same_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdcguard.agent import weights
    from sdcguard.agent.kernels import triton_fingerprint as tf

    monkeypatch.setattr(weights, "PACK_BELOW", 2048)  # small enough for the interpreter
    tensors = [sample(torch.float32, (3000,), 1), sample(torch.float32, (7,), 2), sample(torch.bfloat16, (100,), 3),
               sample(torch.int64, (2500,), 4), sample(torch.float32, (1500,), 5), torch.tensor(2.0),
               sample(torch.float64, (10, 20), 6)]  # a small tensor alone in its group: packed by its length
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(native.KERNEL_ENV, "auto")
    want = [fp.to_hex(r) for r in weights.packed_fingerprints(tensors)]
    assert len(want) == 5  # two large rows, then the small ones per dtype (float32, bfloat16, float64)
    built: list[int] = []
    real = tf.layout_for

    def layout_for(rows: list[list[torch.Tensor]]) -> tf.FingerprintLayout:
        built.append(len(rows))
        return real(rows)

    monkeypatch.setattr(tf, "layout_for", layout_for)
    monkeypatch.setenv(native.KERNEL_ENV, "triton")
    assert [fp.to_hex(r) for r in weights.packed_fingerprints(tensors)] == want
    assert built == [5]
