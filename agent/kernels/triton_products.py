"""The product checks' kernels for a GPU, in Triton: a product checked whole in one launch, from one read of each
operand.

On a GPU the torch form of a product's check (``sdcguard.agent.product_checks``)
widens a bf16 or fp16 operand to an fp32 copy, makes a second copy for ``|a|``,
reads each in a matrix-vector product, then sums the result and takes the
difference: up to five passes over an operand as large as the product's input,
two allocations of it and five to eleven operations per product. Here:

- ``row_check``: the whole check (``sdc_row_check``'s on the device): ``a @ s``
  and ``|a| @ t`` in one read of ``a``, the row sums of the result in one read
  of it, the bias row, and each row's difference and bound written into the
  pass's rows, where the checks judge them with the pass's others;
- ``dual_matvec``: ``(a @ s, |a| @ t)`` alone, for the row sums of an operand
  that is not a weight (``s = t = 1``).

Both read fp16, bf16 or fp32 in any layout, widened in registers, in fp32.

Chosen as the fingerprint's kernels are (``sdcguard.agent.fingerprint.triton_kernels_for``:
``SDCGUARD_FINGERPRINT_KERNEL=triton`` on a GPU, or the CPU under
``TRITON_INTERPRET=1``, how the tests run it); where the setting asks for it and
Triton cannot run, the call raises ``TritonKernelError`` with the reason.
Nothing synchronises with the host.
"""

from __future__ import annotations

import functools

import torch

from sdcguard.agent.kernels import triton_fingerprint

READS = (torch.float16, torch.bfloat16, torch.float32)
"""The operand dtypes the kernel reads (fp32 accumulation: an fp64 operand keeps the torch form)."""
BLOCK_R = 32
BLOCK_P = 128
"""Rows per program and columns per step of its loop: a 32 x 128 tile (4,096 elements) per load."""
PROGRAMS_PER_SM = 4
"""Programs a check should launch per streaming multiprocessor to keep the device's memory busy: fewer (a product
with few rows and a long accumulation) and the check is split along its length (:func:`split_for`)."""
MIN_PART = 4 * BLOCK_P
"""The fewest columns of the accumulation a part of a split check takes (four steps of its loop)."""
MAX_SPLIT = 64
"""The most parts a check is split into (the partial sums are added in a second launch, in order)."""
FINISH_BLOCK = 256
"""Rows per program of the second launch."""


