"""The agent on a GPU: every check a lent GPU must make and every figure the targets ask for, in one run.

On a lent GPU: ``benchmarks/device/run.sh`` (offline: the image's python3, the
repository on ``PYTHONPATH``, the missing packages carried as wheels; see
docs/gpu.md for the exact call). Here: ``./dev bench device -- --smoke`` or
``./dev device smoke`` (the same script, on the CPU).

The run is a list of sections (``SECTIONS``), each isolated: what a section
raises is a FAIL row naming it and the sections after it still run; a
section that needs CUDA is a SKIP row elsewhere, with the reason; every
section runs with deterministic mode and cuDNN's settings restored after it
(the preflight turns deterministic mode on). Rows are printed and flushed as
they come and streamed to ``rows.jsonl``; ``table.txt`` and ``device.json``
(every row and figure) are written to ``--out`` (``$OUT`` where set) at the
end, by the watchdog (``--budget-s``, 450 s by default on a GPU) if the run
outlives its budget.

Judged (PASS or FAIL; the exit status is 1 if any fails, 3 with nothing run
on a machine without CUDA unless ``--smoke`` or ``--device cpu`` asks for the
CPU): fingerprints on the device equal the CPU's bit for bit; the non-finite
flag agrees with the CPU's; the reference job's micro-batch recomputes bit for
bit with deterministic algorithms on; deterministic mode can be set up; SDPA
(flash) recomputes bit for bit; the magnitude trigger runs under deterministic
mode and decides as on the CPU; a world-1 guard run (a NaN, a forced jump,
clean steps at most one host sync each); the Triton kernels' bits against
torch's and the CPU's; the product checks silent on a clean 8 B-shaped layer;
the plain whole-step row timed outside any interception.

Figures (INFO; ``device.json`` holds them all): each kernel and the torch code
it replaces in GB/s against the device's copy bandwidth, the L2 flushed
between calls, 25 and 256 MB, fp32 and bf16, a strided view as it is, the
first call (compile) apart; the product checks' kernels beside their
products; launches and host syncs per guarded step (defaults, clipping,
product checks, Triton); an 8 B-shaped layer's forward and backward (bf16
autocast, 4,096 tokens) with and without product checks; a ~1 B-parameter
world-1 step under the defaults against the same step plain, and with product
checks (and the fused kernels) against the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import device_kernels
from benchmarks.device import figures
from benchmarks.device.report import FIGURES_FILE, ROWS_FILE, TABLE_FILE, Report, Watchdog
from benchmarks.device_kernels import sample
from sdcguard.agent import fingerprint as fp
from sdcguard.agent import replay
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.determinism import DeterminismUnavailable, environment_signature, require_deterministic
from sdcguard.agent.nonfinite import nonfinite_flag
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


NO_CUDA_EXIT = 3
"""The exit status when no CUDA device is here and ``--device`` did not ask for another: nothing was checked."""


def preflight(device: torch.device, table: Report) -> None:
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


def check_attention(device: torch.device, table: Report, repeats: int = 4) -> None:
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


def check_guard(device: torch.device, table: Report, steps: int = 16) -> None:
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
                         publisher=figures._Silent(), injection=None)  # type: ignore[arg-type]
        results, syncs = [], []
        for step in range(steps):
            with figures.counting_syncs(device) as seen:
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
        table.skip("host syncs per clean step (at most 1)", "counted on CUDA only (torch's sync debug mode)")
        return
    clean_syncs = [n for s, n in enumerate(syncs) if s not in (nan_step, jump_step)
                   and s % config.fingerprint_every]
    table.add("host syncs per clean step (at most 1)", [f"up to {max(clean_syncs)}"] if max(clean_syncs) > 1 else [],
              f"per step: {syncs}", {"per_step": syncs})


def check_trigger(device: torch.device, table: Report) -> None:
    """The magnitude trigger's test and the warm-up's cross-rank test on ``device`` under deterministic mode (not
    warn_only), as the guard runs them for 2+ ranks: they must run, and decide as on the CPU."""
    from sdcguard.agent.trigger import MagnitudeTrigger, cross_rank_outliers

    torch.use_deterministic_algorithms(True)
    decisions: dict[str, list[bool]] = {}
    for where in (torch.device("cpu"), device):
        trigger = MagnitudeTrigger(ratio=4.0, window=8, warmup=3, device=where)
        fired = []
        for value in (1.0, 1.1, math.nan, 0.9, 1.05, 50.0, 1.0, 0.01):
            fired.append(trigger.fires(torch.tensor(value, device=where), torch.tensor(2.0, device=where)))
            trigger.observe()
        values = torch.tensor([[1.0, 1.0], [1.1, 0.9], [5e3, 1.0], [math.nan, 1e-5]], device=where)
        outliers = cross_rank_outliers(values)
        decisions[where.type] = [bool(f) for f in fired] + outliers.tolist()
    problems = [] if decisions["cpu"] == decisions[device.type] else [
        f"decisions differ: cpu {decisions['cpu']} vs {device} {decisions[device.type]}"]
    table.add("the magnitude trigger runs under deterministic mode", problems,
              f"decisions as on the CPU: {decisions['cpu']}")


@contextlib.contextmanager
def _flags_restored() -> Iterator[None]:
    """Deterministic mode and cuDNN's settings as they were, whatever the block set (the preflight turns
    deterministic mode on; the rows after it must run as a job's own code would)."""
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags[2], flags[3]


