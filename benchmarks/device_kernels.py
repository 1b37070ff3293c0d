"""The fused Triton kernels on a GPU: their bits against torch's and the CPU's, and their speed against the
device's own copy bandwidth (``./dev bench device`` calls ``run``; the GPU-kernels issue).

Checks (each judged): for every dtype the agent fingerprints, sizes either side
of a block and a chunk and a strided view, the Triton fingerprint equals the
torch implementation's on the device and the CPU's (C kernel) bit for bit; the
bucket passes give the CPU's sum of squares (``sdcguard.agent.grad_norm``), the same
flag and, before the all-reduce, torch's CPU division bit for bit (a NaN only
has to stay a NaN), for clean buckets and ones with a NaN or an infinity.

Timings (CUDA events, medians): on bucket-sized (25 MB) and 256 MB tensors of
fp32 and bf16, a device-to-device copy (read + write, the reference), then each
kernel and the torch code it replaces, as GB/s of the bytes the work must move
(a read for the fingerprint and the pass after the all-reduce; a read and a
write for the pass before it) and as a fraction of the copy's GB/s. The
target is at least 0.8x; nothing here asserts it.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent import grad_norm, native

MEGABYTES = (25, 256)
"""Tensor sizes timed: a DDP bucket (25 MB, DDP's default) and a large one."""
TIMED_DTYPES = (torch.float32, torch.bfloat16)
CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                  torch.int8, torch.uint8, torch.bool)
CHECKED_SIZES = (0, 1, 1023, 1025, 4095, 4097, 5 * 4096 + 1037, (1 << 20) + 13)
TARGET = 0.8
"""The kernels' target as a fraction of the copy bandwidth (a target, reported, not asserted)."""
PRODUCT_SHAPES = ((33, 129), (300, 1031))
"""(rows, accumulation length) of the product checks' kernels' checks: either side of a program's tile, and larger."""
PRODUCT_OPERAND = (8192, 4096)
"""The operand the product checks' pass is timed on: 8,192 tokens into a 4,096-wide layer, beside the product
it checks (with a 4,096 x 4,096 weight)."""
WEIGHT_GRADIENT = (16384, 4096)
"""(tokens, width) of the weight gradient ``dW = dYᵀ X`` whose check is timed: few rows (the width), a long
accumulation (the tokens), the shape that leaves a one-program-per-row-block check short of the device."""
PRODUCT_SPLIT = 3
"""The parts the device checks also split every product's check into (whatever the device would choose)."""


class Rows(Protocol):
    """What ``run`` adds its findings to: ``benchmarks.bench_device.Table``'s ``add``."""

    def add(self, name: str, problems: list[str] | None, detail: str = "") -> None: ...


@dataclass(frozen=True)
class Timing:
    """One timed kernel on one tensor."""

    kernel: str
    dtype: str
    megabytes: int
    ms: float
    moved_bytes: int
    """Bytes the work must move (reads plus writes)."""
    copy_gbps: float
    """The device's copy bandwidth on the same tensor (read + write bytes per second), GB/s."""
    first_ms: float = math.nan
    """The first call alone (a Triton kernel's compile included), apart from the steady state in ``ms``."""

    @property
    def gbps(self) -> float:
        return self.moved_bytes / (self.ms * 1e-3) / 1e9 if self.ms > 0 else math.inf

    @property
    def x_copy(self) -> float:
        """This kernel's GB/s over the copy's: 1.0 is as fast as memory allows."""
        return self.gbps / self.copy_gbps if self.copy_gbps > 0 else math.nan


@dataclass
class Report:
    """Everything ``measure`` found: judged checks, timings, and whether any check failed."""

    checks: list[tuple[str, list[str]]] = field(default_factory=list)
    timings: list[Timing] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(problems for _, problems in self.checks)


