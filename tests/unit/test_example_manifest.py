"""examples/k8s/pytorchjob.yaml: a valid kubeflow.org/v1 PyTorchJob (the fields it uses) that keeps the agent's policy.

The schema below is the part of the PyTorchJob API (training-operator's
``pkg/apis/kubeflow.org/v1``: PyTorchJobSpec, RunPolicy, ElasticPolicy,
ReplicaSpec, and the operator's own validation: replica types Master and
Worker, one Master, a container named ``pytorch`` with an image) and of the
pod template that the manifest uses, closed to unknown keys so that a
misspelt field fails. The policy is what the agent needs: the downward-API
variables, settings that GuardConfig accepts and that name this job, and no
restart of a rank that stopped with exit code 87.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from torch.distributed.run import parse_args

from sdcguard.agent.config import ALARM_EXIT_CODE, ENV_PREFIX, GuardConfig

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "examples" / "k8s" / "pytorchjob.yaml"
WRAPPER = "examples/k8s/torchrun_keep_alarm.py"
SCRIPT = "examples/gpt_ddp_guarded.py"


def _closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string", "minLength": 1}
_ENV = _closed({
    "name": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
    "value": {"type": "string"},
    "valueFrom": _closed({"fieldRef": _closed({"fieldPath": _STR}, ("fieldPath",))}, ("fieldRef",)),
}, ("name",))
_CONTAINER = _closed({
    "name": _STR,
    "image": _STR,
    "workingDir": _STR,
    "command": {"type": "array", "items": {"type": "string"}},
    "args": {"type": "array", "items": {"type": "string"}},
    "ports": {"type": "array", "items": _closed({"name": _STR, "containerPort": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 65535}},
                                                ("containerPort",))},
    "env": {"type": "array", "items": _ENV},
    "resources": _closed({"limits": {"type": "object"}, "requests": {"type": "object"}}),
}, ("name", "image"))
_REPLICA = _closed({
    "replicas": _INT,
    "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
    "template": _closed({
        "metadata": {"type": "object"},
        "spec": _closed({
            "serviceAccountName": _STR,
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            # The operator refuses a replica without a container named "pytorch".
            "containers": {"type": "array", "minItems": 1, "items": _CONTAINER,
                           "contains": {"properties": {"name": {"const": "pytorch"}}}},
        }, ("containers",)),
    }, ("spec",)),
}, ("template",))
PYTORCHJOB_SCHEMA: dict[str, Any] = _closed({
    "apiVersion": {"const": "kubeflow.org/v1"},
    "kind": {"const": "PyTorchJob"},
    "metadata": _closed({
        # PyTorchJob names are DNS-1035 labels (ValidateV1PyTorchJob).
        "name": {"type": "string", "pattern": r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"},
        "namespace": _STR,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    }, ("name",)),
    "spec": _closed({
        "nprocPerNode": {"type": "string"},
        "runPolicy": _closed({
            "suspend": {"type": "boolean"},
            "backoffLimit": _INT,
            "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
            "ttlSecondsAfterFinished": _INT,
            "activeDeadlineSeconds": _INT,
        }),
        "elasticPolicy": _closed({
            "minReplicas": _INT,
            "maxReplicas": _INT,
            "rdzvBackend": {"enum": ["c10d", "etcd", "etcd-v2"]},
            "rdzvPort": _INT,
            "rdzvHost": _STR,
            "rdzvId": _STR,
            "maxRestarts": _INT,
        }),
        "pytorchReplicaSpecs": _closed({
            "Master": {"allOf": [_REPLICA, {"properties": {"replicas": {"const": 1}}}]},
            "Worker": _REPLICA,
        }),
    }, ("pytorchReplicaSpecs",)),
}, ("apiVersion", "kind", "metadata", "spec"))

# What the operator sets in each pod and Kubernetes expands in the command: sample values to parse it.
OPERATOR_ENV = {"WORLD_SIZE": "3", "RANK": "1", "MASTER_ADDR": "gpt-guarded-master-0", "MASTER_PORT": "23456"}


def load() -> dict[str, Any]:
    return yaml.safe_load(MANIFEST.read_text())


def schema_errors(job: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(PYTORCHJOB_SCHEMA)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(job))


def _container(spec: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in spec["template"]["spec"]["containers"] if c["name"] == "pytorch")


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a container's command."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def policy_violations(job: dict[str, Any]) -> list[str]:
    """What in ``job`` breaks the agent's contract (empty when none)."""
    found: list[str] = []
    spec = job["spec"]
    elastic = spec.get("elasticPolicy")
    if elastic is not None and elastic.get("maxRestarts", 0) != 0:
        found.append("elasticPolicy.maxRestarts: an elastic torchrun restarts its workers in place")
    meta = job["metadata"]
    for kind, replica in spec["pytorchReplicaSpecs"].items():
        where = f"pytorchReplicaSpecs.{kind}"
        if replica.get("restartPolicy") != "ExitCode":
            found.append(f"{where}.restartPolicy: must be ExitCode, so that exit code 87 is never restarted")
        container = _container(replica)
        env = {e["name"]: e for e in container.get("env", [])}
        for name, path in (("NODE_NAME", "spec.nodeName"), ("POD_NAME", "metadata.name")):
            if env.get(name, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != path:
                found.append(f"{where}: {name} must come from the downward API ({path})")
        literal = {n: e["value"] for n, e in env.items() if "value" in e}
        settings = {n: v for n, v in literal.items() if n.startswith(ENV_PREFIX)}
        try:
            config = GuardConfig.from_env(settings)
        except ValueError as exc:
            found.append(f"{where}: {exc}")
            continue
        fields = {f"{ENV_PREFIX}{name.upper()}" for name in GuardConfig.__dataclass_fields__}
        found += [f"{where}: {n} is not a GuardConfig setting" for n in env if n.startswith(ENV_PREFIX)
                  and n not in fields]
        if config.on_alarm != "stop":
            found.append(f"{where}: SDCGUARD_ON_ALARM must be stop (exit code {ALARM_EXIT_CODE})")
        if not config.checkpoint_prefix.startswith("s3://"):
            found.append(f"{where}: SDCGUARD_CHECKPOINT_PREFIX must be an s3:// prefix (pods do not share disks)")
        for name, own, path in (("SDCGUARD_NAMESPACE", meta.get("namespace", "default"), "metadata.namespace"),
                                ("SDCGUARD_JOB_NAME", meta["name"],
                                 "metadata.labels['training.kubeflow.org/job-name']")):
            entry = env.get(name, {})
            if entry.get("value") != own and entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != path:
                found.append(f"{where}: {name} must name this job ({own!r})")
        found += _command_violations(where, container, {**OPERATOR_ENV, **literal})
    return found


def _command_violations(where: str, container: dict[str, Any], env: dict[str, str]) -> list[str]:
    command = [_expand(a, env) for a in container.get("command", []) + container.get("args", [])]
    if command[:2] != ["python", WRAPPER] or "--" not in command:
        return [f"{where}: the command must run torchrun through {WRAPPER} (torchrun alone exits 1, never 87)"]
    torchrun = parse_args(command[command.index("--") + 1:])
    found = []
    if torchrun.max_restarts != 0:
        found.append(f"{where}: torchrun --max-restarts must be 0 (restarts stay on the same node)")
    if torchrun.training_script != SCRIPT:
        found.append(f"{where}: torchrun must run {SCRIPT}, got {torchrun.training_script}")
    else:
        example = _example_parser().parse_args(torchrun.training_script_args)
        if example.checkpoint_dir != env.get("SDCGUARD_CHECKPOINT_PREFIX"):
            found.append(f"{where}: the example must checkpoint to SDCGUARD_CHECKPOINT_PREFIX")
    return found


def _example_parser() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location("gpt_ddp_guarded", ROOT / SCRIPT)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return module.parser()


# -- the manifest as shipped -------------------------------------------------------------------------


def test_the_manifest_is_a_pytorchjob_in_the_fields_it_uses() -> None:
    assert schema_errors(load()) == []


def test_the_manifest_keeps_the_agents_policy() -> None:
    assert policy_violations(load()) == []


def test_87_is_a_permanent_failure_under_exit_code_restarts() -> None:
    # training-operator: IsRetryableExitCode(code) is code >= 128 (signals); anything below fails the job.
    assert ALARM_EXIT_CODE < 128


def test_every_replica_runs_the_same_pod_and_the_scripts_exist() -> None:
    job = load()
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]
    assert (ROOT / WRAPPER).is_file()
    assert (ROOT / SCRIPT).is_file()
    # Kubernetes expands $(VAR) only for variables the container defines (or the operator adds).
    container = _container(replicas["Master"])
    defined = {e["name"] for e in container["env"]} | set(OPERATOR_ENV)
    used = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(container["command"])))
    assert used <= defined


