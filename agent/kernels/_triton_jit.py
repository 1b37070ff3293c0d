"""The Triton kernels themselves (imported only by ``sdcguard.agent.kernels.triton_fingerprint``, only when used).

Importing this module imports Triton, and ``triton.jit`` reads
``TRITON_INTERPRET`` when the kernels are defined: set it before the first
import to run them on the CPU through NumPy.

Every integer lane is a wrapping int64 sum (any order gives the same bits);
the sum of squares is added exactly in the order ``sdcguard.agent.grad_norm`` defines
(a fixed tree inside a chunk, the chunks one after another from 0), so
nothing here depends on how the GPU schedules programs. Integer constants
above 2**63 are written as their two's-complement signed values, and logical
right shifts are arithmetic shifts with the sign bits masked off, as in
``sdcguard.agent.fingerprint``'s torch code.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK: tl.constexpr = tl.constexpr(1024)
"""``sdcguard.agent.fingerprint.BLOCK``: the period of the position table."""
SQ_ROW: tl.constexpr = tl.constexpr(16)
SQ_CHUNK: tl.constexpr = tl.constexpr(4096)
"""``sdcguard.agent.grad_norm``'s rows and chunk; a chunk is exactly 4 fingerprint blocks."""

_GOLDEN: tl.constexpr = tl.constexpr(-7046029254386353131)  # 0x9E3779B97F4A7C15
_MIX1: tl.constexpr = tl.constexpr(-4658895280553007687)  # 0xBF58476D1CE4E5B9
_MIX2: tl.constexpr = tl.constexpr(-7723592293110705685)  # 0x94D049BB133111EB
_LOW34: tl.constexpr = tl.constexpr((1 << 34) - 1)
_LOW37: tl.constexpr = tl.constexpr((1 << 37) - 1)
_LOW33: tl.constexpr = tl.constexpr((1 << 33) - 1)
# The compile budget: Triton compiles a variant of a kernel for every integer argument that equals 1 or is a
# multiple of 16, so a run over many sizes compiled each kernel several times over (60-110 variants before the
# first timing on the device). Counts and offsets that only bound loops or place results are not specialised
# (``do_not_specialize``); the sizes and strides that decide how memory is read still are.
_CANONICAL_NAN: tl.constexpr = tl.constexpr(0x7FF8000000000000)
"""The bits of Python's ``math.nan``: a NaN sum is reported as this one, whatever its payload."""


@triton.jit
def _block_weight(blocks):
    """``sdcguard.agent.fingerprint.block_weight`` of an int64 tensor of block indices (SplitMix64 of 2b + 1, made odd)."""
    z = blocks * 2 + 1 + _GOLDEN
    z = (z ^ ((z >> 30) & _LOW34)) * _MIX1
    z = (z ^ ((z >> 27) & _LOW37)) * _MIX2
    return (z ^ ((z >> 31) & _LOW33)) | 1


@triton.jit
def _lanes(v, valid, blocks, table, WIDE: tl.constexpr):
    """The three data lanes of a tile ``v`` (int64 [R, BLOCK], zero where not ``valid``) whose row r is global
    block ``blocks[r]`` and column j position j of it; ``table`` is the position words T (int64 [BLOCK])."""
    columns = tl.arange(0, BLOCK).to(tl.int64)
    rows = tl.sum(v, axis=1)
    lane0 = tl.sum(rows, axis=0)
    # sum (i + 1) v_i with i = b * BLOCK + j, as a row part and a column part: two multiplies per row or column.
    lane1 = tl.sum(rows * (blocks * BLOCK), axis=0) + tl.sum(tl.sum(v, axis=0) * (columns + 1), axis=0)
    if WIDE:
        v = v ^ (v >> 32)  # arithmetic, as torch's: the definition's v ^ (v >> 32)
    m = v ^ table[None, :]
    squares = tl.where(valid, m * m, 0)
    lane2 = tl.sum(tl.sum(squares, axis=1) * _block_weight(blocks), axis=0)
    return lane0, lane1, lane2


