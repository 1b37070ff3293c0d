"""kubectl against the stand-in: a kubeconfig as ``aws eks update-kubeconfig`` writes it, and its credential plugin.

``write_kubeconfig`` reads the cluster's endpoint and CA from EKS
``DescribeCluster`` (on the stand-in: the local EKS API server) and merges a
cluster, a user and a context, all named by the cluster's ARN, into the
kubeconfig file, making it the current context. The user is an exec
credential plugin, ``sdcguard local exec-credential --cluster NAME``, which
``exec_credential`` implements: it prints an ``ExecCredential`` holding a
fresh EKS token, as ``aws eks get-token`` does, so the token never goes stale.

The plugin's environment in the kubeconfig points it at the stand-in (its
endpoint, region and the stand-in's dummy credentials), so kubectl works from
any shell, with or without the stand-in's exports.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
import yaml

from sdcguard.infra.local.eks.bearer_token import eks_bearer_token
from sdcguard.infra.local.seed import is_loopback

if TYPE_CHECKING:
    from mypy_boto3_eks import EKSClient
    from mypy_boto3_sts import STSClient

EXEC_API_VERSION = "client.authentication.k8s.io/v1beta1"
TOKEN_SECONDS = 15 * 60
# kubectl asks the plugin again this long before the token expires.
REFRESH_MARGIN_SECONDS = 60


class KubeconfigError(Exception):
    """The kubeconfig cannot be written as asked (no such cluster, several to choose from, not the stand-in)."""


def plugin_command(cluster_name: str) -> list[str]:
    """The command kubectl runs for a token: this installation's ``sdcguard local exec-credential``.

    The script beside the running interpreter when there is one (so kubectl
    finds it without the virtual environment on PATH), else ``python -m sdcguard``.
    """
    script = Path(sys.executable).with_name("sdcguard")
    prefix = [str(script)] if script.exists() else [sys.executable, "-m", "sdcguard"]
    return [*prefix, "local", "exec-credential", "--cluster", cluster_name]


def kubeconfig_entries(
    cluster: Mapping[str, Any], command: Sequence[str], plugin_env: Mapping[str, str]
) -> dict[str, Any]:
    """A kubeconfig with one cluster, user and context named by the cluster's ARN, from a DescribeCluster ``cluster``."""
    name = str(cluster["arn"])
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [
            {
                "name": name,
                "cluster": {
                    "server": cluster["endpoint"],
                    "certificate-authority-data": cluster["certificateAuthority"]["data"],
                },
            }
        ],
        "users": [
            {
                "name": name,
                "user": {
                    "exec": {
                        "apiVersion": EXEC_API_VERSION,
                        "command": command[0],
                        "args": list(command[1:]),
                        "env": [{"name": k, "value": v} for k, v in plugin_env.items()],
                        "interactiveMode": "Never",
                        "provideClusterInfo": False,
                    }
                },
            }
        ],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }


def merge_kubeconfig(existing: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """``existing`` with ``new``'s clusters, users and contexts added or replaced by name, and its current context."""
    merged: dict[str, Any] = dict(existing or {})
    merged.setdefault("apiVersion", "v1")
    merged.setdefault("kind", "Config")
    merged.setdefault("preferences", {})
    for section in ("clusters", "users", "contexts"):
        incoming = {entry["name"]: entry for entry in new.get(section, [])}
        kept = [entry for entry in merged.get(section) or [] if entry.get("name") not in incoming]
        merged[section] = kept + list(incoming.values())
    merged["current-context"] = new["current-context"]
    return merged


def default_path(env: Mapping[str, str]) -> Path:
    """Where kubectl reads its configuration: the first file in ``KUBECONFIG``, else ``~/.kube/config``."""
    first = next((p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p), "")
    return Path(first).expanduser() if first else Path.home() / ".kube" / "config"


def _choose_cluster(eks: EKSClient, cluster_name: str | None) -> str:
    if cluster_name:
        return cluster_name
    names = eks.list_clusters()["clusters"]
    if len(names) == 1:
        return str(names[0])
    if not names:
        raise KubeconfigError("the stand-in has no EKS cluster yet: run `sdcguard local seed` first")
    raise KubeconfigError(f"the stand-in has {len(names)} EKS clusters; choose one with --cluster: {', '.join(names)}")


def write_kubeconfig(
    cluster_name: str | None = None,
    output: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    eks_client: EKSClient | None = None,
    command: Sequence[str] | None = None,
) -> tuple[Path, str]:
    """Merge the stand-in cluster's entries into the kubeconfig ``output`` (default: ``default_path``); return the file and the context.

    ``cluster_name`` defaults to the stand-in's only EKS cluster; ``env``
    (default ``os.environ``) must point ``AWS_ENDPOINT_URL`` at the
    stand-in; ``command`` replaces the plugin command (default
    ``plugin_command``). The file is written with mode 0600. Raises
    KubeconfigError when there is no stand-in endpoint, the cluster's
    endpoint is not on loopback, or no single cluster can be chosen;
    botocore's ResourceNotFoundException for an unknown cluster.
    """
    from sdcguard.infra.local.standin import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY

    env = os.environ if env is None else env
    endpoint = env.get("AWS_ENDPOINT_URL", "")
    if not endpoint or not is_loopback(endpoint):
        raise KubeconfigError(
            "AWS_ENDPOINT_URL does not point at the local stand-in (start it with `sdcguard local up` and paste "
            "its exports); for a real cluster use `aws eks update-kubeconfig`"
        )
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or REGION
    eks = eks_client or boto3.client(
        "eks",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id=ACCESS_KEY_ID,
        aws_secret_access_key=SECRET_ACCESS_KEY,
    )
    name = _choose_cluster(eks, cluster_name)
    cluster = eks.describe_cluster(name=name)["cluster"]
    if not is_loopback(cluster["endpoint"]):
        raise KubeconfigError(f"cluster {name}'s endpoint {cluster['endpoint']} is not the local EKS API server")
    plugin_env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": region,
        "AWS_DEFAULT_REGION": region,
        # The stand-in's dummy credentials (moto accepts any, AWS none): never the caller's own.
        "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
    }
    entries = kubeconfig_entries(cluster, command or plugin_command(name), plugin_env)
    path = output or default_path(env)
    existing = yaml.safe_load(path.read_text()) if path.exists() else None
    merged = merge_kubeconfig(existing if isinstance(existing, dict) else None, entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        yaml.safe_dump(merged, handle, default_flow_style=False, sort_keys=False)
    return path, str(entries["current-context"])


def exec_credential(
    cluster_name: str, sts_client: STSClient | None = None, now: dt.datetime | None = None
) -> dict[str, Any]:
    """An ``ExecCredential`` with a fresh ``k8s-aws-v1.`` token for ``cluster_name``, as ``aws eks get-token`` prints it.

    The token lives TOKEN_SECONDS; ``expirationTimestamp`` is a minute
    earlier, so kubectl asks again before the server would refuse it.
    Raises botocore's errors when there are no credentials.
    """
    now = now or dt.datetime.now(dt.UTC)
    token = eks_bearer_token(cluster_name, sts_client, expires_in=TOKEN_SECONDS)
    expires = now + dt.timedelta(seconds=TOKEN_SECONDS - REFRESH_MARGIN_SECONDS)
    return {
        "kind": "ExecCredential",
        "apiVersion": EXEC_API_VERSION,
        "spec": {},
        "status": {"expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ"), "token": token},
    }


# What an operator runs at each stage of an incident (what the drill shows at its pauses and the docs list).
OPERATOR_STAGES = ("contained", "replaced", "released")


def operator_commands(stage: str, node: str, namespace: str, job: str) -> list[str]:
    """The kubectl lines that show an incident's ``stage`` on the cluster, for the suspect ``node`` and the PyTorchJob.

    ``contained``: the node cordoned and tainted, the incident annotations,
    the job suspended; ``replaced``: the nodes (the suspect's gone, its
    replacement Ready), the job's pods on them, the job running again;
    ``released``: the node schedulable again and the job running. Each line
    runs as it stands (no pipes). Raises ValueError for an unknown stage.
    """
    suspended = f"kubectl -n {namespace} get pytorchjob {job} -o jsonpath='{{.spec.runPolicy.suspend}}{{\"\\n\"}}'"
    pods = f"kubectl -n {namespace} get pods -o wide -l training.kubeflow.org/job-name={job}"
    if stage == "contained":
        return [
            "kubectl get nodes",
            f"kubectl get node {node} -o jsonpath='{{.spec.unschedulable}}{{\"\\n\"}}"
            f"{{range .spec.taints[*]}}{{.key}}={{.value}}:{{.effect}}{{\"\\n\"}}{{end}}'",
            f"kubectl get node {node} -o jsonpath='{{.metadata.annotations}}{{\"\\n\"}}'",
            suspended,
            pods,
        ]
    if stage == "replaced":
        return ["kubectl get nodes", pods, suspended]
    if stage == "released":
        return [
            f"kubectl get node {node} -o jsonpath='{{.spec.unschedulable}}{{\"\\n\"}}{{.spec.taints}}{{\"\\n\"}}'",
            suspended,
        ]
    raise ValueError(f"stage must be one of {', '.join(OPERATOR_STAGES)}, got {stage!r}")
