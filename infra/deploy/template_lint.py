"""The field's linters on the CloudFormation template, each finding fixed or justified.

``python -m sdcguard.infra.deploy.template_lint checkov TEMPLATE...`` runs checkov's
CloudFormation checks; ``python -m sdcguard.infra.deploy.template_lint parliament
TEMPLATE...`` renders every IAM policy of the template (identity and resource
policies, with the intrinsics resolved against sample parameter values) and
runs parliament, which knows the real catalogue of actions, their resource
types and condition keys, on each. A finding fails the run unless
``lint-exceptions.yaml`` (next to this file) justifies it: an entry names the
check or issue, where it applies, and the reason; an entry that no longer
matches anything fails the run too, so the list never outlives its reasons.

checkov cannot share the project's environment (it pins its own boto3), so
it lives in its own at ``.venv/tools/checkov`` (``SDCGUARD_CHECKOV`` names
another binary). Exits 0 when clean, 1 on findings, 2 when a tool is missing.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sdcguard.infra.deploy.cfn_yaml import load_template

ROOT = Path(__file__).resolve().parents[2]
EXCEPTIONS = Path(__file__).resolve().with_name("lint-exceptions.yaml")
CHECKOV = ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov"

# Sample values for parameters without a default (and a training role, so the bus policy is rendered too).
SAMPLE_PARAMETERS = {
    "HyperPodClusterName": "ml-cluster",
    "HyperPodClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdef123456",
    "EksClusterName": "ml-eks",
    "CheckpointBucket": "ckpt-bucket",
    "CheckpointPrefix": "jobs/llama",
    "TrainingRoleArn": "arn:aws:iam::123456789012:role/trainer",
    "CodeBucket": "code-bucket",
    "CodeKey": "sdcguard/lambda.zip",
    "IncidentDefinitionKey": "sdcguard/incident.asl.json",
    "DecideDefinitionKey": "sdcguard/decide.asl.json",
}
_PSEUDO = {
    "AWS::Partition": "aws",
    "AWS::Region": "us-east-1",
    "AWS::AccountId": "123456789012",
    "AWS::StackName": "sdcguard",
    "AWS::StackId": "arn:aws:cloudformation:us-east-1:123456789012:stack/sdcguard/0d5c1a10-0000-4000-8000-000000000000",
    "AWS::URLSuffix": "amazonaws.com",
}
_NO_VALUE = object()


class ToolMissing(RuntimeError):
    """A linter this check needs is not installed."""


@dataclass(frozen=True)
class Finding:
    tool: str
    check: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.tool} {self.check} at {self.where}: {self.detail}"


# -- the exceptions file ------------------------------------------------------------------------


def load_exceptions(path: Path = EXCEPTIONS) -> dict[str, list[dict[str, Any]]]:
    """The justified findings by tool. Raises ValueError for an entry without a check, a place or a reason."""
    data = yaml.safe_load(path.read_text()) or {}
    for tool, entries in data.items():
        for entry in entries:
            missing = [k for k in ("check", "where", "reason") if not str(entry.get(k, "")).strip()]
            if missing:
                raise ValueError(f"{path.name}: {tool} entry {entry}: needs {', '.join(missing)}")
    return data


def unjustified(findings: Sequence[Finding], entries: Sequence[Mapping[str, Any]]) -> tuple[list[Finding], list[str]]:
    """(findings no entry justifies, entries that justify nothing); ``where`` patterns are fnmatch globs."""

    def matches(entry: Mapping[str, Any], finding: Finding) -> bool:
        places = entry["where"] if isinstance(entry["where"], list) else [entry["where"]]
        return entry["check"] == finding.check and any(fnmatch.fnmatchcase(finding.where, p) for p in places)

    left = [f for f in findings if not any(matches(e, f) for e in entries)]
    stale = [f"{e['check']} at {e['where']}" for e in entries if not any(matches(e, f) for f in findings)]
    return left, stale


# -- checkov -------------------------------------------------------------------------------------


def checkov_binary() -> Path:
    """The checkov executable. Raises :class:`ToolMissing` saying how to get it."""
    binary = Path(os.environ.get("SDCGUARD_CHECKOV") or CHECKOV)
    if not binary.is_file():
        raise ToolMissing(
            f"checkov not found at {binary}: `./dev setup` installs it into its own environment "
            "(.venv/tools/checkov; it cannot share .venv, it pins its own boto3)"
        )
    return binary


def checkov_findings(template: Path) -> list[Finding]:
    """checkov's failed CloudFormation checks on ``template``, as ``CKV_ID`` at ``Type.LogicalId``."""
    result = subprocess.run(
        [str(checkov_binary()), "--file", str(template), "--framework", "cloudformation", "--output", "json",
         "--quiet", "--compact", "--skip-download"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if result.returncode not in (0, 1):
        raise RuntimeError(f"checkov failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    reports = json.loads(result.stdout or "[]")
    out = []
    for report in reports if isinstance(reports, list) else [reports]:
        for failed in report.get("results", {}).get("failed_checks", []):
            out.append(Finding("checkov", failed["check_id"], failed["resource"], failed["check_name"]))
    return out


# -- parliament ---------------------------------------------------------------------------------


def _parliament() -> Any:
    """parliament, imported. It still reads its data through ``pkg_resources``, gone from setuptools 81+."""
    if "pkg_resources" not in sys.modules:
        try:
            import pkg_resources  # noqa: F401
        except ImportError:
            import importlib.resources
            import types

            shim = types.ModuleType("pkg_resources")
            shim.resource_filename = lambda package, name: str(importlib.resources.files(package) / name)  # type: ignore[attr-defined]
            sys.modules["pkg_resources"] = shim
    try:
        import parliament
    except ImportError as exc:
        raise ToolMissing(f"parliament is not installed ({exc}): it is a dev requirement") from None
    return parliament


class _Renderer:
    """Resolves the intrinsics of one template against sample values, as CloudFormation would."""

    def __init__(self, template: Mapping[str, Any], parameters: Mapping[str, str]) -> None:
        self.template = template
        self.resources: Mapping[str, Any] = template.get("Resources", {})
        self.values: dict[str, Any] = {
            name: str(spec["Default"]) for name, spec in template.get("Parameters", {}).items() if "Default" in spec
        }
        self.values.update(parameters)
        self.values.update(_PSEUDO)

    def condition(self, name: str) -> bool:
        return bool(self.render(self.template["Conditions"][name]))

    def render(self, node: Any) -> Any:
        if isinstance(node, list):
            return [v for v in (self.render(x) for x in node) if v is not _NO_VALUE]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (key, arg), = node.items()
            if key == "Ref":
                return self.ref(arg)
            if key == "Fn::GetAtt":
                name, attribute = arg if isinstance(arg, list) else arg.split(".", 1)
                return self.get_att(name, attribute)
            if key == "Fn::Sub":
                return self.sub(arg)
            if key == "Fn::If":
                name, then, otherwise = arg
                return self.render(then if self.condition(name) else otherwise)
            if key == "Fn::Equals":
                a, b = self.render(arg)
                return str(a) == str(b)
            if key == "Fn::Not":
                return not self.render(arg[0])
            if key == "Fn::And":
                return all(self.render(arg))
            if key == "Fn::Or":
                return any(self.render(arg))
            if key == "Condition":
                return self.condition(arg)
            if key == "Fn::Join":
                separator, parts = arg
                return separator.join(str(p) for p in self.render(parts))
            if key == "Fn::Split":
                separator, text = arg
                return str(self.render(text)).split(separator)
            if key == "Fn::Select":
                index, items = arg
                return self.render(items)[int(index)]
        out = {}
        for key, value in node.items():
            rendered = self.render(value)
            if rendered is not _NO_VALUE:
                out[key] = rendered
        return out

    def ref(self, name: str) -> Any:
        if name == "AWS::NoValue":
            return _NO_VALUE
        if name in self.values:
            return self.values[name]
        resource = self.resources[name]
        kind = resource["Type"]
        if kind in ("AWS::SNS::Topic", "AWS::StepFunctions::StateMachine", "AWS::IAM::ManagedPolicy"):
            return self.get_att(name, "Arn")
        if kind == "AWS::KMS::Key":
            return "0d5c1a10-0000-4000-8000-00000000000b"
        if kind == "AWS::SQS::Queue":
            return f"https://sqs.us-east-1.amazonaws.com/123456789012/{name}"
        return self._name(name)

    def _name(self, name: str) -> str:
        props = self.resources[name].get("Properties", {})
        for key in ("FunctionName", "StateMachineName", "Name", "LogGroupName", "TableName", "TopicName"):
            if key in props:
                return str(self.render(props[key]))
        return f"sdcguard-{name}"

    def get_att(self, name: str, attribute: str) -> str:
        kind = self.resources[name]["Type"]
        region, account, resource_name = "us-east-1", "123456789012", self._name(name)
        if attribute in ("Name", "QueueName"):
            return resource_name
        arns = {
            "AWS::Lambda::Function": f"arn:aws:lambda:{region}:{account}:function:{resource_name}",
            "AWS::Logs::LogGroup": f"arn:aws:logs:{region}:{account}:log-group:{resource_name}:*",
            "AWS::DynamoDB::Table": f"arn:aws:dynamodb:{region}:{account}:table/{resource_name}",
            "AWS::SQS::Queue": f"arn:aws:sqs:{region}:{account}:{resource_name}",
            "AWS::SNS::Topic": f"arn:aws:sns:{region}:{account}:{resource_name}",
            "AWS::Events::EventBus": f"arn:aws:events:{region}:{account}:event-bus/{resource_name}",
            "AWS::Events::Rule": f"arn:aws:events:{region}:{account}:rule/{resource_name}",
            "AWS::StepFunctions::StateMachine": f"arn:aws:states:{region}:{account}:stateMachine:{resource_name}",
            "AWS::KMS::Key": f"arn:aws:kms:{region}:{account}:key/0d5c1a10-0000-4000-8000-00000000000b",
            "AWS::IAM::Role": f"arn:aws:iam::{account}:role/{resource_name}",
            "AWS::IAM::ManagedPolicy": f"arn:aws:iam::{account}:policy/{resource_name}",
        }
        if kind not in arns:
            raise ValueError(f"no sample ARN for {name} ({kind})")
        return arns[kind]

    def sub(self, arg: Any) -> str:
        text, variables = (arg, {}) if isinstance(arg, str) else (arg[0], self.render(arg[1]))
        out, i = [], 0
        while i < len(text):
            start = text.find("${", i)
            if start < 0:
                out.append(text[i:])
                break
            end = text.index("}", start)
            out.append(text[i:start])
            name = text[start + 2 : end]
            if name.startswith("!"):
                out.append("${" + name[1:] + "}")
            elif name in variables:
                out.append(str(variables[name]))
            elif "." in name and name.split(".", 1)[0] in self.resources:
                out.append(self.get_att(*name.split(".", 1)))
            else:
                out.append(str(self.ref(name)))
            i = end + 1
        return "".join(out)


def template_policies(template: Mapping[str, Any], parameters: Mapping[str, str] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every IAM policy document of ``template``, rendered: (``LogicalId[.PolicyName]``, document).

    Identity policies (roles' inline policies, managed policies) and resource
    policies (bus, queue, key). Trust policies are left out: parliament reads
    them as identity policies and reports their principals as errors.
    """
    renderer = _Renderer(template, {**SAMPLE_PARAMETERS, **(parameters or {})})
    for name, resource in template.get("Resources", {}).items():
        kind, props = resource["Type"], resource.get("Properties", {})
        documents: list[tuple[str, Any]] = []
        if kind == "AWS::IAM::Role":
            documents = [(f"{name}.{p['PolicyName']}", p["PolicyDocument"]) for p in props.get("Policies", [])]
        elif kind in ("AWS::IAM::ManagedPolicy", "AWS::IAM::Policy", "AWS::SQS::QueuePolicy", "AWS::SNS::TopicPolicy"):
            documents = [(name, props["PolicyDocument"])]
        elif kind == "AWS::Events::EventBus" and "Policy" in props:
            documents = [(name, props["Policy"])]
        elif kind == "AWS::KMS::Key":
            documents = [(name, props["KeyPolicy"])]
        for where, document in documents:
            rendered = renderer.render(document)
            if rendered is not _NO_VALUE and rendered:
                yield where, rendered


def parliament_findings(template: Path) -> list[Finding]:
    """parliament's findings on every policy statement of ``template``, at ``LogicalId[.PolicyName].Sid``.

    Each statement is analysed as a policy of its own, so that a finding names
    the statement it is about (parliament reports only a line and column).
    """
    parliament = _parliament()
    out = []
    for where, document in template_policies(load_template(template)):
        statements = document.get("Statement", [])
        for i, statement in enumerate(statements if isinstance(statements, list) else [statements]):
            place = f"{where}.{statement.get('Sid') or f'[{i}]'}"
            single = {"Version": document.get("Version", "2012-10-17"), "Statement": [statement]}
            for finding in parliament.analyze_policy_string(json.dumps(single)).findings:
                detail = finding.detail if isinstance(finding.detail, str) else json.dumps(finding.detail, default=str)
                out.append(Finding("parliament", finding.issue, place, detail))
    return out


# -- the command ---------------------------------------------------------------------------------


def run(tool: str, templates: Sequence[Path], exceptions: Path = EXCEPTIONS) -> int:
    """Lint ``templates`` with ``tool``; print what is unjustified; 0 clean, 1 findings, 2 tool missing."""
    try:
        entries = load_exceptions(exceptions).get(tool, [])
        findings = [f for t in templates for f in (checkov_findings(t) if tool == "checkov" else parliament_findings(t))]
    except ToolMissing as exc:
        print(f"{tool}: {exc}", file=sys.stderr)
        return 2
    left, stale = unjustified(findings, entries)
    for finding in left:
        print(f"{finding}  (fix it, or justify it in {exceptions.name})")
    for entry in stale:
        print(f"{tool}: {exceptions.name} justifies {entry}, which no longer occurs: remove the entry")
    justified = len(findings) - len(left)
    print(f"{tool}: {len(left)} unjustified finding(s), {justified} justified in {exceptions.name}, {len(stale)} stale")
    return 1 if left or stale else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in ("checkov", "parliament"):
        print("usage: python -m sdcguard.infra.deploy.template_lint {checkov|parliament} TEMPLATE...", file=sys.stderr)
        return 2
    return run(args[0], [Path(a) for a in args[1:]])


if __name__ == "__main__":
    sys.exit(main())
