"""The figures that answer the GPU targets, each a ratio measured in the same run: an 8 B-shaped layer's forward
and backward with and without the product checks, a ~1 B-parameter world-1 step under the guard against the same
step plain, and the launches and host synchronisations of a guarded step.

Plain rows run with no interception installed: the product checks register
their kernels for torch's product operators while any checks exist
(``sdcguard.agent.product_checks``), so a plain row timed beside them would
pay for the interception it is meant to be measured without. Each row says
whether it ran with the interception installed (``intercepting``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def intercepting() -> bool:
    """Whether the product checks' interception is installed in this process now."""
    from sdcguard.agent import product_checks

    return product_checks._INTERCEPTION._installed > 0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class LayerShape:
    """A decoder layer's sizes (Llama-3-8B's by default) and the tokens of one micro-batch."""

    dim: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    tokens: int = 4096


SMOKE_LAYER = LayerShape(dim=64, heads=4, kv_heads=2, ffn=128, tokens=64)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer shaped as an 8 B model's: grouped-query attention (SDPA, causal) and a SwiGLU MLP."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.shape = shape
        head = shape.dim // shape.heads
        self.norm1, self.norm2 = nn.RMSNorm(shape.dim), nn.RMSNorm(shape.dim)
        self.q = nn.Linear(shape.dim, shape.dim, bias=False)
        self.k = nn.Linear(shape.dim, shape.kv_heads * head, bias=False)
        self.v = nn.Linear(shape.dim, shape.kv_heads * head, bias=False)
        self.o = nn.Linear(shape.dim, shape.dim, bias=False)
        self.gate = nn.Linear(shape.dim, shape.ffn, bias=False)
        self.up = nn.Linear(shape.dim, shape.ffn, bias=False)
        self.down = nn.Linear(shape.ffn, shape.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        s = self.shape
        head, group = d // s.heads, s.heads // s.kv_heads
        h = self.norm1(x)
        q = self.q(h).view(b, t, s.heads, head).transpose(1, 2)
        k = self.k(h).view(b, t, s.kv_heads, head).transpose(1, 2).repeat_interleave(group, dim=1)
        v = self.v(h).view(b, t, s.kv_heads, head).transpose(1, 2).repeat_interleave(group, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (kernel selection, allocator)
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def layer_figures(device: torch.device, shape: LayerShape, repeats: int, triton: bool = False) -> dict[str, Any]:
    """The decoder layer's forward and backward under bf16 autocast (``shape.tokens`` tokens): plain before any
    checks exist, with the product checks (and, with ``triton``, with them in the fused kernels), and plain again
    after they are removed. Returns the medians (ms), the ratios of the checked passes to the mean of the two
    plain ones, the products checked per pass and the checks' verdict (failing sites: 0 on a clean pass)."""
    from sdcguard.agent.product_checks import ProductChecks

    torch.manual_seed(0)
    with torch.device(device):
        layer = DecoderLayer(shape)
    x = torch.randn(1, shape.tokens, shape.dim, device=device)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = layer(x)
        out.float().square().mean().backward()

    before = intercepting()
    plain_ms = _median_ms(step, device, repeats)
    checks = ProductChecks(layer, device=device)

    def checked() -> None:
        checks.begin_step()
        with checks.watching():
            step()

    fused: dict[str, Any] = {}
    try:
        checked_ms = _median_ms(checked, device, repeats)
        failing = int(checks.summary()[1])
        products = checks.checked
        if triton:
            try:  # the fused form's failure is its own figure's, not the torch form's
                with kernel_setting("triton"):
                    fused["checked_triton_ms"] = _median_ms(checked, device, repeats)
                    fused["failing_sites_triton"] = int(checks.summary()[1])
            except Exception as exc:
                fused["triton_error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
    finally:
        checks.remove()
    again_ms = _median_ms(step, device, repeats)
    plain = (plain_ms + again_ms) / 2
    if "checked_triton_ms" in fused:
        fused["x_plain_triton"] = fused["checked_triton_ms"] / plain
    return {"tokens": shape.tokens, "dim": shape.dim, "ffn": shape.ffn, "params": sum(p.numel() for p in layer.parameters()),
            "plain_ms": plain_ms, "checked_ms": checked_ms, "plain_again_ms": again_ms,
            "x_plain": checked_ms / plain, "products_checked": products, "failing_sites": failing,
            "plain_intercepting": before or intercepting(), **fused}


@dataclass(frozen=True)
class StepShape:
    """The GPT example's sizes for a whole-step row, its micro-batch and whether it runs under bf16 autocast."""

    vocab: int = 32000
    seq: int = 1024
    dim: int = 2048
    heads: int = 16
    layers: int = 16
    micro_batch: int = 2
    autocast: bool = True


ONE_B = StepShape()
"""About 0.87 B parameters (12·layers·dim² + (vocab + seq)·dim): the "~1 B world-1 step" of the targets."""
EXAMPLE = StepShape(vocab=256, seq=64, dim=128, heads=4, layers=4, micro_batch=8, autocast=False)
"""The GPT example's default sizes (examples/gpt_model.py): the launches and host syncs, the smoke run."""


class _Silent:
    """A publisher that publishes nowhere (the run is the bench's own)."""

    def publish(self, alarm: Any) -> Any:
        from sdcguard.agent.publisher import PublishOutcome

        return PublishOutcome(delivered=True, event_id="bench")

    def republish_spooled(self, **_: Any) -> dict[str, Any]:
        return {}


@contextlib.contextmanager
def kernel_setting(value: str | None) -> Iterator[None]:
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


class RandomTokens:
    """``sampler(step, rank)``: one micro-batch of uniformly random tokens drawn from a generator seeded by
    ``(step, rank)``, as the GPT example's ``TokenSampler`` returns them (a list of one (inputs, targets)), so
    any rank can rebuild any other's. The example's Markov corpus would need a vocab-squared table (4 GB at
    the 1 B row's 32,000 tokens) and seconds to build; timing needs no learnable data."""

    def __init__(self, shape: StepShape, device: torch.device) -> None:
        self.shape, self.device = shape, device

    def __call__(self, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(step * 65_537 + rank)
        tokens = torch.randint(self.shape.vocab, (self.shape.micro_batch, self.shape.seq + 1), generator=g)
        tokens = tokens.to(self.device)
        return [(tokens[:, :-1], tokens[:, 1:])]


class StepRows:
    """Whole training steps of the GPT example at ``shape`` on ``device`` (world 1), one model per row.

    ``plain(row)`` is DDP with AdamW and nothing else; ``guarded(row, **config)`` the same under an
    ``SDCGuard`` with ``GuardConfig(**config)`` (``kernel="triton"`` runs it with the fused kernels). ``time``
    takes the rows in turns, a step at a time, the order rotated every round (round 0 warms up and is dropped)."""

    def __init__(self, device: torch.device, shape: StepShape) -> None:
        from benchmarks.bench_products import _gpt_example

        self.device, self.shape = device, shape
        self.example = _gpt_example()
        self.cfg = self.example.GPTConfig(vocab=shape.vocab, seq=shape.seq, dim=shape.dim, heads=shape.heads,
                                          layers=shape.layers, dropout=0.0)
        self.sampler = RandomTokens(shape, device)
        self.scratch = tempfile.mkdtemp(prefix="sdcguard-bench-")
        self.steps: dict[str, Callable[[int], object]] = {}
        self.kernels: dict[str, str | None] = {}
        self.guards: dict[str, Any] = {}
        self.params = 0

    def _model(self) -> tuple[nn.parallel.DistributedDataParallel, torch.optim.Optimizer]:
        torch.manual_seed(0)
        with torch.device(self.device):  # made on the device: 0.87 B parameters initialised on the host took seconds
            model = self.example.GPT(self.cfg)
        self.params = sum(p.numel() for p in model.parameters())
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def plain(self, row: str) -> None:
        ddp, optimizer = self._model()
        autocast = self.shape.autocast

        def step(n: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = self.example.loss_fn(ddp, self.sampler(n, 0)[0])
            loss.backward()
            optimizer.step()

        self.steps[row], self.kernels[row] = step, None

    def guarded(self, row: str, kernel: str | None = None, **config: Any) -> Any:
        from sdcguard.agent.config import GuardConfig
        from sdcguard.agent.guard import SDCGuard

        ddp, optimizer = self._model()
        where = os.path.join(self.scratch, str(len(self.steps)))
        settings = GuardConfig(on_alarm="continue", checkpoint_prefix=os.path.join(where, "checkpoints"),
                               spool_dir=os.path.join(where, "spool"),
                               autocast_dtype="bfloat16" if self.shape.autocast else None, **config)
        with kernel_setting(kernel):
            guard = SDCGuard(ddp, optimizer, loss_fn=self.example.loss_fn,
                             batch_for=lambda n, r: self.sampler(n, r)[0], config=settings,
                             publisher=_Silent(), injection=None)  # type: ignore[arg-type]
        self.steps[row], self.kernels[row], self.guards[row] = guard.step, kernel, guard
        return guard

    def drop(self, row: str) -> None:
        """Free a row's model (the 1 B rows do not all fit at once)."""
        self.steps.pop(row, None)
        self.kernels.pop(row, None)
        guard = self.guards.pop(row, None)
        if guard is not None and guard.products is not None:
            guard.products.remove()  # the interception goes with the last checks
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self, row: str, n: int) -> None:
        with kernel_setting(self.kernels[row]):
            self.steps[row](n)

    def time(self, rows: list[str], rounds: int, first: int = 0) -> dict[str, dict[str, Any]]:
        """Median ms per step of each of ``rows`` over ``rounds`` interleaved rounds (after one warm-up round),
        with whether the interception was installed while each ran."""
        times: dict[str, list[float]] = {row: [] for row in rows}
        flags: dict[str, bool] = {row: False for row in rows}
        for round_ in range(rounds + 1):
            shift = round_ % len(rows)
            for row in rows[shift:] + rows[:shift]:
                synchronize(self.device)
                started = time.perf_counter()
                self.run(row, first + round_)
                synchronize(self.device)
                flags[row] |= intercepting()
                if round_:
                    times[row].append((time.perf_counter() - started) * 1e3)
        # The median is the every-step cost; the mean adds the weight check's (every ``fingerprint_every`` steps).
        return {row: {"ms": statistics.median(t), "mean_ms": statistics.fmean(t), "rounds": len(t),
                      "intercepting": flags[row]} for row, t in times.items()}

    def close(self) -> None:
        """Drop every row (their product checks removed) and the scratch folder."""
        for row in list(self.steps):
            self.drop(row)
        shutil.rmtree(self.scratch, ignore_errors=True)


def step_figures(device: torch.device, shape: StepShape, rounds: int, triton: bool) -> dict[str, Any]:
    """The whole step at ``shape``: plain against the guard's defaults (phase 1: no product checks exist yet, so
    plain runs outside any interception), then the defaults against the defaults with product checks (and, with
    ``triton``, with the fused kernels) in phase 2. Ratios are taken within a phase; products over plain is the
    product of the two."""
    rows = StepRows(device, shape)
    try:
        rows.plain("plain DDP")
        rows.guarded("guard, defaults")
        first = rows.time(["plain DDP", "guard, defaults"], rounds)
        rows.drop("plain DDP")
        second_rows = ["guard, defaults", "guard, defaults + product checks"]
        rows.guarded("guard, defaults + product checks", product_checks=True)
        failed: dict[str, str] = {}
        if triton:
            row = "guard, defaults + products, triton"
            try:  # its own failure (a compile error, say) is its row's, not the other rows'
                rows.guarded(row, kernel="triton", product_checks=True)
                rows.run(row, 0)
                second_rows.append(row)
            except Exception as exc:
                failed[row] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
                rows.drop(row)
        second = rows.time(second_rows, rounds, first=rounds + 1)
    finally:
        rows.close()
    defaults = first["guard, defaults"]["ms"] / first["plain DDP"]["ms"]
    out: dict[str, Any] = {"params": rows.params, "shape": shape.__dict__, "rounds": rounds,
                           "phase1": first, "phase2": second, "defaults_x_plain": defaults, "failed": failed}
    for row in second_rows[1:]:
        over_defaults = second[row]["ms"] / second["guard, defaults"]["ms"]
        out[f"{row} x defaults"] = over_defaults
        out[f"{row} x plain"] = over_defaults * defaults
    return out


LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel")


@contextlib.contextmanager
def counting_syncs(device: torch.device) -> Iterator[list[str]]:
    """The host synchronisations of the block, as torch's sync debug mode reports them (CUDA only)."""
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


def launches_and_syncs(device: torch.device, shape: StepShape, steps: int, triton: bool, warm: int = 3,
                       ) -> dict[str, Any]:
    """Per guarded step of the GPT example at ``shape`` (after ``warm`` warm-up steps; none of them a weight-check
    step): kernel launches (the profiler's launch calls, Triton's included) and host synchronisations (torch's
    sync debug mode), for the defaults, with clipping, with product checks and, with ``triton``, with the fused
    kernels and product checks."""
    configs: list[tuple[str, str | None, dict[str, Any]]] = [
        ("defaults", None, {}), ("defaults + clipping", None, {"max_grad_norm": 1.0}),
        ("defaults + product checks", None, {"product_checks": True})]
    if triton:
        configs.append(("defaults + product checks, triton", "triton", {"product_checks": True}))
    out: dict[str, Any] = {}
    for name, kernel, config in configs:
        rows = StepRows(device, shape)
        try:  # a configuration that fails is its own row's failure ({"error": ...}), not the others'
            out[name] = _count(rows, name, kernel, config, device, steps, warm)
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"}
        finally:
            rows.close()
    return out


def _count(rows: StepRows, name: str, kernel: str | None, config: dict[str, Any], device: torch.device,
           steps: int, warm: int) -> dict[str, Any]:
    """One configuration's launches and syncs per step (``launches_and_syncs``)."""
    from torch.profiler import ProfilerActivity, profile

    rows.guarded(name, kernel=kernel, fingerprint_every=1000, **config)
    for n in range(1, 1 + warm):
        rows.run(name, n)
    synchronize(device)
    counted = range(1 + warm, 1 + warm + steps)
    if device.type != "cuda":  # nothing to count (and the profiler costs seconds on the CPU): the path alone
        for n in counted:
            rows.run(name, n)
        return {"launches_per_step": 0.0, "kernels_per_step": 0.0, "syncs_per_step": 0.0, "syncs": [], "steps": steps}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        # The profiler's own waits (at its start and end) and the one below stay outside the count.
        with counting_syncs(device) as syncs:
            for n in counted:
                rows.run(name, n)
        synchronize(device)
    events = prof.events()
    launches = sum(1 for e in events if e.name in LAUNCH_NAMES)
    # The device's side too: kernels that ran (copies and fills apart), whichever API launched them.
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.name.lower().startswith(("memcpy", "memset")))
    return {"launches_per_step": launches / steps, "kernels_per_step": kernels / steps,
            "syncs_per_step": len(syncs) / steps, "syncs": sorted(set(syncs))[:5], "steps": steps}
