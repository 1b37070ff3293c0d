"""The communication hook's fused bucket passes against one pass per result (the "fusion" part of
``./dev bench agent``), on the large model where the passes show.

Before the all-reduce the hook wants, of each bucket, the NaN/Inf flag, the
norm and the division by the world size; after it, the flag, the fingerprint
and the norm. The C kernel does each side in one pass (``agent.nonfinite``'s
``local_pass`` and ``reduced_pass``). The baseline here gets the same results
one pass each (``nonfinite_flag``, ``grad_norm.bucket_norm``, ``div_``,
``fingerprint``), as the hook took them before the fusion, so its rows differ
in nothing but the passes. Plain DDP, the defaults with one pass per result
and the defaults as they are take turns one step at a time on 2 gloo ranks,
one thread each, in an order rotated every round; steps that would check the
weights or audit are skipped, in the defaults' cadence (every 10 and 100).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agent import fingerprint as fp
from agent import grad_norm, nonfinite
from agent.config import GuardConfig
from agent.guard import SDCGuard
from agent.nonfinite import BucketPass, nonfinite_flag
from agent.train import JobShape, SyntheticData, build, init_process_group, launch, loss_fn, shutdown

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
            steps[name] = _plain_step(ddp, optimizer, data, rank)
            continue
        config = GuardConfig(on_alarm="raise", ranks_per_node=1, threads=1, spool_dir=spool)
        steps[name] = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=data, config=config, injection=None).step
    timings: dict[str, list[float]] = {name: [] for name in ROWS}
    cpu: dict[str, list[float]] = {name: [] for name in ROWS}
    step = 0
    for round_ in range(rounds + 1):  # round 0 warms up (and DDP rebuilds its buckets)
        shift = round_ % len(ROWS)
        for name in ROWS[shift:] + ROWS[:shift]:
            _Passes.one_per_result = name == ROWS[1]
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            steps[name](step)
            elapsed = torch.tensor([time.perf_counter() - started])
            used = torch.tensor([time.process_time() - cpu_started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(used, op=dist.ReduceOp.SUM)
            if round_:
                timings[name].append(float(elapsed))
                cpu[name].append(float(used))
        step += 1
        while step % 10 == 0:  # no weight check (every 10) nor audit (every 100): the passes alone differ
            step += 1
    if rank == 0:
        Path(out).write_text(json.dumps({"wall": timings, "cpu": cpu}))
    steps.clear()
    shutdown()


def _plain_step(ddp: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
                data: SyntheticData, rank: int) -> Any:
    def step(step: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp, data(step, rank)).backward()
        optimizer.step()
    return step


def fusion_table(shape: JobShape, rounds: int) -> int:
    """One interleaved run of the three rows on 2 ranks; prints them and their ratios to plain DDP."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        codes = launch(2, _rank_main, (out, shape, rounds, str(Path(tmp) / "spool")),
                       env={"OMP_NUM_THREADS": "1"}, timeout=3600)
        if codes != [0, 0]:
            print(f"bench agent: fusion ranks exited with {codes}")
            return 1
        measured: dict[str, dict[str, list[float]]] = json.loads(Path(out).read_text())
    print(f"\nthe fused bucket passes: TinyGPT dim={shape.dim} layers={shape.layers} seq={shape.seq} "
          f"batch={shape.batch}, 2 gloo ranks on 2 simulated nodes, 1 thread each; {rounds} rounds of one step "
          "without a weight check or an audit")
    print("wall: the slower rank's time per step; cpu: both ranks' CPU time per step (work, not waiting).")
    print(f"| {'row':<30} | {'wall ms':>8} | {'x plain':>7} | {'q1 x plain':>10} | {'cpu ms':>7} | {'x plain':>7} |")
    print(f"|{'-' * 32}|{'-' * 10}|{'-' * 9}|{'-' * 12}|{'-' * 9}|{'-' * 9}|")
    quartiles = {kind: {name: statistics.quantiles(times, n=4)[:2] for name, times in series.items()}
                 for kind, series in measured.items()}
    (plain_q1, plain_median), (_, plain_cpu) = quartiles["wall"][ROWS[0]], quartiles["cpu"][ROWS[0]]
    for name in ROWS:
        (q1, median), (_, cpu_median) = quartiles["wall"][name], quartiles["cpu"][name]
        print(f"| {name:<30} | {median * 1e3:8.2f} | {median / plain_median:7.3f} | {q1 / plain_q1:10.3f} | "
              f"{cpu_median * 1e3:7.2f} | {cpu_median / plain_cpu:7.3f} |")
    return 0
