"""Gap: moto's CloudFormation builds state machines that never run.

``AWS::StepFunctions::StateMachine`` reads only ``DefinitionString``, ignores
``DefinitionSubstitutions``, and registers the machine in the plain backend,
while executions run in the parser backend that the
``execute_state_machine`` config selects. And an execution started without
a name gets an ARN ending in ``None`` (a second one then collides).

Here the CloudFormation resource takes ``Definition`` (an object),
``DefinitionString`` or ``DefinitionS3Location`` (read from the stand-in's
S3), applies ``DefinitionSubstitutions``, honours ``StateMachineType``, and
registers the machine in the backend Step Functions requests use; ``GetAtt
Arn`` works; and a nameless execution gets a unique name.

Hooks: ``StateMachine.create_from_cloudformation_json``,
``update_from_cloudformation_json``, ``delete_from_cloudformation_json``,
``get_cfn_attribute``/``has_cfn_attr``, and ``start_execution`` of both
Step Functions backends.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from moto.cloudformation.exceptions import ValidationError as CloudFormationValidationError
from moto.stepfunctions.models import StateMachine, StepFunctionBackend
from moto.stepfunctions.parser.models import StepFunctionsParserBackend
from moto.stepfunctions.responses import get_backend
from moto.stepfunctions.utils import cfn_to_api_tags

_original_get_cfn_attribute = StateMachine.get_cfn_attribute
_original_plain_start = StepFunctionBackend.start_execution
_original_parser_start = StepFunctionsParserBackend.start_execution
_SUBSTITUTION = re.compile(r"\$\{([A-Za-z0-9_.:]+)\}")


class DefinitionError(CloudFormationValidationError):
    """The resource's definition properties cannot produce a definition.

    A CloudFormation ``ValidationError``, so the caller gets a 400 naming the
    problem (moto has no rollback) and no state machine is created.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message=message)


def definition_from_properties(properties: dict[str, Any], account_id: str) -> str:
    """The ASL text a ``AWS::StepFunctions::StateMachine`` resource describes.

    Raises ``DefinitionError`` when no definition is given, when the S3
    object is missing, or when a ``${Name}`` has no substitution.
    """
    if "Definition" in properties:
        text = json.dumps(properties["Definition"])
    elif "DefinitionString" in properties:
        text = str(properties["DefinitionString"])
    elif "DefinitionS3Location" in properties:
        text = _read_s3(properties["DefinitionS3Location"], account_id)
    else:
        raise DefinitionError("state machine has none of Definition, DefinitionString, DefinitionS3Location")
    substitutions = {str(k): v for k, v in (properties.get("DefinitionSubstitutions") or {}).items()}

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in substitutions:
            raise DefinitionError(f"definition uses ${{{name}}} but DefinitionSubstitutions has no {name}")
        value = substitutions[name]
        return value if isinstance(value, str) else json.dumps(value)

    return _SUBSTITUTION.sub(substitute, text)


def _read_s3(location: dict[str, Any], account_id: str) -> str:
    from moto.s3.models import s3_backends

    backend = s3_backends[account_id]["aws"]
    try:
        key = backend.get_object(location["Bucket"], location["Key"], version_id=location.get("Version"))
    except Exception as exc:  # moto raises its own missing-bucket/key errors
        raise DefinitionError(f"DefinitionS3Location s3://{location.get('Bucket')}/{location.get('Key')}: {exc}") from exc
    if key is None:
        raise DefinitionError(f"DefinitionS3Location s3://{location['Bucket']}/{location['Key']} does not exist")
    return bytes(key.value).decode("utf-8")


