"""A gloo process ends cleanly while gloo's workers still hold its last collectives (sdcguard.agent.exit_grace).

Two real processes (gloo, world 2) each issue a few all-reduces whose work
objects and tensors Python drops at once, and end: the collectives are still
running on gloo's worker threads when the script's last line has run. Without
the wait at exit a worker destroys its finished collective while the
interpreter is finalising, asks for the GIL, and the process aborts
(``terminate called without an active exception``; measured 4 aborted ranks
in 8 runs without it, 0 in 28 with it, 2026-12-02), or its peer waits for a
collective that will never finish. With the wait registered (as a guard
registers it), every rank exits 0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
RUNS = 3

SCRIPT = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from sdcguard.agent import exit_grace
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    exit_grace.GRACE_S = 1.0  # the mechanism, with room for a loaded machine
    exit_grace.settle_gloo_at_exit(None)
    for _ in range(4):
        dist.all_reduce(torch.ones(1 << 16), async_op=True)  # its work and tensor dropped, still running
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_process_that_ends_while_gloo_still_holds_its_collectives_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "end_with_collectives_in_flight.py"
    script.write_text(SCRIPT)
    for run in range(RUNS):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
        procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(rank)}, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]
        try:
            results = [p.communicate(timeout=90) for p in procs]
        finally:
            for p in procs:
                p.kill()
        codes = [p.returncode for p in procs]
        assert codes == [0, 0], (run, codes, [err[-800:] for _, err in results])