@dataclass
class Run:
    """What every section gets: the device, the options, the report and the watchdog (time left)."""

    device: torch.device
    args: argparse.Namespace
    report: Report
    watchdog: Watchdog

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def triton(self) -> bool:
        """Whether the fused kernels can run here (a GPU with Triton)."""
        return self.cuda and device_kernels.triton_unavailable(self.device) is None


def _environment(run: Run) -> None:
    report, device = run.report, run.device
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda or "not built in",
                "python": sys.version.split()[0]}
    for name in ("triton", "pydantic"):
        try:
            versions[name] = getattr(__import__(name), "__version__", "?")
        except ImportError as exc:
            versions[name] = f"missing ({exc})"
    if run.cuda:
        props = torch.cuda.get_device_properties(device)
        versions.update(device=props.name, multiprocessors=str(props.multi_processor_count),
                        memory_gib=f"{props.total_memory / 2**30:.1f}",
                        l2_mb=f"{getattr(props, 'L2_cache_size', 0) / 1e6:.0f}")
    report.meta.update(versions)
    report.add("versions", None, ", ".join(f"{k}={v}" for k, v in versions.items()), versions)


def _preflight(run: Run) -> None:
    preflight(run.device, run.report)


def _fingerprints(run: Run) -> None:
    run.report.add("fingerprints equal on the device and the CPU", check_fingerprints(run.device))


def _nonfinite(run: Run) -> None:
    run.report.add("the non-finite flag agrees with the CPU", check_nonfinite(run.device))


def _recompute(run: Run) -> None:
    run.report.add("recomputation is bit-identical (deterministic algorithms on)",
                   check_recompute(run.device, run.args.steps, True))
    informational = check_recompute(run.device, run.args.steps, False)
    run.report.add("recomputation with deterministic algorithms off", None,
                   "bit-identical" if not informational else "; ".join(informational[:3]))


def _attention(run: Run) -> None:
    check_attention(run.device, run.report)


def _trigger(run: Run) -> None:
    check_trigger(run.device, run.report)


def _guard(run: Run) -> None:
    check_guard(run.device, run.report)


def _kernels(run: Run) -> None:
    device_kernels.run(run.report, run.device, run.args.repeats, run.report.figures.setdefault("kernels", {}))


def _product_kernels(run: Run) -> None:
    device_kernels.run_product_timings(run.device, run.args.repeats, run.report.figures.setdefault("products", {}))
    run.report.add("the product checks' kernels timed beside their products", None, "tables printed above")


