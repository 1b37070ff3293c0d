"""The product checks' pass over an operand as one fused Triton kernel: ``(a @ s, |a| @ t)`` in one read of ``a``.

On a GPU the torch form of this pass (``sdcguard.agent.product_checks``) widens a
bf16 or fp16 operand to an fp32 copy, makes a second copy for ``|a|`` and reads
each in a matrix-vector product: five passes over an operand as large as the
product's input, and two allocations of it, per product. This kernel reads
``a`` once, in its own layout and dtype, widens it in registers and writes two
fp32 vectors. It serves both of a product's passes: the row sums of an operand
that is not a weight (``s = t = 1``) and the check of the other operand.

Chosen as the fingerprint's kernels are (``sdcguard.agent.fingerprint.triton_kernels_for``:
``SDCGUARD_FINGERPRINT_KERNEL=triton`` on a GPU, or the CPU under
``TRITON_INTERPRET=1``, how the tests run it); where the setting asks for it and
Triton cannot run, the call raises ``TritonKernelError`` with the reason.
Nothing synchronises with the host.
"""

from __future__ import annotations

import torch

from sdcguard.agent.kernels import triton_fingerprint

READS = (torch.float16, torch.bfloat16, torch.float32)
"""The operand dtypes the kernel reads (fp32 accumulation: an fp64 operand keeps the torch form)."""
BLOCK_R = 32
BLOCK_P = 128
"""Rows per program and columns per step of its loop: a 32 x 128 tile (4,096 elements) per load."""


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
