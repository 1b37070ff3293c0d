"""The agent's overhead on the reference job: plain DDP, each detector alone, and the defaults, side by side.

Two gloo ranks on the CPU, each its own simulated node (so the ring audit
runs), one intra-op thread each. Every configuration has its own model and
guard; they take turns, one short burst each (by default a single step), in
an order rotated every round, so a noisy neighbour or a slow drift of the
machine falls on all of them alike. Per configuration it reports the median
and the lower quartile of the per-step times over all rounds, and their ratios
to plain DDP (the same model, data and optimizer, no guard) from the same run:
when the two ratios agree, the figure is not an artefact of the noise.
``./dev bench agent [-- --steps N --rounds R --dim D]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agent.config import GuardConfig
from agent.guard import SDCGuard
from agent.train import JobShape, SyntheticData, build, init_process_group, launch, loss_fn, shutdown

# name -> GuardConfig overrides (None: plain DDP without a guard).
CONFIGS: dict[str, dict[str, Any] | None] = {
    "plain DDP": None,
    "detector 1 (non-finite)": {"reduced_grad": False, "audit_every": 0, "fingerprint_every": 0},
    "reduced-gradient compare": {"nonfinite": False, "audit_every": 0, "fingerprint_every": 0},
    "detectors 1 + reduced (every step)": {"audit_every": 0, "fingerprint_every": 0},
    "detector 2 (audit every step)": {"nonfinite": False, "reduced_grad": False, "audit_every": 1,
                                      "fingerprint_every": 0},
    "detector 3 (weights every step)": {"nonfinite": False, "reduced_grad": False, "audit_every": 0,
                                        "fingerprint_every": 1},
    "defaults (audit /100, weights /10)": {"audit_every": 100, "fingerprint_every": 10},
}


def _rank_main(out: str, shape: JobShape, steps: int, rounds: int) -> None:
    init_process_group()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    data = SyntheticData(shape, device)
    rank = dist.get_rank()
    runners: dict[str, Any] = {}
    for name, overrides in CONFIGS.items():
        ddp, optimizer = build(shape, device)
        if overrides is None:
            runners[name] = (ddp, optimizer, None)
        else:
            config = GuardConfig(on_alarm="raise", ranks_per_node=1, threads=1, **overrides)
            runners[name] = (ddp, optimizer, SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=data,
                                                     config=config, injection=None))
    position = dict.fromkeys(CONFIGS, 0)
    timings: dict[str, list[float]] = {name: [] for name in CONFIGS}
    cpu: dict[str, list[float]] = {name: [] for name in CONFIGS}
    names = list(runners)
    for round_ in range(rounds + 1):  # round 0 warms up (and DDP rebuilds its buckets)
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            ddp, optimizer, guard = runners[name]
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step = position[name]
                if guard is None:
                    optimizer.zero_grad(set_to_none=True)
                    loss_fn(ddp, data(step, rank)).backward()
                    optimizer.step()
                else:
                    guard.step(step)
                position[name] += 1
            elapsed = torch.tensor([time.perf_counter() - started])
            used = torch.tensor([time.process_time() - cpu_started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(used, op=dist.ReduceOp.SUM)
            if round_:
                timings[name].append(float(elapsed) / steps)
                cpu[name].append(float(used) / steps)
    if rank == 0:
        Path(out).write_text(json.dumps({"wall": timings, "cpu": cpu}))
    runners.clear()
    shutdown()


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table; returns 0."""
    parser = argparse.ArgumentParser(prog="bench agent")
    parser.add_argument("--steps", type=int, default=1, help="steps per burst")
    parser.add_argument("--rounds", type=int, default=150, help="bursts per configuration")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 4:
        parser.error("--steps must be at least 1 and --rounds at least 4 (quartiles need data)")
    shape = JobShape(vocab=256, dim=args.dim, layers=args.layers, seq=args.seq, batch=args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        codes = launch(2, _rank_main, (out, shape, args.steps, args.rounds), env={"OMP_NUM_THREADS": "1"},
                       timeout=1800)
        if codes != [0, 0]:
            print(f"bench agent: ranks exited with {codes}")
            return 1
        measured: dict[str, dict[str, list[float]]] = json.loads(Path(out).read_text())
    params = sum(p.numel() for p in build_params(shape))
    print(f"reference job: TinyGPT dim={shape.dim} layers={shape.layers} seq={shape.seq} batch={shape.batch} "
          f"({params / 1e6:.2f} M parameters), 2 gloo ranks on 2 simulated nodes, 1 thread each; "
          f"{args.rounds} rounds of {args.steps}-step bursts")
    print("wall: the slower rank's time per step; cpu: both ranks' CPU time per step, all threads (work, not waiting).")
    print("x plain: median / plain DDP's median; q1: the same for the lower quartiles.")
    stats = {kind: {name: _quartiles(times) for name, times in series.items()} for kind, series in measured.items()}
    print(f"| {'configuration':<36} | {'wall ms':>8} | {'x plain':>7} | {'q1 x plain':>10} | "
          f"{'cpu ms':>7} | {'x plain':>7} |")
    print(f"|{'-' * 38}|{'-' * 10}|{'-' * 9}|{'-' * 12}|{'-' * 9}|{'-' * 9}|")
    plain_wall, plain_cpu = stats["wall"]["plain DDP"], stats["cpu"]["plain DDP"]
    for name in CONFIGS:
        (q1, median), (_, cpu_median) = stats["wall"][name], stats["cpu"][name]
        print(f"| {name:<36} | {median * 1e3:8.2f} | {median / plain_wall[1]:7.3f} | {q1 / plain_wall[0]:10.3f} | "
              f"{cpu_median * 1e3:7.2f} | {cpu_median / plain_cpu[1]:7.3f} |")
    ratio = {name: median / plain_wall[1] for name, (_, median) in stats["wall"].items()}
    amortized = (ratio["detectors 1 + reduced (every step)"]
                 + (ratio["detector 2 (audit every step)"] - 1) / 100
                 + (ratio["detector 3 (weights every step)"] - 1) / 10)
    print(f"defaults amortized from the parts: {amortized:.3f} x plain DDP (target <= 1.10); "
          f"measured directly: {ratio['defaults (audit /100, weights /10)']:.3f} x")
    print(f"an audit step vs a plain step: {ratio['detector 2 (audit every step)']:.3f} x (target <= 2.1)")
    print(f"detector 1 alone: {ratio['detector 1 (non-finite)']:.3f} x (target <= 1.05)")
    return 0


def _quartiles(times: list[float]) -> tuple[float, float]:
    """(lower quartile, median) of per-step times."""
    q1, median, _ = statistics.quantiles(times, n=4)
    return q1, median


def build_params(shape: JobShape) -> list[torch.nn.Parameter]:
    """The reference model's parameters (to report its size)."""
    from agent.train import TinyGPT

    return list(TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout).parameters())


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
