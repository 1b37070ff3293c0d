"""The communication hook's fused bucket passes: the bits of the separate passes, on every instruction set and
without the kernel, and a sum of squares that follows its definition."""

from __future__ import annotations

import math
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent import grad_norm, native
from sdcguard.agent.nonfinite import BucketPass, local_pass, measure, nonfinite_flag, reduced_pass

HAVE_COMPILER = any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))
HALF_AND_SINGLE = [torch.float16, torch.bfloat16, torch.float32]
# Odd lengths, a whole chunk and either side of one, several chunks with a partial last one.
LENGTHS = [1, 15, 17, 4095, 4096, 4097, 3 * 4096 + 1037]
BAD = [float("nan"), float("inf"), float("-inf")]


@pytest.fixture(scope="module")
def kernel() -> native.Kernel:
    if not HAVE_COMPILER:
        pytest.skip("no C compiler on this machine")
    return native.load(native.build())


def isas(kernel: native.Kernel) -> list[native.Kernel]:
    return [kernel.with_isa(i) for i in range(kernel.lib.sdc_fp_best_isa() + 1)]


def bucket(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Gradient-like values over many magnitudes, with zeros, a negative zero and subnormals among them."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))).to(dtype)
    info = torch.finfo(dtype)
    for k, value in enumerate((0.0, -0.0, info.smallest_normal / 8, -info.max, info.max)):
        if k < n:
            t[(k * 7919) % n] = value
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    return fp.bit_view(t).clone()


def double_bits(x: float) -> int:
    return int.from_bytes(struct.pack("<d", x), "little")


def flag_of(seen: BucketPass) -> bool:
    assert seen.nonfinite is not None
    return bool(seen.nonfinite)


def norm_of(seen: BucketPass) -> float:
    assert seen.norm is not None
    return float(seen.norm)


def fingerprint_of(seen: BucketPass) -> str:
    assert seen.fingerprint is not None
    return fp.to_hex(seen.fingerprint)


def the_separate_passes(t: torch.Tensor) -> tuple[bool, float, str]:
    """Flag, sum of squares and fingerprint by torch alone: the unfused definitions."""
    return bool(nonfinite_flag(t)), grad_norm.sum_of_squares_torch(t), fp.to_hex(fp.fingerprint_torch(t))


def using(monkeypatch: pytest.MonkeyPatch, chosen: native.Kernel | None) -> None:
    """Make ``native.kernel()`` answer ``chosen`` (None: the torch implementation, as without a compiler)."""
    monkeypatch.setattr(native, "kernel", lambda: chosen)


def every_implementation(kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Callable[[], None]]]:
    def pick(chosen: native.Kernel | None) -> Callable[[], None]:
        return lambda: using(monkeypatch, chosen)

    return [(k.isa_name, pick(k)) for k in isas(kernel)] + [("torch", pick(None))]


def every_bucket(test: Callable[..., None]) -> Callable[..., None]:
    """Run ``test`` for every float width and every bucket length of LENGTHS (arguments ``dtype``, ``n``)."""
    return pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)(pytest.mark.parametrize("n", LENGTHS)(test))


@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("n", [0, *LENGTHS])
def test_the_sum_of_squares_follows_its_definition_everywhere(kernel: native.Kernel, dtype: torch.dtype, n: int) -> None:
    t = bucket(dtype, n, seed=n)
    want = native.sum_of_squares_reference([float(v) for v in t.double().tolist()])
    assert grad_norm.sum_of_squares_torch(t) == want
    code = native.SUM_FORMATS[str(dtype).removeprefix("torch.")]
    for k in isas(kernel):
        assert k.sum_of_squares(t.data_ptr(), n, code) == want, k.isa_name


@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
def test_long_buckets_agree_across_the_torch_pieces(kernel: native.Kernel, dtype: torch.dtype) -> None:
    n = grad_norm.TORCH_PIECE * 2 + 4096 * 3 + 11  # three pieces, the last partial
    t = bucket(dtype, n, seed=3)
    code = native.SUM_FORMATS[str(dtype).removeprefix("torch.")]
    want = grad_norm.sum_of_squares_torch(t)
    assert {k.sum_of_squares(t.data_ptr(), n, code) for k in isas(kernel)} == {want}
    # And it is a sum of squares: close to the plain one.
    assert want == pytest.approx(float((t.double() ** 2).sum()), rel=1e-12)


@every_bucket
def test_the_local_pass_gives_the_separate_passes_bits(
    kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, n: int
) -> None:
    original = bucket(dtype, n, seed=n + 1)
    flag, total, _ = the_separate_passes(original)
    divided = bits(original.clone().div_(3))
    for name, use in every_implementation(kernel, monkeypatch):
        use()
        buffer = original.clone()
        seen = local_pass(buffer, 3, flag=True, norm=True)
        assert flag_of(seen) is flag, name
        assert double_bits(norm_of(seen)) == double_bits(math.sqrt(total)), name
        assert torch.equal(bits(buffer), divided), name  # the division is torch's, bit for bit
        again = measure(original, flag=True, norm=True)  # the recomputation's side: the same, nothing divided
        assert norm_of(again) == norm_of(seen)
        assert torch.equal(bits(original), bits(bucket(dtype, n, seed=n + 1)))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 1024, 16384 + 1])
