"""A run's end compared with the clean run's at the same step, every rank's figures gathered.

Both fault phases end their runs here: a compute fault's run without
detectors, and the training after a checkpoint loaded without checks.
"""

from __future__ import annotations

import math

import torch

from sdcguard.campaign.observers import ReducedGradWatch
from sdcguard.campaign.rank import Rank
from sdcguard.campaign.records import EndState
from sdcguard.campaign.trajectory import flat_state


def compared(rank: Rank, module: torch.nn.Module, optimizer: torch.optim.Optimizer, at: int, losses: list[float],
             norms: list[float], start: int, watch: ReducedGradWatch | None = None) -> EndState:
    """The run's state at ``at`` against the clean run's, and its series from ``start`` (collective).

    With ``watch`` (the run without detectors), also whether every loss, local and reduced gradient of every
    rank was finite at every step (``all_finite``), and whether every rank received the same reduced
    gradients at every step (``reduced_identical``)."""
    weights, state = flat_state(module, optimizer)
    clean_w = rank.clean.weights[at]
    exact = bool(torch.equal(state, rank.clean.state[at]))
    finite = bool(torch.isfinite(state).all())
    rel = float((weights.double() - clean_w.double()).norm() / clean_w.double().norm())
    rel = rel if math.isfinite(rel) else math.inf
    seen = [float(watch.finite), *watch.words()] if watch is not None else []
    head = 3 + len(seen)
    rows = rank.group.gather([float(exact), float(finite), rel, *seen, *losses, *norms])
    n = len(losses)
    all_finite = reduced_identical = None
    if watch is not None:
        series = [v for r in rows for v in r[head:]]  # every loss and local gradient norm of every rank
        all_finite = all(bool(r[3]) for r in rows) and all(math.isfinite(v) for v in series)
        reduced_identical = all(r[4:head] == rows[0][4:head] for r in rows)
    return EndState(
        end_step=at,
        exact_final=all(bool(r[0]) for r in rows),
        finite_final=all(bool(r[1]) for r in rows),
        weight_rel=max(r[2] for r in rows),
        losses=[[rows[r][head + s] for r in range(rank.world)] for s in range(n)],
        norms=[[rows[r][head + n + s] for r in range(rank.world)] for s in range(n)],
        series_start=start,
        all_finite=all_finite,
        reduced_identical=reduced_identical,
    )