# -- the checks can fail -----------------------------------------------------------------------------


def _mutated(change: Any) -> dict[str, Any]:
    job = copy.deepcopy(load())
    change(job)
    return job


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    return _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])


def _set_env(name: str, value: str) -> Any:
    def change(job: dict[str, Any]) -> None:
        for replica in job["spec"]["pytorchReplicaSpecs"].values():
            env = _container(replica)["env"]
            env[:] = [e for e in env if e["name"] != name] + [{"name": name, "value": value}]
    return change


@pytest.mark.parametrize(("change", "expected"), [
    (lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartpolicy="Never"), "restartpolicy"),
    (lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="Sometimes"), "Sometimes"),
    (lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2), "1 was expected"),
    (lambda j: j["spec"]["runPolicy"].update(cleanPodPolicy="Some"), "Some"),
    (lambda j: j["spec"]["runPolicy"].update(suspend="no"), "'no' is not of type 'boolean'"),
    (lambda j: _pod(j).update(name="trainer"), "contain"),
    (lambda j: j["metadata"].update(name="GPT_guarded"), "does not match"),
    (lambda j: j["spec"].update(elasticPolicy={"maxRestart": 0}), "maxRestart"),
], ids=["misspelt-field", "unknown-restart-policy", "two-masters", "clean-pod-policy", "suspend-type",
        "no-pytorch-container", "bad-name", "elastic-typo"])
