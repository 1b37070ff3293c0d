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

from sdcguard.infra.deploy.cfn_yaml import load_template
from sdcguard.infra.local.eks.auth import verify_token
from sdcguard.infra.local.eks.bearer_token import cluster_api_client
from sdcguard.infra.local.kubeconfig import (
    OPERATOR_STAGES,
    exec_credential,
    operator_commands,
    plugin_command,
    write_kubeconfig,
)
from sdcguard.infra.local.seed import seed
from sdcguard.infra.local.standin import (
    PIPELINE_GROUP,
    RBAC_MANIFEST,
    RBAC_NAMESPACE_MANIFEST,
    READ_GROUP,
    LocalStandIn,
)

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


def test_the_stand_in_binds_the_templates_groups_to_the_manifests_roles() -> None:
    parameters = load_template(RBAC_MANIFEST.parent / "template.yaml")["Parameters"]
    bindings = [
        d for path in (RBAC_MANIFEST, RBAC_NAMESPACE_MANIFEST) for d in yaml.safe_load_all(path.read_text())
        if d["kind"].endswith("Binding")
    ]  # fmt: skip

    assert parameters["KubernetesGroup"]["Default"] == PIPELINE_GROUP
    assert parameters["KubernetesReadGroup"]["Default"] == READ_GROUP
    bound = {(b["kind"], s["name"]) for b in bindings for s in b["subjects"]}
    assert bound == {(kind, group) for kind in ("ClusterRoleBinding", "RoleBinding") for group in (PIPELINE_GROUP, READ_GROUP)}


def test_can_i_answers_for_the_pipeline_as_a_cluster_would(
    kubectl_binary: str, kubeconfig: Path, seeded: dict[str, Any]
) -> None:
    as_pipeline = ("--as", "sdcguard-pipeline", "--as-group", PIPELINE_GROUP)
    as_reader = ("--as", "sdcguard-pipeline-read", "--as-group", READ_GROUP)
    ns = seeded["namespace"]

    def can_i(*args: str) -> tuple[int, str]:
        result = _run(kubectl_binary, kubeconfig, "auth", "can-i", *args)
        return result.returncode, result.stdout.strip()

    assert can_i("patch", "nodes", *as_pipeline) == (0, "yes")
    assert can_i("patch", "pytorchjobs.kubeflow.org", "-n", ns, *as_pipeline) == (0, "yes")
    assert can_i("create", "jobs.batch", "-n", ns, *as_pipeline) == (0, "yes")
    # Only in the job's namespace: not in another, nor in all of them.
    assert can_i("create", "jobs.batch", "-n", "default", *as_pipeline) == (1, "no")
    assert can_i("list", "pods", "--all-namespaces", *as_pipeline) == (1, "no")
    assert can_i("delete", "nodes", *as_pipeline) == (1, "no")
    # resolve and guard: reads only.
    assert can_i("get", "pods", "-n", ns, *as_reader) == (0, "yes")
    assert can_i("get", "nodes", *as_reader) == (0, "yes")
    assert can_i("patch", "nodes", *as_reader) == (1, "no")
    assert can_i("patch", "pytorchjobs.kubeflow.org", "-n", ns, *as_reader) == (1, "no")
    assert can_i("delete", "nodes") == (0, "yes")


def test_kubectl_applies_the_namespaced_manifest_into_a_namespace(
    kubectl_binary: str, kubeconfig: Path, kube: k8s.ApiClient
) -> None:
    ns = _name("team")
    k8s.CoreV1Api(kube).create_namespace({"metadata": {"name": ns}})
    as_pipeline = ("--as", "sdcguard-pipeline", "--as-group", PIPELINE_GROUP)
    before = _run(kubectl_binary, kubeconfig, "auth", "can-i", "create", "jobs.batch", "-n", ns, *as_pipeline)

    # The stand-in serves no OpenAPI document, which kubectl's client-side validation downloads.
    apply = ("apply", "--validate=false", "-n", ns, "-f", str(RBAC_NAMESPACE_MANIFEST))
    applied = _ok(kubectl_binary, kubeconfig, *apply)
    again = _ok(kubectl_binary, kubeconfig, *apply)
    after = _run(kubectl_binary, kubeconfig, "auth", "can-i", "create", "jobs.batch", "-n", ns, *as_pipeline)

    assert before.stdout.strip() == "no"
    assert "role.rbac.authorization.k8s.io/sdcguard-pipeline created" in applied
    assert "rolebinding.rbac.authorization.k8s.io/sdcguard-pipeline-read created" in applied
    assert "created" not in again
    assert after.stdout.strip() == "yes"
    roles = _rows(_ok(kubectl_binary, kubeconfig, "get", "roles", "-n", ns))
    assert [row[0] for row in roles] == ["NAME", "sdcguard-pipeline", "sdcguard-pipeline-read"]


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
    node, pod, ns = seeded["nodes"][0]["node_name"], seeded["nodes"][0]["pod"], seeded["namespace"]
    rbac_api = k8s.RbacAuthorizationV1Api(kube)
    rules = rbac_api.read_cluster_role("sdcguard-pipeline").to_dict()["rules"]

    core.patch_node(node, {"metadata": {"annotations": {"sdcguard.io/rbac-probe": "1"}}})
    assert k8s.CoreV1Api(kube).read_node(node).metadata.annotations["sdcguard.io/rbac-probe"] == "1"
    assert pod in [p.metadata.name for p in core.list_namespaced_pod(ns).items]  # pods: listed in the namespace
    for refused in (lambda: core.delete_namespaced_pod(pod, ns), lambda: core.list_pod_for_all_namespaces()):
        with pytest.raises(k8s.ApiException) as caught:
            refused()  # but never deleted, nor listed across namespaces
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


def test_the_read_roles_credentials_read_and_change_nothing(
    standin: LocalStandIn, seeded: dict[str, Any], kube: k8s.ApiClient
) -> None:
    # A role named as CloudFormation names the template's KubernetesReadRole: its access entry is the read group's.
    iam = standin.client("iam")
    name = _name("stack-KubernetesReadRole")
    arn = iam.create_role(RoleName=name, AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    env = standin.role_env(arn)
    sts = standin.client("sts", aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                         aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], aws_session_token=env["AWS_SESSION_TOKEN"])  # fmt: skip
    reader = cluster_api_client(seeded["eks_cluster"], standin.client("eks"), sts)
    core = k8s.CoreV1Api(reader)
    node, pod, ns = seeded["nodes"][0]["node_name"], seeded["nodes"][0]["pod"], seeded["namespace"]

    assert core.read_namespaced_pod(pod, ns).spec.node_name == node
    assert core.read_node(node).metadata.name == node
    with pytest.raises(k8s.ApiException) as caught:
        core.patch_node(node, {"spec": {"unschedulable": True}})
    reader.close()

    assert caught.value.status == 403
    assert 'User "sdcguard-pipeline-read" cannot patch resource "nodes"' in json.loads(caught.value.body)["message"]
    assert not k8s.CoreV1Api(kube).read_node(node).spec.unschedulable


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
    assert taints == "true\nsdcguard.io/quarantine=inc-lines:NoSchedule\nnode.kubernetes.io/unschedulable=:NoSchedule\n"
    assert '"sdcguard.io/incident":"inc-lines"' in annotations
    assert suspended == "true\n"
    assert node in pods
    for stage in OPERATOR_STAGES:
        assert all(line.startswith("kubectl ") for line in operator_commands(stage, node, ns, job))
