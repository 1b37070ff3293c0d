"""The agent's assumptions checked on a GPU, and the fingerprint's speed there: the one script for a lent GPU.

``./dev bench device [-- --device cuda:0 --elements 64M,256M --repeats 10 --steps 5]``

Checks, each a row of one table, PASS, FAIL or INFO (the exit status is 1 if
any fails; 3, with nothing run, on a machine without CUDA unless
``--device cpu`` asks for the CPU smoke run):

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
   setting matters on this device;
4. **the preflight**: this machine's environment signature (what bit-exact
   recomputation depends on) and whether deterministic mode can be set up
   (``sdcguard.agent.determinism.require_deterministic``);
5. **SDPA attention recomputed**: the flash backend's forward and backward
   twice, bit for bit, with deterministic mode on (judged) and with
   ``warn_only`` (reported: torch keeps the non-deterministic kernel);
6. **the guard on the device**: a world-1 NCCL guard run (gloo on the CPU)
   with a NaN injected into one step's input and a forced magnitude trigger,
   under ``torch.cuda.set_sync_debug_mode("warn")``: the NaN step must not
   update, the jump must fire the trigger, clean steps must update, and a
   clean step must wait on the host at most once (syncs counted per step).

Then it times, on the device, a copy into a preallocated buffer, a sum, the
fingerprint and the non-finite flag, and prints the ratios to the copy; and
the GPT example's whole training step (world 1) as plain DDP, under the
guard's defaults, and with product checks on, each as a ratio to plain DDP
(``--step-rounds``).

With ``--device cpu`` it runs everything on the CPU with small sizes (the
sync count is a GPU's only), which is how the tests keep it working. It is
one short script (a few minutes on a GPU) so that a session lent one can run
it at once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import device_kernels
from benchmarks.bench_fingerprint import _counts, _label, _median_seconds
from benchmarks.device_kernels import sample
from sdcguard.agent import fingerprint as fp
from sdcguard.agent import replay
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.determinism import DeterminismUnavailable, environment_signature, require_deterministic
from sdcguard.agent.nonfinite import nonfinite_flag
from sdcguard.agent.publisher import PublishOutcome
from sdcguard.agent.testing.train import JobShape, SyntheticData, TinyGPT, loss_fn

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
SIZES = [0, 1, 1023, 1025, 3 * fp.BLOCK + 7, (1 << 20) + 13]


def check_fingerprints(device: torch.device) -> list[str]:
    """Problems found comparing device and CPU fingerprints (empty: PASS)."""
    problems = []
    for dtype in DTYPES:
        for n in SIZES:
            t = sample(dtype, n, seed=n)
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
        base = sample(dtype, 100_003, seed=1)
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
    replay.seed_micro_batch(0, step, 0, next(module.parameters()).device)
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


NO_CUDA_EXIT = 3
"""The exit status when no CUDA device is here and ``--device`` did not ask for another: nothing was checked."""


@dataclass
class Table:
    """The one table the script prints: a row per check (PASS, FAIL or INFO) and its detail."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, name: str, problems: list[str] | None, detail: str = "") -> None:
        """A judged row (``problems`` empty: PASS) or, with ``problems=None``, an INFO row."""
        status = "INFO" if problems is None else ("FAIL" if problems else "PASS")
        self.rows.append((name, status, "; ".join(problems[:5]) if problems else detail))

    @property
    def failed(self) -> bool:
        """Whether any judged row failed."""
        return any(status == "FAIL" for _, status, _ in self.rows)

    def print(self) -> None:
        width = max(len(name) for name, _, _ in self.rows)
        for name, status, detail in self.rows:
            print(f"{status:<4}  {name:<{width}}  {detail}")


