"""The non-finite flag of many tensors at once (FSDP2's reduced shards, ``sdcguard.agent.sharded.reduced_shards``): true exactly when an element of a
tensor is a NaN or an infinity, on every path (the CPU's scan, torch's multi-tensor maximum, the Triton
multi-tensor kernel run by its interpreter), and the shards' fingerprints unchanged by the flag."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Iterator

import pytest
import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent import native, nonfinite, weights
from sdcguard.agent.sharded import ShardsPass, reduced_shards

# As in test_fingerprint_triton: Triton reads this when it is first imported (only the kernels import it).
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (the dev extra has it)")

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Either side of a block (1,024) and of a tile (4,096), and enough tiles that both interpreted programs take some.
SIZES = [1, 1023, 1025, 4095, 4097, 3 * 4096 + 517]
EXPONENT_ONES = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000,
                 torch.float64: 0x7FF0000000000000}


@pytest.fixture(scope="module", autouse=True)
def _restore_interpret_setting() -> Iterator[None]:
    yield
    if _INTERPRET_BEFORE is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _INTERPRET_BEFORE


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter for every test here (another module's teardown may have unset it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _c_or_torch(tensors: list[torch.Tensor]) -> torch.Tensor:
    return nonfinite.any_nonfinite(tensors)


def _foreach(tensors: list[torch.Tensor]) -> torch.Tensor:
    # What an accelerator without the Triton setting runs (the CPU takes the scan instead).
    return nonfinite._nonfinite_by_foreach(tensors, tensors[0].device)


def _triton(tensors: list[torch.Tensor]) -> torch.Tensor:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    return tf.any_nonfinite(tensors)


PATHS: list[Callable[[list[torch.Tensor]], torch.Tensor]] = [_c_or_torch, _foreach]
if HAVE_TRITON:
    PATHS.append(_triton)


@pytest.fixture(params=["auto", "torch"])
def kernel_setting(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The C scan (auto) and the torch implementation on the CPU; the Triton paths are called directly."""
    monkeypatch.setenv(native.KERNEL_ENV, request.param)
    return str(request.param)


def finite_values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Finite values that must not trip the flag: the format's largest (both signs), its smallest normal and
    subnormals, zeros of both signs, and ordinary gradients."""
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g).to(dtype)
    for k, value in enumerate((info.max, -info.max, info.smallest_normal, info.smallest_normal / 4,
                               -info.smallest_normal / 2, 0.0, -0.0, info.max / 2)):
        t[(k * 7919 + seed) % n] = value
    assert torch.isfinite(t).all()
    return t


def nonfinite_variants(dtype: torch.dtype) -> list[int]:
    """Bit patterns with an exponent of all ones: +-infinity, quiet and signalling NaNs, negative NaNs."""
    ones = EXPONENT_ONES[dtype]
    width = torch.finfo(dtype).bits
    sign = 1 << (width - 1)
    return [ones, ones | sign, ones | 1, ones | (ones >> 1 & ~ones) | sign, ones | ((sign - 1) & ~ones)]


def signed_bits(value: int, width: int) -> int:
    return value - (1 << width) if value >> (width - 1) else value


def shards_of(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Several tensors across the chunk boundaries, 2-D ones and non-contiguous views among them."""
    flat = [finite_values(dtype, n, seed + n) for n in SIZES]
    matrix = finite_values(dtype, 70 * 90, seed).reshape(70, 90)
    return [*flat, matrix, matrix.t(), matrix[:, ::3], finite_values(dtype, 3000, seed + 1)[1::2]]


