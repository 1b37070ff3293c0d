"""Fault knobs for reliability tests: added latency, a random error rate, and named one-off failures.

Set them in-process (``server.faults``) or over HTTP on the server's
``/_standin/faults`` path, so a drill can disturb a server started by
``sdcguard local up``. They act only on Kubernetes API requests, never on the
stand-in's own paths.
"""

from __future__ import annotations

import random
import threading
from dataclasses import asdict, dataclass
from typing import Any

FAILURE_STATUSES = (429, 500, 502, 503, 504)
MAX_LATENCY_SECONDS = 60.0


@dataclass
class NamedFailure:
    """The next ``times`` requests matching method/resource/name (None matches anything) fail with ``status``."""

    method: str | None = None
    resource: str | None = None
    name: str | None = None
    status: int = 500
    times: int = 1

    def matches(self, method: str, resource: str, name: str | None) -> bool:
        """Whether a request falls under this failure."""
        return (
            (self.method is None or self.method.upper() == method.upper())
            and (self.resource is None or self.resource == resource)
            and (self.name is None or self.name == name)
        )


@dataclass(frozen=True)
class Verdict:
    """What the knobs decided for one request: how long to stall, and a status to fail with (None: serve it)."""

    delay_seconds: float
    fail_status: int | None
    why: str = ""


def _status(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value not in FAILURE_STATUSES:
        raise ValueError(f"{field} must be one of {FAILURE_STATUSES}, got {value!r}")
    return value


class Faults:
    """The server's fault knobs; thread-safe. All off by default."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latency_seconds = 0.0
        self.error_rate = 0.0
        self.error_status = 500
        self._random = random.Random(0)
        self._named: list[NamedFailure] = []

    def set(
        self,
        *,
        latency_seconds: float | None = None,
        error_rate: float | None = None,
        error_status: int | None = None,
        seed: int | None = None,
    ) -> None:
        """Change the given knobs; raises ValueError naming a knob that is out of range (nothing changes then)."""
        if latency_seconds is not None and (
            isinstance(latency_seconds, bool)
            or not isinstance(latency_seconds, int | float)
            or not 0 <= latency_seconds <= MAX_LATENCY_SECONDS
        ):
            raise ValueError(
                f"latency_seconds must be between 0 and {MAX_LATENCY_SECONDS}, got {latency_seconds!r}"
            )
        if error_rate is not None and (
            isinstance(error_rate, bool)
            or not isinstance(error_rate, int | float)
            or not 0 <= error_rate <= 1
        ):
            raise ValueError(f"error_rate must be between 0 and 1, got {error_rate!r}")
        if error_status is not None:
            _status(error_status, "error_status")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        with self._lock:
            if latency_seconds is not None:
                self.latency_seconds = float(latency_seconds)
            if error_rate is not None:
                self.error_rate = float(error_rate)
            if error_status is not None:
                self.error_status = error_status
            if seed is not None:
                self._random = random.Random(seed)

    def fail_next(
        self,
        method: str | None = None,
        resource: str | None = None,
        name: str | None = None,
        *,
        status: int = 500,
        times: int = 1,
    ) -> NamedFailure:
        """Make the next ``times`` matching requests fail with ``status``, e.g. ``fail_next("PATCH", "nodes", "hyperpod-i-...")``.

        Raises ValueError for a status outside FAILURE_STATUSES or times < 1.
        """
        _status(status, "status")
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise ValueError(f"times must be a positive integer, got {times!r}")
        for field, value in (("method", method), ("resource", resource), ("name", name)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{field} must be a string or null, got {value!r}")
        failure = NamedFailure(method, resource, name, status, times)
        with self._lock:
            self._named.append(failure)
        return failure

    def clear(self) -> None:
        """Turn every knob off."""
        with self._lock:
            self.latency_seconds = 0.0
            self.error_rate = 0.0
            self.error_status = 500
            self._named.clear()

    def decide(self, method: str, resource: str, name: str | None) -> Verdict:
        """Consume the knobs for one request (a matching named failure is used up)."""
        with self._lock:
            for failure in self._named:
                if failure.matches(method, resource, name):
                    failure.times -= 1
                    if failure.times <= 0:
                        self._named.remove(failure)
                    return Verdict(self.latency_seconds, failure.status, "named failure")
            if self.error_rate and self._random.random() < self.error_rate:
                return Verdict(self.latency_seconds, self.error_status, "error rate")
            return Verdict(self.latency_seconds, None)

    def to_dict(self) -> dict[str, Any]:
        """The knobs as JSON (what GET /_standin/faults returns)."""
        with self._lock:
            return {
                "latency_seconds": self.latency_seconds,
                "error_rate": self.error_rate,
                "error_status": self.error_status,
                "fail_next": [asdict(f) for f in self._named],
            }

    def apply(self, body: Any) -> None:
        """Apply a JSON body of POST /_standin/faults: any of latency_seconds, error_rate, error_status, seed, fail_next[].

        Validates everything first and raises ValueError naming the field, so a bad body changes nothing.
        """
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        known = {"latency_seconds", "error_rate", "error_status", "seed", "fail_next"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(
                f"unknown fault knob(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        failures = body.get("fail_next", [])
        if not isinstance(failures, list):
            raise ValueError("fail_next must be a list")
        checked: list[dict[str, Any]] = []
        for i, failure in enumerate(failures):
            if not isinstance(failure, dict) or set(failure) - {
                "method",
                "resource",
                "name",
                "status",
                "times",
            }:
                raise ValueError(
                    f"fail_next[{i}] must be an object with method, resource, name, status, times"
                )
            probe = Faults()
            try:
                probe.fail_next(**failure)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"fail_next[{i}]: {exc}") from exc
            checked.append(failure)
        Faults().set(
            **{k: body[k] for k in ("latency_seconds", "error_rate", "error_status", "seed") if k in body}
        )
        self.set(
            **{k: body[k] for k in ("latency_seconds", "error_rate", "error_status", "seed") if k in body}
        )
        for failure in checked:
            self.fail_next(**failure)
