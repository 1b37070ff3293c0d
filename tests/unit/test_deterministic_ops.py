"""No operator of a guarded step is one that CUDA refuses under ``torch.use_deterministic_algorithms(True)``.

The guard turns deterministic mode on for every job of two or more ranks, and
CUDA then raises for the operators that have no deterministic kernel; the CPU
build raises for none of them, so a CPU run never shows the crash (the
magnitude trigger's ``torch.nanmedian(dim=0)`` ended every guarded GPU job
of two ranks or more at its first step past the warm-up). Here a dispatch mode
sees every aten operator two forked gloo ranks run in guarded steps (clean
steps, ring audits, a confirmation by recomputation after a jump, product
checks and gradient clipping on, the torch forms a GPU runs) and the test
checks them against ``REFUSED_ON_CUDA``: the documented list, kept here as
data with the torch version it was read from, and the operators CUDA's
kernels refuse that the documentation does not name.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.forked import launch_forked

DOCUMENTED_IN = "2.13"
"""The torch version whose ``torch.use_deterministic_algorithms.__doc__`` the documented entries were read from."""


@dataclass(frozen=True)
class Refused:
    """An operator CUDA refuses in deterministic mode: the aten overload packet, the condition on its arguments
    (None: always), and the documentation's line for it (None: refused by the kernel, not documented)."""

    op: str
    doc: str | None
    when: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None


