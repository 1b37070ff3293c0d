"""What a device run leaves behind, whatever happens to it: rows streamed as they come, and the table and every
figure written to the output folder at the end, by the watchdog if the run outlives its budget.

A lent GPU runs one command for a few minutes and brings back only the files
under its output folder, so nothing may depend on the run finishing: each
row is printed and flushed and appended to ``rows.jsonl`` when it is added;
``Report.write`` (called in the run's ``finally``, and by the watchdog
before it ends the process) writes ``table.txt`` and ``device.json``, which
holds every row, every section's figures and seconds, and why the run
stopped.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

PASS, FAIL, INFO, SKIP = "PASS", "FAIL", "INFO", "SKIP"
ROWS_FILE, TABLE_FILE, FIGURES_FILE = "rows.jsonl", "table.txt", "device.json"


@dataclass(frozen=True)
class Row:
    """One line of the table: a check (PASS or FAIL), a figure (INFO) or a section that could not run (SKIP)."""

    name: str
    status: str
    detail: str
    section: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it (a NaN or an infinity as its name, anything unknown as its text)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


class Report:
    """The run's rows and figures. ``out`` (None: print only) is the folder the files go to; it is created."""

    def __init__(self, out: Path | None = None, stream: TextIO | None = None) -> None:
        self.out = out
        self.stream = stream or sys.stdout
        self.rows: list[Row] = []
        self.figures: dict[str, Any] = {}
        """Free-form figures by section (tables of timings, ratios): everything the rows summarise."""
        self.meta: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.section = ""
        """The section running now (rows are filed under it; the watchdog names it)."""
        self.sections: dict[str, float] = {}
        """Seconds each section took."""
        self.stopped = "running"
        self._lock = threading.Lock()
        self._written = False
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / ROWS_FILE).write_text("")

    def add(self, name: str, problems: list[str] | None, detail: str = "", figures: dict[str, Any] | None = None,
            ) -> None:
        """A judged row (``problems`` empty: PASS, else FAIL with the first five) or, with ``problems=None``, an
        INFO row; printed and flushed at once."""
        status = INFO if problems is None else (FAIL if problems else PASS)
        self._append(Row(name, status, "; ".join(problems[:5]) if problems else detail, self.section,
                         dict(figures or {})))

    def skip(self, name: str, reason: str) -> None:
        """A row that could not run here, with the reason (not a failure)."""
        self._append(Row(name, SKIP, reason, self.section))

    def fail(self, name: str, error: BaseException) -> None:
        """A FAIL row for an exception: its type, its message's first line and where it was raised."""
        where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
        place = f" (at {Path(where[0].filename).name}:{where[0].lineno})" if where else ""
        message = (str(error).splitlines() or [""])[0][:300]
        self._append(Row(name, FAIL, f"raised {type(error).__name__}: {message}{place}", self.section))

    def _append(self, row: Row) -> None:
        with self._lock:
            self.rows.append(row)
            print(f"{row.status:<4}  {row.name}  {row.detail}", file=self.stream, flush=True)
            if self.out is not None:
                with open(self.out / ROWS_FILE, "a") as rows:
                    rows.write(json.dumps(_plain(asdict(row))) + "\n")

    @property
    def failed(self) -> bool:
        """Whether any judged row failed."""
        return any(row.status == FAIL for row in self.rows)

    def table(self) -> str:
        """Every row, one a line, aligned."""
        width = max((len(row.name) for row in self.rows), default=0)
        return "\n".join(f"{row.status:<4}  {row.name:<{width}}  {row.detail}" for row in self.rows)

    def write(self, stopped: str) -> None:
        """Write ``table.txt`` and ``device.json`` (once: a later call does nothing) and print the table."""
        with self._lock:
            if self._written:
                return
            self._written = True
            self.stopped = stopped
        table = self.table()
        print(f"\n{table}", file=self.stream, flush=True)
        if self.out is None:
            return
        (self.out / TABLE_FILE).write_text(table + "\n")
        document = {"meta": self.meta, "stopped": stopped, "section": self.section, "sections": self.sections,
                    "rows": [asdict(row) for row in self.rows], "figures": self.figures}
        (self.out / FIGURES_FILE).write_text(json.dumps(_plain(document), indent=1) + "\n")


class Watchdog:
    """Ends the process ``budget_s`` seconds after ``start()``, writing the report first (the run's files come
    back even then). ``remaining()`` lets a section see whether it still fits."""

    EXIT = 124
    """The exit status after the watchdog ended the run (``timeout``'s)."""

    def __init__(self, report: Report, budget_s: float, exit: Callable[[int], None] = os._exit) -> None:
        self.report = report
        self.budget_s = budget_s
        self._exit = exit
        self._deadline = math.inf
        self._timer: threading.Timer | None = None

    def start(self) -> None:
        self._deadline = time.monotonic() + self.budget_s
        if math.isfinite(self.budget_s):
            self._timer = threading.Timer(self.budget_s, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def remaining(self) -> float:
        return self._deadline - time.monotonic()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        print(f"watchdog: the run's budget of {self.budget_s:.0f} s is spent, in section "
              f"{self.report.section!r}: writing what it has and stopping", file=self.report.stream, flush=True)
        self.report.write(f"watchdog after {self.budget_s:.0f} s in section {self.report.section!r}")
        self._exit(self.EXIT)
