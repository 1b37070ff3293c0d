"""What the product checks cost: a plain training step against the same step with every product checked.

One gloo rank, one intra-op thread (the CPU ratio needs no all-reduce: the
checks add no collective of their own). Per model, four rows take turns,
one step each, in an order rotated every round (benchmarks/interleave.py):

- plain: forward, backward and AdamW's update, nothing else;
- interception alone: the same inside ``ProductChecks.watching()`` with the
  checks' work taken out (the sites' naming hooks and the products'
  interception below autograd: what seeing the products costs before any
  checksum is computed);
- passes skipped: the checks whole, but with the compiled kernel's product
  calls (``sdc_row_verdict``, ``sdc_dual_matvec``) returning at once: the
  checks' Python per product without the passes over the operands (where
  the compiled kernel is not loaded this row checks in torch's form and
  says so);
- product checks: the same inside ``ProductChecks.watching()``.

The last line splits the checks' cost three ways: seeing the products (the
second row), the checks' Python (third minus second), the compiled passes
(fourth minus third).

The models: the agent bench's 24 M-parameter TinyGPT (``--dim 576
--layers 6``, batch 8 x 64 tokens) and the GPT example (examples/gpt_model.py,
its default sizes). Prints the table and each row's ratio to plain, the
median and the lower quartile. ``./dev bench products [-- --rounds R]``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks.interleave import launch_timed, ratio_table, timed_rounds, write_timings
from sdcguard.agent.native_products import Products
from sdcguard.agent.product_checks import ProductChecks
from sdcguard.agent.testing.train import SyntheticData, TinyGPT, init_process_group, shutdown
from sdcguard.agent.testing.train import loss_fn as tiny_loss

ROWS = ("plain", "interception alone", "passes skipped", "product checks")
WHOLE_SET_ARGS = ["--rounds", "6", "--models", "gpt-example"]


def _gpt_example() -> ModuleType:
    """examples/gpt_model.py (the examples are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "gpt_model.py"
    spec = importlib.util.spec_from_file_location("sdcguard_example_gpt_model", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _model(name: str, dim: int, layers: int) -> tuple[torch.nn.Module, Callable[..., torch.Tensor],
                                                       Callable[[int], Any]]:
    """(model, loss_fn, batch of step) for ``name``, seeded."""
    torch.manual_seed(0)
    if name == "tinygpt-24m":
        from sdcguard.agent.testing.train import JobShape

        shape = JobShape(vocab=256, dim=dim, layers=layers, seq=64, batch=8, heads=8)
        data = SyntheticData(shape, torch.device("cpu"))
        model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout)
        return model, tiny_loss, lambda step: data(step, 0)
    example = _gpt_example()
    cfg = example.GPTConfig()
    sampler = example.TokenSampler(cfg, micro_batch=8, accum=1, device=torch.device("cpu"))
    return example.GPT(cfg), example.loss_fn, lambda step: sampler(step, 0)[0]


def _rank_main(out: str, name: str, dim: int, layers: int, rounds: int, _spool: str) -> None:
    init_process_group()
    torch.set_num_threads(1)
    runners: dict[str, Callable[[int], object]] = {}
    for row in ROWS:
        model, loss_fn, batch_of = _model(name, dim, layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        checks = None if row == "plain" else _PassesSkipped(model) if row == "passes skipped" else ProductChecks(model)
        if checks is not None and row == "interception alone":
            checks.on_product = _seen  # type: ignore[method-assign,assignment]
            if checks._compiled is not None:
                checks._compiled.enabled(checks.enabled, checking=False, python_form=not checks._named_in_cpp)
        runners[row] = _stepper(model, optimizer, loss_fn, batch_of, row, checks)
    write_timings(out, timed_rounds(runners, rounds))
    shutdown()


def _seen(*_product: Any) -> None:
    """A product seen and not checked."""


class _PassesSkipped(ProductChecks):
    """Product checks whose compiled product calls return at once (the checks' own Python, no pass over an
    operand; every product then passes)."""

    def _refresh(self) -> None:
        super()._refresh()
        if self._kernel is not None:
            self._kernel = _SkippedKernel(self._kernel)

    def _use_kernel(self, compiled: Products, kernel: Any) -> None:
        # The compiled path calls the passes through their addresses: these answer at once.
        skipped = [ctypes.cast(getattr(compiled.lib, name), ctypes.c_void_p).value
                   for name in ("sdc_px_skipped_verdict", "sdc_px_skipped_dual")]
        compiled.use_kernel(kernel, verdict=skipped[0], dual=skipped[1])


class _SkippedKernel:
    """The compiled kernel (its ``lib`` too) with ``sdc_row_verdict`` and ``sdc_dual_matvec`` answering 0 (done) at
    once; every other function is the real library's."""

    def __init__(self, kernel: Any) -> None:
        self.isa = kernel.isa
        self.lib = self
        self._lib = kernel.lib
        self.sdc_row_verdict = self.sdc_dual_matvec = _done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)


def _done(*_args: Any) -> int:
    return 0


def _stepper(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
             batch_of: Callable[[int], Any], row: str, checks: ProductChecks | None) -> Callable[[int], None]:
    def step(n: int) -> None:
        batch = batch_of(n)
        optimizer.zero_grad(set_to_none=True)
        if checks is not None:
            checks.begin_step()
            with checks.watching():
                loss_fn(model, batch).backward()
            # What the step's collective would carry (read here only to keep the benchmark honest about it).
            checks.summary()
        else:
            loss_fn(model, batch).backward()
        optimizer.step()
    return step


def main(argv: list[str]) -> int:
    """Run the benchmark and print one table per model; 0, or 1 when the rank failed."""
    parser = argparse.ArgumentParser(prog="bench products")
    parser.add_argument("--rounds", type=int, default=40,
                        help="steps per row (after one warm-up round); 100 resolve a change of a point on the GPT "
                             "example")
    parser.add_argument("--models", default="tinygpt-24m,gpt-example", help="comma-separated: tinygpt-24m, gpt-example")
    parser.add_argument("--dim", type=int, default=576, help="the TinyGPT's width (576: 24.3 M parameters)")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := set(models) - {"tinygpt-24m", "gpt-example"}:
        parser.error(f"--models: unknown {sorted(unknown)}")
    if args.rounds < 4:
        parser.error("--rounds: at least 4 (quartiles need data)")
    status = 0
    for name in models:
        measured = launch_timed(1, _rank_main, (name, args.dim, args.layers, args.rounds), name)
        if measured is None:
            status = 1
            continue
        model, _, _ = _model(name, args.dim, args.layers)
        params = sum(p.numel() for p in model.parameters())
        print(f"\n{name} ({params / 1e6:.2f} M parameters), 1 rank, 1 thread, {args.rounds} rounds of 1 step "
              "(forward, backward, AdamW)")
        stats = ratio_table(measured, ROWS, "plain", header="row", width=20)
        for kind, what in (("wall", "wall time"), ("cpu", "CPU time (read this one on a busy machine)")):
            plain = stats[kind]["plain"].median
            median = {row: q.median / plain - 1 for row, q in stats[kind].items()}
            seen, python, total = median["interception alone"], median["passes skipped"], median["product checks"]
            print(f"{what}: product checks {100 * total:+.1f} % of a plain step: seeing the products "
                  f"{100 * seen:+.1f} %, the checks' Python {100 * (python - seen):+.1f} %, the compiled passes "
                  f"{100 * (total - python):+.1f} %")
        if _native_kernel_missing():
            print("(the compiled kernel is not loaded here: the checks ran in torch's form, and the passes-skipped "
                  "row is the whole check)")
        print("target: within 5 % on top of the guard's defaults")
    return status


def _native_kernel_missing() -> bool:
    from sdcguard.agent import native

    return native.kernel() is None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
