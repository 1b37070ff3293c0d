"""The Kubernetes RBAC manifests grant exactly what the handlers use, per group and scope, to the template's groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sdcguard.infra.deploy.cfn_yaml import load_template

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = [d for d in yaml.safe_load_all((ROOT / "infra" / "deploy" / "rbac.yaml").read_text()) if d]
NAMESPACED = [d for d in yaml.safe_load_all((ROOT / "infra" / "deploy" / "rbac-namespace.yaml").read_text()) if d]
PARAMETERS = load_template(ROOT / "infra" / "deploy" / "template.yaml")["Parameters"]
PIPELINE = PARAMETERS["KubernetesGroup"]["Default"]
READ = PARAMETERS["KubernetesReadGroup"]["Default"]


def _grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _role_bound_to(docs: list[dict[str, Any]], binding_kind: str, group: str) -> dict[str, Any]:
    (binding,) = [d for d in docs if d["kind"] == binding_kind and {"kind": "Group", "name": group,
                  "apiGroup": "rbac.authorization.k8s.io"} in d["subjects"]]  # fmt: skip
    ref = binding["roleRef"]
    (role,) = [d for d in docs if d["kind"] == ref["kind"] and d["metadata"]["name"] == ref["name"]]
    return role


def test_the_groups_are_granted_only_what_their_handlers_use() -> None:
    # What the handlers were seen to request (tests/functional/test_iam_inventory.py records it): no watch.
    # Cluster-scoped, the nodes only: patched by the acting group, read by resolve and guard.
    assert _grants(_role_bound_to(CLUSTER, "ClusterRoleBinding", PIPELINE)) == {("", "nodes", "get"), ("", "nodes", "patch")}
    assert _grants(_role_bound_to(CLUSTER, "ClusterRoleBinding", READ)) == {("", "nodes", "get")}
    # In the job's namespace: the PyTorchJob read and patched; the node checks' Jobs by name (create, read,
    # delete: the ledger names them, so no list), their pod listed by its label and its log read.
    assert _grants(_role_bound_to(NAMESPACED, "RoleBinding", PIPELINE)) == {
        ("kubeflow.org", "pytorchjobs", "get"), ("kubeflow.org", "pytorchjobs", "patch"),
        ("batch", "jobs", "create"), ("batch", "jobs", "get"), ("batch", "jobs", "delete"),
        ("", "pods", "list"), ("", "pods/log", "get"),
    }  # fmt: skip
    # resolve: the suspects' pods and the job's PyTorchJob, each read by name.
    assert _grants(_role_bound_to(NAMESPACED, "RoleBinding", READ)) == {
        ("", "pods", "get"), ("kubeflow.org", "pytorchjobs", "get"),
    }  # fmt: skip


def test_the_read_group_may_change_nothing() -> None:
    granted = _grants(_role_bound_to(CLUSTER, "ClusterRoleBinding", READ)) | _grants(
        _role_bound_to(NAMESPACED, "RoleBinding", READ)
    )
    assert {verb for _, _, verb in granted} == {"get"}


def test_only_nodes_are_granted_at_the_cluster_scope() -> None:
    assert {d["kind"] for d in CLUSTER} == {"ClusterRole", "ClusterRoleBinding"}
    assert {d["kind"] for d in NAMESPACED} == {"Role", "RoleBinding"}
    for role in (d for d in CLUSTER if d["kind"] == "ClusterRole"):
        assert {resource for _, resource, _ in _grants(role)} == {"nodes"}
    # No namespace written in: `kubectl apply -n <job namespace>` puts it where the job is.
    assert all("namespace" not in d["metadata"] for d in NAMESPACED)
    # A RoleBinding refers to a Role of its own namespace, so the pods and Jobs are granted there only.
    assert {d["roleRef"]["kind"] for d in NAMESPACED if d["kind"] == "RoleBinding"} == {"Role"}


def test_the_roles_grant_no_wildcards_and_no_secrets() -> None:
    for role in (d for d in CLUSTER + NAMESPACED if d["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
            assert "resourceNames" not in rule
            assert "nonResourceURLs" not in rule
            assert not {"secrets", "configmaps"} & set(rule["resources"])


def test_the_bindings_name_the_access_entries_groups() -> None:
    subjects = {s["name"] for d in CLUSTER + NAMESPACED if d["kind"].endswith("Binding") for s in d["subjects"]}
    assert subjects == {PIPELINE, READ}
    for binding in (d for d in CLUSTER + NAMESPACED if d["kind"].endswith("Binding")):
        assert binding["roleRef"]["apiGroup"] == "rbac.authorization.k8s.io"
        assert len(binding["subjects"]) == 1
        assert binding["subjects"][0]["kind"] == "Group"
