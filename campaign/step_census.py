"""What one clean step computes and communicates: its matrix products per direction and its float
all-reduces (the gradient buckets), counted for the injectors' ``ModelShape``.

The products are counted by a dispatch mode, the all-reduces by wrapping
``dist.all_reduce`` for the census's ``with`` block only
(``all_reduce_wrap.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from sdcguard.campaign.all_reduce_wrap import AllReduce, wrapped_all_reduce
from sdcguard.campaign.injectors import ProductMode


class StepCensus:
    """Counts, over every ``counting()`` block, the matrix products by direction and the float all-reduces."""

    def __init__(self) -> None:
        self.products = {"fwd": 0, "bwd": 0}
        self.allreduces = 0

    def _product(self, _out: torch.Tensor, direction: str) -> None:
        self.products[direction] += 1

    def _counting_all_reduce(self, original: AllReduce) -> AllReduce:
        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.is_floating_point():
                self.allreduces += 1
            return original(tensor, *args, **kwargs)

        return all_reduce

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count what runs inside the block (enter it around ``guard.step``)."""
        with wrapped_all_reduce(self._counting_all_reduce), ProductMode(self._product):
            yield
