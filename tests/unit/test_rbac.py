"""The Kubernetes RBAC manifest grants exactly what the handlers use, to the template's group."""

from __future__ import annotations

from pathlib import Path

import yaml

from infra.deploy.cfn_yaml import load_template

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_role_grants_only_what_the_handlers_use() -> None:
    docs = list(yaml.safe_load_all((ROOT / "infra" / "deploy" / "rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # What the handlers were seen to request (tests/functional/test_iam_inventory.py records it): no watch,
    # nothing on nodes or PyTorchJobs beyond reading and patching them, on pods beyond reading the suspects' by
    # name and listing a node check's pod to read its log; Jobs only the node checks' own, each by name (create,
    # read, delete: the ledger names them, so no list).
    assert granted == {
        ("", "nodes", "get"), ("", "nodes", "patch"),
        ("", "pods", "get"), ("", "pods", "list"), ("", "pods/log", "get"),
        ("kubeflow.org", "pytorchjobs", "get"), ("kubeflow.org", "pytorchjobs", "patch"),
        ("batch", "jobs", "create"), ("batch", "jobs", "get"), ("batch", "jobs", "delete"),
    }  # fmt: skip


def test_the_cluster_role_grants_no_wildcards_and_no_secrets() -> None:
    docs = list(yaml.safe_load_all((ROOT / "infra" / "deploy" / "rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
        assert "resourceNames" not in rule
        assert "nonResourceURLs" not in rule
    assert not any({"secrets", "configmaps"} & set(rule["resources"]) for rule in role["rules"])


def test_binding_names_the_access_entry_group() -> None:
    docs = list(yaml.safe_load_all((ROOT / "infra" / "deploy" / "rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    group = load_template(ROOT / "infra" / "deploy" / "template.yaml")["Parameters"]["KubernetesGroup"]["Default"]
    assert binding["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group}]
