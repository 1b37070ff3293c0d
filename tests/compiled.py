"""A torch.compile backend whose code rounds otherwise than eager, as inductor's fused kernels do.

Inductor itself takes tens of seconds a model on this machine; this backend
compiles at once: it runs dynamo's graph with every fp32 matrix product
accumulated in fp64 and rounded back, so the compiled model's bits differ
from the eager model's while its values agree to rounding. A recomputation
that runs the compiled code where the pass it checks ran eagerly (or the
reverse) then disagrees bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_PRODUCTS = frozenset({torch.nn.functional.linear, torch._C._nn.linear, torch.matmul, torch.Tensor.matmul,
                       torch.Tensor.__matmul__, torch.mm, torch.bmm, torch.addmm, torch.baddbmm})


class _Wider(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _PRODUCTS and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            wide = [a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args]
            return func(*wide, **kwargs).float()
        return func(*args, **kwargs)


def rounding_otherwise(gm: torch.fx.GraphModule, _example_inputs: Any) -> Callable[..., Any]:
    """A ``torch.compile`` backend: ``gm`` with its fp32 matrix products accumulated in fp64."""

    def run(*args: Any) -> Any:
        with _Wider():
            return gm(*args)
    return run