@triton.jit
def _add_lanes(out_ptr, lane0, lane1, lane2):
    """Add three int64 values to out[0..3) atomically (integer atomics: exact and order-free)."""
    index = tl.arange(0, 4)
    values = tl.where(index == 0, lane0, tl.where(index == 1, lane1, lane2))
    tl.atomic_add(out_ptr + index, values, mask=index < 3)


@triton.jit
def _nonfinite(v, exponent):
    """1 (int32) when an element of ``v`` (raw bits, sign-extended to int64; masked-out elements 0) has an
    exponent of all ones (``exponent``: the format's exponent mask; NaN or infinity), else 0."""
    return tl.max(tl.max(((v & exponent) == exponent).to(tl.int32), axis=1), axis=0)


@triton.jit(do_not_specialize=("start", "n_tiles"))
def fingerprint_kernel(x_ptr, n, start, size1, size2, size3, stride0, stride1, stride2, stride3,
                       table_ptr, out_ptr, n_tiles, flag_ptr,
                       WIDE: tl.constexpr, STRIDED: tl.constexpr, ROWS: tl.constexpr, EXPONENT: tl.constexpr):
    """Add the lanes of ``n`` elements, logical positions ``start`` .. ``start + n``, to out[0..3).

    The elements are a (up to) 4-D view in row-major order: sizes (., size1, size2, size3) and element strides
    stride0..3 (``STRIDED``), or contiguous. Tiles of ``ROWS`` whole global blocks, visited grid-stride; one
    atomic add per program. ``EXPONENT`` (a float format's exponent mask; 0: none): also raise flag[0]
    (int32) to 1 when an element is NaN or infinite, from the same loads."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    table = tl.load(table_ptr + tl.arange(0, BLOCK))
    columns = tl.arange(0, BLOCK).to(tl.int64)
    first_block = start // BLOCK
    lane0 = tl.zeros([], tl.int64)
    lane1 = tl.zeros([], tl.int64)
    lane2 = tl.zeros([], tl.int64)
    flag = tl.zeros([], tl.int32)
    for tile in range(pid, n_tiles, programs):
        blocks = first_block + tl.cast(tile, tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        e = blocks[:, None] * BLOCK + columns[None, :] - start
        valid = (e >= 0) & (e < n)
        if STRIDED:
            i3 = e % size3
            rest = e // size3
            i2 = rest % size2
            rest = rest // size2
            offset = (rest // size1) * stride0 + (rest % size1) * stride1 + i2 * stride2 + i3 * stride3
        else:
            offset = e
        v = tl.load(x_ptr + offset, mask=valid, other=0).to(tl.int64)
        t0, t1, t2 = _lanes(v, valid, blocks, table, WIDE)
        lane0 += t0
        lane1 += t1
        lane2 += t2
        if EXPONENT != 0:
            flag = tl.maximum(flag, _nonfinite(v, EXPONENT))
    _add_lanes(out_ptr, lane0, lane1, lane2)
    if EXPONENT != 0:
        tl.atomic_max(flag_ptr, flag)


@triton.jit(do_not_specialize=("n_tiles", "tiles_per_program"))
def many_kernel(pieces_ptr, sizes_ptr, tile_piece_ptr, tile_block_ptr, table_ptr, out_ptr, flag_ptr,
                n_tiles, tiles_per_program,
                ELEMENT: tl.constexpr, WIDE: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr,
                FLAG: tl.constexpr):
    """Lanes of many contiguous pieces of one element type, each added to its row of out (int64 [rows, 3]).

    Device-side metadata: per piece (address, row, position of its first element in the row, the exponent
    mask of its float format or 0) and its element count; per tile its piece and first block (of the row's
    positions). A program takes a run of consecutive tiles (so most runs stay in one piece) and adds its sums
    to the piece's row when the run leaves the piece (integer atomics: exact). ``LANES``: compute the lanes;
    ``FLAG``: raise flag[0] (int32) to 1 when an element of a float piece has an exponent of all ones (NaN or
    infinity), from the same loads (one atomic max per program)."""
    pid = tl.program_id(0)
    table = tl.load(table_ptr + tl.arange(0, BLOCK))
    columns = tl.arange(0, BLOCK).to(tl.int64)
    first = pid * tiles_per_program
    last = tl.minimum(first + tiles_per_program, n_tiles)
    current = tl.load(tile_piece_ptr + first, mask=first < n_tiles, other=0)
    lane0 = tl.zeros([], tl.int64)
    lane1 = tl.zeros([], tl.int64)
    lane2 = tl.zeros([], tl.int64)
    flag = tl.zeros([], tl.int32)
    for tile in range(first, last):
        k = tl.load(tile_piece_ptr + tile)
        if LANES:  # noqa: SIM102 (a constexpr test alone: Triton compiles the branch away)
            if k != current:
                _add_lanes(out_ptr + tl.load(pieces_ptr + current * 4 + 1) * 3, lane0, lane1, lane2)
                lane0 = tl.zeros([], tl.int64)
                lane1 = tl.zeros([], tl.int64)
                lane2 = tl.zeros([], tl.int64)
                current = k
        base = tl.load(pieces_ptr + k * 4).to(tl.pointer_type(ELEMENT))
        position = tl.load(pieces_ptr + k * 4 + 2)
        n = tl.load(sizes_ptr + k)
        blocks = tl.load(tile_block_ptr + tile) + tl.arange(0, ROWS).to(tl.int64)
        e = blocks[:, None] * BLOCK + columns[None, :] - position
        valid = (e >= 0) & (e < n)
        v = tl.load(base + e, mask=valid, other=0).to(tl.int64)
        if LANES:
            t0, t1, t2 = _lanes(v, valid, blocks, table, WIDE)
            lane0 += t0
            lane1 += t1
            lane2 += t2
        if FLAG:
            exponent = tl.load(pieces_ptr + k * 4 + 3)
            # A piece that is no float has mask 0: never flagged.
            flag = tl.maximum(flag, tl.where(exponent != 0, _nonfinite(v, exponent), 0))
    if LANES:  # noqa: SIM102 (as above)
        if first < n_tiles:
            _add_lanes(out_ptr + tl.load(pieces_ptr + current * 4 + 1) * 3, lane0, lane1, lane2)
    if FLAG:
        tl.atomic_max(flag_ptr, flag)


@triton.jit
def _chunk_sum_of_squares(x):
    """``sdcguard.agent.grad_norm``'s value of one chunk: ``x`` fp64 [SQ_CHUNK] (zeros past the end), squared, the 256
    rows of 16 added pairwise (row 2i + row 2i+1) level by level, the last row's lanes folded l + l+8, l+4,
    l+2, l+1. A sum over an axis of 2 is one IEEE addition, whatever the order: the bits are the definition's."""
    t = x * x
    t = tl.sum(tl.reshape(t, [128, 2, SQ_ROW]), axis=1)
    t = tl.sum(tl.reshape(t, [64, 2, SQ_ROW]), axis=1)
    t = tl.sum(tl.reshape(t, [32, 2, SQ_ROW]), axis=1)
    t = tl.sum(tl.reshape(t, [16, 2, SQ_ROW]), axis=1)
    t = tl.sum(tl.reshape(t, [8, 2, SQ_ROW]), axis=1)
    t = tl.sum(tl.reshape(t, [4, 2, SQ_ROW]), axis=1)
    t = tl.sum(tl.reshape(t, [2, 2, SQ_ROW]), axis=1)
    row = tl.sum(tl.reshape(t, [2, SQ_ROW]), axis=0)
    row = tl.sum(tl.reshape(row, [2, 8]), axis=0)
    row = tl.sum(tl.reshape(row, [2, 4]), axis=0)
    row = tl.sum(tl.reshape(row, [2, 2]), axis=0)
    return tl.sum(row, axis=0)


