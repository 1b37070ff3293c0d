"""What each handler accepts: the EventBridge alarm event and the state machine's task inputs.

One model per input; anything else is refused with :class:`MalformedEvent`
naming the field, before any handler touches anything.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from aws_lambda_powertools.utilities.parser import parse
from aws_lambda_powertools.utilities.parser.exceptions import InvalidModelTypeError
from aws_lambda_powertools.utilities.parser.models import EventBridgeModel
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sdcguard.contract import DETAIL_TYPE, EVENT_SOURCE, Alarm, Decision
from sdcguard.lambdas.errors import MalformedEvent

IncidentId = Annotated[str, Field(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
InstanceId = Annotated[str, Field(pattern=r"^i-[0-9a-f]{8,17}$")]


class AlarmEvent(EventBridgeModel):
    """The EventBridge event the agent puts on the bus, its detail typed as the alarm contract."""

    source: Literal["sdcguard.agent"]
    detail_type: Literal["SDC Alarm"] = Field(alias="detail-type")
    detail: Alarm


assert (EVENT_SOURCE, DETAIL_TYPE) == ("sdcguard.agent", "SDC Alarm")  # the Literals above mirror the contract


class TaskInput(BaseModel):
    """Base of the state machine's task inputs: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


ExecutionArn = Annotated[str, Field(min_length=1, max_length=2048, pattern=r"^arn:aws[a-z-]*:states:")]


class RecordRequest(TaskInput):
    """What the incident machine hands ``record``: the alarm event, and which execution records it."""

    event: AlarmEvent
    execution_id: ExecutionArn
    """``$$.Execution.Id``: a retry of the same execution recognises its own write."""


class IncidentRef(TaskInput):
    """Input of the handlers that act on the incident as a whole."""

    incident_id: IncidentId


class InstanceRef(TaskInput):
    """Input of the per-instance handlers (the Map's iterations): cordon, replace."""

    incident_id: IncidentId
    instance_id: InstanceId
    decision: Decision | None = None
    """Accepted from state machines deployed before it was dropped, and ignored: a handler acts only on the
    decision the decide function wrote to the ledger."""


class ApprovalRequest(TaskInput):
    """Input of request_approval (``.waitForTaskToken``)."""

    incident_id: IncidentId
    task_token: Annotated[str, Field(min_length=1, max_length=2048)]
    timeout_seconds: Annotated[int, Field(ge=1)]
    evidence: dict[str, Any] | None = None
    """The evidence summary, carried in the state's input so the console shows it."""


class DecidedRef(TaskInput):
    """Input of release (the reject path): the incident."""

    incident_id: IncidentId
    decision: Decision | None = None
    """Accepted from state machines deployed before it was dropped, and ignored: release acts only on the
    decision the decide function wrote to the ledger."""


class StatusPoll(TaskInput):
    """Input of replacement_status in the wait loop."""

    incident_id: IncidentId
    attempt: Annotated[int, Field(ge=0)] = 0


class NodeCheckStart(TaskInput):
    """Input of start_node_check: which incident, and which check (reproduction on the suspects before approval,
    qualification of the replacements before the job resumes)."""

    incident_id: IncidentId
    purpose: Literal["reproduce", "qualify"]


class NodeCheckPoll(TaskInput):
    """Input of node_check_status in its wait loop."""

    incident_id: IncidentId
    purpose: Literal["reproduce", "qualify"]
    attempt: Annotated[int, Field(ge=0)] = 0


class CaughtError(BaseModel):
    """What a ``Catch`` puts at its ``ResultPath``."""

    model_config = ConfigDict(populate_by_name=True)

    error: str = Field("", alias="Error", max_length=256)
    cause: str = Field("", alias="Cause")


class FailureReport(TaskInput):
    """Input of fail and needs_attention: where it happened and what the Catch caught."""

    incident_id: IncidentId | None = None
    state: Annotated[str, Field(min_length=1, max_length=128)]
    error: CaughtError = CaughtError()
    execution_id: ExecutionArn | None = None
    """For a refused alarm (no ``incident_id``): the execution, so that an incident its ``record`` opened
    before failing is found and not reported as "nothing was opened"."""
    event: dict[str, Any] | None = None
    """For a refused alarm: the event as the execution received it."""


class DecideInput(TaskInput):
    """The decision machine's input, as a reviewer types it in the console."""

    incident_id: IncidentId
    decision: Annotated[str, Field(max_length=32)]
    reason: Annotated[str, Field(min_length=1, max_length=1024)]
    reviewer: Annotated[str, Field(min_length=1, max_length=512)]
    execution_arn: ExecutionArn
    """Added by the decide machine (``$$.Execution.Id``), not typed by the reviewer: joins CloudTrail's
    StartExecution event, which names the caller. The decide function confirms with Step Functions that it is
    a running execution of the decide machine started for this incident and decision."""


M = TypeVar("M", bound=BaseModel)


def parse_input(model: type[M], event: object) -> M:
    """``event`` parsed as ``model`` (through powertools' parser).

    Raises :class:`MalformedEvent` naming each offending field.
    """
    if not isinstance(event, dict):
        raise MalformedEvent(f"not a valid {model.__name__}: expected a JSON object, got {type(event).__name__}")
    try:
        return parse(event=event, model=model)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:10])
        raise MalformedEvent(f"not a valid {model.__name__}: {problems}") from None
    except InvalidModelTypeError as exc:  # what powertools' parser raises for input it cannot hand to the model
        raise MalformedEvent(f"not a valid {model.__name__}: {exc}") from None
