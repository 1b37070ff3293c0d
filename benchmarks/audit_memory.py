"""What an audit step costs in memory (the "memory" part of ``./dev bench agent``).

On an audit step the auditor recomputes its neighbour's micro-batches after
its own backward (sdcguard.agent.recompute.recompute_step): one more forward and
backward, whose local gradients it turns into per-parameter digests
(sdcguard.agent.confirm.audit_record) and drops. The owner keeps per-parameter
digests of its own gradients (three 64-bit lanes per parameter tensor), not
a copy of them, on every audited step, the first included.

This part measures, with the torch profiler's memory timeline, the peak of
the memory allocated during (a) the rank's own pass from ``zero_grad``
(activations, then the ``.grad`` fields) and (b) the recomputation, which
runs while ``.grad`` holds the step's gradients. The audit step's peak
extra memory is then ``max(a, grads + b) - a``, against the parameters'
size. The figures are the allocator's, not the process's resident size, so
they are the same on any machine for the same shapes; on a GPU the caching
allocator reserves in blocks on top of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from sdcguard.agent.recompute import recompute_step
from sdcguard.agent.testing.train import JobShape, SyntheticData, TinyGPT, loss_fn


def peak_allocated(fn: Callable[[], Any]) -> int:
    """The largest sum of the bytes that ``fn`` allocated and had not yet freed, at any moment of its run."""
    from torch.profiler._memory_profiler import Action  # the profiler's own timeline; no public form yet

    fn()  # warm: lazily built state (autograd's, the allocator's) is not the audit's
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    current = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            current += size
        elif action == Action.DESTROY:
            current -= size
        peak = max(peak, current)
    return peak


def audit_memory(shape: JobShape, micro_batches: int) -> dict[str, int]:
    """Bytes: the parameters, the own pass's peak, the recomputation's peak, and the audit step's extra peak."""
    torch.manual_seed(0)
    model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout)
    data = SyntheticData(shape, torch.device("cpu"))
    batches = [data(0, i) for i in range(micro_batches)]
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)

    def own_pass() -> None:
        model.zero_grad(set_to_none=True)
        for batch in batches:
            loss = loss_fn(model, batch)
            (loss / micro_batches if micro_batches > 1 else loss).backward()

    own = peak_allocated(own_pass)
    own_pass()  # .grad holds the step's gradients while the auditor recomputes, as in a real step

    def seed() -> None:
        torch.manual_seed(1)

    recomputed = peak_allocated(lambda: recompute_step(model, loss_fn, batches, names, params, seed))
    return {"params": param_bytes, "own": own, "recompute": recomputed,
            "extra": max(own, param_bytes + recomputed) - own}


def memory_table(shape: JobShape, micro_batches: tuple[int, ...] = (1, 4)) -> int:
    """Print the audit step's memory on ``shape`` for each number of micro-batches per step; returns 0."""
    mb = 1e6
    print(f"\naudit step memory: TinyGPT {shape.dim}-dim x {shape.layers} layers, batch {shape.batch} x "
          f"{shape.seq}, fp32, allocator bytes (torch profiler)")
    print("| micro-batches | parameters MB | own pass peak MB | recomputation peak MB | audit step extra MB "
          "| extra / parameters |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k in micro_batches:
        m = audit_memory(shape, k)
        print(f"| {k} | {m['params'] / mb:.1f} | {m['own'] / mb:.1f} | {m['recompute'] / mb:.1f} "
              f"| {m['extra'] / mb:.1f} | {m['extra'] / m['params']:.2f}x |")
    return 0
