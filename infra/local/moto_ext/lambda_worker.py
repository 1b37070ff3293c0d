"""The process one Lambda function runs in on the local stand-in.

Started by ``lambda_runner`` as ``python lambda_worker.py CODE_DIR HANDLER``
with the function's environment, it imports the handler from the unpacked
deployment package once (the cold start) and then serves invocations, one JSON
line in, one JSON line out, for as long as the runner keeps it warm. It
imports nothing from this project: the handler must come from the package
under test, never from the working tree.

Protocol (one line each):
  runner -> worker  {"event": <json text>, "context": {...}}
  worker -> runner  {"ok": true, "payload": <json text>}
                    {"ok": false, "error": {"errorType", "errorMessage", "stackTrace"}}
The first line the worker writes is the result of the cold start
(``{"ok": true}`` or an error like Lambda's ``Runtime.ImportModuleError``).
Whatever the handler prints goes to the worker's stderr, which the runner
collects as the invocation's log.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO


class LambdaContext:
    """The subset of the Lambda context object that handlers and powertools read."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.function_name: str = fields["function_name"]
        self.function_version: str = fields["function_version"]
        self.invoked_function_arn: str = fields["invoked_function_arn"]
        self.memory_limit_in_mb: int = int(fields["memory_limit_in_mb"])
        self.aws_request_id: str = fields["aws_request_id"]
        self.log_group_name: str = fields["log_group_name"]
        self.log_stream_name: str = fields["log_stream_name"]
        self.identity = None
        self.client_context = None
        self._deadline: float = float(fields["deadline"])

    def get_remaining_time_in_millis(self) -> int:
        """Milliseconds left before the runner stops this invocation."""
        return max(0, int((self._deadline - time.time()) * 1000))


def _error(
    error_type: str, exc: BaseException | None, message: str | None = None, *, skip: int = 0
) -> dict[str, Any]:
    tb = exc.__traceback__ if exc is not None else None
    # Like Lambda, show the function's frames, not the runtime's.
    for _ in range(skip):
        tb = tb.tb_next if tb is not None else None
    stack = traceback.format_tb(tb) if tb is not None else []
    return {
        "errorType": error_type,
        "errorMessage": message if message is not None else str(exc),
        "stackTrace": stack,
    }


def _load(spec: str) -> Callable[[Any, Any], Any]:
    module_name, _, attr = spec.rpartition(".")
    if not module_name:
        raise _InitError("Runtime.MalformedHandlerName", f"Bad handler '{spec}': not enough values to unpack")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise _InitError("Runtime.ImportModuleError", f"Unable to import module '{module_name}': {exc}") from exc
    handler = getattr(module, attr, None)
    if not callable(handler):
        raise _InitError("Runtime.HandlerNotFound", f"Handler '{attr}' missing on module '{module_name}'")
    return handler


class _InitError(Exception):
    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def _reply(out: TextIO, message: dict[str, Any]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    out.write(json.dumps(message) + "\n")
    out.flush()


def main(argv: list[str]) -> int:
    """Serve invocations of one handler until stdin closes."""
    code_dir, spec = argv[1], argv[2]
    # The protocol gets a private copy of stdout; fd 1 then points at the log
    # (stderr) so a handler's print() can never corrupt a reply.
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    # sys.path[0] is this script's folder: the package replaces it, and comes
    # before any installed copy of the same modules.
    sys.path[0] = code_dir
    os.chdir(code_dir)
    try:
        handler = _load(spec)
    except _InitError as exc:
        traceback.print_exc()
        _reply(protocol, {"ok": False, "error": _error(exc.error_type, exc.__cause__, str(exc))})
        return 1
    except Exception as exc:  # an import-time crash is Lambda's init error
        traceback.print_exc()
        _reply(protocol, {"ok": False, "error": _error("Runtime.ImportModuleError", exc)})
        return 1
    _reply(protocol, {"ok": True})
    for line in sys.stdin:
        request = json.loads(line)
        context = LambdaContext(request["context"])
        try:
            result = handler(json.loads(request["event"]), context)
        except Exception as exc:
            traceback.print_exc()
            _reply(protocol, {"ok": False, "error": _error(type(exc).__name__, exc, skip=1)})
            continue
        try:
            payload = json.dumps(result)
        except (TypeError, ValueError) as exc:
            _reply(
                protocol,
                {"ok": False, "error": _error("Runtime.MarshalError", exc, f"Unable to marshal response: {exc}")},
            )
            continue
        _reply(protocol, {"ok": True, "payload": payload})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
