"""The agent's assumptions checked on an accelerator, and the fingerprint's speed there.

``./dev bench device [-- --device cuda:0 --elements 64M,256M --repeats 10 --steps 5]``

Checks, each PASS or FAIL (the exit status is 1 if any fails):

1. **fingerprints do not depend on the device**: for every element type and
   a range of sizes (and a strided view), the fingerprint computed on the
   device equals the CPU's, bit for bit. Replicas compare fingerprints and a
   checkpoint saved on a GPU is verified on whatever loads it;
2. **detector 1's test agrees**: the non-finite flag on the device matches
   the CPU's for clean tensors and for a NaN or an infinity at either end;
3. **the ring audit's premise**: the reference job's micro-batch, recomputed
   on the bare module with the guard's seeding, gives the loss and every
   gradient bit for bit as the DDP pass did (a world of one on this device),
   with torch's deterministic algorithms on, as the guard runs the audit. The
   same comparison without them is reported, not judged: it shows whether the
   setting matters on this device.

Then it times, on the device, a copy into a preallocated buffer, a sum, the
fingerprint and the non-finite flag, and prints the ratios to the copy.

Without an accelerator it runs everything on the CPU with small sizes, which
is how the tests keep it working. It is one short script so that a session
lent a GPU can run it at once.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from agent import fingerprint as fp
from agent import replay
from agent.nonfinite import nonfinite_flag
from agent.train import JobShape, SyntheticData, TinyGPT, loss_fn
from benchmarks.bench_fingerprint import _counts, _label, _median_seconds

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
SIZES = [0, 1, 1023, 1025, 3 * fp.BLOCK + 7, (1 << 20) + 13]


def _sample(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), (n,), generator=g, dtype=dtype)
    return (torch.randn(n, generator=g) * 3).to(dtype)


def check_fingerprints(device: torch.device) -> list[str]:
    """Problems found comparing device and CPU fingerprints (empty: PASS)."""
    problems = []
    for dtype in DTYPES:
        for n in SIZES:
            t = _sample(dtype, n, seed=n)
            views = [t] + ([t[::3]] if n > 3 else [])
            for view in views:
                # On a CPU-only smoke run the other side is the torch implementation (what GPUs run).
                other = fp.fingerprint(view.to(device)) if device.type != "cpu" else fp.fingerprint_torch(view)
                here, there = fp.to_hex(fp.fingerprint(view)), fp.to_hex(other)
                if here != there:
                    problems.append(f"{dtype} n={view.numel()}: cpu {here} vs {device} {there}")
    return problems


def check_nonfinite(device: torch.device) -> list[str]:
    """Problems found comparing the non-finite flag on the device and the CPU (empty: PASS)."""
    problems = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        base = _sample(dtype, 100_003, seed=1)
        cases: list[tuple[str, torch.Tensor]] = [("clean", base)]
        for bad in (float("nan"), float("inf"), float("-inf")):
            for where in (0, base.numel() - 1):
                probe = base.clone()
                probe[where] = bad
                cases.append((f"{bad} at {where}", probe))
        for label, t in cases:
            if bool(nonfinite_flag(t)) != bool(nonfinite_flag(t.to(device))):
                problems.append(f"{dtype} {label}: the CPU and {device} disagree")
    return problems


def _pass_bits(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> list[str]:
    """The loss and every gradient of one seeded forward and backward, as fingerprints."""
    module.zero_grad(set_to_none=True)
    replay.seed_micro_batch(0, step, 0)
    loss = loss_fn(module, batch)
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros(0) for p in module.parameters()]
    return [fp.to_hex(fp.fingerprint(loss.detach())), *(fp.to_hex(fp.fingerprint(g)) for g in grads)]


def check_recompute(device: torch.device, steps: int, deterministic: bool) -> list[str]:
    """Problems found recomputing the reference job's micro-batches on the bare module (empty: PASS)."""
    torch.use_deterministic_algorithms(deterministic)
    shape = JobShape(vocab=256, dim=128, layers=2, seq=64, batch=8)
    torch.manual_seed(shape.seed)
    model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    data = SyntheticData(shape, device)
    problems = []
    for step in range(steps):
        batch = data(step, 0)
        owner = _pass_bits(ddp, batch, step)
        auditor = _pass_bits(ddp.module, batch, step)
        again = _pass_bits(ddp.module, batch, step)
        if owner != auditor or auditor != again:
            differing = sum(a != b for a, b in zip(owner, auditor, strict=True))
            problems.append(f"step {step}: {differing} of {len(owner)} fingerprints (loss first) differ")
    return problems


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn``, waiting for the device to finish each call."""

    def synced() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _median_seconds(synced, repeats)


def time_on(device: torch.device, elements: list[int], repeats: int) -> None:
    """Print copy, sum, fingerprint and non-finite times on the device, with ratios to the copy."""
    print(f"{'dtype':<9} {'elements':>8} {'copy ms':>8} {'sum ms':>7} {'fp ms':>8} {'fp GB/s':>8} "
          f"{'fp x copy':>9} {'flag ms':>8} {'flag x copy':>11}")
    for dtype in (torch.float32, torch.bfloat16):
        for n in elements:
            t = torch.randn(n, device=device).to(dtype)
            buffer = torch.empty_like(t)
            copy = _seconds(functools.partial(buffer.copy_, t), device, repeats)
            total = _seconds(t.sum, device, repeats)
            lanes = _seconds(functools.partial(fp.fingerprint, t), device, repeats)
            flag = _seconds(functools.partial(nonfinite_flag, t), device, repeats)
            print(f"{str(dtype).removeprefix('torch.'):<9} {_label(n):>8} {copy * 1e3:8.3f} {total * 1e3:7.3f} "
                  f"{lanes * 1e3:8.3f} {n * t.element_size() / lanes / 1e9:8.1f} {copy / lanes:9.2f} "
                  f"{flag * 1e3:8.3f} {copy / flag:11.2f}")


def main(argv: list[str]) -> int:
    """Run the checks and the timings; 0 when every check passed, 1 otherwise."""
    has_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="bench device", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0" if has_gpu else "cpu", help="default: cuda:0 when there is one")
    parser.add_argument("--elements", type=_counts, default=[64 << 20, 256 << 20] if has_gpu else [1 << 20],
                        help="tensor sizes to time, e.g. 64M,256M")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="micro-batches recomputed per setting")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        parser.error(f"--device {args.device}: not usable here: {exc}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", replay.CUBLAS_WORKSPACE)
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        print(f"device: {device} (no accelerator: a smoke run), torch {torch.__version__}")

    started_group = not dist.is_initialized()
    if started_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    try:
        results = {
            "fingerprints equal on the device and the CPU": check_fingerprints(device),
            "the non-finite flag agrees with the CPU": check_nonfinite(device),
            "recomputation is bit-identical (deterministic algorithms on)": check_recompute(device, args.steps, True),
        }
        informational = check_recompute(device, args.steps, False)
    finally:
        torch.use_deterministic_algorithms(deterministic_before)
        if started_group:
            dist.destroy_process_group()
    failed = False
    for name, problems in results.items():
        print(f"{'PASS' if not problems else 'FAIL'}  {name}")
        for problem in problems[:10]:
            print(f"      {problem}")
        failed |= bool(problems)
    print(f"info  recomputation with deterministic algorithms off: "
          f"{'bit-identical' if not informational else '; '.join(informational[:3])}")
    time_on(device, args.elements, args.repeats)
    return 1 if failed else 0
