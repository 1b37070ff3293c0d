"""Kubernetes ``Status`` failures, as the API server returns them."""

from __future__ import annotations

from typing import Any

# HTTP status -> the ``reason`` Kubernetes puts in a Status body.
REASONS: dict[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """A request the server refuses; ``body()`` is the ``Status`` object sent back."""

    def __init__(
        self,
        code: int,
        message: str,
        *,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.details = details

    def body(self) -> dict[str, Any]:
        """The ``Status`` object, in the shape the kubernetes clients parse."""
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            out["details"] = self.details
        return out


def not_found(plural: str, name: str, group: str = "") -> ApiError:
    """404 for a missing object, worded as the API server words it."""
    resource = f"{plural}.{group}" if group else plural
    return ApiError(
        404, f'{resource} "{name}" not found', details={"name": name, "kind": plural, "group": group}
    )


def already_exists(plural: str, name: str, group: str = "") -> ApiError:
    """409 AlreadyExists for a create whose name is taken."""
    resource = f"{plural}.{group}" if group else plural
    return ApiError(
        409,
        f'{resource} "{name}" already exists',
        reason="AlreadyExists",
        details={"name": name, "kind": plural, "group": group},
    )


def conflict(plural: str, name: str, group: str = "") -> ApiError:
    """409 Conflict for a write that carried a stale ``resourceVersion``."""
    resource = f"{plural}.{group}" if group else plural
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        details={"name": name, "kind": plural, "group": group},
    )


def invalid(kind: str, plural: str, name: str, causes: list[dict[str, str]], group: str = "") -> ApiError:
    """422 Invalid listing every field that failed validation."""
    summary = ", ".join(f"{c['field']}: {c['message']}" for c in causes)
    return ApiError(
        422,
        f'{kind} "{name}" is invalid: {summary}',
        details={"name": name, "kind": plural, "group": group, "causes": causes},
    )
