"""The communication hook's fused bucket passes against one pass per result (the "fusion" part of
``./dev bench agent``), on the large model where the passes show.

Before the all-reduce the hook wants, of each bucket, the NaN/Inf flag, the
norm and the division by the world size; after it, the flag, the fingerprint
and the norm. The C kernel does each side in one pass (``sdcguard.agent.nonfinite``'s
``local_pass`` and ``reduced_pass``). The baseline here gets the same results
one pass each (``nonfinite_flag``, ``grad_norm.bucket_norm``, ``div_``,
``fingerprint``), as the hook took them before the fusion, so its rows differ
in nothing but the passes. Plain DDP, the defaults with one pass per result
and the defaults as they are take turns one step at a time on 2 gloo ranks,
one thread each, in an order rotated every round; steps that would check the
weights or audit are skipped, in the defaults' cadence (every 10 and 100).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from benchmarks.interleave import launch_timed, plain_step, ratio_table, timed_rounds, write_timings
from sdcguard.agent import fingerprint as fp
from sdcguard.agent import grad_norm, nonfinite
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.nonfinite import BucketPass, nonfinite_flag
from sdcguard.agent.testing.train import JobShape, SyntheticData, build, init_process_group, loss_fn, shutdown

ROWS = ("plain DDP", "defaults, one pass per result", "defaults, fused passes")


def _one_pass_local(buffer: torch.Tensor, divisor: int, *, flag: bool, norm: bool) -> BucketPass:
    found = BucketPass(nonfinite_flag(buffer) if flag else None, grad_norm.bucket_norm(buffer) if norm else None)
    buffer.div_(divisor)
    return found


def _one_pass_reduced(reduced: torch.Tensor, *, flag: bool, fingerprint: bool, norm: bool) -> BucketPass:
    return BucketPass(nonfinite_flag(reduced) if flag else None, grad_norm.bucket_norm(reduced) if norm else None,
                      fp.fingerprint(reduced) if fingerprint else None)


class _Passes:
    """Which passes the communication hooks of this process take: the rows step one at a time and DDP waits
    for every bucket's callback before a backward returns, so a switch set around a row's step is enough."""

    one_per_result = False

    @classmethod
    def install(cls) -> None:
        local, reduced = nonfinite.local_pass, nonfinite.reduced_pass
        nonfinite.local_pass = lambda *a, **k: (_one_pass_local if cls.one_per_result else local)(*a, **k)
        nonfinite.reduced_pass = lambda *a, **k: (_one_pass_reduced if cls.one_per_result else reduced)(*a, **k)


def _rank_main(out: str, shape: JobShape, rounds: int, spool: str) -> None:
    init_process_group()
    torch.set_num_threads(1)
    _Passes.install()
    device = torch.device("cpu")
    data = SyntheticData(shape, device)
    rank = dist.get_rank()
    steps: dict[str, Any] = {}
    for name in ROWS:
        ddp, optimizer = build(shape, device)
        if name == ROWS[0]:
            steps[name] = plain_step(ddp, optimizer, data, rank)
            continue
        config = GuardConfig(on_alarm="raise", ranks_per_node=1, threads=1, spool_dir=spool)
        steps[name] = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=data, config=config, injection=None).step

    def passes_for(name: str) -> None:
        _Passes.one_per_result = name == ROWS[1]

    write_timings(out, timed_rounds(steps, rounds, step_number=_without_checks, before=passes_for))
    steps.clear()
    shutdown()


def _without_checks(n: int) -> int:
    """A row's n-th step number: 0 (the warm-up round's), then 1 to 9, 11 to 19, 21 ...: no multiple of 10, so no
    weight check (every 10) nor audit (every 100), and the passes alone differ."""
    return n + (n - 1) // 9 if n else 0


def fusion_table(shape: JobShape, rounds: int) -> int:
    """One interleaved run of the three rows on 2 ranks; prints them and their ratios to plain DDP."""
    measured = launch_timed(2, _rank_main, (shape, rounds), "fusion ranks")
    if measured is None:
        return 1
    print(f"\nthe fused bucket passes: TinyGPT dim={shape.dim} layers={shape.layers} seq={shape.seq} "
          f"batch={shape.batch}, 2 gloo ranks on 2 simulated nodes, 1 thread each; {rounds} rounds of one step "
          "without a weight check or an audit")
    print("wall: the slower rank's time per step; cpu: both ranks' CPU time per step (work, not waiting).")
    ratio_table(measured, ROWS, ROWS[0], header="row", width=30)
    return 0