def create_from_cloudformation_json(
    cls: type[StateMachine],
    resource_name: str,
    cloudformation_json: Any,
    account_id: str,
    region_name: str,
    **kwargs: Any,
) -> StateMachine:
    """Create the machine in the backend where executions run."""
    properties = cloudformation_json["Properties"]
    backend = get_backend(account_id, region_name)
    return backend.create_state_machine(
        properties.get("StateMachineName", resource_name),
        definition_from_properties(properties, account_id),
        properties.get("RoleArn", ""),
        tags=cfn_to_api_tags(properties.get("Tags", [])),
        loggingConfiguration=properties.get("LoggingConfiguration"),
        tracingConfiguration=properties.get("TracingConfiguration"),
        sm_type=properties.get("StateMachineType", "STANDARD"),
    )


def update_from_cloudformation_json(
    cls: type[StateMachine],
    original_resource: Any,
    new_resource_name: str,
    cloudformation_json: Any,
    account_id: str,
    region_name: str,
) -> StateMachine:
    """Update in place, or replace when the name changes, as CloudFormation does."""
    properties = cloudformation_json.get("Properties", {})
    name = properties.get("StateMachineName", original_resource.name)
    backend = get_backend(account_id, region_name)
    if name != original_resource.name:
        created = create_from_cloudformation_json(cls, name, cloudformation_json, account_id, region_name)
        backend.delete_state_machine(original_resource.arn)
        return created
    return backend.update_state_machine(
        original_resource.arn,
        definition=definition_from_properties(properties, account_id),
        role_arn=properties.get("RoleArn"),
    )


def delete_from_cloudformation_json(
    cls: type[StateMachine], resource_name: str, cloudformation_json: Any, account_id: str, region_name: str
) -> None:
    """Delete by ARN or by name from the backend where the machine lives."""
    backend = get_backend(account_id, region_name)
    for machine in list(backend.state_machines):
        if resource_name in (machine.arn, machine.name):
            backend.delete_state_machine(machine.arn)


def has_cfn_attr(cls: type[StateMachine], attr: str) -> bool:
    """Attributes ``Fn::GetAtt`` may read (moto lacks ``Arn``)."""
    return attr in ["Arn", "Name", "DefinitionString", "RoleArn", "StateMachineName", "Tags"]


def get_cfn_attribute(self: StateMachine, attribute_name: str) -> Any:
    """``Fn::GetAtt``, with ``Arn``."""
    if attribute_name == "Arn":
        return self.arn
    return _original_get_cfn_attribute(self, attribute_name)


def _unique_name(name: str | None) -> str:
    return name or str(uuid.uuid4())


def plain_start_execution(self: StepFunctionBackend, state_machine_arn: str, name: str, execution_input: str) -> Any:
    """``start_execution`` of the plain backend, with a unique name when none is given."""
    return _original_plain_start(self, state_machine_arn, _unique_name(name), execution_input)


def parser_start_execution(
    self: StepFunctionsParserBackend,
    state_machine_arn: str,
    name: str | None = None,
    execution_input: str | None = None,
    trace_header: str | None = None,
) -> Any:
    """``start_execution`` of the executing backend, with a unique name when none is given."""
    return _original_parser_start(
        self,
        state_machine_arn,
        _unique_name(name),
        execution_input,  # type: ignore[arg-type]
        trace_header,  # type: ignore[arg-type]
    )


def install() -> None:
    """Register CloudFormation state machines where they run; name nameless executions."""
    StateMachine.create_from_cloudformation_json = classmethod(create_from_cloudformation_json)  # type: ignore[method-assign,assignment]
    StateMachine.update_from_cloudformation_json = classmethod(update_from_cloudformation_json)  # type: ignore[method-assign,assignment]
    StateMachine.delete_from_cloudformation_json = classmethod(delete_from_cloudformation_json)  # type: ignore[method-assign,assignment]
    StateMachine.has_cfn_attr = classmethod(has_cfn_attr)  # type: ignore[method-assign,assignment]
    StateMachine.get_cfn_attribute = get_cfn_attribute  # type: ignore[method-assign]
    StepFunctionBackend.start_execution = plain_start_execution  # type: ignore[method-assign]
    StepFunctionsParserBackend.start_execution = parser_start_execution  # type: ignore[method-assign]