def differs(label: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """A problem line when ``got`` and ``want`` differ in shape, dtype or any bit (compared on the CPU; a NaN
    only has to meet a NaN), else None."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{label}: {got.dtype} {list(got.shape)} vs {want.dtype} {list(want.shape)}"
    if got.is_floating_point():
        nan = torch.isnan(got)
        if not torch.equal(nan, torch.isnan(want)):
            return f"{label}: NaN in different places"
        got, want = fp.bit_view(got)[~nan], fp.bit_view(want)[~nan]
    if torch.equal(got, want):
        return None
    where = (got != want).reshape(-1).nonzero()
    return f"{label}: {where.numel()} of {got.numel()} values differ (first at {int(where[0])})"


def format_timings(timings: Sequence[Timing]) -> str:
    """The timings as a fixed-width table, one line per kernel and tensor, the copy's GB/s alongside."""
    lines = [f"{'kernel':<40} {'dtype':<9} {'MB':>5} {'ms':>8} {'GB/s':>8} {'copy GB/s':>9} {'x copy':>7} "
             f"{'first ms':>9}"]
    for t in timings:
        lines.append(f"{t.kernel:<40} {t.dtype:<9} {t.megabytes:>5} {t.ms:8.3f} {t.gbps:8.1f} "
                     f"{t.copy_gbps:9.1f} {t.x_copy:7.2f} {t.first_ms:9.1f}")
    return "\n".join(lines)


def sample(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` seeded values of ``dtype`` spread over many binades, all finite (both device scripts check bits on them)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), (n,), generator=g, dtype=dtype)
    finfo = torch.finfo(dtype)
    limit = min(finfo.max, torch.finfo(torch.float32).max)  # finite in the dtype: only NaN/inf cases flag
    t = (torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))).clamp(-limit, limit)
    t = t.to(dtype)
    for k, value in enumerate((-0.0, finfo.smallest_normal / 8, -finfo.max)):  # a negative zero, a subnormal
        if k < n:
            t[(k * 7919) % n] = value
    return t


def cpu_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The CPU's fingerprint of ``t`` (copied to the CPU): the C kernel when it is in use, else torch's, whatever
    ``SDCGUARD_FINGERPRINT_KERNEL`` sends elsewhere."""
    t = t.cpu()
    kernel = native.kernel()
    return fp.fingerprint_native(t, kernel) if kernel is not None else fp.fingerprint_torch(t)


def check_fingerprints(device: torch.device, sizes: Sequence[int] = CHECKED_SIZES) -> list[str]:
    """Triton, torch (on ``device``) and the CPU's fingerprint of every checked dtype and size, a strided view
    included: problem lines (empty: all equal)."""
    from sdcguard.agent.kernels import triton_fingerprint as tf

    problems = []
    for dtype in CHECKED_DTYPES:
        for n in sizes:
            t = sample(dtype, n, seed=n)
            views = [t, t[::3]] if n > 3 else [t]
            for view in views:
                here = view.to(device)
                cpu = cpu_fingerprint(view)
                for name, lanes in (("triton", tf.fingerprint(here)), ("torch", fp.fingerprint_torch(here))):
                    problem = differs(f"{dtype} n={view.numel()} {name} vs cpu", lanes, cpu)
                    if problem:
                        problems.append(problem)
    rows = [sample(torch.float32, n, seed=n).to(device) for n in (7, 5000, 1 << 16)]
    problem = differs("fingerprint_many vs cpu", tf.fingerprint_many(rows),
                      torch.stack([cpu_fingerprint(r) for r in rows]))
    if problem:
        problems.append(problem)
    return problems


def check_bucket_passes(device: torch.device, sizes: Sequence[int] = CHECKED_SIZES) -> list[str]:
    """The bucket passes on ``device`` against the CPU's definitions (sum of squares, flag, torch's division,
    fingerprint), clean and with a NaN or an infinity: problem lines (empty: all equal)."""
    from sdcguard.agent.kernels import triton_fingerprint as tf

    problems = []
    for dtype in tf.BUCKET_DTYPES:
        for n in (s for s in sizes if s):
            clean = sample(dtype, n, seed=n + 1)
            cases = [("clean", clean)]
            for bad in (math.nan, math.inf):
                probe = clean.clone()
                probe[n // 2] = bad
                cases.append((f"{bad} at {n // 2}", probe))
            for label, t in cases:
                name = f"{dtype} n={n} {label}"
                total = torch.tensor(grad_norm.sum_of_squares(t), dtype=torch.float64)
                flag = torch.tensor(not math.isfinite(float(total)))
                after = tf.reduced_pass(t.to(device))
                buffer = t.to(device, copy=True)
                before = tf.local_pass(buffer, 3)
                assert after.fingerprint is not None
                for problem in (differs(f"{name} sum of squares after", after.sum_of_squares, total),
                                differs(f"{name} sum of squares before", before.sum_of_squares, total),
                                differs(f"{name} flag after", after.nonfinite, flag),
                                differs(f"{name} flag before", before.nonfinite, flag),
                                differs(f"{name} fingerprint", after.fingerprint, cpu_fingerprint(t)),
                                differs(f"{name} division by 3", buffer, t.clone().div_(3))):
                    if problem:
                        problems.append(problem)
    return problems


def check_product_pass(device: torch.device, shapes: Sequence[tuple[int, int]] = PRODUCT_SHAPES) -> list[str]:
    """The product checks' fused kernels (``sdcguard.agent.kernels.triton_products``) on ``device``: the pass
    over an operand (``a @ s``, ``|a| @ t``) within fp32 rounding of its fp64 definition for every dtype it
    reads, by rows and by columns; and the whole check of a product the device itself computed (``Linear``
    with a bias, through the device's own GEMM) within the checks' bound when clean and outside it with one
    element corrupted: what a false alarm or a miss on this GPU would look like."""
    from sdcguard.agent.kernels import triton_products
    from sdcguard.agent.product_checks import Arithmetic

    problems = []
    for dtype in triton_products.READS:
        for r, p in shapes:
            for layout in ("rows", "columns"):
                g = torch.Generator().manual_seed(r * 7 + p)
                a = (torch.randn(r, p, generator=g) * torch.logspace(-2, 2, p)).to(dtype)
                if layout == "columns":
                    a = a.mT.contiguous().mT  # the same values stored by columns (kept by .to(device))
                s, t = torch.randn(p, generator=g), torch.rand(p, generator=g)
                e, b = triton_products.dual_matvec(a.to(device), s.to(device), t.to(device))
                exact = a.double()
                allowed = (p + 1) * 2.0 ** -24 / (1 - (p + 1) * 2.0 ** -24)  # gamma_p: any order of additions
                off_e = (e.cpu().double() - exact @ s.double()).abs() > allowed * (exact.abs() @ s.double().abs())
                exact_b = exact.abs() @ t.double()
                off_b = (b.cpu().double() - exact_b).abs() > allowed * exact_b
                if bool(off_e.any()) or bool(off_b.any()):
                    problems.append(f"{dtype} {r}x{p} by {layout}: {int(off_e.sum())} + {int(off_b.sum())} rows "
                                    "outside fp32 rounding of the definition")
            g = torch.Generator().manual_seed(r + p)
            x = torch.randn(r, p, generator=g).to(dtype).to(device)
            weight = (torch.randn(p, p // 2 + 1, generator=g) / math.sqrt(p)).to(dtype).to(device)
            bias = torch.randn(p // 2 + 1, generator=g).to(dtype).to(device)
            y = torch.nn.functional.linear(x, weight.t(), bias)  # the device's GEMM (addmm), as a model runs it
            arithmetic = Arithmetic.of(dtype, dtype, device, conv=False)
            if arithmetic is None:
                problems.append(f"{dtype}: the checks have no bound for it")
                continue
            coefficient = arithmetic.coefficient(p + 2, y.shape[-1])
            absolute = arithmetic.absolute(p, y.shape[-1])
            s, t = weight.float().sum(-1), weight.float().abs().sum(-1)
            for corrupted in (False, True):
                if corrupted:
                    y[r // 2, 1] += 1e4  # far above any rounding of these sizes, and finite in every dtype
                for split in (1, PRODUCT_SPLIT):  # in one launch, and split along the length (two)
                    rows = torch.empty(2, r, device=device)
                    triton_products.row_check(x, s, t, y, bias, 1.0, 1.0, rows, 0, split=split)
                    over = (rows[0] > coefficient * rows[1] + absolute).cpu()
                    want = [r // 2] if corrupted else []
                    if over.nonzero().flatten().tolist() != want:
                        problems.append(f"{dtype} {r}x{p} linear{' corrupted' if corrupted else ''} in {split} "
                                        f"part(s): rows over the bound {over.nonzero().flatten().tolist()[:5]}, "
                                        f"expected {want}")
    return problems


def time_product_pass(device: torch.device, repeats: int = 10,
                      operand: tuple[int, int] = PRODUCT_OPERAND) -> str:
    """The product checks' whole check of one product on a GPU (an ``operand``-shaped input into a square weight),
    fused (one Triton launch: ``row_check``) and in torch's form (a widened copy, an ``|a|`` copy, two
    matrix-vector products, the row sums of the result and the difference), beside the product itself; as ms,
    GB/s of one read of the input and the result, and a fraction of the product's time. A table (CUDA only)."""
    from sdcguard.agent.kernels import triton_products

    r, p = operand
    lines = [f"the product checks' check of one {r} x {p} by {p} x {p} product, beside the product:",
             f"{'row':<40} {'dtype':<9} {'ms':>8} {'GB/s':>8} {'x product':>9}"]
    for dtype in TIMED_DTYPES:
        name = str(dtype).removeprefix("torch.")
        a = torch.randn(r, p, device=device).to(dtype)
        weight = torch.randn(p, p, device=device).to(dtype)
        c = a @ weight.t()
        s = weight.float().sum(-1)
        t = weight.float().abs().sum(-1)
        rows = torch.empty(2, r, device=device)

        def product(a: torch.Tensor = a, weight: torch.Tensor = weight) -> None:
            torch.matmul(a, weight.t())

        def fused(a: torch.Tensor = a, s: torch.Tensor = s, t: torch.Tensor = t, c: torch.Tensor = c,
                  rows: torch.Tensor = rows) -> None:
            triton_products.row_check(a, s, t, c, None, 1.0, 1.0, rows, 0)

        moved = (a.numel() + c.numel()) * a.element_size()
        product_ms = _cuda_ms(product, repeats)
        chosen = triton_products.split_for(-(-r // triton_products.BLOCK_R), p, triton_products.wanted_programs(device))
        for row, ms in (("the product (a @ W^T)", product_ms),
                        (f"triton check (row_check, {chosen} part(s))", _cuda_ms(fused, repeats)),
                        ("torch form of the check", _cuda_ms(functools.partial(_torch_form, a, s, t, c), repeats))):
            lines.append(f"{row:<40} {name:<9} {ms:8.3f} {moved / (ms * 1e-3) / 1e9:8.1f} {ms / product_ms:9.3f}")
        del a, weight, c
    return "\n".join(lines)


def time_weight_gradient_check(device: torch.device, repeats: int = 10,
                               shape: tuple[int, int] = WEIGHT_GRADIENT) -> str:
    """The check of a weight gradient's product ``dW = dYᵀ X`` (``shape``: tokens, width; ``dYᵀ`` the transposed
    view autograd hands over): split along the tokens as the device chooses (``triton_products.split_for``), in
    one launch, and in torch's form, beside the product itself. Says whether the split pays on this device."""
    from sdcguard.agent.kernels import triton_products

    tokens, width = shape
    lines = [f"the check of a weight gradient dW = dY^T X ({width} x {tokens} by {tokens} x {width}), beside it:",
             f"{'row':<40} {'dtype':<9} {'ms':>8} {'GB/s':>8} {'x product':>9}"]
    for dtype in TIMED_DTYPES:
        name = str(dtype).removeprefix("torch.")
        gradient = torch.randn(tokens, width, device=device).to(dtype)
        x = torch.randn(tokens, width, device=device).to(dtype)
        a = gradient.mT
        c = a @ x
        s = x.float().sum(-1)
        t = x.float().abs().sum(-1)
        rows = torch.empty(2, width, device=device)
        chosen = triton_products.split_for(-(-width // triton_products.BLOCK_R), tokens,
                                           triton_products.wanted_programs(device))

        def product(a: torch.Tensor = a, x: torch.Tensor = x) -> None:
            torch.matmul(a, x)

        def fused(split: int, a: torch.Tensor = a, s: torch.Tensor = s, t: torch.Tensor = t, c: torch.Tensor = c,
                  rows: torch.Tensor = rows) -> None:
            triton_products.row_check(a, s, t, c, None, 1.0, 1.0, rows, 0, split=split)

        moved = (a.numel() + c.numel()) * a.element_size()
        product_ms = _cuda_ms(product, repeats)
        for row, ms in (("the product (dY^T @ X)", product_ms),
                        (f"triton check, {chosen} part(s) (chosen)", _cuda_ms(functools.partial(fused, chosen),
                                                                            repeats)),
                        ("triton check, one launch", _cuda_ms(functools.partial(fused, 1), repeats)),
                        ("torch form of the check", _cuda_ms(functools.partial(_torch_form, a, s, t, c), repeats))):
            lines.append(f"{row:<40} {name:<9} {ms:8.3f} {moved / (ms * 1e-3) / 1e9:8.1f} {ms / product_ms:9.3f}")
        del gradient, x, a, c
    return "\n".join(lines)


def _torch_form(a: torch.Tensor, s: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> None:
    """A product's check as torch runs it on a GPU: a widened copy, an ``|a|`` copy, two matrix-vector products,
    the row sums of the result and the difference."""
    wide = a.float()
    expected = torch.mv(wide, s)
    torch.mv(wide.abs(), t)
    torch.sub(c.sum(-1, dtype=torch.float32), expected).abs_()


L2_FLUSH_BYTES = 256 << 20
"""Written between timed calls where ``triton.testing.do_bench`` is not at hand: more than any L2 (50 MB on an
H100, 60 MB on an H200), so a 25 MB tensor is read from memory, not from the cache it was left in."""


def _cuda_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` on the current stream, the L2 cache flushed before every timed call:
    ``triton.testing.do_bench`` (which flushes it) where Triton is installed, else CUDA events around ``fn``
    with a 256 MB buffer written between calls. One untimed call first."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        # Its warm-up and repetitions are milliseconds; about ``repeats`` calls of a 1 ms kernel, 5 at least.
        return float(do_bench(fn, warmup=max(5, repeats), rep=max(25, 5 * repeats), return_mode="median"))
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    fn()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def first_call_ms(fn: Callable[[], object]) -> float:
    """The wall time of one call to the device's completion, in ms: for a kernel not yet compiled, its compile."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def _cases(t: torch.Tensor, buffer: torch.Tensor, pieces: list[torch.Tensor]) -> list[tuple[str, Callable[[], object], int]]:
    """(kernel, call, bytes the work must move) for one tensor ``t``, its scratch ``buffer`` and ``t`` cut
    into ``pieces``: each Triton kernel, then the torch code it replaces."""
    from sdcguard.agent.kernels import triton_fingerprint as tf
    from sdcguard.agent.nonfinite import nonfinite_flag

    nbytes = t.numel() * t.element_size()

    def torch_before() -> None:
        nonfinite_flag(buffer)
        grad_norm.bucket_norm(buffer)
        buffer.div_(1)

    def torch_after() -> None:
        nonfinite_flag(t)
        grad_norm.bucket_norm(t)
        fp.fingerprint_torch(t)

    strided = t[::2]  # handed over as it is: the kernels read strided views in place
    strided_bytes = strided.numel() * strided.element_size()
    return [
        ("triton fingerprint", lambda: tf.fingerprint(t), nbytes),
        ("torch fingerprint", lambda: fp.fingerprint_torch(t), nbytes),
        ("triton fingerprint, strided [::2]", lambda: tf.fingerprint(strided), strided_bytes),
        ("torch fingerprint, strided [::2]", lambda: fp.fingerprint_torch(strided), strided_bytes),
        ("triton before all-reduce (divides)", lambda: tf.local_pass(buffer, 1), 2 * nbytes),
        ("torch before all-reduce (divides)", torch_before, 2 * nbytes),
        ("triton after all-reduce", lambda: tf.reduced_pass(t), nbytes),
        ("torch after all-reduce", torch_after, nbytes),
        (f"triton many ({len(pieces)} tensors)", lambda: tf.fingerprint_many(pieces), nbytes),
        (f"torch many ({len(pieces)} tensors)", lambda: fp.fingerprint_many(pieces), nbytes),
    ]


def time_kernels(device: torch.device, repeats: int = 10, megabytes: Sequence[int] = MEGABYTES) -> list[Timing]:
    """The copy, each kernel and the torch code it replaces, on ``megabytes``-sized fp32 and bf16 tensors, a
    strided view among them (CUDA only: ``_cuda_ms``, the L2 flushed between calls; each first call timed apart).
    ``x copy`` is always the kernel's GB/s of the bytes its work must move over the copy's GB/s of read plus
    written bytes: 1.0 moves bytes as fast as the copy does."""
    timings: list[Timing] = []
    for dtype in TIMED_DTYPES:
        name = str(dtype).removeprefix("torch.")
        for mb in megabytes:
            size = torch.empty((), dtype=dtype).element_size()
            n = mb * 10**6 // size
            t = torch.randn(n, device=device).to(dtype)
            buffer = t.clone()
            nbytes = n * size
            copy = functools.partial(buffer.copy_, t)
            first = first_call_ms(copy)
            copy_ms = _cuda_ms(copy, repeats)
            copy_gbps = 2 * nbytes / (copy_ms * 1e-3) / 1e9
            timings.append(Timing("copy (read + write: the reference)", name, mb, copy_ms, 2 * nbytes, copy_gbps,
                                  first))
            # Weights and optimizer state: many tensors of one dtype.
            for kernel, fn, moved in _cases(t, buffer, list(t.split(-(-n // 64)))):
                first = first_call_ms(fn)
                timings.append(Timing(kernel, name, mb, _cuda_ms(fn, repeats), moved, copy_gbps, first))
            del t, buffer
    return timings


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None when they can."""
    from sdcguard.agent.kernels import triton_fingerprint as tf

    return tf.unavailable_reason(device)


def measure(device: torch.device, repeats: int = 10, sizes: Sequence[int] = CHECKED_SIZES,
            product_shapes: Sequence[tuple[int, int]] = PRODUCT_SHAPES) -> Report:
    """The checks (tensors of ``sizes`` elements, products of ``product_shapes``), then on a GPU the timings, on
    ``device``. Without Triton,
    or off a GPU without Triton's interpreter, a single failed check saying why (nothing runs in its place)."""
    from sdcguard.agent.kernels import triton_fingerprint as tf

    report = Report()
    reason = tf.unavailable_reason(device)
    if reason is not None:
        report.checks.append(("the Triton kernels can run", [reason]))
        return report
    report.checks.append(("triton, torch and cpu fingerprints equal bit for bit", check_fingerprints(device, sizes)))
    report.checks.append(("triton bucket passes have the cpu's bits", check_bucket_passes(device, sizes)))
    report.checks.append(("triton product checks: rounding, clean GEMM silent, corruption caught",
                          check_product_pass(device, product_shapes)))
    if device.type == "cuda":
        report.timings = time_kernels(device, repeats)
    return report


def run(table: Rows, device: torch.device, repeats: int = 10, figures: dict[str, object] | None = None) -> bool:
    """The device run's part for these kernels: adds the checks to ``table`` (a row each; on a CUDA device without
    Triton a failed row saying why), then times them: one INFO row per timed kernel and tensor (its GB/s and
    ``x copy``), the timing tables printed, and every timing put into ``figures`` (``kernels``,
    ``product_pass``, ``weight_gradient_check``). Returns whether a check failed. Off a GPU one SKIP row: the
    unit tests check these kernels in Triton's interpreter."""
    if device.type != "cuda":
        skip = getattr(table, "skip", None)
        reason = "GPU only (tests/unit/test_fingerprint_triton.py checks them in Triton's interpreter)"
        if skip is not None:
            skip("GPU kernels (Triton)", reason)
        else:
            table.add("GPU kernels (Triton)", None, f"not run: {reason}")
        return False
    figures = {} if figures is None else figures
    report = measure(device, repeats)
    for name, problems in report.checks:
        table.add(name, problems)
    if report.timings:
        figures["kernels"] = [{**t.__dict__, "gbps": t.gbps, "x_copy": t.x_copy} for t in report.timings]
        for t in report.timings:
            table.add(f"{t.kernel}, {t.dtype}, {t.megabytes} MB", None,
                      f"{t.gbps:.0f} GB/s = {t.x_copy:.2f}x copy (target {TARGET}x); first call {t.first_ms:.0f} ms")
        print(f"GPU kernels against the copy bandwidth (target {TARGET}x, not asserted):")
        print(format_timings(report.timings), flush=True)
    return report.failed


def run_product_timings(device: torch.device, repeats: int, figures: dict[str, object]) -> None:
    """The product checks' kernels timed beside the products they check (CUDA only): the tables printed and kept
    in ``figures``."""
    for key, timed in (("product_pass", time_product_pass), ("weight_gradient_check", time_weight_gradient_check)):
        text = timed(device, repeats)
        figures[key] = text.splitlines()
        print(text, flush=True)
