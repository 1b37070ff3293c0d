"""Reading CloudFormation YAML: the short-form intrinsic tags (``!Ref``, ``!Sub``, ...) as plain data.

PyYAML refuses unknown tags; CloudFormation's short forms are tags. This loader
turns each into the long form CloudFormation itself uses (``!Ref X`` becomes
``{"Ref": "X"}``, ``!GetAtt A.B`` becomes ``{"Fn::GetAtt": ["A", "B"]}``), so
the template can be inspected as data by the deploy script and the tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class _CfnLoader(yaml.SafeLoader):
    """A safe loader that also knows CloudFormation's short-form tags."""


def _intrinsic(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node) -> dict[str, Any]:
    value: Any
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        assert isinstance(node, yaml.MappingNode)
        value = loader.construct_mapping(node, deep=True)
    if tag_suffix == "Ref":
        return {"Ref": value}
    if tag_suffix == "GetAtt" and isinstance(value, str):
        resource, _, attribute = value.partition(".")
        return {"Fn::GetAtt": [resource, attribute]}
    if tag_suffix == "Condition":
        return {"Condition": value}
    return {f"Fn::{tag_suffix}": value}


_CfnLoader.add_multi_constructor("!", _intrinsic)


def load_template(path: str | Path) -> dict[str, Any]:
    """The template at ``path`` as a dict, intrinsic functions in their long form.

    Raises ``OSError`` if it cannot be read and ``ValueError`` if it is not a
    YAML mapping with a ``Resources`` section.
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        # A SafeLoader subclass: no arbitrary objects, only the intrinsic tags.
        data = yaml.load(text, Loader=_CfnLoader)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("Resources"), dict):
        raise ValueError(f"{path}: not a CloudFormation template (no Resources mapping)")
    return data