def preflight(device: torch.device, table: Table) -> None:
    """The environment signature of this machine and whether deterministic mode can be set up here."""
    signature = environment_signature(device)
    table.add("environment signature", None, ", ".join(f"{k}={v}" for k, v in sorted(signature.items())))
    try:
        require_deterministic(device)
        table.add("deterministic mode can be set up (not warn_only)", [],
                  f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG') or '(not needed)'}")
    except DeterminismUnavailable as exc:
        table.add("deterministic mode can be set up (not warn_only)", [str(exc)])


def _attention_bits(device: torch.device, repeats: int) -> list[list[str]]:
    """``repeats`` forward and backward passes of causal SDPA (flash on CUDA) on one input: their fingerprints."""
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(4, 8, 256, 64, generator=g).to(device, dtype) for _ in range(3))
    grad = torch.randn(4, 8, 256, 64, generator=g).to(device, dtype)
    backend: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    runs = []
    for _ in range(repeats):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        with backend:
            out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        out.backward(grad)
        grads = [x.grad for x in (qq, kk, vv) if x.grad is not None]
        runs.append([fp.to_hex(fp.fingerprint(t)) for t in (out.detach(), *grads)])
    return runs


def check_attention(device: torch.device, table: Table, repeats: int = 4) -> None:
    """SDPA (flash on CUDA) recomputed: judged with deterministic mode on, reported with warn_only."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        for warn_only in (False, True):
            torch.use_deterministic_algorithms(True, warn_only=warn_only)
            name = f"SDPA {'flash ' if device.type == 'cuda' else ''}attention recomputed bit for bit" + (
                " (warn_only)" if warn_only else "")
            try:
                runs = _attention_bits(device, repeats)
            except RuntimeError as exc:
                table.add(name, None if warn_only else [f"raised: {str(exc).splitlines()[0][:200]}"])
                continue
            differing = [i for i, run in enumerate(runs[1:], 1) if run != runs[0]]
            problems = [f"runs {differing} of {repeats} differ from run 0 (output, dq, dk, dv)"] if differing else []
            table.add(name, None if warn_only else problems,
                      "; ".join(problems) if warn_only and problems else f"{repeats} runs identical")
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


class _Silent:
    """A publisher that publishes nowhere (the run is the bench's own)."""

    def publish(self, alarm: Any) -> PublishOutcome:
        return PublishOutcome(delivered=True, event_id="bench")

    def republish_spooled(self, **_: Any) -> dict[str, PublishOutcome]:
        return {}


@contextlib.contextmanager
def _counting_syncs(device: torch.device) -> Iterator[list[str]]:
    """The host synchronisations of the block, as torch's warnings report them (CUDA only; empty elsewhere)."""
    seen: list[str] = []
    if device.type != "cuda":
        yield seen
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen += [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]


def check_guard(device: torch.device, table: Table, steps: int = 16) -> None:
    """A world-1 guard run on ``device``: an injected NaN, a forced trigger, clean steps; syncs per clean step."""
    from sdcguard.agent.guard import SDCGuard

    nan_step, jump_step = 4, steps - 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def batch_for(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Made on the device by the device's generator: a host-to-device copy would be the loader's sync.
        g = torch.Generator(device=device).manual_seed(step * 1000 + rank)
        x = torch.randn(16, 32, generator=g, device=device)
        y = torch.randn(16, 1, generator=g, device=device)
        if step == nan_step:
            x[0, 0] = math.nan
        if step == jump_step:
            x, y = x * 1e3, y * 1e3
        return x, y

    def mse(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(module(x), y)

    scratch = tempfile.mkdtemp(prefix="sdcguard-bench-")
    config = GuardConfig(on_alarm="continue", trigger_warmup=4, trigger_window=8, fingerprint_every=5,
                         checkpoint_prefix=os.path.join(scratch, "checkpoints"), spool_dir=os.path.join(scratch, "spool"))
    try:
        guard = SDCGuard(ddp, optimizer, loss_fn=mse, batch_for=batch_for, config=config,
                         publisher=_Silent(), injection=None)  # type: ignore[arg-type]
        results, syncs = [], []
        for step in range(steps):
            with _counting_syncs(device) as seen:
                results.append(guard.step(step))
            syncs.append(len(seen))
    except Exception as exc:  # any failure here is the finding: the guard does not run on this device
        table.add("the guard runs on the device (world 1)", [f"{type(exc).__name__}: {str(exc)[:300]}"])
        return
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    nan, jump = results[nan_step], results[jump_step]
    clean = [r for s, r in enumerate(results) if s not in (nan_step, jump_step)]
    table.add("the guard runs on the device (world 1)",
              [f"step {r.step}: {r.alarm.message if r.alarm else 'no update'}" for r in clean
               if r.alarm is not None or not r.updated])
    table.add("an injected NaN: no update", [] if not nan.updated else [f"step {nan_step} updated"],
              "alarm" if nan.alarm is not None else "data fault" if nan.data_fault else "skipped")
    table.add("a forced jump fires the magnitude trigger", [] if jump.triggered else [f"step {jump_step}: silent"])
    if device.type != "cuda":
        table.add("host syncs per clean step", None, "not counted on the CPU")
        return
    clean_syncs = [n for s, n in enumerate(syncs) if s not in (nan_step, jump_step)
                   and s % config.fingerprint_every]
    table.add("host syncs per clean step (at most 1)", [f"up to {max(clean_syncs)}"] if max(clean_syncs) > 1 else [],
              f"per step: {syncs}")


STEP_ROWS = ("plain DDP", "guard, defaults", "guard, defaults + product checks")
TRITON_ROW = "guard, defaults + products, triton"
"""A fourth row on a GPU where Triton runs: the third with ``SDCGUARD_FINGERPRINT_KERNEL=triton`` (the guard's
checks and the product checks by the fused kernels). Should it raise, it is dropped with the error printed, and
the other rows stand."""


def _fused_row(device: torch.device) -> bool:
    """Whether ``time_steps`` adds ``TRITON_ROW``: on a GPU where Triton runs."""
    return device.type == "cuda" and device_kernels.triton_unavailable(device) is None


@contextlib.contextmanager
def _kernel_setting(value: str | None) -> Iterator[None]:
    """``SDCGUARD_FINGERPRINT_KERNEL`` set to ``value`` inside (None: as it is); restored after."""
    from sdcguard.agent import native

    before = os.environ.get(native.KERNEL_ENV)
    if value is not None:
        os.environ[native.KERNEL_ENV] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(native.KERNEL_ENV, None)
        else:
            os.environ[native.KERNEL_ENV] = before


def time_steps(device: torch.device, rounds: int) -> dict[str, float]:
    """The whole training step of the GPT example (examples/gpt_model.py, its default sizes) on ``device``, as
    plain DDP, under the guard's defaults, and under the defaults with product checks on; a world of one.

    Each row has its own model, optimizer and guard; the rows take turns a step at a time, in an order rotated
    every round (round 0 warms up and is dropped), each step timed to the device's completion. On a GPU where
    Triton runs, a fourth row (``TRITON_ROW``) runs the product checks' row with the fused kernels. Returns the
    median seconds per step by row (``print_steps`` prints them). A world of one has no other node, so no ring audit or confirmation runs:
    this is the every-step checks' cost (and the weight check at its cadence), not the audit's."""
    from benchmarks.bench_products import _gpt_example
    from sdcguard.agent.guard import SDCGuard

    example = _gpt_example()
    cfg = example.GPTConfig()
    sampler = example.TokenSampler(cfg, micro_batch=8, accum=1, device=device)
    scratch = tempfile.mkdtemp(prefix="sdcguard-bench-")
    steps: dict[str, Callable[[int], object]] = {}
    rows: tuple[str, ...] = (*STEP_ROWS, TRITON_ROW) if _fused_row(device) else STEP_ROWS
    try:
        for row in rows:
            torch.manual_seed(0)
            ddp = torch.nn.parallel.DistributedDataParallel(
                example.GPT(cfg).to(device), device_ids=[device.index] if device.type == "cuda" else None)
            optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
            if row == "plain DDP":
                def plain(n: int, ddp: Any = ddp, optimizer: Any = optimizer) -> None:
                    optimizer.zero_grad(set_to_none=True)
                    example.loss_fn(ddp, sampler(n, 0)[0]).backward()
                    optimizer.step()
                steps[row] = plain
                continue
            where = os.path.join(scratch, str(len(steps)))
            config = GuardConfig(on_alarm="continue", product_checks=row != "guard, defaults",
                                 checkpoint_prefix=os.path.join(where, "checkpoints"),
                                 spool_dir=os.path.join(where, "spool"))
            guard = SDCGuard(ddp, optimizer, loss_fn=example.loss_fn, batch_for=lambda n, r: sampler(n, r)[0],
                             config=config, publisher=_Silent(), injection=None)  # type: ignore[arg-type]
            steps[row] = guard.step
        times: dict[str, list[float]] = {row: [] for row in rows}
        for round_ in range(rounds + 1):
            shift = round_ % len(rows)
            for row in rows[shift:] + rows[:shift]:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                try:
                    with _kernel_setting("triton" if row == TRITON_ROW else None):
                        steps[row](round_)
                except Exception as exc:
                    if row != TRITON_ROW:
                        raise
                    print(f"bench device: the row {row!r} failed and was dropped: {type(exc).__name__}: {exc}")
                    rows = STEP_ROWS
                    del times[row]
                    continue
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if round_:
                    times[row].append(time.perf_counter() - started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {row: sorted(t)[len(t) // 2] for row, t in times.items()}


def print_steps(medians: dict[str, float], device: torch.device, rounds: int) -> None:
    """``time_steps``' table: each row's median step and its ratio to plain DDP."""
    print(f"the GPT example's whole step on {device}, world 1, median of {rounds} interleaved rounds:")
    print(f"{'row':<34} {'ms':>9} {'x plain':>8}")
    for row in medians:
        print(f"{row:<34} {medians[row] * 1e3:9.2f} {medians[row] / medians['plain DDP']:8.3f}")


def run_kernels(device: torch.device, table: Table) -> None:
    """The fused kernels' timings and bit checks (``benchmarks/device_kernels.py``)."""
    device_kernels.run(table, device)


def main(argv: list[str]) -> int:
    """Run the checks and the timings; 0 when every check passed, 1 otherwise, 3 without CUDA (nothing run)."""
    has_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="bench device", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="default: cuda:0; cpu runs the CPU smoke run")
    parser.add_argument("--elements", type=_counts, default=None, help="tensor sizes to time, e.g. 64M,256M")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="micro-batches recomputed per setting")
    parser.add_argument("--step-rounds", type=int, default=None,
                        help="interleaved rounds of the whole-step timing (default 30 on a GPU, 2 on the CPU)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or (args.step_rounds is not None and args.step_rounds < 1):
        parser.error("--repeats, --steps and --step-rounds must be at least 1")
    if args.device is None and not has_gpu:
        print(f"bench device: no CUDA device on this machine (torch {torch.__version__}, CUDA "
              f"{torch.version.cuda or 'not built in'}): the GPU checks did not run. "
              f"`--device cpu` runs the CPU smoke run.")
        return NO_CUDA_EXIT
    name = args.device or "cuda:0"
    if name.startswith("cuda"):
        # Before CUDA starts in this process: cuBLAS reads its workspace setting at first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", replay.CUBLAS_WORKSPACE)
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        parser.error(f"--device {name}: not usable here: {exc}")
    elements = args.elements or ([64 << 20, 256 << 20] if device.type == "cuda" else [1 << 20])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        print(f"device: {device} (no accelerator: a smoke run), torch {torch.__version__}")
    started = time.monotonic()
    table = Table()
    started_group = not dist.is_initialized()
    if started_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    try:
        table.add("fingerprints equal on the device and the CPU", check_fingerprints(device))
        table.add("the non-finite flag agrees with the CPU", check_nonfinite(device))
        table.add("recomputation is bit-identical (deterministic algorithms on)",
                  check_recompute(device, args.steps, True))
        informational = check_recompute(device, args.steps, False)
        table.add("recomputation with deterministic algorithms off", None,
                  "bit-identical" if not informational else "; ".join(informational[:3]))
        preflight(device, table)
        check_attention(device, table)
        check_guard(device, table)
        run_kernels(device, table)
        step_rounds = args.step_rounds or (30 if device.type == "cuda" else 2)
        step_times = time_steps(device, step_rounds)
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags[2], flags[3]
        if started_group:
            dist.destroy_process_group()
    table.print()
    time_on(device, elements, args.repeats)
    print_steps(step_times, device, step_rounds)
    print(f"checks took {time.monotonic() - started:.0f} s")
    return 1 if table.failed else 0