def readable(a: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether :func:`dual_matvec` takes ``a`` with vectors ``s``: a 2- or 3-dimensional fp16, bf16 or fp32
    operand with at least one element and fp32 vectors on its device."""
    return (a.dtype in READS and a.dim() in (2, 3) and a.numel() > 0 and s.dtype == torch.float32
            and s.device == a.device)


def dual_matvec(a: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a @ s, |a| @ t)`` in fp32, shaped as ``a`` less its last dimension, from one read of ``a`` (any
    strides). ``s`` and ``t``: fp32 ``[p]``, or ``[batch, p]`` for a 3-dimensional ``a`` (one per entry).

    Raises ValueError for an operand it does not read (see :func:`readable`), TritonKernelError where Triton
    cannot run."""
    triton_fingerprint.require(a.device)
    if not readable(a, s) or t.dtype != s.dtype or t.shape != s.shape:
        raise ValueError(f"dual_matvec: reads a 2- or 3-dimensional {', '.join(str(d) for d in READS)} operand "
                         f"with fp32 vectors on its device, got {a.dtype} {tuple(a.shape)} on {a.device} with "
                         f"{s.dtype} {tuple(s.shape)} and {t.dtype} {tuple(t.shape)}")
    batched = a.dim() == 3
    batch, r, p = (a.shape[0], a.shape[1], a.shape[2]) if batched else (1, a.shape[0], a.shape[1])
    per_entry = s.dim() == 2 and s.shape[0] > 1
    s, t = s.contiguous(), t.contiguous()
    out = torch.empty(2, batch * r, dtype=torch.float32, device=a.device)
    row_blocks = -(-r // BLOCK_R)
    triton_fingerprint._jit().dual_matvec_kernel[(batch * row_blocks,)](
        a, r, p, row_blocks, a.stride(0) if batched else 0, a.stride(-2), a.stride(-1), s, t,
        p if per_entry else 0, out, batch * r, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P)
    shape = (batch, r) if batched else (r,)
    return out[0].view(shape), out[1].view(shape)


def split_for(programs: int, length: int, wanted: int) -> int:
    """How many parts to split a check of ``programs`` row blocks along its ``length`` (the longer of the
    accumulation and the result's width) into, for ``wanted`` programs on the device: 1 where the row blocks
    alone fill it or the length is too short to share; else enough parts to fill it, each at least ``MIN_PART``
    long, at most ``MAX_SPLIT``."""
    if programs >= wanted or length < 2 * MIN_PART:
        return 1
    return max(1, min(-(-wanted // programs), length // MIN_PART, MAX_SPLIT))


@functools.cache
def wanted_programs(device: torch.device) -> int:
    """The programs a check should launch on ``device``: ``PROGRAMS_PER_SM`` per streaming multiprocessor of a
    GPU; 1 off a GPU (Triton's interpreter runs one program at a time: no check is split unless asked)."""
    if device.type != "cuda":
        return 1
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def row_check(a: torch.Tensor, s: torch.Tensor, t: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
              alpha: float, beta: float, rows: torch.Tensor, start: int, *, split: int | None = None) -> None:
    """The whole check of one product ``c = beta·bias + alpha·(a @ b)`` in one launch (``sdc_row_check``'s on a
    GPU): given ``s = b 1`` and ``t = |b| 1`` (fp32 ``[p]``, or ``[batch, p]``), writes each row's difference
    ``|c 1 - (alpha·a s + beta·Σ bias)|`` into ``rows[0, start:]`` and its bound ``|alpha|·|a| t +
    |beta|·Σ|bias|`` into ``rows[1, start:]``, rows numbered across the batch. ``bias``: None, or one row of
    ``c``'s width (an ``nn.Linear``'s), or one value. One read of ``a`` and of ``c``, no copy.

    A product with too few rows to fill the device (``dW = dYᵀ X`` in a backward: the layer's width in rows, the
    tokens as its length) is split along its length into ``split`` parts (None: :func:`split_for`'s choice for
    the device), each program reading its part of a row block; a second launch adds the parts in a fixed order,
    so the rows are the same on every run.

    Raises ValueError for operands it does not take (see :func:`readable`; ``c`` as ``a``, of ``a``'s rows, on
    its device; ``rows`` fp32 [2, at least start + the rows] with unit stride; ``split`` from 1 to
    ``MAX_SPLIT``), TritonKernelError where Triton cannot run."""
    triton_fingerprint.require(a.device)
    batched = a.dim() == 3
    batch, r, p = (a.shape[0], a.shape[1], a.shape[2]) if batched else (1, a.shape[0], a.shape[1])
    n = c.shape[-1]
    if not readable(a, s) or t.shape != s.shape or t.dtype != s.dtype or c.dtype not in READS or (
            c.dim() != a.dim() or c.shape[:-1] != a.shape[:-1] or c.device != a.device) or (
            bias is not None and (bias.dtype not in READS or bias.numel() != bias.shape[-1]
                                  or bias.shape[-1] not in (1, n))) or (
            rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[0] != 2 or rows.stride(1) != 1
            or rows.shape[1] < start + batch * r or rows.device != a.device):
        raise ValueError(f"row_check: takes a and c of {', '.join(str(d) for d in READS)} with the same rows, "
                         f"a bias row of c's width or one value, and fp32 rows [2, >= {start + batch * r}] on "
                         f"a's device; got a {a.dtype} {tuple(a.shape)}, c {c.dtype} {tuple(c.shape)}, bias "
                         f"{None if bias is None else (bias.dtype, tuple(bias.shape))}, rows {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if split is not None and not 1 <= split <= MAX_SPLIT:
        raise ValueError(f"row_check: split is 1 to {MAX_SPLIT} parts (or None: chosen for the device), got {split}")
    per_entry = s.dim() == 2 and s.shape[0] > 1
    s, t = s.contiguous(), t.contiguous()
    row_blocks = -(-r // BLOCK_R)
    if split is None:
        split = split_for(batch * row_blocks, max(p, n), wanted_programs(a.device))
    bias_stride = 0 if bias is None or bias.shape[-1] == 1 else bias.stride(-1)
    bias_at = a if bias is None else bias
    jit = triton_fingerprint._jit()
    a_at = (a, r, p, row_blocks, a.stride(0) if batched else 0, a.stride(-2), a.stride(-1), s, t,
            p if per_entry else 0)
    c_at = (c, n, c.stride(0) if batched else 0, c.stride(-2), c.stride(-1))
    if split == 1:
        jit.row_check_kernel[(batch * row_blocks,)](
            *a_at, *c_at, float(alpha), bias_at, bias_stride, float(beta), rows, rows.stride(0), start,
            HAS_BIAS=bias is not None, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P)
        return
    total = batch * r
    parts = torch.empty(3, split, total, dtype=torch.float32, device=a.device)
    p_chunk = -(-p // (split * BLOCK_P)) * BLOCK_P  # whole steps of the loop: only the last part is ragged
    n_chunk = -(-n // (split * BLOCK_P)) * BLOCK_P
    jit.row_parts_kernel[(batch * row_blocks, split)](
        *a_at, *c_at, parts, total, p_chunk, n_chunk, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P)
    jit.row_finish_kernel[(-(-total // FINISH_BLOCK),)](
        parts, split, total, split * total, n, float(alpha), bias_at, bias_stride, float(beta), rows, rows.stride(0),
        start, HAS_BIAS=bias is not None, BLOCK=FINISH_BLOCK, BLOCK_P=BLOCK_P)
