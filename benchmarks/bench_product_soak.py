"""The product checks' clean soak: train from scratch with every matrix product checked, and count false alarms.

A product check is a rank's own: it compares a product with its checksums on
the rank's device, with no collective. A rank-step of a clean soak is one
micro-batch's forward and backward inside ``ProductChecks.watching()``, and a
false alarm is any product of it that fails its bound. So the soak runs one
process per configuration, no process group, and each step is one rank-step:

- ``gpt-fp32``: the GPT example (examples/gpt_model.py: attention written
  out, dropout 0.1), fp32;
- ``gpt-bf16``: the same under bf16 autocast (the products in bf16, fp32
  accumulation);

each training from scratch with AdamW (lr 1e-3) on its token sampler, so the
weights, activations and gradients move through a real run's magnitudes.
Prints a progress line every ``--every`` steps and, at the end, per
configuration: steps, products checked, products that failed (the false
alarms: 0 is the only right answer), products seen but not checkable, and
seconds. Exit 1 if any product failed.

``./dev bench product_soak`` (the default: 50,000 steps each, 100,000 in
all); ``-- --steps 20`` for a quick form (the tests run 3).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.bench_products import _gpt_example
from sdcguard.agent.product_checks import ProductChecks

CONFIGS = ("gpt-fp32", "gpt-bf16")
WHOLE_SET_ARGS = ["--steps", "20"]


@dataclass
class SoakRow:
    """One configuration's soak."""

    config: str
    steps: int
    checked: int
    failed: int
    """Products whose checksums failed their bound: false alarms on clean training."""
    failed_sites: list[str]
    unchecked: int
    seconds: float


def soak(config: str, steps: int, every: int, say: Callable[[str], None]) -> SoakRow:
    """Train ``steps`` clean steps of ``config`` from scratch with every product checked."""
    if config not in CONFIGS:
        raise ValueError(f"config: {config!r} is not one of {', '.join(CONFIGS)}")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    example = _gpt_example()
    cfg = example.GPTConfig()
    sampler = example.TokenSampler(cfg, micro_batch=8, accum=1, device=torch.device("cpu"))
    model = example.GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checks = ProductChecks(model)
    autocast: Any = (torch.autocast("cpu", dtype=torch.bfloat16) if config == "gpt-bf16"
                     else contextlib.nullcontext())
    checked = unchecked = 0
    failed = torch.zeros((), dtype=torch.int64)
    sites: set[str] = set()
    started = time.perf_counter()
    for step in range(steps):
        batch = sampler(step, 0)[0]
        optimizer.zero_grad(set_to_none=True)
        checks.begin_step()
        with checks.watching():
            with autocast:
                loss = example.loss_fn(model, batch)
            loss.backward()
        optimizer.step()
        checked += checks.checked
        unchecked += checks.unchecked
        failing = checks.flags.sum()
        failed += failing
        if int(failing):  # a false alarm: name its sites (read only then)
            sites.update(name for _, name in checks.findings(checks.flags.unsqueeze(0)))
        if every and (step + 1) % every == 0:
            say(f"product soak {config}: step {step + 1:,} of {steps:,}, {checked:,} products checked, "
                f"{int(failed)} failed, loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)")
    return SoakRow(config, steps, checked, int(failed), sorted(sites), unchecked,
                   round(time.perf_counter() - started, 1))


def _child(config: str, steps: int, every: int, queue: Any) -> None:
    queue.put(asdict(soak(config, steps, every, lambda line: print(line, file=sys.stderr, flush=True))))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="./dev bench product_soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50_000, help="steps per configuration (default 50,000)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--every", type=int, default=5_000, help="steps between two progress lines (0: none)")
    parser.add_argument("--json", dest="json_out", help="also write the rows to this file")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    if args.steps < 1:
        parser.error("--steps: must be at least 1")
    # One process per configuration, side by side (each one thread): the soak's wall time is the longest's.
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_child, args=(c, args.steps, args.every, queue)) for c in configs]
    for p in procs:
        p.start()
    rows = sorted((queue.get() for _ in procs), key=lambda r: configs.index(r["config"]))
    for p in procs:
        p.join()
    print(f"{'config':<10} {'steps':>8} {'checked':>12} {'failed':>7} {'unchecked':>10} {'seconds':>8}")
    for r in rows:
        print(f"{r['config']:<10} {r['steps']:>8,} {r['checked']:>12,} {r['failed']:>7} {r['unchecked']:>10,} "
              f"{r['seconds']:>8.0f}")
        if r["failed_sites"]:
            print(f"  failed at: {', '.join(r['failed_sites'][:20])}")
    total = sum(r["steps"] for r in rows)
    print(f"{total:,} rank-steps, {sum(r['checked'] for r in rows):,} products checked, "
          f"{sum(r['failed'] for r in rows)} false alarm(s)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["failed"] for r in rows) or any(p.exitcode for p in procs) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
