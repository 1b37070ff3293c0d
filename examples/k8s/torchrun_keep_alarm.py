"""torchrun for a guarded job on Kubernetes: keep the alarm's exit code, and hold until the job is suspended.

    python examples/k8s/torchrun_keep_alarm.py [--hold-s 600] -- <torchrun arguments> script.py <its arguments>

Why not plain torchrun, in the pod of a PyTorchJob (``pytorchjob.yaml``):

- torchrun exits 1 whatever its workers exit with, so the pod would never
  show the guard's code 87 (``sdcguard.agent.ALARM_EXIT_CODE``, "stopped on suspect
  hardware"). This runs torchrun in-process and exits 87 when any worker did.
- A PyTorchJob with ``restartPolicy: ExitCode`` fails for good when a pod exits
  87 (below 128: not retryable), which is what must happen rather than a
  restart onto the suspect node. But the training operator never restarts a
  finished job, so the pipeline's resume (un-suspending the job after the
  node is replaced) would then do nothing. So after an alarm this waits, up to
  ``--hold-s`` seconds, for the pipeline's suspend: the operator deletes the
  pods of a suspended job (SIGTERM here, and then exit 87), and un-suspending
  creates new ones, which the scheduler keeps off the cordoned node. When no
  suspend comes (no pipeline, its dry-run mode, a blast-radius refusal) the
  pod exits 87 at the end of the wait and the job fails: it never restarts on
  suspect hardware by itself.

Any other failure leaves as torchrun leaves it (exit 1, its report on stderr).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from sdcguard.agent.config import ALARM_EXIT_CODE


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with the arguments after ``--``; 0, or ALARM_EXIT_CODE after an alarm and the hold.

    Re-raises torchrun's ChildFailedError when no worker exited with ALARM_EXIT_CODE.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, torchrun_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    p = argparse.ArgumentParser(prog="torchrun_keep_alarm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--hold-s", type=float, default=600.0,
                   help="after an alarm, how long to wait for the job to be suspended (default 600)")
    hold_s = p.parse_args(ours).hold_s
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as exc:
        codes = sorted({failure.exitcode for failure in exc.failures.values()})
        if ALARM_EXIT_CODE not in codes:
            raise
        print(f"torchrun_keep_alarm: workers exited {codes}: an sdcguard alarm stopped training; waiting up to "
              f"{hold_s:.0f} s for the job to be suspended, then exiting {ALARM_EXIT_CODE}", file=sys.stderr,
              flush=True)
        hold(hold_s)
        return ALARM_EXIT_CODE
    return 0


def hold(seconds: float) -> None:
    """Sleep ``seconds``; a SIGTERM (the pod deleted, the job suspended) ends it at once with ALARM_EXIT_CODE."""
    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(ALARM_EXIT_CODE)

    signal.signal(signal.SIGTERM, on_term)
    time.sleep(seconds)


if __name__ == "__main__":
    sys.exit(main())
