"""Gap: moto's StopExecution does not end an execution that waits on a task token, and Step Functions does.

moto marks the stopped execution's program as stopped, but the thread that
runs a ``.waitForTaskToken`` task keeps waiting for the token's answer until
the task times out. Until then the execution reads RUNNING, and a
SendTaskSuccess with its token is accepted and recorded, where AWS has
already ended the execution as ABORTED and answers any later
SendTaskSuccess, SendTaskFailure or SendTaskHeartbeat with that token
``TaskTimedOut`` ("Provided task does not exist anymore"). moto's own
``TaskTimedOut`` also reaches the client with no error code.

Hooks: the parser backend's ``Execution.stop`` also marks every task token of
the execution as dead, wakes the task that waits on it, and records ABORTED
with the stop date at once, which the execution keeps when the woken task
ends. The woken task ends as timed out (its history
shows ``TaskTimedOut`` before ``ExecutionAborted``, where AWS shows neither
task event), and ``Environment.set_error`` leaves a stopped program stopped,
so the execution never turns FAILED. The backend's ``send_task_success``,
``send_task_failure`` and ``send_task_heartbeat`` answer ``TaskTimedOut``, with
its code, for a token whose execution has ended.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any

from moto.core.exceptions import AWSError
from moto.stepfunctions.parser.api import ExecutionStatus, TaskTimedOut
from moto.stepfunctions.parser.asl.eval.callback.callback import CallbackConsumerTimeout
from moto.stepfunctions.parser.asl.eval.environment import Environment
from moto.stepfunctions.parser.asl.eval.program_state import ProgramStopped
from moto.stepfunctions.parser.backend.execution import BaseExecutionWorkerCommunication, Execution
from moto.stepfunctions.parser.models import StepFunctionsParserBackend

ENDED = "Provided task does not exist anymore"
"""AWS's message for a task token whose execution has ended."""


def _task_timed_out() -> AWSError:
    return AWSError(ENDED, "TaskTimedOut")


def _callbacks(execution: Execution) -> list[Any]:
    worker = execution.exec_worker
    if worker is None or worker.env is None:
        return []
    return list(worker.env.callback_pool_manager._pool.values())


def _stop(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def stop(self: Execution, stop_date: datetime.datetime, error: str | None, cause: str | None) -> None:
        running = self.exec_status == ExecutionStatus.RUNNING
        original(self, stop_date=stop_date, error=error, cause=cause)
        if not running:
            return
        self.exec_status = ExecutionStatus.ABORTED
        self.stop_date = stop_date
        for callback in _callbacks(self):
            callback.report(CallbackConsumerTimeout())
            callback.interrupt_all()

    stop.__sdcguard_patched__ = True  # type: ignore[attr-defined]
    return stop


def _keeping_stopped(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def set_error(self: Environment, error: Any) -> None:
        # The woken task fails as timed out; a stopped program stays stopped (ABORTED), as on AWS.
        if isinstance(self._program_state, ProgramStopped):
            return
        original(self, error)

    set_error.__sdcguard_patched__ = True  # type: ignore[attr-defined]
    return set_error


def _keeping_the_stop_date(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def reflect(self: BaseExecutionWorkerCommunication) -> None:
        # The woken task ends a moment after the stop: the execution keeps the date StopExecution answered.
        stopped = self.execution.stop_date if self.execution.exec_status == ExecutionStatus.ABORTED else None
        original(self)
        if stopped is not None:
            self.execution.stop_date = stopped

    reflect.__sdcguard_patched__ = True  # type: ignore[attr-defined]
    return reflect


def _held_by_an_ended_execution(backend: StepFunctionsParserBackend, token: str) -> bool:
    return any(
        execution.exec_status != ExecutionStatus.RUNNING
        and any(callback.callback_id == token for callback in _callbacks(execution))
        for execution in backend._get_executions()
    )


def _answering(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def answer(self: StepFunctionsParserBackend, task_token: str, *args: Any, **kwargs: Any) -> Any:
        # Decided before moto looks: it searches running executions only, or fails to build its own error.
        if _held_by_an_ended_execution(self, task_token):
            raise _task_timed_out()
        try:
            return original(self, task_token, *args, **kwargs)
        except TaskTimedOut:
            raise _task_timed_out() from None

    answer.__sdcguard_patched__ = True  # type: ignore[attr-defined]
    return answer


def install() -> None:
    """Make StopExecution end a task-token wait at once, and its token dead (idempotent)."""
    if not getattr(Execution.stop, "__sdcguard_patched__", False):
        Execution.stop = _stop(Execution.stop)  # type: ignore[method-assign]
    reflect = BaseExecutionWorkerCommunication._reflect_execution_status
    if not getattr(reflect, "__sdcguard_patched__", False):
        BaseExecutionWorkerCommunication._reflect_execution_status = _keeping_the_stop_date(reflect)  # type: ignore[method-assign]
    if not getattr(Environment.set_error, "__sdcguard_patched__", False):
        Environment.set_error = _keeping_stopped(Environment.set_error)  # type: ignore[method-assign]
    for name in ("send_task_success", "send_task_failure", "send_task_heartbeat"):
        method = getattr(StepFunctionsParserBackend, name)
        if not getattr(method, "__sdcguard_patched__", False):
            setattr(StepFunctionsParserBackend, name, _answering(method))