def _layer(run: Run) -> None:
    shape = figures.LayerShape() if run.cuda else figures.SMOKE_LAYER
    found = figures.layer_figures(run.device, shape, repeats=run.args.repeats, triton=run.triton)
    run.report.figures["layer"] = found
    name = f"{'an 8 B' if run.cuda else 'a tiny'} layer's forward + backward ({shape.tokens} tokens, bf16 autocast)"
    run.report.add(f"{name}: product checks silent on a clean pass",
                   [] if found["failing_sites"] == 0 else [f"{found['failing_sites']} site(s) failed"])
    run.report.add(f"{name}: product checks' cost", None,
                   f"{found['checked_ms']:.2f} ms against {found['plain_ms']:.2f} / {found['plain_again_ms']:.2f} ms "
                   f"plain = {found['x_plain']:.3f}x ({found['products_checked']} products; target <= 1.05x)", found)
    if "triton_error" in found:
        run.report.add(f"{name}: product checks in the fused kernels", [f"raised {found['triton_error']}"])
    elif "x_plain_triton" in found:
        run.report.add(f"{name}: product checks in the fused kernels", [] if found["failing_sites_triton"] == 0
                       else [f"{found['failing_sites_triton']} site(s) failed on a clean pass"],
                       f"{found['checked_triton_ms']:.2f} ms = {found['x_plain_triton']:.3f}x plain (target <= 1.05x)")


def _step(run: Run) -> None:
    shape = figures.ONE_B if run.cuda else figures.EXAMPLE
    rounds = run.args.step_rounds or (20 if run.cuda else 1)
    found = figures.step_figures(run.device, shape, rounds, triton=run.triton)
    run.report.figures["step"] = found
    label = f"a {found['params'] / 1e9:.2f} B" if run.cuda else "the GPT example's"
    plain = found["phase1"]["plain DDP"]
    run.report.add(f"{label} world-1 step: plain outside any interception",
                   ["the plain row ran with the product checks' interception installed"] if plain["intercepting"]
                   else [], f"{plain['ms']:.2f} ms")
    run.report.add(f"{label} world-1 step: defaults", None,
                   f"{found['defaults_x_plain']:.3f}x plain (target <= 1.03x)", {"x": found["defaults_x_plain"]})
    for row, error in found["failed"].items():
        run.report.add(f"{label} world-1 step: {row.removeprefix('guard, ')}", [f"raised {error}"])
    for key, value in found.items():
        if key.endswith(" x plain"):
            row = key.removesuffix(" x plain")
            run.report.add(f"{label} world-1 step: {row.removeprefix('guard, ')}", None,
                           f"{found[row + ' x defaults']:.3f}x defaults, {value:.3f}x plain", {"x_plain": value})


def _launches(run: Run) -> None:
    steps = 3 if run.cuda else 1
    found = figures.launches_and_syncs(run.device, figures.EXAMPLE, steps, triton=run.triton, warm=3 if run.cuda else 1)
    run.report.figures["launches"] = found
    for name, row in found.items():
        if "error" in row:
            run.report.add(f"launches and host syncs per step: {name}", [f"raised {row['error']}"])
            continue
        if not run.cuda:
            run.report.skip(f"launches and host syncs per step: {name}",
                            "counted on CUDA only (the profiler's launches, torch's sync debug mode); the path ran")
            continue
        run.report.add(f"launches and host syncs per step: {name}", None,
                       f"{row['launches_per_step']:.0f} launches ({row['kernels_per_step']:.0f} kernels ran), "
                       f"{row['syncs_per_step']:.1f} syncs", row)


@dataclass(frozen=True)
class Section:
    """A part of the run: ``run`` adds its rows; ``cuda`` (a reason) where it needs a GPU; ``seconds`` what it is
    expected to take on a GPU (it is skipped when less time is left)."""

    name: str
    run: Callable[[Run], None]
    cuda: str | None = None
    seconds: float = 10


SECTIONS = (
    Section("environment", _environment, seconds=1),
    Section("preflight", _preflight, seconds=5),
    Section("fingerprints", _fingerprints, seconds=20),
    Section("nonfinite", _nonfinite, seconds=5),
    Section("recompute", _recompute, seconds=15),
    Section("attention", _attention, seconds=5),
    Section("trigger", _trigger, seconds=2),
    Section("guard", _guard, seconds=15),
    Section("kernels", _kernels, cuda="the Triton kernels are checked and timed on a GPU only "
            "(tests/unit/test_fingerprint_triton.py checks them in Triton's interpreter)", seconds=120),
    Section("product_kernels", _product_kernels, cuda="timed on a GPU only", seconds=30),
    Section("launches", _launches, seconds=30),
    Section("layer", _layer, seconds=30),
    Section("step", _step, seconds=90),
)
"""In order of what the run must not miss: the judged checks first, the costliest figures last."""