@triton.jit
def _round_to_bf16(x):
    """fp32 to bf16 rounded to nearest, ties to even, by integer arithmetic on the bits: c10::BFloat16's
    rounding (a NaN becomes 0x7FC0), the same on a GPU and in the interpreter."""
    u = x.to(tl.int32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = tl.where(x != x, 0x7FC0, rounded)
    return out.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit(do_not_specialize=("n_chunks",))
def bucket_kernel(x_ptr, n, n_chunks, divisor, table_ptr, sums_ptr, parts_ptr,
                  BITS: tl.constexpr, EXPONENT: tl.constexpr, BF16: tl.constexpr,
                  FINGERPRINT: tl.constexpr, DIVIDE: tl.constexpr):
    """One read (and, with ``DIVIDE``, one write) of a contiguous bucket of fp16, bf16 or fp32.

    Per chunk of SQ_CHUNK elements (grid-stride): its sum of squares into sums[chunk]; the non-finite flag
    from the raw exponent bits (all ones: NaN or infinity); with ``FINGERPRINT`` the lanes of the bits (read
    as ``BITS``, sign-extended); with ``DIVIDE`` each element divided by ``divisor`` in place (IEEE division
    in fp32, rounded to the element type, as torch's ``div_`` on the CPU) after it was read. Each program
    writes (lane0, lane1, lane2, flag) to parts[program]; ``finish_kernel`` adds them up."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offsets = tl.arange(0, SQ_CHUNK).to(tl.int64)
    lane0 = tl.zeros([], tl.int64)
    lane1 = tl.zeros([], tl.int64)
    lane2 = tl.zeros([], tl.int64)
    flag = tl.zeros([], tl.int64)
    if FINGERPRINT:
        table = tl.load(table_ptr + tl.arange(0, BLOCK))
    for chunk in range(pid, n_chunks, programs):
        e = tl.cast(chunk, tl.int64) * SQ_CHUNK + offsets
        valid = e < n
        x = tl.load(x_ptr + e, mask=valid, other=0.0)
        bits = x.to(BITS, bitcast=True)
        flag = tl.maximum(flag, tl.max(((bits & EXPONENT) == EXPONENT).to(tl.int64), axis=0))
        if BF16:
            # bf16 is the top half of an fp32: widened by a shift, exact everywhere (Triton's interpreter
            # emulates bf16 conversions inexactly).
            single = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            single = x.to(tl.float32)
        tl.store(sums_ptr + chunk, _chunk_sum_of_squares(single.to(tl.float64)))
        if FINGERPRINT:
            blocks = tl.cast(chunk, tl.int64) * (SQ_CHUNK // BLOCK) + tl.arange(0, SQ_CHUNK // BLOCK).to(tl.int64)
            v = tl.reshape(bits.to(tl.int64), [SQ_CHUNK // BLOCK, BLOCK])
            t0, t1, t2 = _lanes(v, tl.reshape(valid, [SQ_CHUNK // BLOCK, BLOCK]), blocks, table, False)
            lane0 += t0
            lane1 += t1
            lane2 += t2
        if DIVIDE:
            quotient = tl.math.div_rn(single, divisor)
            if BF16:
                tl.store(x_ptr + e, _round_to_bf16(quotient), mask=valid)
            else:
                tl.store(x_ptr + e, quotient.to(x.dtype), mask=valid)
    index = tl.arange(0, 4)
    values = tl.where(index == 0, lane0, tl.where(index == 1, lane1, tl.where(index == 2, lane2, flag)))
    tl.store(parts_ptr + pid * 4 + index, values)


@triton.jit(do_not_specialize=("n_chunks", "n_parts"))
def finish_kernel(sums_ptr, n_chunks, parts_ptr, n_parts, descriptor_ptr, out_ptr,
                  PARTS: tl.constexpr, RUN: tl.constexpr):
    """One program: the chunks' sums of squares added in order from 0 (the definition's; a NaN made the
    canonical one), the programs' lanes and flags added up with the descriptor. Writes int64
    out = [lane0, lane1, lane2, flag, sum of squares (fp64 bits), its square root (fp64 bits)]."""
    total = tl.zeros([], tl.float64)
    for base in range(0, n_chunks, RUN):
        # RUN independent loads, then RUN dependent additions: only the additions are serial.
        for r in tl.static_range(RUN):
            total += tl.load(sums_ptr + base + r, mask=base + r < n_chunks, other=0.0)
    nan = tl.full([], _CANONICAL_NAN, tl.int64).to(tl.float64, bitcast=True)
    total = tl.where(total != total, nan, total)
    root = tl.sqrt(total)
    root = tl.where(root != root, nan, root)
    rows = tl.arange(0, PARTS)
    index = tl.arange(0, 4)
    parts = tl.load(parts_ptr + rows[:, None] * 4 + index[None, :], mask=rows[:, None] < n_parts, other=0)
    summed = tl.sum(tl.where(index[None, :] < 3, parts, 0), axis=0)
    flag = tl.max(tl.where(index[None, :] == 3, parts, 0))
    lanes = summed + tl.load(descriptor_ptr + index, mask=index < 3, other=0)
    tl.store(out_ptr + index, tl.where(index < 3, lanes, flag))
    tl.store(out_ptr + 4, total.to(tl.int64, bitcast=True))
    tl.store(out_ptr + 5, root.to(tl.int64, bitcast=True))



@triton.jit
def _dual_rows(a_ptr, batch, rows, row_ok, begin, end, a_batch, a_row, a_col, s_ptr, t_ptr, vector_stride,
               BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """``(a @ s, |a| @ t)`` over columns ``[begin, end)`` for ``rows`` of batch entry ``batch`` of ``a`` (any
    strides and float dtype, widened to fp32 in registers), in one read of them: the pass over an operand of the
    product checks."""
    base = a_ptr + batch.to(tl.int64) * a_batch
    row_at = rows.to(tl.int64) * a_row
    vectors = batch.to(tl.int64) * vector_stride
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    dot_abs = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k in range(begin, end, BLOCK_P):
        cols = k + tl.arange(0, BLOCK_P)
        col_ok = cols < end
        tile = tl.load(base + row_at[:, None] + cols.to(tl.int64)[None, :] * a_col,
                       mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        s = tl.load(s_ptr + vectors + cols, mask=col_ok, other=0.0)
        t = tl.load(t_ptr + vectors + cols, mask=col_ok, other=0.0)
        dot += tl.sum(tile * s[None, :], axis=1)
        dot_abs += tl.sum(tl.abs(tile) * t[None, :], axis=1)
    return dot, dot_abs


@triton.jit(do_not_specialize=("row_blocks", "total"))
def dual_matvec_kernel(a_ptr, r, p, row_blocks, a_batch, a_row, a_col, s_ptr, t_ptr, vector_stride,
                       out_ptr, total, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """``(a @ s, |a| @ t)`` of a product check (``sdcguard.agent.product_checks``) in one read of ``a``
    ([batch, r, p], any strides, fp16, bf16 or fp32: no copy, no ``|a|`` tensor). One program per block of
    ``BLOCK_R`` rows of one batch entry; ``s`` and ``t`` are fp32 [p] (``vector_stride`` 0) or one row per
    batch entry. Writes fp32 ``out[0:total]`` (``a @ s``) and ``out[total:2 total]`` (``|a| @ t``), rows in
    order."""
    pid = tl.program_id(0)
    batch = pid // row_blocks
    rows = (pid % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < r
    dot, dot_abs = _dual_rows(a_ptr, batch, rows, row_ok, 0, p, a_batch, a_row, a_col, s_ptr, t_ptr,
                              vector_stride, BLOCK_R, BLOCK_P)
    out = batch.to(tl.int64) * r + rows
    tl.store(out_ptr + out, dot, mask=row_ok)
    tl.store(out_ptr + total + out, dot_abs, mask=row_ok)


@triton.jit(do_not_specialize=("row_blocks", "start"))
def row_check_kernel(a_ptr, r, p, row_blocks, a_batch, a_row, a_col, s_ptr, t_ptr, vector_stride,
                     c_ptr, n, c_batch, c_row, c_col, alpha, bias_ptr, bias_stride, beta, rows_ptr, rows_stride,
                     start, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """The whole check of one product ``c = beta·bias + alpha·(a @ b)`` by its row sums, ``sdc_row_check``'s on a
    GPU: ``a @ (b 1)`` and ``|a| @ (|b| 1)`` (``s``, ``t``) in one read of ``a``, the row sums of ``c`` in one
    read of ``c``, the bias row's sums (``bias_stride`` 0: one value), then per row the difference
    ``|c 1 - (alpha·a s + beta·Σ bias)|`` and its bound ``|alpha|·|a| t + |beta|·Σ|bias|``, written at
    ``rows[0, start + row]`` and ``rows[1, start + row]`` (rows numbered across the batch). Operands fp16, bf16 or
    fp32, any strides, widened in registers; fp32 arithmetic."""
    pid = tl.program_id(0)
    batch = pid // row_blocks
    rows = (pid % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < r
    dot, dot_abs = _dual_rows(a_ptr, batch, rows, row_ok, 0, p, a_batch, a_row, a_col, s_ptr, t_ptr,
                              vector_stride, BLOCK_R, BLOCK_P)
    observed = _sum_rows(c_ptr, batch, rows, row_ok, 0, n, c_batch, c_row, c_col, BLOCK_R, BLOCK_P)
    _store_rows(dot, dot_abs, observed, batch * r + rows, row_ok, n, alpha, bias_ptr, bias_stride, beta,
                rows_ptr, rows_stride, start, HAS_BIAS, BLOCK_P)


@triton.jit
def _sum_rows(c_ptr, batch, rows, row_ok, begin, end, c_batch, c_row, c_col, BLOCK_R: tl.constexpr,
              BLOCK_P: tl.constexpr):
    """``c 1`` over columns ``[begin, end)`` for ``rows`` of batch entry ``batch`` of ``c`` (any strides and float
    dtype), in fp32: the observed side of a product's check."""
    c_base = c_ptr + batch.to(tl.int64) * c_batch
    c_at = rows.to(tl.int64) * c_row
    observed = tl.zeros([BLOCK_R], dtype=tl.float32)
    for j in range(begin, end, BLOCK_P):
        cols = j + tl.arange(0, BLOCK_P)
        col_ok = cols < end
        tile = tl.load(c_base + c_at[:, None] + cols.to(tl.int64)[None, :] * c_col,
                       mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        observed += tl.sum(tile, axis=1)
    return observed


@triton.jit
def _store_rows(dot, dot_abs, observed, numbers, ok, n, alpha, bias_ptr, bias_stride, beta, rows_ptr, rows_stride,
                start, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr):
    """Each row's difference ``|observed - (alpha·dot + beta·Σ bias)|`` and bound ``|alpha|·dot_abs +
    |beta|·Σ|bias|`` (the bias row of ``n`` values, ``bias_stride`` 0: one value) at ``rows[0, start + number]``
    and ``rows[1, start + number]``."""
    total = tl.zeros([BLOCK_P], dtype=tl.float32)
    magnitude = tl.zeros([BLOCK_P], dtype=tl.float32)
    if HAS_BIAS:
        for j in range(0, n, BLOCK_P):
            cols = j + tl.arange(0, BLOCK_P)
            col_ok = cols < n
            bias = tl.load(bias_ptr + cols.to(tl.int64) * bias_stride, mask=col_ok, other=0.0).to(tl.float32)
            total += bias
            magnitude += tl.abs(bias)
    shift = beta * tl.sum(total, axis=0)
    shift_abs = tl.abs(beta) * tl.sum(magnitude, axis=0)
    out = start + numbers.to(tl.int64)
    tl.store(rows_ptr + out, tl.abs(observed - (alpha * dot + shift)), mask=ok)
    tl.store(rows_ptr + rows_stride + out, tl.abs(alpha) * dot_abs + shift_abs, mask=ok)


@triton.jit(do_not_specialize=("row_blocks", "total", "p_chunk", "n_chunk"))
def row_parts_kernel(a_ptr, r, p, row_blocks, a_batch, a_row, a_col, s_ptr, t_ptr, vector_stride,
                     c_ptr, n, c_batch, c_row, c_col, parts_ptr, total, p_chunk, n_chunk,
                     BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """The first half of a product's check split along its length (few rows, a long accumulation: ``dW``'s
    product in the backward): program ``(i, k)`` takes block ``i`` of ``BLOCK_R`` rows and part ``k`` of the
    columns (``p_chunk`` of ``a``'s, ``n_chunk`` of ``c``'s), and writes its partial ``a @ s``, ``|a| @ t`` and
    ``c 1`` at ``parts[0|1|2, k, row]`` (``total`` rows across the batch); ``row_finish_kernel`` adds them up."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    batch = pid // row_blocks
    rows = (pid % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < r
    p_begin = part * p_chunk
    dot, dot_abs = _dual_rows(a_ptr, batch, rows, row_ok, p_begin, tl.minimum(p_begin + p_chunk, p), a_batch,
                              a_row, a_col, s_ptr, t_ptr, vector_stride, BLOCK_R, BLOCK_P)
    n_begin = part * n_chunk
    observed = _sum_rows(c_ptr, batch, rows, row_ok, n_begin, tl.minimum(n_begin + n_chunk, n), c_batch, c_row,
                         c_col, BLOCK_R, BLOCK_P)
    out = part.to(tl.int64) * total + batch.to(tl.int64) * r + rows
    plane = parts.to(tl.int64) * total
    tl.store(parts_ptr + out, dot, mask=row_ok)
    tl.store(parts_ptr + plane + out, dot_abs, mask=row_ok)
    tl.store(parts_ptr + 2 * plane + out, observed, mask=row_ok)


@triton.jit(do_not_specialize=("split", "total", "plane", "start"))
def row_finish_kernel(parts_ptr, split, total, plane, n, alpha, bias_ptr, bias_stride, beta, rows_ptr, rows_stride,
                      start, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    """The second half: each row's ``split`` partial sums added in order ``0, 1, ...`` (the same sum on every
    run, whatever the schedule), then its difference and bound written as ``row_check_kernel`` writes them.
    ``plane``: ``split · total``, from the host (64-bit where it must be; an integer argument of 1, as ``total``
    may be, is a compile-time constant, not a tensor)."""
    numbers = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = numbers < total
    row_at = numbers.to(tl.int64)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    dot_abs = tl.zeros([BLOCK], dtype=tl.float32)
    observed = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(0, split):
        dot += tl.load(parts_ptr + row_at, mask=ok, other=0.0)
        dot_abs += tl.load(parts_ptr + plane + row_at, mask=ok, other=0.0)
        observed += tl.load(parts_ptr + 2 * plane + row_at, mask=ok, other=0.0)
        row_at += total
    _store_rows(dot, dot_abs, observed, numbers, ok, n, alpha, bias_ptr, bias_stride, beta, rows_ptr, rows_stride,
                start, HAS_BIAS, BLOCK_P)
