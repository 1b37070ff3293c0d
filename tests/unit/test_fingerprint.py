"""Fingerprints: the exact definition (a slow pure-Python reference) and the detection properties."""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdcguard.agent.fingerprint import (
    BLOCK,
    DEFAULT_CHUNK,
    SINGLE_THREAD_CHUNK,
    block_weight,
    block_weights,
    combine,
    default_chunk,
    descriptor,
    fingerprint,
    fingerprint_many,
    fingerprint_torch,
    position_word,
    to_hex,
)
from sdcguard.contract.alarm import FingerprintGroup

MASK64 = (1 << 64) - 1
# Derandomized: CI sees the same examples every run; widen with SDCGUARD_FP_EXAMPLES for a deeper search.
PROPERTY = settings(
    max_examples=int(os.environ.get("SDCGUARD_FP_EXAMPLES", "60")),
    derandomize="SDCGUARD_FP_EXAMPLES" not in os.environ,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

INTEGER_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
EVERY_DTYPE = [*FLOAT_DTYPES, *INTEGER_DTYPES, torch.bool, torch.complex64]
if hasattr(torch, "float8_e4m3fn"):
    EVERY_DTYPE.append(torch.float8_e4m3fn)


def reference_hex(t: torch.Tensor) -> str:
    """The definition, element by element in Python integers (see agent/fingerprint.py's docstring)."""
    bits = torch.view_as_real(t) if t.is_complex() else t
    width = bits.element_size()
    raw = bits.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if bits.numel() else b""
    signed = bits.dtype not in (torch.bool, torch.uint8)
    values = [int.from_bytes(raw[k : k + width], "little", signed=signed) for k in range(0, len(raw), width)]
    lane0 = lane1 = lane2 = 0
    for i, v in enumerate(values):
        lane0 += v
        lane1 += (i + 1) * v
        u = v ^ (v >> 32) if width == 8 else v
        m = (u ^ position_word(i % BLOCK)) & MASK64
        lane2 += block_weight(i // BLOCK) * ((m * m) & MASK64)
    lanes = (lane0, lane1, lane2)
    return "".join(
        f"{(lane + d) & MASK64:016x}"
        for lane, d in zip(lanes, descriptor(t.dtype, tuple(t.shape)), strict=True)
    )


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with varied bits (both signs, fractions, the full integer range)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in INTEGER_DTYPES:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), shape, generator=g, dtype=dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def flip_bit(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of ``t`` with one bit of one element (flattened index) inverted."""
    out = t.clone()
    raw = out.view(-1).view(torch.uint8)
    byte = index * t.element_size() + bit // 8
    raw[byte] ^= 1 << (bit % 8)
    return out


@pytest.mark.parametrize("dtype", EVERY_DTYPE, ids=str)
@pytest.mark.parametrize("shape", [(0,), (), (7,), (2 * BLOCK + 3,), (3, 1100)], ids=str)
def test_matches_the_reference_definition(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = sample(dtype, shape)
    assert to_hex(fingerprint(t, chunk=BLOCK)) == reference_hex(t)
    assert to_hex(fingerprint(t)) == reference_hex(t)
    # The torch implementation (what a GPU runs) as well as the C kernel the CPU uses.
    assert to_hex(fingerprint_torch(t, chunk=BLOCK)) == reference_hex(t)
    assert to_hex(fingerprint_torch(t)) == reference_hex(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8], ids=str)
def test_non_contiguous_tensors_match_the_reference(dtype: torch.dtype) -> None:
    base = sample(dtype, (5, 900, 3))
    for view in (base.transpose(0, 1), base[:, ::7, 1], base.permute(2, 0, 1)[:, 1:, 5:]):
        assert not view.is_contiguous()
        expected = reference_hex(view)
        assert to_hex(fingerprint(view, chunk=BLOCK)) == expected
        assert to_hex(fingerprint(view, chunk=2 * BLOCK)) == expected
        assert to_hex(fingerprint(view.contiguous())) == expected
        assert to_hex(fingerprint_torch(view, chunk=BLOCK)) == expected


@PROPERTY
@given(dtype=st.sampled_from(EVERY_DTYPE), n=st.integers(0, 3 * BLOCK), seed=st.integers(0, 2**16))
def test_equal_tensors_have_equal_fingerprints(dtype: torch.dtype, n: int, seed: int) -> None:
    a = sample(dtype, (n,), seed)
    b = a.clone()
    assert torch.equal(fingerprint(a), fingerprint(b))
    assert torch.equal(fingerprint(a, chunk=BLOCK), fingerprint(b))


@PROPERTY
@given(dtype=st.sampled_from(EVERY_DTYPE), data=st.data())
def test_any_single_bit_flip_changes_the_fingerprint(dtype: torch.dtype, data: st.DataObject) -> None:
    t = sample(dtype, (2 * BLOCK + 5,), data.draw(st.integers(0, 2**16)))
    index = data.draw(st.integers(0, t.numel() - 1))
    bits = 1 if dtype == torch.bool else t.element_size() * 8
    bit = data.draw(st.integers(0, bits - 1))
    assert not torch.equal(fingerprint(flip_bit(t, index, bit)), fingerprint(t))


@PROPERTY
@given(dtype=st.sampled_from([d for d in EVERY_DTYPE if d != torch.bool]), data=st.data())
def test_two_bit_flips_in_two_elements_change_the_fingerprint(
    dtype: torch.dtype, data: st.DataObject
) -> None:
    t = sample(dtype, (3 * BLOCK,), data.draw(st.integers(0, 2**16)))
    i, j = data.draw(st.lists(st.integers(0, t.numel() - 1), min_size=2, max_size=2, unique=True))
    bits = t.element_size() * 8
    # The same bit in both is the case linear lanes are weakest at (e.g. two sign flips).
    bit_i = data.draw(st.integers(0, bits - 1))
    bit_j = data.draw(st.one_of(st.just(bit_i), st.integers(0, bits - 1)))
    assert not torch.equal(fingerprint(flip_bit(flip_bit(t, i, bit_i), j, bit_j)), fingerprint(t))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.float32, torch.bfloat16], ids=str)
def test_two_sign_flips_are_caught_in_every_position_pair(dtype: torch.dtype) -> None:
    # Two sign flips move lanes 0 and 1 by multiples of 2**63 for 64-bit types, which
    # cancel when i + j is even; the folded square in lane 2 must still see them.
    t = sample(dtype, (64,))
    before = fingerprint(t)
    top = t.element_size() * 8 - 1
    for i in range(0, 64, 3):
        for j in range(i + 1, 64, 5):
            assert not torch.equal(fingerprint(flip_bit(flip_bit(t, i, top), j, top)), before), (i, j)


@PROPERTY
@given(dtype=st.sampled_from(EVERY_DTYPE), data=st.data())
def test_swapping_two_different_elements_changes_the_fingerprint(
    dtype: torch.dtype, data: st.DataObject
) -> None:
    t = sample(dtype, (3 * BLOCK,), data.draw(st.integers(0, 2**16)))
    # Elements as rows of bytes: comparing and swapping bits works for every dtype.
    rows = t.view(torch.uint8).view(t.numel(), t.element_size())
    i, j = data.draw(st.lists(st.integers(0, t.numel() - 1), min_size=2, max_size=2, unique=True))
    if torch.equal(rows[i], rows[j]):
        j = next(k for k in range(t.numel()) if not torch.equal(rows[k], rows[i]))
    swapped = t.clone()
    swapped_rows = swapped.view(torch.uint8).view(t.numel(), t.element_size())
    swapped_rows[[i, j]] = rows[[j, i]]
    assert not torch.equal(fingerprint(swapped), fingerprint(t))


@PROPERTY
@given(
    n=st.integers(2, 3 * BLOCK),
    d=st.integers(1, 2**30),
    data=st.data(),
)
def test_compensating_changes_are_caught(n: int, d: int, data: st.DataObject) -> None:
    t = sample(torch.int32, (n,), data.draw(st.integers(0, 2**16))) // 4
    i, j = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
    changed = t.clone()
    changed[i] += d
    changed[j] -= d
    assert int(changed.sum()) == int(t.sum())
    assert not torch.equal(fingerprint(changed), fingerprint(t))


def test_the_non_linear_lane_sees_what_the_linear_lanes_cannot() -> None:
    # +d, -2d, +d at neighbours keeps the sum and the position-weighted sum.
    t = sample(torch.int32, (4 * BLOCK,), 7) // 4
    before = fingerprint(t)
    for i, d in ((0, 1), (BLOCK - 1, 12345), (3 * BLOCK + 17, 2**20)):
        changed = t.clone()
        changed[i] += d
        changed[i + 1] -= 2 * d
        changed[i + 2] += d
        after = fingerprint(changed)
        assert torch.equal(after[:2], before[:2])
        assert after[2] != before[2]


@PROPERTY
@given(dtype=st.sampled_from([*FLOAT_DTYPES, torch.int32]), data=st.data())
def test_random_multi_element_changes_change_the_fingerprint(dtype: torch.dtype, data: st.DataObject) -> None:
    t = sample(dtype, (2 * BLOCK + 100,), data.draw(st.integers(0, 2**16)))
    positions = data.draw(st.lists(st.integers(0, t.numel() - 1), min_size=2, max_size=40, unique=True))
    changed = t.clone()
    flat = changed.view(-1)
    for p in positions:
        flat[p] = sample(dtype, (1,), data.draw(st.integers(0, 2**16)))[0]
    if torch.equal(changed.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)):
        return  # drew the same values back: nothing changed, nothing to detect
    assert not torch.equal(fingerprint(changed), fingerprint(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_thread_count_and_chunk_size_never_change_the_result(dtype: torch.dtype) -> None:
    t = sample(dtype, (300_000 + 17,))
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for chunk in (None, BLOCK, 8 * BLOCK, DEFAULT_CHUNK, SINGLE_THREAD_CHUNK, 1024 * BLOCK):
                results.append(fingerprint(t, chunk=chunk))
                results.append(fingerprint_torch(t, chunk=chunk))
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(r, results[0]) for r in results)


def test_concurrent_calls_from_threads_agree_with_serial_calls() -> None:
    # The DDP hook fingerprints buckets from gloo threads: no shared scratch may race.
    tensors = [sample(torch.float32, (50_000 + k * 777,), k) for k in range(8)]
    serial = [fingerprint(t, chunk=4 * BLOCK) for t in tensors]
    results: dict[int, list[torch.Tensor]] = {}

    def work(worker: int) -> None:
        results[worker] = [fingerprint(t, chunk=4 * BLOCK) for t in tensors for _ in range(3)][::3]

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    for got in results.values():
        assert all(torch.equal(a, b) for a, b in zip(got, serial, strict=True))


def test_dtype_and_shape_are_part_of_the_fingerprint() -> None:
    x = sample(torch.float32, (6, 4))
    assert not torch.equal(fingerprint(x), fingerprint(x.view(torch.int32)))
    assert not torch.equal(fingerprint(x), fingerprint(x.reshape(4, 6)))
    assert not torch.equal(fingerprint(x), fingerprint(x.reshape(-1)))
    assert not torch.equal(fingerprint(torch.zeros(3)), fingerprint(torch.zeros(4)))
    assert not torch.equal(fingerprint(torch.zeros(0)), fingerprint(torch.zeros(0, dtype=torch.float16)))
    assert not torch.equal(
        fingerprint(torch.zeros(2, dtype=torch.int16)), fingerprint(torch.zeros(2, dtype=torch.bfloat16))
    )


def test_many_and_combine() -> None:
    tensors = [
        sample(torch.float32, (100,), 1),
        sample(torch.bfloat16, (3, 40), 2),
        sample(torch.int64, (5,), 3),
    ]
    many = fingerprint_many(tensors)
    assert many.dtype == torch.int64
    assert many.shape == (3, 3)
    for row, t in zip(many, tensors, strict=True):
        assert torch.equal(row, fingerprint(t))
    whole = combine(many)
    assert whole.shape == (3,)
    assert not torch.equal(whole, combine(many[[1, 0, 2]]))
    assert not torch.equal(whole, combine(many[:2]))
    assert torch.equal(whole, combine(fingerprint_many(t.clone() for t in tensors)))
    assert fingerprint_many([]).shape == (0, 3)


def test_many_batches_small_tensors_without_changing_their_fingerprints() -> None:
    base = sample(torch.float32, (40, 30))
    tensors = [
        sample(torch.float32, (7,)),
        sample(torch.float64, (BLOCK,), 1),
        torch.tensor(2.5),
        torch.zeros(0, 3, dtype=torch.bfloat16),
        base[:, ::3],
        sample(torch.int64, (3, 5), 2),
        sample(torch.bfloat16, (2 * BLOCK + 1,), 3),
        sample(torch.bool, (BLOCK + 1,), 4),
        sample(torch.uint8, (33,), 5),
        sample(torch.complex64, (9,), 6),
    ]
    many = fingerprint_many(tensors, chunk=BLOCK)
    for row, t in zip(many, tensors, strict=True):
        assert to_hex(row) == reference_hex(t)
        assert torch.equal(row, fingerprint(t))


def test_hex_is_the_contract_fingerprint() -> None:
    text = to_hex(fingerprint(sample(torch.float32, (10,))))
    assert len(text) == 48
    assert text == text.lower()
    int(text, 16)
    assert FingerprintGroup(fingerprint=text, ranks=[0]).fingerprint == text
    assert to_hex(torch.tensor([-1, 0, 1])) == "f" * 16 + "0" * 16 + "0" * 15 + "1"


def testblock_weights_for_large_tensors_follow_the_definition() -> None:
    # The per-block weights are computed in torch for speed; they must equal the definition.
    blocks = torch.tensor([0, 1, 2, 1000, 2**20 + 3, 2**40 + 5], dtype=torch.int64)
    got = [w & MASK64 for w in block_weights(blocks).tolist()]
    assert got == [block_weight(b) for b in blocks.tolist()]


def test_default_chunk_stays_below_the_intra_op_grain_with_several_threads() -> None:
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert default_chunk(torch.device("cpu")) == DEFAULT_CHUNK < 32768
        torch.set_num_threads(1)
        assert default_chunk(torch.device("cpu")) == SINGLE_THREAD_CHUNK
    finally:
        torch.set_num_threads(saved)
    assert default_chunk(torch.device("cuda")) % BLOCK == 0


def test_bad_input_is_refused_by_name() -> None:
    t = torch.ones(4)
    with pytest.raises(ValueError, match="chunk"):
        fingerprint(t, chunk=1000)
    with pytest.raises(ValueError, match="chunk"):
        fingerprint(t, chunk=0)
    with pytest.raises(ValueError, match="combine"):
        combine(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="to_hex"):
        to_hex(torch.zeros(4, dtype=torch.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, which is why they are unsupported
        quantized = torch.quantize_per_tensor(t, 0.1, 0, torch.quint8)
    with pytest.raises(TypeError, match="dtype"):
        fingerprint(quantized)