def run_section(run: Run, section: Section, broken: set[str]) -> None:
    """One section, isolated: whatever it raises is a FAIL row naming it, and the rows after it still run. A
    section that needs CUDA is a SKIP row elsewhere; one that no longer fits the time left, a SKIP row."""
    report = run.report
    report.section = section.name
    if section.cuda and not run.cuda:
        report.skip(section.name, section.cuda)
        return
    left = run.watchdog.remaining()
    if run.cuda and left < section.seconds:
        report.skip(section.name, f"out of time ({left:.0f} s left, it needs about {section.seconds:.0f} s)")
        return
    started = time.monotonic()
    try:
        with _flags_restored():
            if section.name in broken:
                raise RuntimeError(f"--fail-section {section.name}: this section was asked to fail")
            section.run(run)
    except Exception as exc:  # the isolation: a section's failure is its row, never the end of the run
        report.fail(f"section {section.name}", exc)
        traceback.print_exc()
    finally:
        report.sections[section.name] = time.monotonic() - started
        if run.cuda:
            torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    """Run every section; 0 when every judged row passed, 1 otherwise, 3 without CUDA (nothing run)."""
    has_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="bench device", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="default: cuda:0; cpu runs the CPU smoke run")
    parser.add_argument("--smoke", action="store_true", help="the CPU smoke run (--device cpu, tiny sizes)")
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help=f"folder for {TABLE_FILE}, {FIGURES_FILE} and {ROWS_FILE} (default: $OUT if set)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the watchdog: write what there is and stop after this many seconds (default 450 on "
                             "a GPU, none on the CPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="micro-batches recomputed per setting")
    parser.add_argument("--step-rounds", type=int, default=None,
                        help="interleaved rounds of the whole-step timing (default 20 on a GPU, 1 on the CPU)")
    parser.add_argument("--only", default="", help="comma-separated sections to run (default: all: "
                        + ",".join(s.name for s in SECTIONS) + ")")
    parser.add_argument("--fail-section", default="", help=argparse.SUPPRESS)  # the tests' proof of isolation
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or (args.step_rounds is not None and args.step_rounds < 1):
        parser.error("--repeats, --steps and --step-rounds must be at least 1")
    names = {s.name for s in SECTIONS}
    only = {n for n in args.only.split(",") if n}
    if only - names:
        parser.error(f"--only: unknown section(s) {', '.join(sorted(only - names))}; known: {', '.join(sorted(names))}")
    if args.smoke:
        args.device = args.device or "cpu"
    if args.device is None and not has_gpu:
        print(f"bench device: no CUDA device on this machine (torch {torch.__version__}, CUDA "
              f"{torch.version.cuda or 'not built in'}): the GPU checks did not run. "
              f"`--smoke` (or `--device cpu`) runs the CPU smoke run.")
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
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}",
              flush=True)
    else:
        print(f"device: {device} (no accelerator: a smoke run, tiny sizes), torch {torch.__version__}", flush=True)
    report = Report(Path(args.out) if args.out else None)
    report.meta.update(device=str(device), argv=argv)
    budget = args.budget_s if args.budget_s is not None else (450.0 if device.type == "cuda" else math.inf)
    watchdog = Watchdog(report, budget)
    watchdog.start()
    run = Run(device, args, report, watchdog)
    started = time.monotonic()
    started_group = not dist.is_initialized()
    stopped = "crashed"
    try:
        if started_group:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1)
        broken = {n for n in args.fail_section.split(",") if n}
        for section in SECTIONS:
            if not only or section.name in only:
                run_section(run, section, broken)
        stopped = "finished"
    finally:
        watchdog.cancel()
        report.section = ""
        report.meta["seconds"] = time.monotonic() - started
        report.write(stopped)
        if started_group and dist.is_initialized():
            dist.destroy_process_group()
    print(f"the run took {time.monotonic() - started:.0f} s", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
