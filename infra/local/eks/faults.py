"""Fault knobs for reliability tests: added latency, a random error rate, named one-off failures, and chaos.

Set them in-process (``server.faults``) or over HTTP on the server's
``/_standin/faults`` path, so a drill can disturb a server started by
``sdcguard local up``. They act only on Kubernetes API requests, never on the
stand-in's own paths.

Chaos (:class:`Chaos`, ``server.faults.chaos``, in-process only) fails a
fraction of calls transiently and counts what it did: the faults it injected
and the retries that absorbed them. The SageMaker HyperPod extension uses the
same class for its calls (``sdcguard.infra.local.moto_ext.hyperpod_faults``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import random
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

FAILURE_STATUSES = (429, 500, 502, 503, 504)
MAX_LATENCY_SECONDS = 60.0
CHAOS_STATUSES = (429, 500, 503)
"""What chaos fails with by default: throttling and the two 5xx a service answers when it is briefly unwell."""


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


@dataclass
class ChaosTally:
    """What chaos did, per operation (``"PATCH nodes"``, ``"ListClusterNodes"``)."""

    injected: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)
    """Faults injected: operation -> status -> how many."""
    retried: dict[str, int] = dataclasses.field(default_factory=dict)
    """Faults followed by a retry of the same call that chaos let through: operation -> how many."""
    outstanding: dict[str, int] = dataclasses.field(default_factory=dict)
    """Faults no later request of the same call has followed (yet): operation -> how many."""

    @property
    def faults(self) -> int:
        """Faults injected in all."""
        return sum(sum(by_status.values()) for by_status in self.injected.values())


class Chaos:
    """Fail a fraction of calls transiently, reproducibly from a seed, and count the retries that absorb them.

    Whether the n-th call of an operation fails, and with which status, is a
    hash of (seed, operation, n): the same seed fails the same calls of each
    operation however the calls of other operations interleave with them.
    ``call`` names the request more finely (the object it is about, or its
    body): a fault counts as retried when a later request of the same call
    is let through. Thread-safe; off (rate 0) by default.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rate = 0.0
        self.seed = 0
        self.statuses: tuple[int, ...] = CHAOS_STATUSES
        self._paused = 0
        self._calls: collections.Counter[str] = collections.Counter()
        self._pending: dict[tuple[str, str], int] = {}
        self._tally = ChaosTally()

    def set(self, rate: float, *, seed: int = 0, statuses: tuple[int, ...] = CHAOS_STATUSES) -> None:
        """Fail ``rate`` of the calls from now on, with ``statuses`` in equal shares; the counts start again.

        Raises ValueError naming the argument out of range (nothing changes then).
        """
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise ValueError(f"rate must be between 0 and 1, got {rate!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not statuses:
            raise ValueError("statuses must name at least one status")
        for status in statuses:
            _status(status, "statuses")
        with self._lock:
            self.rate, self.seed, self.statuses = float(rate), seed, tuple(statuses)
            self._calls.clear()
            self._pending.clear()
            self._tally = ChaosTally()

    def off(self) -> None:
        """Stop failing calls; the counts stay readable."""
        with self._lock:
            self.rate = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Let every call through while inside (an observer's own reads), without counting them."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    def draw(self, operation: str, n: int) -> int | None:
        """The status the n-th call (from 0) of ``operation`` fails with under this seed and rate, or None."""
        digest = hashlib.blake2b(f"{self.seed}\0{operation}\0{n}".encode(), digest_size=16).digest()
        if int.from_bytes(digest[:8], "big") >= self.rate * 2**64:
            return None
        return self.statuses[int.from_bytes(digest[8:], "big") % len(self.statuses)]

    def decide(self, operation: str, call: str) -> int | None:
        """Count one call of ``operation`` and return the status it must fail with, or None to serve it."""
        with self._lock:
            if self._paused or not self.rate:
                return None
            n = self._calls[operation]
            self._calls[operation] = n + 1
            status = self.draw(operation, n)
            key = (operation, call)
            tally = self._tally
            if status is None:
                absorbed = self._pending.pop(key, 0)
                if absorbed:
                    tally.retried[operation] = tally.retried.get(operation, 0) + absorbed
                return None
            self._pending[key] = self._pending.get(key, 0) + 1
            by_status = tally.injected.setdefault(operation, {})
            by_status[status] = by_status.get(status, 0) + 1
            return status

    def tally(self) -> ChaosTally:
        """A copy of the counts since the last ``set``."""
        with self._lock:
            outstanding: dict[str, int] = {}
            for (operation, _call), count in self._pending.items():
                outstanding[operation] = outstanding.get(operation, 0) + count
            return ChaosTally(
                injected={op: dict(by_status) for op, by_status in self._tally.injected.items()},
                retried=dict(self._tally.retried),
                outstanding=outstanding,
            )


class Faults:
    """The server's fault knobs; thread-safe. All off by default."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latency_seconds = 0.0
        self.error_rate = 0.0
        self.error_status = 500
        self._random = random.Random(0)
        self._named: list[NamedFailure] = []
        self.chaos = Chaos()
        """Transient failures at a rate, counted (see :class:`Chaos`); operations are ``"METHOD resource"``."""

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
        self.chaos.off()

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
            latency = self.latency_seconds
        chaos = self.chaos.decide(f"{method.upper()} {resource}", name or "")
        return Verdict(latency, chaos, "chaos" if chaos is not None else "")

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
