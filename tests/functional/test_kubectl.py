"""The real kubectl against the stand-in, through the kubeconfig `sdcguard local kubeconfig` writes.

Each command must exit 0, and what it changed is read back through the
official kubernetes client, the way the handlers read the cluster. kubectl
must be installed (``infra/local/install-kubectl.sh``); without it these tests
fail, they do not skip.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from infra.deploy.cfn_yaml import load_template
from infra.local.eks.auth import verify_token
from infra.local.eks.bearer_token import cluster_api_client
from infra.local.kubeconfig import (
    OPERATOR_STAGES,
    exec_credential,
    operator_commands,
    plugin_command,
    write_kubeconfig,
)
from infra.local.seed import seed
from infra.local.standin import PIPELINE_GROUP, RBAC_MANIFEST, LocalStandIn

# SDCGUARD_KUBECTL picks another binary, e.g. an older kubectl that reads the legacy discovery documents.
KUBECTL = os.environ.get("SDCGUARD_KUBECTL") or shutil.which("kubectl")
# Every kubectl run starts the credential plugin, a Python process: seconds each on a busy machine.
pytestmark = pytest.mark.slow


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def kubectl_binary() -> str:
    if KUBECTL is None:
        pytest.fail("kubectl is not installed: run infra/local/install-kubectl.sh (CI does)")
    return KUBECTL


@pytest.fixture(scope="module")
def seeded(standin: LocalStandIn) -> dict[str, Any]:
    return seed(standin, nodes=3, ranks_per_node=2, cluster=_name("kctl"), job=_name("llm"))


@pytest.fixture(scope="module")
def kubeconfig(standin: LocalStandIn, seeded: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kube") / "config"
    written, _context = write_kubeconfig(seeded["eks_cluster"], path, env=standin.env)
    return written


@pytest.fixture(scope="module")
def kube(standin: LocalStandIn, seeded: dict[str, Any]) -> Iterator[k8s.ApiClient]:
    api = cluster_api_client(seeded["eks_cluster"], standin.client("eks"), standin.client("sts"))
    yield api
    api.close()


def _run(kubectl_binary: str, kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Only the kubeconfig reaches kubectl: no AWS_* variables, a HOME of its own for its discovery cache.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(kubeconfig.parent), "KUBECONFIG": str(kubeconfig)}
    return subprocess.run(
        [kubectl_binary, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def _ok(kubectl_binary: str, kubeconfig: Path, *args: str) -> str:
    result = _run(kubectl_binary, kubeconfig, *args)
    assert result.returncode == 0, f"kubectl {' '.join(args)} failed: {result.stderr}"
    return result.stdout


def _rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.strip().splitlines()]


# --- the kubeconfig ------------------------------------------------------------------------


def test_kubeconfig_names_the_cluster_by_arn_and_uses_the_exec_plugin(
    standin: LocalStandIn, seeded: dict[str, Any], kubeconfig: Path
) -> None:
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = standin.client("eks").describe_cluster(name=seeded["eks_cluster"])["cluster"]

    assert config["current-context"] == cluster["arn"]
    [entry] = [c for c in config["clusters"] if c["name"] == cluster["arn"]]
    assert entry["cluster"]["server"] == cluster["endpoint"]
    assert entry["cluster"]["certificate-authority-data"] == cluster["certificateAuthority"]["data"]
    [user] = [u for u in config["users"] if u["name"] == cluster["arn"]]
    assert "token" not in user["user"]
    plugin = user["user"]["exec"]
    assert [plugin["command"], *plugin["args"]] == plugin_command(seeded["eks_cluster"])
    assert {e["name"]: e["value"] for e in plugin["env"]}["AWS_ENDPOINT_URL"] == standin.endpoint_url
    assert kubeconfig.stat().st_mode & 0o077 == 0


def test_kubeconfig_merges_into_an_existing_file(standin: LocalStandIn, seeded: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "config"
    other = {"name": "elsewhere", "cluster": {"server": "https://example.invalid"}}
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "clusters": [other], "current-context": "x"}))

    write_kubeconfig(seeded["eks_cluster"], path, env=standin.env)
    write_kubeconfig(seeded["eks_cluster"], path, env=standin.env)

    config = yaml.safe_load(path.read_text())
    assert next(c["name"] for c in config["clusters"]) == "elsewhere"
    assert len(config["clusters"]) == 2  # written twice, present once
    assert config["current-context"].endswith(f":cluster/{seeded['eks_cluster']}")


def test_exec_credential_holds_a_token_the_cluster_accepts(standin: LocalStandIn, seeded: dict[str, Any]) -> None:
    credential = exec_credential(seeded["eks_cluster"], standin.client("sts"))

    caller = verify_token(credential["status"]["token"])
    expires = dt.datetime.strptime(credential["status"]["expirationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")
    assert credential["kind"] == "ExecCredential"
    assert credential["apiVersion"] == "client.authentication.k8s.io/v1beta1"
    # kubectl must ask again before the server would refuse the token
    assert expires.replace(tzinfo=dt.UTC) < caller.expires_at


def test_the_plugin_command_prints_an_exec_credential(standin: LocalStandIn, seeded: dict[str, Any]) -> None:
    env = {**os.environ, **standin.env}
    result = subprocess.run(
        plugin_command(seeded["eks_cluster"]), capture_output=True, text=True, timeout=120, env=env, check=False
    )

    assert result.returncode == 0, result.stderr
    credential = json.loads(result.stdout)
    verify_token(credential["status"]["token"])


# --- kubectl --------------------------------------------------------------------------------


def test_get_nodes_prints_the_servers_table(kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any]) -> None:
    rows = _rows(_ok(kubectl_binary, kubeconfig, "get", "nodes"))

    assert rows[0] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    by_name = {row[0]: row for row in rows[1:]}
    for node in seeded["nodes"]:
        assert by_name[node["node_name"]][1] == "Ready"


def test_get_pods_wide_shows_each_pods_node(kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any]) -> None:
    rows = _rows(_ok(kubectl_binary, kubeconfig, "get", "pods", "-n", seeded["namespace"], "-o", "wide"))

    header = rows[0]
    assert header[:5] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    node_column = header.index("NODE")
    by_name = {row[0]: row for row in rows[1:]}
    for node in seeded["nodes"]:
        assert by_name[node["pod"]][node_column] == node["node_name"]
        assert by_name[node["pod"]][2] == "Running"


def test_get_pytorchjobs_shows_the_job_and_its_state(
    kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any]
) -> None:
    rows = _rows(_ok(kubectl_binary, kubeconfig, "get", "pytorchjobs", "-n", seeded["namespace"]))

    assert rows[0] == ["NAME", "STATE", "AGE"]
    assert [seeded["job"], "Running"] in [row[:2] for row in rows[1:]]


def test_cordon_and_uncordon(
    kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    node = seeded["nodes"][0]["node_name"]
    core = k8s.CoreV1Api(kube)

    assert "cordoned" in _ok(kubectl_binary, kubeconfig, "cordon", node)
    assert core.read_node(node).spec.unschedulable is True
    assert _ok(kubectl_binary, kubeconfig, "get", "node", node, "-o", "jsonpath={.spec.unschedulable}") == "true"
    status = {row[0]: row[1] for row in _rows(_ok(kubectl_binary, kubeconfig, "get", "nodes"))[1:]}
    assert status[node] == "Ready,SchedulingDisabled"

    assert "uncordoned" in _ok(kubectl_binary, kubeconfig, "uncordon", node)
    assert not core.read_node(node).spec.unschedulable
    assert _ok(kubectl_binary, kubeconfig, "get", "node", node, "-o", "jsonpath={.spec.unschedulable}") == ""


def test_get_nodes_watch_shows_a_cordon_as_it_happens(
    kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    node = seeded["nodes"][1]["node_name"]
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(kubeconfig.parent), "KUBECONFIG": str(kubeconfig)}
    watcher = subprocess.Popen(
        [kubectl_binary, "get", "nodes", "-w", "--request-timeout=60s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert watcher.stdout is not None
        assert watcher.stdout.readline().split()[:2] == ["NAME", "STATUS"]  # the list came: the watch is next
        k8s.CoreV1Api(kube).patch_node(node, {"spec": {"unschedulable": True}})
        seen = ""
        while "SchedulingDisabled" not in seen:
            line = watcher.stdout.readline()
            assert line, f"the watch ended without the cordon: {watcher.stderr.read() if watcher.stderr else ''}"
            seen = line if line.startswith(node) else ""
    finally:
        watcher.kill()
        watcher.communicate()
        k8s.CoreV1Api(kube).patch_node(node, {"spec": {"unschedulable": None}})
    assert seen.split()[:2] == [node, "Ready,SchedulingDisabled"]


def test_patch_pytorchjob_merge_suspends_and_resumes(
    kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    custom = k8s.CustomObjectsApi(kube)
    ns, job = seeded["namespace"], seeded["job"]

    def suspended() -> Any:
        obj = custom.get_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", job)
        return obj["spec"]["runPolicy"]["suspend"]

    suspend = json.dumps({"spec": {"runPolicy": {"suspend": True}}})
    resume = json.dumps({"spec": {"runPolicy": {"suspend": False}}})

    _ok(kubectl_binary, kubeconfig, "-n", ns, "patch", "pytorchjob", job, "--type", "merge", "-p", suspend)
    assert suspended() is True
    _ok(kubectl_binary, kubeconfig, "-n", ns, "patch", "pytorchjob", job, "--type", "merge", "-p", resume)
    assert suspended() is False


def test_describe_node_shows_taints_and_pods(
    kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    node, pod = seeded["nodes"][1]["node_name"], seeded["nodes"][1]["pod"]
    taint = {"key": "sdcguard.io/quarantine", "value": "inc-kubectl", "effect": "NoSchedule"}
    k8s.CoreV1Api(kube).patch_node(node, {"spec": {"taints": [taint]}})
    try:
        out = _ok(kubectl_binary, kubeconfig, "describe", "node", node)
    finally:
        k8s.CoreV1Api(kube).patch_node(node, {"spec": {"taints": None}})

    assert f"Name:               {node}" in out
    assert "Taints:             sdcguard.io/quarantine=inc-kubectl:NoSchedule" in out
    assert pod in out.split("Non-terminated Pods:")[1]


def test_drain_server_dry_run_changes_nothing(
    kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    node, pod = seeded["nodes"][2]["node_name"], seeded["nodes"][2]["pod"]
    core = k8s.CoreV1Api(kube)

    out = _ok(kubectl_binary, kubeconfig, "drain", node, "--dry-run=server", "--ignore-daemonsets")

    assert "drained (server dry run)" in out
    assert f"evicting pod {seeded['namespace']}/{pod} (server dry run)" in out
    assert not core.read_node(node).spec.unschedulable
    assert core.read_namespaced_pod(pod, seeded["namespace"]).spec.node_name == node


def test_a_bad_token_fails_kubectl(kubectl_binary: str, kubeconfig: Path, tmp_path: Path) -> None:
    # The check above can fail: the same kubeconfig with a plugin that prints a token the server refuses.
    config = yaml.safe_load(kubeconfig.read_text())
    bad = {"kind": "ExecCredential", "apiVersion": "client.authentication.k8s.io/v1beta1",
           "status": {"token": "k8s-aws-v1.bm90LWEtdXJs"}}  # fmt: skip
    for user in config["users"]:
        user["user"]["exec"].update(command=sys.executable, args=["-c", f"print({json.dumps(bad)!r})"])
    broken = tmp_path / "config"
    broken.write_text(yaml.safe_dump(config))

    result = _run(kubectl_binary, broken, "get", "nodes")

    assert result.returncode != 0
    assert "Unauthorized" in result.stderr or "must be logged in" in result.stderr


# --- RBAC: the pipeline's identity, as kubectl and the handlers' credentials see it -----------------


def test_the_stand_in_binds_the_templates_group_to_the_manifests_role() -> None:
    template = load_template(RBAC_MANIFEST.parent / "template.yaml")
    binding = next(d for d in yaml.safe_load_all(RBAC_MANIFEST.read_text()) if d["kind"] == "ClusterRoleBinding")

    assert template["Parameters"]["KubernetesGroup"]["Default"] == PIPELINE_GROUP
    assert {"kind": "Group", "name": PIPELINE_GROUP} in [
        {"kind": s["kind"], "name": s["name"]} for s in binding["subjects"]
    ]


def test_can_i_answers_for_the_pipeline_as_a_cluster_would(kubectl_binary: str, kubeconfig: Path) -> None:
    as_pipeline = ("--as", "sdcguard-pipeline", "--as-group", PIPELINE_GROUP)

    granted = _run(kubectl_binary, kubeconfig, "auth", "can-i", "patch", "nodes", *as_pipeline)
    job = _run(kubectl_binary, kubeconfig, "auth", "can-i", "patch", "pytorchjobs.kubeflow.org", *as_pipeline)
    refused = _run(kubectl_binary, kubeconfig, "auth", "can-i", "delete", "nodes", *as_pipeline)
    admin = _run(kubectl_binary, kubeconfig, "auth", "can-i", "delete", "nodes")

    assert (granted.returncode, granted.stdout.strip()) == (0, "yes")
    assert (job.returncode, job.stdout.strip()) == (0, "yes")
    assert (refused.returncode, refused.stdout.strip()) == (1, "no")
    assert (admin.returncode, admin.stdout.strip()) == (0, "yes")


def test_kubectl_as_the_pipeline_cannot_delete_a_node(
    kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    node = seeded["nodes"][0]["node_name"]

    result = _run(
        kubectl_binary, kubeconfig, "delete", "node", node, "--as", "sdcguard-pipeline", "--as-group", PIPELINE_GROUP
    )

    assert result.returncode == 1
    assert "Forbidden" in result.stderr
    assert k8s.CoreV1Api(kube).read_node(node).metadata.name == node


def test_the_handlers_credentials_get_exactly_the_manifests_grants(
    standin: LocalStandIn, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    # Temporary credentials, as the stand-in's Lambda functions have them: the pipeline's access entry.
    sts = standin.client(
        "sts", aws_access_key_id="ASIATESTING", aws_secret_access_key="testing", aws_session_token="testing"
    )
    pipeline = cluster_api_client(seeded["eks_cluster"], standin.client("eks"), sts)
    core = k8s.CoreV1Api(pipeline)
    node, pod = seeded["nodes"][0]["node_name"], seeded["nodes"][0]["pod"]
    rbac_api = k8s.RbacAuthorizationV1Api(kube)
    rules = rbac_api.read_cluster_role("sdcguard-pipeline").to_dict()["rules"]

    core.patch_node(node, {"metadata": {"annotations": {"sdcguard.io/rbac-probe": "1"}}})
    assert k8s.CoreV1Api(kube).read_node(node).metadata.annotations["sdcguard.io/rbac-probe"] == "1"
    assert core.read_namespaced_pod(pod, seeded["namespace"]).spec.node_name == node  # pods: get by name
    with pytest.raises(k8s.ApiException) as caught:
        core.delete_namespaced_pod(pod, seeded["namespace"])  # but never delete
    assert caught.value.status == 403

    # patch taken out of the role: the same call is refused, and nothing changes
    narrowed = [
        {"apiGroups": r["api_groups"], "resources": r["resources"], "verbs": [v for v in r["verbs"] if v != "patch"]}
        for r in rules
    ]
    rbac_api.patch_cluster_role("sdcguard-pipeline", {"rules": narrowed})
    try:
        with pytest.raises(k8s.ApiException) as caught:
            core.patch_node(node, {"metadata": {"annotations": {"sdcguard.io/rbac-probe": "2"}}})
    finally:
        restored = [{"apiGroups": r["api_groups"], "resources": r["resources"], "verbs": r["verbs"]} for r in rules]
        rbac_api.patch_cluster_role("sdcguard-pipeline", {"rules": restored})
        core.patch_node(node, {"metadata": {"annotations": {"sdcguard.io/rbac-probe": None}}})
    assert caught.value.status == 403
    assert "sdcguard.io/rbac-probe" not in (k8s.CoreV1Api(kube).read_node(node).metadata.annotations or {})
    pipeline.close()


# --- the lines an operator runs at each stage of an incident -----------------------------------------


def test_the_operators_lines_show_a_contained_node_and_job(
    kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    node, ns, job = seeded["nodes"][2]["node_name"], seeded["namespace"], seeded["job"]
    core, custom = k8s.CoreV1Api(kube), k8s.CustomObjectsApi(kube)
    # Contained as the cordon and suspend handlers leave it.
    taint = {"key": "sdcguard.io/quarantine", "value": "inc-lines", "effect": "NoSchedule"}
    core.patch_node(node, {"metadata": {"annotations": {"sdcguard.io/incident": "inc-lines"}},
                           "spec": {"unschedulable": True, "taints": [taint]}})  # fmt: skip
    custom.patch_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", job,
                                          {"spec": {"runPolicy": {"suspend": True}}})  # fmt: skip
    try:
        outputs = [
            _ok(kubectl_binary, kubeconfig, *shlex.split(line)[1:])
            for line in operator_commands("contained", node, ns, job)
        ]
    finally:
        core.patch_node(node, {"metadata": {"annotations": {"sdcguard.io/incident": None}},
                               "spec": {"unschedulable": None, "taints": None}})  # fmt: skip
        custom.patch_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", job,
                                              {"spec": {"runPolicy": {"suspend": False}}})  # fmt: skip

    nodes, taints, annotations, suspended, pods = outputs
    assert f"{node}   Ready,SchedulingDisabled" in nodes
    assert taints == "true\nsdcguard.io/quarantine=inc-lines:NoSchedule\n"
    assert '"sdcguard.io/incident":"inc-lines"' in annotations
    assert suspended == "true\n"
    assert node in pods
    for stage in OPERATOR_STAGES:
        assert all(line.startswith("kubectl ") for line in operator_commands(stage, node, ns, job))