def test_the_division_is_torchs_for_every_world_size(
    kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    # Powers of two take an exact reciprocal: the same bits as a division, subnormals, infinities and NaN included.
    original = bucket(torch.float32, 3 * 4096 + 7, seed=world)
    original[5], original[6], original[7] = float("inf"), float("nan"), -torch.finfo(torch.float32).tiny / 3
    expected = bits(original.clone().div_(world))
    for name, use in every_implementation(kernel, monkeypatch):
        use()
        buffer = original.clone()
        local_pass(buffer, world, flag=True, norm=False)
        assert torch.equal(bits(buffer), expected), name


@every_bucket
def test_the_reduced_pass_gives_the_separate_passes_bits(
    kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, n: int
) -> None:
    reduced = bucket(dtype, n, seed=n + 2)
    flag, total, fingerprint = the_separate_passes(reduced)
    for name, use in every_implementation(kernel, monkeypatch):
        use()
        seen = reduced_pass(reduced, flag=True, fingerprint=True, norm=True)
        assert flag_of(seen) is flag, name
        assert double_bits(norm_of(seen)) == double_bits(math.sqrt(total)), name
        assert fingerprint_of(seen) == fingerprint, name
        # Without the norm (clipping on) or the flag (detector 1 off): the same parts.
        assert fingerprint_of(reduced_pass(reduced, flag=True, fingerprint=True, norm=False)) == fingerprint
        assert fingerprint_of(reduced_pass(reduced, flag=False, fingerprint=True, norm=False)) == fingerprint
        assert flag_of(reduced_pass(reduced, flag=True, fingerprint=False, norm=False)) is flag


@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_a_nonfinite_element_anywhere_is_flagged_on_both_sides(
    kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bad: float
) -> None:
    n = 2 * 4096 + 333
    clean = bucket(dtype, n, seed=5)
    # Every lane of a row, both ends, either side of a chunk boundary, the partial last chunk.
    for where in (0, 1, 7, 8, 15, 16, 4095, 4096, 4097, 2 * 4096, n - 17, n - 1):
        t = clean.clone()
        t[where] = bad
        expected_fp = fp.to_hex(fp.fingerprint_torch(t))
        for name, use in every_implementation(kernel, monkeypatch):
            use()
            before = local_pass(t.clone(), 2, flag=True, norm=True)
            after = reduced_pass(t, flag=True, fingerprint=True, norm=True)
            for seen in (before, after):
                assert flag_of(seen), (name, where)
                # NaN in, the canonical NaN out (whatever the order of operations made of its payload).
                assert double_bits(norm_of(seen)) == double_bits(math.nan if math.isnan(bad) else math.inf), name
            assert fingerprint_of(after) == expected_fp, (name, where)


def test_a_clean_bucket_is_never_flagged_even_at_the_extremes(kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    for dtype in HALF_AND_SINGLE:
        t = torch.full((4096 + 5,), torch.finfo(dtype).max, dtype=dtype)  # the largest squares there are
        for name, use in every_implementation(kernel, monkeypatch):
            use()
            seen = reduced_pass(t, flag=True, fingerprint=False, norm=True)
            assert not flag_of(seen), (dtype, name)
            assert math.isfinite(norm_of(seen))


def test_float64_and_strided_buckets_take_the_separate_passes(kernel: native.Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    using(monkeypatch, kernel)
    # fp64 squares can overflow: a finite bucket with an infinite sum of squares is not non-finite.
    wide = torch.tensor([1e200, 3.0, -2.5], dtype=torch.float64)
    seen = local_pass(wide.clone(), 2, flag=True, norm=True)
    assert not flag_of(seen)
    assert norm_of(seen) == math.inf
    strided = bucket(torch.float32, 3 * 4096 + 1, seed=8)[::3]
    assert norm_of(measure(strided, flag=True, norm=True)) == math.sqrt(grad_norm.sum_of_squares(strided.contiguous()))


def test_nothing_asked_is_nothing_measured() -> None:
    buffer = bucket(torch.float32, 100)
    expected = bits(buffer.clone().div_(4))
    assert local_pass(buffer, 4, flag=False, norm=False) == BucketPass()
    assert torch.equal(bits(buffer), expected)  # still divided
    assert reduced_pass(buffer, flag=False, fingerprint=False, norm=False) == BucketPass()


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C compiler on this machine")
@pytest.mark.parametrize("change", [
    # A reciprocal multiply is the classic "optimisation" of a division: not torch's bits.
    ("x[k] = x[k] / w;", "x[k] = x[k] * (1.0f / w);"),
    # Squares rounded to fp32 before they are added (here in a bucket's partial last chunk): not the definition.
    ("double v = l < count ? VALUE(x[r * SQ_ROW + l]) : 0.0;",
     "float v = l < count ? (float)VALUE(x[r * SQ_ROW + l]) : 0.0f;"),
], ids=["reciprocal division", "fp32 squares"])
def test_a_kernel_whose_bucket_passes_differ_is_never_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: tuple[str, str]
) -> None:
    old, new = change
    source = native.SOURCE.read_text()
    assert old in source
    wrong = tmp_path / "fingerprint.c"
    wrong.write_text(source.replace(old, new))
    monkeypatch.setattr(native, "SOURCE", wrong)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    built = native.load(native.build())
    assert native.self_check(built) is not None
