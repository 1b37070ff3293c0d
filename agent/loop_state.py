"""The training loop's state a checkpoint carries beside the model and the optimizer, and putting it back.

Under the checkpoint's ``extra`` key :data:`LOOP_STATE`: the LR schedule's
and the GradScaler's state, and every rank's magnitude-trigger history (its
window of losses and gradient norms, how many steps it has seen), so a
resumed run is the one that stopped, learning rate included, and its trigger
watches from the first resumed step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from sdcguard.agent.checkpoint import LoadedCheckpoint
from sdcguard.agent.trigger import MagnitudeTrigger

log = logging.getLogger(__name__)

LOOP_STATE = "sdcguard_loop"
"""The key of a checkpoint's ``extra`` under which the guard keeps the LR schedule's and the GradScaler's state
and every rank's magnitude-trigger history."""

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's ``[n]`` tensor as ``[world, n]`` on the CPU (a collective)."""


def loop_state(*, scheduler: Any, scaler: torch.amp.GradScaler | None, trigger: MagnitudeTrigger | None,
               gather: Gather) -> dict[str, Any]:
    """The schedule's and the GradScaler's state and every rank's trigger state, for the checkpoint's extra
    (``{LOOP_STATE: ...}``, or ``{}`` when there is none; a collective when the trigger is on)."""
    state: dict[str, Any] = {}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    if trigger is not None:
        state["trigger"] = trigger_states(trigger, gather)
    return {LOOP_STATE: state} if state else {}


def trigger_states(trigger: MagnitudeTrigger, gather: Gather) -> list[dict[str, Any]]:
    """Every rank's magnitude-trigger state, indexed by rank (a collective: rank 0 alone writes the
    checkpoint's extra, and each rank's history is its own loss and gradient norm)."""
    history = trigger.history.detach().to(torch.float64)
    mine = torch.cat([history.reshape(-1), torch.tensor([float(trigger.seen)], dtype=torch.float64,
                                                         device=history.device)])
    rows = gather(mine)
    window = history.shape[0]
    return [{"history": row[:-1].reshape(window, 2).clone(), "seen": int(row[-1]), "window": window,
             "warmup": trigger.warmup} for row in rows]


def restore_loop_state(loaded: LoadedCheckpoint, *, scheduler: Any, scaler: torch.amp.GradScaler | None,
                       trigger: MagnitudeTrigger | None, rank: int) -> None:
    """Put the schedule, the GradScaler and this rank's trigger back where the checkpoint left them (a warning
    for each the checkpoint holds no state of)."""
    state = loaded.extra.get(LOOP_STATE) or {}
    for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if obj is None:
            continue
        if name in state:
            obj.load_state_dict(state[name])
        else:
            log.warning("%s holds no %s state: the %s starts afresh, so this run will not be the one that "
                        "saved it", loaded.uri, name, name)
    if trigger is not None:
        restore_trigger(loaded, state.get("trigger"), trigger, rank)


def restore_trigger(loaded: LoadedCheckpoint, states: Any, trigger: MagnitudeTrigger, rank: int) -> None:
    """Give this rank's trigger its saved history, so the resumed job watches from its first step. Saved by
    a world of another size: the history of rank ``rank mod saved world`` (the ranks train the same model
    on like data, so their losses and norms are of one magnitude). None saved (an older checkpoint): a
    warning, and the trigger warms up again with the cross-rank test."""
    if not isinstance(states, list) or not states:
        log.warning("%s holds no magnitude-trigger state: the trigger warms up again (the cross-rank test "
                    "watches meanwhile)", loaded.uri)
        return
    trigger.load_state_dict(states[rank % len(states)])