def test_the_schema_rejects(change: Any, expected: str) -> None:
    errors = schema_errors(_mutated(change))
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize(("change", "expected"), [
    (lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="OnFailure"), "must be ExitCode"),
    (lambda j: j["spec"].update(elasticPolicy={"maxRestarts": 3}), "elasticPolicy.maxRestarts"),
    (lambda j: _pod(j)["command"].__setitem__(slice(None), ["torchrun", *_pod(j)["command"][4:]]), WRAPPER),
    (lambda j: _pod(j)["command"].__setitem__(_pod(j)["command"].index("--max-restarts=0"), "--max-restarts=2"),
     "--max-restarts must be 0"),
    (lambda j: _pod(j)["env"].pop(0), "NODE_NAME"),
    (_set_env("SDCGUARD_AUDIT_EVERY", "-1"), "audit_every"),
    (_set_env("SDCGUARD_ON_ALARM", "continue"), "SDCGUARD_ON_ALARM must be stop"),
    (_set_env("SDCGUARD_AUDITEVERY", "10"), "SDCGUARD_AUDITEVERY is not a GuardConfig setting"),
    (_set_env("SDCGUARD_JOB_NAME", "another-job"), "SDCGUARD_JOB_NAME must name this job"),
    (_set_env("SDCGUARD_CHECKPOINT_PREFIX", "checkpoints"), "s3:// prefix"),
], ids=["on-failure", "elastic-restarts", "bare-torchrun", "torchrun-restarts", "no-node-name", "bad-setting",
        "on-alarm-continue", "unknown-setting", "other-job", "local-checkpoints"])
def test_the_policy_rejects(change: Any, expected: str) -> None:
    job = _mutated(change)
    assert schema_errors(job) == []
    found = policy_violations(job)
    assert any(expected in v for v in found), found
