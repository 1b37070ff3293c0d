"""The norm of a bucket of gradients, as the communication hook takes it: on the CPU, a sum of squares whose
order is part of its definition, so that the C kernel and torch give the same bits.

The norm of a rank's local gradients is more than a statistic: the magnitude
trigger watches it, and it is part of the rank's claim about its own pass,
which a confirmation on another node recomputes and compares bit for bit. So
every implementation that may run on either side must give the same bits.
On the CPU the C kernel computes it in the same pass as the division by the
world size (before the all-reduce) or the fingerprint (after it); torch
computes it where the kernel is not available. Both follow one definition:

- the elements are cut into chunks of ``SQ_CHUNK`` = 4,096, each 256 rows of
  16 (the last chunk padded with zeros), and each element is squared in fp64;
- in a chunk, the rows are added pairwise, row 2i + row 2i+1, level by level
  down to one row, whose 16 lanes are folded: lane l + lane l+8, then l+4,
  l+2, l+1;
- the chunks' values are added in order, starting from 0.

Every step is an elementwise IEEE operation, so vectorising or threading the
work inside a step changes nothing; torch does it with additions of strided
views (no reduction kernel, whose order torch does not promise). The square
of an fp16, bf16 or fp32 value is exact in fp64 and no sum of finite squares
can overflow, so the sum is finite exactly when every element is: the
kernel's non-finite flag comes with its sum. A NaN sum is returned as the
canonical NaN, whatever its payload. The result is also more accurate than a
running fp32 sum.

Off the CPU (a GPU) the hook keeps ``torch.linalg.vector_norm``: every rank of
a job then runs the same device code, and the kernel does not read device
memory.
"""

from __future__ import annotations

import math

import torch

from sdcguard.agent import native

SQ_ROW = native.SQ_ROW
SQ_CHUNK = native.SQ_CHUNK
TORCH_PIECE = 64 * SQ_CHUNK
"""Elements the torch implementation widens to fp64 at a time (2 MiB of scratch), a whole number of chunks."""


def kernel_for(t: torch.Tensor) -> tuple[native.Kernel, int] | None:
    """The C kernel and its float format for ``t`` when the kernel can read it (a contiguous CPU tensor of
    fp16, bf16 or fp32, and the kernel in use), else None."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    float_format = native.SUM_FORMATS.get(str(t.dtype).removeprefix("torch."))
    if float_format is None:
        return None
    kernel = native.kernel()
    return None if kernel is None else (kernel, float_format)


def canonical(total: float) -> float:
    """``total``, with any NaN replaced by the canonical one (a payload depends on the order of operations)."""
    return math.nan if total != total else total


def sum_of_squares(t: torch.Tensor) -> float:
    """The sum of squares of a CPU tensor's elements (in logical order) by the definition above.

    The C kernel computes it where it can read the tensor, torch elsewhere, with
    the same bits. Raises ValueError for a tensor not on the CPU, TypeError for
    one that is not floating point."""
    if t.device.type != "cpu":
        raise ValueError(f"sum_of_squares: defined on the CPU, not {t.device} (use bucket_norm)")
    readable = kernel_for(t)
    if readable is None:
        return sum_of_squares_torch(t)
    kernel, float_format = readable
    return canonical(kernel.sum_of_squares(t.data_ptr(), t.numel(), float_format))


def sum_of_squares_torch(t: torch.Tensor) -> float:
    """``sum_of_squares`` by torch ops alone (any CPU float tensor; fp64 elements are squared with rounding).

    In pieces of ``TORCH_PIECE`` elements: widened to fp64 in a scratch
    buffer, squared, the rows added pairwise (strided views into a second
    buffer and back), the lanes folded; the chunks' values are added in order
    in Python (a cumulative sum would do, but torch does not promise its
    order). Raises TypeError for a tensor that is not floating point."""
    if not t.is_floating_point():
        raise TypeError(f"sum_of_squares: expected a floating-point tensor, got {t.dtype}")
    flat = t.detach().reshape(-1)
    n = flat.numel()
    total = 0.0
    if n == 0:
        return total
    size = min(-(-n // SQ_CHUNK), TORCH_PIECE // SQ_CHUNK) * SQ_CHUNK
    rows = torch.empty(size, dtype=torch.float64, device="cpu")
    half = torch.empty(size // 2, dtype=torch.float64, device="cpu")
    for start in range(0, n, TORCH_PIECE):
        m = min(TORCH_PIECE, n - start)
        chunks = -(-m // SQ_CHUNK)
        rows[:m].copy_(flat[start:start + m])
        rows[m:chunks * SQ_CHUNK].zero_()
        square = rows[:chunks * SQ_CHUNK]
        square.mul_(square)
        tree, spare = square.view(chunks, SQ_CHUNK // SQ_ROW, SQ_ROW), half
        while tree.shape[1] > 1:
            level = spare[:tree.numel() // 2].view(chunks, tree.shape[1] // 2, SQ_ROW)
            torch.add(tree[:, 0::2], tree[:, 1::2], out=level)
            tree, spare = level, (rows if spare is half else half)
        lanes = tree[:, 0]
        width = SQ_ROW // 2
        while width:
            lanes = lanes[:, :width] + lanes[:, width:2 * width]
            width //= 2
        for value in lanes[:, 0].tolist():
            total += value
    return canonical(total)


def bucket_norm(t: torch.Tensor) -> torch.Tensor:
    """The norm the communication hook takes of a bucket: a 0-dim tensor on ``t``'s device.

    On the CPU the square root of ``sum_of_squares``, fp64; elsewhere
    ``torch.linalg.vector_norm`` in ``t``'s dtype (no host synchronisation)."""
    if t.device.type != "cpu":
        return torch.linalg.vector_norm(t.detach())
    return norm_from_sum(sum_of_squares(t))


def norm_from_sum(total: float) -> torch.Tensor:
    """The 0-dim fp64 CPU norm for a sum of squares (NaN and infinity stay what they are)."""
    return torch.tensor(math.sqrt(total), dtype=torch.float64, device="cpu")