def _floating(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    dtype = kwargs.get("dtype") or (args[2] if len(args) > 2 and isinstance(args[2], torch.dtype) else None)
    dtype = dtype or args[0].dtype
    return dtype.is_floating_point or dtype.is_complex


def _weighted(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return (args[1] if len(args) > 1 else kwargs.get("weights")) is not None


def _prod(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return (args[4] if len(args) > 4 else kwargs.get("reduce")) == "prod"


def _max_mode(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return 2 in args[5:8] or kwargs.get("mode") == 2  # EmbeddingBag's mode: 0 sum, 1 mean, 2 max


def _quantized(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return bool(args[0].is_quantized)


_BACKWARD = "when attempting to differentiate a CUDA tensor"
REFUSED_ON_CUDA: tuple[Refused, ...] = (
    Refused("avg_pool3d_backward", f":class:`torch.nn.AvgPool3d` {_BACKWARD}"),
    Refused("_adaptive_avg_pool2d_backward", f":class:`torch.nn.AdaptiveAvgPool2d` {_BACKWARD}"),
    Refused("_adaptive_avg_pool3d_backward", f":class:`torch.nn.AdaptiveAvgPool3d` {_BACKWARD}"),
    Refused("adaptive_max_pool2d_backward", f":class:`torch.nn.AdaptiveMaxPool2d` {_BACKWARD}"),
    Refused("fractional_max_pool2d_backward", f":class:`torch.nn.FractionalMaxPool2d` {_BACKWARD}"),
    Refused("fractional_max_pool3d_backward", f":class:`torch.nn.FractionalMaxPool3d` {_BACKWARD}"),
    Refused("max_unpool2d", ":class:`torch.nn.MaxUnpool1d`"),
    Refused("max_unpool2d", ":class:`torch.nn.MaxUnpool2d`"),
    Refused("max_unpool3d", ":class:`torch.nn.MaxUnpool3d`"),
    Refused("upsample_linear1d_backward", f":func:`torch.nn.functional.interpolate` {_BACKWARD} and one of the "
            "following modes is used: - ``linear`` - ``bilinear`` - ``bicubic`` - ``trilinear``"),
    Refused("upsample_bilinear2d_backward", None),
    Refused("upsample_bicubic2d_backward", None),
    Refused("upsample_trilinear3d_backward", None),
    Refused("reflection_pad1d_backward", f":class:`torch.nn.ReflectionPad1d` {_BACKWARD}"),
    Refused("reflection_pad2d_backward", f":class:`torch.nn.ReflectionPad2d` {_BACKWARD}"),
    Refused("reflection_pad3d_backward", f":class:`torch.nn.ReflectionPad3d` {_BACKWARD}"),
    # The CUDA kernel that alerts is the 2-d one (atomics); a 1-d NLLLoss (cross-entropy on [N, C]) runs.
    Refused("nll_loss2d_forward", ":class:`torch.nn.NLLLoss` when called on a CUDA tensor"),
    Refused("_ctc_loss_backward", f":class:`torch.nn.CTCLoss` {_BACKWARD}"),
    Refused("_embedding_bag_backward", f":class:`torch.nn.EmbeddingBag` {_BACKWARD} when ``mode='max'``",
            _max_mode),
    Refused("_embedding_bag_dense_backward", None, _max_mode),
    Refused("put_", ":func:`torch.Tensor.put_` when ``accumulate=False``"),
    Refused("put_", ":func:`torch.Tensor.put_` when ``accumulate=True`` and called on a CUDA tensor"),
    Refused("put", None),
    Refused("histc", ":func:`torch.histc` when called on a CUDA tensor"),
    Refused("bincount", ":func:`torch.bincount` when called on a CUDA tensor and ``weights`` tensor is given",
            _weighted),
    Refused("median.dim", ":func:`torch.median` with indices output when called on a CUDA tensor"),
    # Not documented: the same CUDA kernel (median_with_indices_impl, ignore_nan) alerts for nanmedian along a
    # dimension, and kthvalue's alerts too ("kthvalue CUDA").
    Refused("nanmedian.dim", None),
    Refused("kthvalue", None),
    Refused("grid_sampler_2d_backward", f":func:`torch.nn.functional.grid_sample` {_BACKWARD}"),
    Refused("grid_sampler_3d_backward", None),
    Refused("cumsum", ":func:`torch.cumsum` when called on a CUDA tensor when dtype is floating point or complex",
            _floating),
    Refused("cumsum_", None, _floating),
    Refused("scatter_reduce", ":func:`torch.Tensor.scatter_reduce` when ``reduce='prod'`` and called on CUDA tensor",
            _prod),
    Refused("scatter_reduce_", None, _prod),
    Refused("resize_", ":func:`torch.Tensor.resize_` when called with a quantized tensor", _quantized),
)


def refusals(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Refused]:
    """The entries of ``REFUSED_ON_CUDA`` that an aten call matches (by packet, or packet.overload)."""
    packet, overload = func._overloadpacket.__name__, func._overloadname
    return [r for r in REFUSED_ON_CUDA if r.op in (packet, f"{packet}.{overload}")
            and (r.when is None or r.when(args, kwargs))]


class RefusedOps(TorchDispatchMode):
    """Records every aten operator run under it, and each call that CUDA would refuse in deterministic mode.

    ``following_callbacks()`` extends it to the callbacks of ``torch.Future.then`` (a DDP communication hook's
    pass after the all-reduce runs in the process group's thread, where a dispatch mode is not in force)."""

    def __init__(self, parent: RefusedOps | None = None) -> None:
        super().__init__()
        self.parent = parent
        self.seen: set[str] = set() if parent is None else parent.seen
        self.refused: set[str] = set() if parent is None else parent.refused
        self.in_callbacks = 0
        """Calls seen inside ``Future.then`` callbacks."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        self.seen.add(str(func))
        self.refused.update(str(func) for _ in refusals(func, args, kwargs))
        if self.parent is not None:
            self.parent.in_callbacks += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def following_callbacks(self) -> Iterator[None]:
        """Inside, every ``Future.then`` callback runs under a recorder that adds to this one's findings."""
        real = torch._C.Future.then

        def then(future: Any, callback: Callable[[Any], Any]) -> Any:
            def recorded(done: Any) -> Any:
                with RefusedOps(self):
                    return callback(done)

            return real(future, recorded)

        torch._C.Future.then = then  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            torch._C.Future.then = real  # type: ignore[method-assign]


def test_the_list_names_every_operator_this_torch_documents_as_refused() -> None:
    doc = torch.use_deterministic_algorithms.__doc__ or ""
    section = re.search(r"will throw a\s+:class:`RuntimeError` when ``mode=True``:(.*?)\n\s*In addition", doc, re.S)
    if section is None:
        pytest.skip(f"torch {torch.__version__}: its documentation has no list of refused operators in this form")
    documented = {" ".join(item.split()) for item in re.split(r"\n\s*\* ", "\n" + section.group(1).strip())
                  if item.strip()}
    kept = {r.doc for r in REFUSED_ON_CUDA if r.doc is not None}
    if not torch.__version__.startswith(DOCUMENTED_IN):
        # Another torch may document more: every entry it adds must be added to the list (with its operator).
        assert documented - kept == set(), f"torch {torch.__version__} documents more refused operators"
    else:
        assert documented == kept


def test_a_dispatch_mode_sees_a_refused_call_and_only_under_its_condition() -> None:
    history = torch.tensor([[0.0, math.nan], [1.0, 2.0], [3.0, math.nan]], dtype=torch.float64)
    with RefusedOps() as mode:
        torch.nanmedian(history, dim=0)
        torch.nanmedian(history)  # no indices: CUDA runs it
        torch.bincount(torch.tensor([0, 1, 1]))  # no weights: CUDA runs it
        torch.cumsum(torch.tensor([1, 2, 3]), 0)  # integers: CUDA runs it
    assert mode.refused == {"aten.nanmedian.dim"}
    assert {"aten.nanmedian.default", "aten.bincount.default", "aten.cumsum.default"} <= mode.seen


def test_the_trigger_s_median_is_nanmedian_s_bit_for_bit() -> None:
    from sdcguard.agent.trigger import lower_nanmedian

    g = torch.Generator().manual_seed(0)
    for window in (1, 2, 3, 4, 7, 32):
        for _ in range(50):
            history = torch.randn(window, 2, generator=g, dtype=torch.float64)
            history[torch.rand(window, 2, generator=g) < 0.4] = math.nan  # even, odd and empty columns
            if window > 2:
                history[1] = history[0]  # ties
            got, want = lower_nanmedian(history), torch.nanmedian(history, dim=0).values
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            assert torch.equal(got.nan_to_num(7.0).view(torch.int64), want.nan_to_num(7.0).view(torch.int64))
    assert torch.isnan(lower_nanmedian(torch.full((4, 2), math.nan, dtype=torch.float64))).all()


def guarded_rank(out: str) -> None:
    """A rank of ``test_no_operator_of_a_guarded_step_is_refused_by_cuda``: guarded steps under the recorder."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from sdcguard.agent.config import GuardConfig
    from sdcguard.agent.guard import SDCGuard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    jump_step = 6

    def batch_for(step: int, owner: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 100 + owner)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if (step, owner) == (jump_step, 1):  # a real jump in the data: the trigger fires, recomputation confirms
            x, y = x * 1e3, y * 1e3
        return x, y

    def mse(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(module(batch[0]), batch[1])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    config = GuardConfig(on_alarm="continue", ranks_per_node=1, audit_every=3, fingerprint_every=2,
                         trigger_warmup=2, trigger_window=4, product_checks=True, max_grad_norm=1.0,
                         spool_dir=os.path.join(out, f"spool-{rank}"),
                         checkpoint_prefix=os.path.join(out, "checkpoints"))
    guard = SDCGuard(ddp, optimizer, loss_fn=mse, batch_for=batch_for, config=config, publisher=None)
    results = []
    started = time.perf_counter()
    mode = RefusedOps()
    with mode.following_callbacks(), mode:
        for step in range(8):
            results.append(guard.step(step))
    Path(out, f"{rank}.json").write_text(json.dumps({
        "seen": sorted(mode.seen), "refused": sorted(mode.refused),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "audited": sum(r.audited for r in results), "triggered": sum(r.triggered for r in results),
        "confirmed": sum(bool(r.confirmed) for r in results), "alarms": sum(r.alarm is not None for r in results),
        "updated": sum(r.updated for r in results), "in_callbacks": mode.in_callbacks, "seconds": time.perf_counter() - started}))
    dist.barrier()
    dist.destroy_process_group()


def test_no_operator_of_a_guarded_step_is_refused_by_cuda(tmp_path: Path) -> None:
    # The torch forms of the fingerprint and the product checks: what a GPU without Triton runs.
    env = {"SDCGUARD_FINGERPRINT_KERNEL": "torch", "SDCGUARD_PRODUCTS_KERNEL": "python"}
    codes = launch_forked(2, guarded_rank, [str(tmp_path)], env=env, timeout=180,
                          preload=["sdcguard.agent.guard"])
    assert codes == [0, 0]
    ranks = [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(2)]
    for seen in ranks:
        # The steps the test means to cover happened: deterministic mode on, audits, a confirmed jump, no alarm.
        assert seen["deterministic"]
        assert seen["audited"] >= 2
        assert seen["confirmed"] >= 1
        assert seen["alarms"] == 0
        assert seen["updated"] == 8
        # The product checks' torch form (its matrix-vector products) and the clipping ran under the recorder.
        assert {"aten.mv.default", "aten._foreach_mul_.Tensor"} <= set(seen["seen"])
    assert [seen["triggered"] for seen in ranks] == [0, 1]  # the jump's owner's own trigger, past its warm-up
    # The pass after the all-reduce (in the process group's thread) was seen too.
    assert all(seen["in_callbacks"] > 0 for seen in ranks)
    assert [seen["refused"] for seen in ranks] == [[], []]