@pytest.mark.usefixtures("kernel_setting")
@pytest.mark.parametrize("path", PATHS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_flag_is_set_exactly_when_an_element_is_nan_or_infinite(
        path: Callable[[list[torch.Tensor]], torch.Tensor], dtype: torch.dtype) -> None:
    shards = shards_of(dtype, seed=1)
    flag = path(shards)
    assert flag.dtype == torch.bool
    assert flag.dim() == 0
    assert not bool(flag), "large finite values, subnormals and signed zeros are finite"
    width = torch.finfo(dtype).bits
    for k, target in enumerate(shards):
        for m, bits in enumerate(nonfinite_variants(dtype)):
            hit = [s.clone() if s is not target else s for s in shards]  # views stay views of their own base
            index = (k * 131 + m * 977) % target.numel()
            flat_bits = fp.bit_view(target)
            position = torch.unravel_index(torch.tensor(index), target.shape)
            kept = flat_bits[position].clone()
            flat_bits[position] = signed_bits(bits, width)
            try:
                want = any(not bool(torch.isfinite(s).all()) for s in hit)
                assert want, (k, hex(bits))
                assert bool(path(hit)), (k, hex(bits), index)
            finally:
                flat_bits[position] = kept
    assert not bool(path(shards)), "restored"


@pytest.mark.parametrize("path", PATHS, ids=lambda f: f.__name__.strip("_"))
def test_mixed_dtypes_and_empty_or_integer_tensors_are_read_as_their_own_format(
        path: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
    # An int16 of 0x7C00 and an fp32 whose low half looks like a half infinity are finite.
    ints = torch.full((2000,), 0x7C00, dtype=torch.int16)
    single = torch.full((1500,), 0x00007C00, dtype=torch.int32).view(torch.float32)
    tensors = [finite_values(torch.bfloat16, 5000, 2), torch.zeros(0), single, ints,
               finite_values(torch.float16, 1100, 3)]
    if path is _foreach:
        tensors = [t for t in tensors if t.is_floating_point()]
    assert not bool(path(tensors))
    tensors[-1][1099] = -math.inf
    assert bool(path(tensors))


@needs_triton
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_under_the_triton_setting_one_read_gives_the_packed_fingerprints_and_the_flag(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    from sdcguard.agent.kernels import triton_fingerprint as tf

    monkeypatch.setattr(weights, "PACK_BELOW", 2048)  # large and small shards, small enough for the interpreter
    # The last: alone in its group and 2-D (packed as its flattening, on every path).
    shards = [*shards_of(dtype, seed=5), finite_values(torch.float16 if dtype == torch.float32 else torch.float32,
                                                        700, 6).reshape(7, 100)]
    monkeypatch.setenv(native.KERNEL_ENV, "torch")
    want = weights.packed_fingerprints(shards)
    assert want.shape[0] > 2
    monkeypatch.setenv(native.KERNEL_ENV, "triton")
    launched: list[tuple[bool, bool]] = []
    real = tf.FingerprintLayout._launch

    def launch(self: tf.FingerprintLayout, out: torch.Tensor | None, found: torch.Tensor | None) -> None:
        launched.append((out is not None, found is not None))
        real(self, out, found)

    monkeypatch.setattr(tf.FingerprintLayout, "_launch", launch)
    clean = reduced_shards(shards, flag=True, fingerprint=True)
    assert launched == [(True, True)], "the flag comes with the fingerprint's pass"
    assert clean.fingerprints is not None
    assert clean.nonfinite is not None
    assert torch.equal(clean.fingerprints, want), "the same bits as the fingerprint alone, on the torch path"
    assert not bool(clean.nonfinite)
    only_rows = reduced_shards(shards, flag=False, fingerprint=True)
    assert only_rows.nonfinite is None
    assert only_rows.fingerprints is not None
    assert torch.equal(only_rows.fingerprints, want)
    for target in (shards[3], shards[7]):  # a large contiguous shard and a strided view
        kept = target.reshape(-1)[0].clone() if target.is_contiguous() else target[0, 0].clone()
        where = (0,) if target.dim() == 1 else (0, 0)
        target[where] = math.nan
        hit = reduced_shards(shards, flag=True, fingerprint=True)
        assert hit.nonfinite is not None
        assert bool(hit.nonfinite)
        monkeypatch.setenv(native.KERNEL_ENV, "torch")
        assert hit.fingerprints is not None
        assert torch.equal(hit.fingerprints, weights.packed_fingerprints(shards))
        monkeypatch.setenv(native.KERNEL_ENV, "triton")
        target[where] = kept
    alone = reduced_shards(shards, flag=True, fingerprint=False)
    assert alone.fingerprints is None
    assert alone.nonfinite is not None
    assert not bool(alone.nonfinite)


@pytest.mark.usefixtures("kernel_setting")
def test_off_the_triton_setting_the_shards_pass_is_the_separate_checks() -> None:
    shards = shards_of(torch.float32, seed=9)
    found = reduced_shards(shards, flag=True, fingerprint=True)
    assert found.fingerprints is not None
    assert torch.equal(found.fingerprints, weights.packed_fingerprints(shards))
    assert found.nonfinite is not None
    assert not bool(found.nonfinite)
    shards[2][5] = math.inf
    assert bool(reduced_shards(shards, flag=True, fingerprint=False).nonfinite)
    assert reduced_shards(shards, flag=False, fingerprint=False) == ShardsPass()
    assert reduced_shards([], flag=True, fingerprint=True) == ShardsPass()


def test_no_tensors_is_a_false_flag_on_the_device_asked_for() -> None:
    """An empty list has no device of its own: the flag lands where the caller's step tensors live (a fake CUDA
    device under FakeTensorMode here, as on a GPU, where a CPU flag among CUDA tensors would raise)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not bool(nonfinite.any_nonfinite([]))
    with FakeTensorMode(allow_non_fake_inputs=True):
        flag = nonfinite.any_nonfinite([], device=torch.device("cuda", 0))
        assert flag.device == torch.device("cuda", 0)
        assert flag.dtype == torch.bool
