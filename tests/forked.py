"""Launch a test's ranks from a fresh process that forks them: one start-up instead of one per rank.

A spawned rank imports torch and the agent on its own (seconds each on a
busy 2-core machine, and a world of 6 pays it six times). Only a process that
has started no threads and run no torch operation may fork (``sdcguard.agent.testing.train.launch``),
and a test process has done both; so the test starts a plain launcher, which
imports what the ranks need and forks them.

``launch_forked`` takes what ``sdcguard.agent.testing.train.launch`` takes, with ``fn`` a
module-level function (the launcher imports it by name) and ``args`` JSON.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sdcguard.agent.testing.train import launch

ROOT = Path(__file__).resolve().parents[1]


def launch_forked(nproc: int, fn: Callable[..., Any], args: Sequence[Any] = (), env: Mapping[str, str] | None = None,
                  timeout: float = 600, preload: Sequence[str] = ()) -> list[int | None]:
    """Run ``fn(*args)`` on ``nproc`` ranks forked by a fresh launcher; their exit codes (None: stopped).

    ``preload`` names modules the launcher imports before forking (what every
    rank would otherwise import on first use). The launcher's own output is
    passed through; a launcher that fails before reporting raises AssertionError
    with its output."""
    if "." in fn.__qualname__ or fn.__module__ == "__main__":
        raise ValueError(f"launch_forked: {fn.__qualname__} must be a module-level function of an importable module")
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp, "spec.json"), Path(tmp, "codes.json")
        spec.write_text(json.dumps({"nproc": nproc, "module": fn.__module__, "function": fn.__qualname__,
                                    "args": list(args), "env": dict(env or {}), "timeout": timeout,
                                    "preload": list(preload), "result": str(result)}))
        done = subprocess.run([sys.executable, "-m", "tests.forked", str(spec)], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout + 60, check=False)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        assert result.exists(), f"the launcher failed (exit {done.returncode}):\n{done.stderr[-6000:]}"
        codes: list[int | None] = json.loads(result.read_text())
        return codes


def main(argv: list[str]) -> int:
    """``SPEC`` (JSON, written by ``launch_forked``): import, fork the ranks, write their exit codes."""
    spec = json.loads(Path(argv[0]).read_text())
    for name in spec["preload"]:
        importlib.import_module(name)
    fn = getattr(importlib.import_module(spec["module"]), spec["function"])
    codes = launch(spec["nproc"], fn, spec["args"], env=spec["env"], timeout=spec["timeout"], start_method="fork")
    Path(spec["result"]).write_text(json.dumps(codes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
