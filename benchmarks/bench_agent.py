"""The agent's overhead on the reference job: plain DDP, each detector alone, and the defaults, side by side.

Two gloo ranks on the CPU, each its own simulated node (so the ring audit
runs), one intra-op thread each. Every configuration has its own model and
guard; they run round-robin in short bursts and the median of the bursts is
reported, so a noisy neighbour slows all of them alike. Ratios are against
plain DDP (the same model, data and optimizer, no guard) measured in the same
run. ``./dev bench agent [-- --steps N --rounds R --dim D]``.
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
    for round_ in range(rounds + 1):  # round 0 warms up (and DDP rebuilds its buckets)
        for name, (ddp, optimizer, guard) in runners.items():
            dist.barrier()
            started = time.perf_counter()
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
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_:
                timings[name].append(float(elapsed) / steps)
    if rank == 0:
        Path(out).write_text(json.dumps({n: statistics.median(t) for n, t in timings.items()}))
    runners.clear()
    shutdown()


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table; returns 0."""
    parser = argparse.ArgumentParser(prog="bench agent")
    parser.add_argument("--steps", type=int, default=20, help="steps per burst")
    parser.add_argument("--rounds", type=int, default=5, help="bursts per configuration")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    shape = JobShape(vocab=256, dim=args.dim, layers=args.layers, seq=args.seq, batch=args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        codes = launch(2, _rank_main, (out, shape, args.steps, args.rounds), env={"OMP_NUM_THREADS": "1"},
                       timeout=1800)
        if codes != [0, 0]:
            print(f"bench agent: ranks exited with {codes}")
            return 1
        per_step = json.loads(Path(out).read_text())
    params = sum(p.numel() for p in build_params(shape))
    print(f"reference job: TinyGPT dim={shape.dim} layers={shape.layers} seq={shape.seq} batch={shape.batch} "
          f"({params / 1e6:.2f} M parameters), 2 gloo ranks on 2 simulated nodes, 1 thread each; "
          f"median of {args.rounds} bursts of {args.steps} steps")
    plain = per_step["plain DDP"]
    print(f"| {'configuration':<36} | {'ms/step':>8} | {'x plain DDP':>11} |")
    print(f"|{'-' * 38}|{'-' * 10}|{'-' * 13}|")
    for name, seconds in per_step.items():
        print(f"| {name:<36} | {seconds * 1e3:8.2f} | {seconds / plain:11.3f} |")
    every = per_step["detectors 1 + reduced (every step)"]
    amortized = (every + (per_step["detector 2 (audit every step)"] - plain) / 100
                 + (per_step["detector 3 (weights every step)"] - plain) / 10)
    print(f"defaults amortized from the parts: {amortized / plain:.3f} x plain DDP (target <= 1.10)")
    print(f"an audit step vs a plain step: {per_step['detector 2 (audit every step)'] / plain:.3f} x (target <= 2.1)")
    print(f"detector 1 alone: {per_step['detector 1 (non-finite)'] / plain:.3f} x (target <= 1.05)")
    return 0


def build_params(shape: JobShape) -> list[torch.nn.Parameter]:
    """The reference model's parameters (to report its size)."""
    from agent.train import TinyGPT

    return list(TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout).parameters())


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
