"""``torch.distributed.all_reduce`` wrapped for the length of a ``with`` block, and only for it.

The guard's communication (its DDP hook, its agreement on flags) calls
``dist.all_reduce`` through the module, so the campaign observes and corrupts
it by putting a wrapper in that place: the census of a clean step counts the
float all-reduces, the all-reduce fault corrupts one rank's result. Set by
hand and left in place, such a wrapper would outlive the run it was meant for
(an exception between setting and restoring leaves it for every later run);
here it is scoped: the original is back when the block ends, however it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

AllReduce = Callable[..., Any]
"""The signature of ``torch.distributed.all_reduce``: ``(tensor, op=..., group=..., async_op=...)``."""


@contextlib.contextmanager
def wrapped_all_reduce(wrap: Callable[[AllReduce], AllReduce]) -> Iterator[None]:
    """Within the block, ``dist.all_reduce`` is ``wrap(the all_reduce in place before)``; restored on exit.

    Blocks nest (each wraps what the enclosing one put in place) and must end
    in the reverse order (an internal invariant, asserted).
    """
    original = dist.all_reduce
    wrapper = wrap(original)
    dist.all_reduce = wrapper
    try:
        yield
    finally:
        assert dist.all_reduce is wrapper, "all_reduce wrappers must be removed in the reverse order"
        dist.all_reduce = original
