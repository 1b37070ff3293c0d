"""At interpreter exit, a moment for gloo's worker threads to retire their last collectives.

A gloo worker thread (``ProcessGroupGloo::runLoop``) destroys a finished
collective after it has woken the caller. The collective's tensors were made
in Python, so destroying them takes the GIL. If the script ends first, the
interpreter is already finalising: the worker's request for the GIL ends the
thread (``pthread_exit``), and the unwinding through C++ aborts the process,
``terminate called without an active exception`` and exit -6, after a run
that did all its work. ``destroy_process_group`` does not join those threads
while anything still holds the group (a DDP model's reducer does), and a
stop on an alarm (``on_alarm="stop"``) leaves the group as it is.

Seen once in about 70 runs of ``examples/adopt_minimal.py`` under load
(2026-12-02; its core dump: ``~AsyncAllreduceWork`` called from
``ProcessGroupGloo::runLoop``, ``take_gil`` -> ``PyThread_exit_thread``), and
in CI; a script that ends with its all-reduces still in flight aborts 4 ranks
in 8 runs without the wait and 0 in 28 with it
(``tests/functional/test_exit_grace_gloo.py``). So a process whose guard talks
over a gloo group waits, once, at exit,
with the GIL released, while the interpreter is still whole: a worker that
finished a collective gets the CPU and retires it. NCCL retires its work on
its watchdog thread, which ``destroy_process_group`` joins: a group without
gloo gets no wait.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

GRACE_S = 0.2
"""How long the exit waits: a runnable thread on a loaded machine gets a core within a few scheduler periods."""

_registered = False


def settle_gloo_at_exit(group: dist.ProcessGroup | None) -> bool:
    """Register the wait at exit once per process if ``group`` (None: the default group) runs on gloo; whether
    it is registered now."""
    global _registered
    if not _registered and "gloo" in str(dist.get_backend(group)):
        atexit.register(_settle)
        _registered = True
    return _registered


def _settle() -> None:
    time.sleep(GRACE_S)  # the GIL is released: the workers destroy what they hold while Python is alive
