"""Gap: moto's EventBridge delivers only to logs, SQS, archives and other buses.

It has no Step Functions or Lambda targets, ignores ``InputPath``, delivers to
DISABLED rules, and has no dead-letter queues. Here a rule's delivery:

- does nothing when the rule is DISABLED;
- shapes each target's input as EventBridge does: the whole event, or
  ``Input`` (a fixed JSON text), ``InputPath`` (a JSONPath into the event) or
  ``InputTransformer`` (``InputPathsMap`` + ``InputTemplate``);
- starts an execution for a Step Functions target (in the backend that runs
  executions) and invokes a Lambda target asynchronously;
- sends an event whose delivery failed to the target's
  ``DeadLetterConfig`` SQS queue with EventBridge's error attributes;
- leaves the kinds of target moto already handles to moto.

Hook: ``moto.events.models.Rule.send_to_targets``.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import threading
from typing import Any

from jsonpath_ng.ext import parse as jsonpath
from moto.core.utils import iso_8601_datetime_without_milliseconds, utcfromtimestamp
from moto.events.models import Rule
from moto.utilities.arns import parse_arn

logger = logging.getLogger(__name__)

_original_send_to_targets = Rule.send_to_targets
_PLACEHOLDER = re.compile(r"<([A-Za-z0-9_.\-]+)>")


class DeliveryError(Exception):
    """A target could not take the event; the reason goes to its dead-letter queue."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _public_event(event: dict[str, Any]) -> dict[str, Any]:
    """The event as a target sees it: an ISO time, no moto-internal fields."""
    public = {k: v for k, v in copy.deepcopy(event).items() if k != "ingestion-time"}
    if isinstance(public.get("time"), int | float):
        public["time"] = iso_8601_datetime_without_milliseconds(utcfromtimestamp(public["time"]))
    return public


def _first(path: str, event: dict[str, Any]) -> Any:
    matches = jsonpath(path).find(event)
    if not matches:
        return None
    return matches[0].value


def render_input(target: dict[str, Any], event: dict[str, Any], rule_name: str, rule_arn: str) -> str:
    """The text EventBridge would hand ``target`` for ``event``.

    Raises ``DeliveryError`` when the target's input settings cannot be applied.
    """
    if "Input" in target and target["Input"] is not None:
        return str(target["Input"])
    if target.get("InputPath"):
        try:
            return json.dumps(_first(target["InputPath"], event))
        except Exception as exc:
            raise DeliveryError("InvalidInputPath", f"InputPath {target['InputPath']!r}: {exc}") from exc
    transformer = target.get("InputTransformer")
    if not transformer:
        return json.dumps(event)
    values: dict[str, Any] = {}
    for name, path in (transformer.get("InputPathsMap") or {}).items():
        try:
            values[name] = _first(path, event)
        except Exception as exc:
            raise DeliveryError("InvalidInputPath", f"InputPathsMap {name}={path!r}: {exc}") from exc
    values["aws.events.rule-arn"] = rule_arn
    values["aws.events.rule-name"] = rule_name
    values["aws.events.event"] = event
    values["aws.events.event.json"] = event
    values["aws.events.event.ingestion-time"] = event.get("time")
    template = str(transformer.get("InputTemplate", ""))

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            return match.group(0)
        value = values[name]
        inside_quotes = (
            match.start() > 0
            and template[match.start() - 1] == '"'
            and match.end() < len(template)
            and template[match.end()] == '"'
        )
        if inside_quotes:
            # Within a JSON string a value is spliced in as text, escaped.
            text = value if isinstance(value, str) else json.dumps(value)
            return json.dumps(text)[1:-1]
        if value is None:
            return "null"
        return json.dumps(value)

    return _PLACEHOLDER.sub(substitute, template)


def _start_execution(arn: str, text: str, account: str, region: str) -> None:
    from moto.stepfunctions.responses import get_backend

    try:
        json.loads(text)
    except ValueError as exc:
        raise DeliveryError("InvalidInput", f"input for {arn} is not JSON: {exc}") from exc
    try:
        get_backend(account, region).start_execution(arn, name=None, execution_input=text)  # type: ignore[arg-type]
    except Exception as exc:  # whatever the backend refuses is a failed delivery
        raise DeliveryError(type(exc).__name__, str(exc)) from exc


def _invoke_function(arn: str, text: str, account: str, region: str) -> None:
    from moto.awslambda.exceptions import LambdaClientError
    from moto.awslambda.models import lambda_backends

    try:
        fn = lambda_backends[account][region].get_function(arn, None)
    except LambdaClientError as exc:
        raise DeliveryError("ResourceNotFoundException", str(exc)) from exc
    # EventBridge invokes Lambda targets asynchronously.
    threading.Thread(target=fn._invoke_lambda, args=(text,), daemon=True).start()


def _dead_letter(rule: Rule, target: dict[str, Any], event: dict[str, Any], error: DeliveryError) -> None:
    from moto.sqs.models import sqs_backends

    queue_arn = (target.get("DeadLetterConfig") or {}).get("Arn")
    if not queue_arn:
        logger.warning("event %s to %s failed (%s) and the target has no DLQ", event.get("id"), target["Arn"], error)
        return
    queue = parse_arn(queue_arn)
    attributes = {
        "RULE_ARN": rule.arn,
        "TARGET_ARN": target["Arn"],
        "ERROR_CODE": error.code,
        "ERROR_MESSAGE": str(error)[:256],
    }
    sqs_backends[queue.account][queue.region].send_message(
        queue_name=queue.resource_id,
        message_body=json.dumps(event),
        message_attributes={k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()},
    )


def send_to_targets(self: Rule, original_event: Any, transform_input: bool = True) -> None:
    """Replacement for ``Rule.send_to_targets``."""
    if self.state != "ENABLED":
        return
    if not self.event_pattern.matches_event(original_event):
        return
    others = []
    for target in self.targets:
        arn = parse_arn(target["Arn"])
        if arn.service not in ("states", "lambda"):
            others.append(target)
            continue
        event = _public_event(original_event)
        try:
            text = render_input(target, event, self.name, self.arn) if transform_input else json.dumps(event)
            if arn.service == "states":
                _start_execution(target["Arn"], text, arn.account, arn.region)
            else:
                _invoke_function(target["Arn"], text, arn.account, arn.region)
        except DeliveryError as exc:
            _dead_letter(self, target, event, exc)
    if others:
        # A shallow copy, so a concurrent delivery on the same rule still sees all targets.
        narrowed = copy.copy(self)
        narrowed.targets = others
        _original_send_to_targets(narrowed, original_event, transform_input)


def install() -> None:
    """Make EventBridge rules deliver to Step Functions and Lambda, and respect DISABLED."""
    Rule.send_to_targets = send_to_targets  # type: ignore[method-assign]
